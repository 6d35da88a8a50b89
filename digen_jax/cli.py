"""What the absl command-line scripts of launch/ and convert/ share."""
from __future__ import annotations

import contextlib
import sys
import traceback
from typing import Iterator, Sequence

from absl import app

USAGE_ERROR = 2  # exit status of a command line that cannot run
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
    definition (it reads the overrides when no --config is given) and the flag parsing."""
    try:
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


def parse_flags(argv: Sequence[str]) -> list[str]:
    """absl's flag parsing for `app.run(main, flags_parser=parse_flags)`, config keys checked."""
    with config_override_errors(argv):
        return app.parse_flags_with_usage(argv)


def run(main) -> None:
    """`absl.app.run(main)` with config keys checked (`parse_flags`), except that a help flag
    prints the usage and exits with status 0 (absl exits with 1 after printing it, which reads
    as a failure to scripts and shells)."""
    args = sys.argv[1:]
    if "--" in args:
        args = args[: args.index("--")]
    asked = [a for a in args if a in _SHORT_HELP + _FULL_HELP]
    if asked:
        app.usage(shorthelp=asked[0] in _SHORT_HELP, writeto_stdout=True)
        sys.exit(0)
    app.run(main, flags_parser=parse_flags)
