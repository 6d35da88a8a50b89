"""What the absl command-line scripts of launch/ and convert/ share."""
from __future__ import annotations

import sys

from absl import app

_SHORT_HELP = ("--help", "-help", "--helpshort", "-helpshort", "-h", "-?")
_FULL_HELP = ("--helpfull", "-helpfull")


def run(main) -> None:
    """`absl.app.run(main)`, except that a help flag prints the usage and exits with status 0
    (absl exits with 1 after printing it, which reads as a failure to scripts and shells)."""
    args = sys.argv[1:]
    if "--" in args:
        args = args[: args.index("--")]
    asked = [a for a in args if a in _SHORT_HELP + _FULL_HELP]
    if asked:
        app.usage(shorthelp=asked[0] in _SHORT_HELP, writeto_stdout=True)
        sys.exit(0)
    app.run(main)
