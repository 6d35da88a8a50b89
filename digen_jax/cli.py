"""What the absl command-line scripts of launch/ and convert/ share."""
from __future__ import annotations

import contextlib
import os
import sys
import traceback
from typing import Callable, Iterator, Sequence

from absl import app, flags

from digen_jax.app import renamed_keys
from digen_jax.app.errors import ConfigError

USAGE_ERROR = 2  # exit status of a command line that cannot run
INTERRUPTED = 130  # exit status after Ctrl-C (128 + SIGINT), as shells report it
_SHORT_HELP = ("--help", "-help", "--helpshort", "-helpshort", "-h", "-?")
_FULL_HELP = ("--helpfull", "-helpfull")


def _missing_key(error: BaseException) -> str | None:
    """The text of ml_collections' error for a key a config lacks (with its "Did you mean"), else None."""
    frames = traceback.extract_tb(error.__traceback__)
    if not isinstance(error, (AttributeError, KeyError)) or not frames or "ml_collections" not in frames[-1].filename:
        return None
    while error.args and isinstance(error.args[0], BaseException):  # AttributeError(KeyError(text))
        error = error.args[0]
    return str(error.args[0]) if error.args else None


@contextlib.contextmanager
def config_override_errors(argv: Sequence[str] | None = None, flag: str = "config") -> Iterator[None]:
    """Turn a `--config.KEY=value` override of a key the config lacks into one line on stderr and
    exit status 2, instead of ml_collections' chained traceback. Wrap both the config flag's
    definition (it reads the overrides when no --config is given) and the flag parsing.

    On entry, overrides of renamed keys take their new names (`renamed_keys.rename_overrides`, one
    warning line); both names given with different values: one error line and exit status 2."""
    try:
        _rename_overrides(argv, flag)
        yield
    except (AttributeError, KeyError) as e:
        text = _missing_key(e)
        if text is None:
            raise
        name, _, hint = text.partition("\n")
        overrides = [a for a in (sys.argv if argv is None else argv) if a.startswith(f"--{flag}.")]
        named = [a for a in overrides if name.strip("'\"") in a.split("=", 1)[0].split(".")]
        where = ", ".join(named or overrides) or f"--{flag}"
        print(f"error: {where}: the config has no key {name}. {hint}".rstrip(), file=sys.stderr)
        sys.exit(USAGE_ERROR)


_RENAMED_ON_COMMAND_LINE: list[str] = []  # new keys an old-named override was rewritten to


def _rename_overrides(argv: Sequence[str] | None, flag: str) -> None:
    """Rewrite renamed keys' overrides in sys.argv (what the config flag reads) and in `argv`; a
    warning line for each key renamed."""
    try:
        for args in [sys.argv] + ([argv] if argv is not None and argv is not sys.argv else []):
            for old, new in renamed_keys.rename_overrides(args, flag):
                if new not in _RENAMED_ON_COMMAND_LINE:
                    _RENAMED_ON_COMMAND_LINE.append(new)
                    print(renamed_keys.warning(old, new), file=sys.stderr, flush=True)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(USAGE_ERROR)


def _given_value(argv: Sequence[str], flag: str) -> str | None:
    """The last value of `--flag=VALUE` or `--flag VALUE` on the command line, else None."""
    value = None
    for i, arg in enumerate(argv):
        if arg.startswith(f"--{flag}="):
            value = arg.split("=", 1)[1]
        elif arg == f"--{flag}" and i + 1 < len(argv):
            value = argv[i + 1]
    return value


@contextlib.contextmanager
def config_file_errors(argv: Sequence[str] | None = None, flag: str = "config", default: str | None = None
                       ) -> Iterator[None]:
    """Turn a config file that cannot be loaded (ml_collections' chained OSError tracebacks, at
    the first override or the first use of the config) into one line on stderr naming the file
    and where it was looked for, and exit status 2. `default`: the flag's default path, where the
    flag is not defined yet (around its definition, which reads the overrides)."""
    try:
        yield
    except OSError as e:
        if "config file" not in str(e) and "Configuration is not available" not in str(e):
            raise
        argv = sys.argv if argv is None else argv
        given = _given_value(argv, flag)
        if default is None and flag in flags.FLAGS:
            default = flags.FLAGS[flag].default
        path = str(given if given is not None else default).split(":", 1)[0]
        what = f"--{flag}={given}" if given is not None else f"the default --{flag}={path}"
        if not os.path.isfile(path):
            print(f"error: {what}: no such file (looked for {os.path.abspath(path)}); give the path of a config "
                  "file such as configs/tiny.py in the repository", file=sys.stderr)
        else:
            cause = str(e.__cause__ or e).strip().splitlines()
            print(f"error: {what} could not be loaded: {cause[-1].strip()}", file=sys.stderr)
        sys.exit(USAGE_ERROR)


def parse_flags(argv: Sequence[str]) -> list[str]:
    """absl's flag parsing for `app.run(main, flags_parser=parse_flags)`, config keys and the
    config file checked."""
    with config_file_errors(argv), config_override_errors(argv):
        args = app.parse_flags_with_usage(argv)
        config = flags.FLAGS["config"].value if "config" in flags.FLAGS else None
        if config is not None:
            config.get  # a config file that failed to load raises here, not in main
            overridden = [a.split("=", 1)[0].lstrip("-").removeprefix("config.") for a in argv
                          if a.lstrip("-").startswith("config.")]
            renamed_keys.resolve(config, command_line=overridden, renamed_on_command_line=_RENAMED_ON_COMMAND_LINE)
        return args


def run(main, interrupted: Callable[[], str] = lambda: "interrupted") -> None:
    """`absl.app.run(main)` with config keys checked (`parse_flags`), except that a help flag
    prints the usage and exits with status 0 (absl exits with 1 after printing it, which reads
    as a failure to scripts and shells), and that Ctrl-C prints `interrupted()` (what was kept
    and how to go on) instead of a traceback and exits with status 130."""
    args = sys.argv[1:]
    if "--" in args:
        args = args[: args.index("--")]
    asked = [a for a in args if a in _SHORT_HELP + _FULL_HELP]
    if asked:
        app.usage(shorthelp=asked[0] in _SHORT_HELP, writeto_stdout=True)
        sys.exit(0)
    try:
        app.run(main, flags_parser=parse_flags)
    except KeyboardInterrupt:
        sys.stdout.flush()
        try:
            line = interrupted()
        except Exception:  # noqa: BLE001 (interrupted before what it reads exists: a config, a workdir)
            line = "interrupted"
        print(line, file=sys.stderr)
        # Several processes: tell the others and exit now (a process that watches others has
        # imported the watchdog; importing it here would load JAX into every script).
        watchdog = sys.modules.get("digen_jax.runtime.peer_watchdog")
        if watchdog is not None:
            watchdog.end_after_failure("interrupted (Ctrl-C)", INTERRUPTED)
        sys.exit(INTERRUPTED)
