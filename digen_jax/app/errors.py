"""The errors a run stops with: a config that cannot run, an expected fault."""


class ConfigError(ValueError):
    """A config that cannot run; the message names the config key and what to do."""


class RunStopped(Exception):
    """An expected fault or user error: the message says what happened and what to do
    (launch/train.py prints it without a traceback)."""
