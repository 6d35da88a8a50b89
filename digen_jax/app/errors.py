"""The error a config that cannot run raises."""


class ConfigError(ValueError):
    """A config that cannot run; the message names the config key and what to do."""
