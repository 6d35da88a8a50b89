"""What a run prints when several processes run it: process 0 reports, the others only fail.

Every process runs the same program, so each would print every progress line and every
library warning. `launch/train.py` gives `loop.train` a log that prints on process 0 only and
calls `quiet(process_index)` once the processes have joined:

* absl warnings (orbax's among them) are shown by process 0 alone; the other processes show
  errors, and their own failures go to stderr as before;
* orbax's "Given directory is read only" warning, logged for the checkpoint manager of every
  process that does not write checkpoints, says nothing to the user and is dropped;
* Gloo, the CPU collectives library, writes `[Gloo] Rank R is connected to N peer ranks ...`
  to stdout (C++ `std::cout`, no switch turns it off) for every communicator it builds: 35
  lines in a 2-process tiny run. Stdout passes through a thread that drops those lines.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading

from absl import logging

# Lines of libraries' own stdout that carry nothing for the user (see the module docstring).
CHATTER = (b"[Gloo] Rank ",)
_READ_ONLY_NOTE = "Given directory is read only"


def _not_read_only_note(record) -> bool:
    return not str(record.msg).startswith(_READ_ONLY_NOTE)


class StdoutFilter:
    """Replace file descriptor `fd` by a pipe whose lines reach the original descriptor unless
    they start with one of `prefixes`; `close` (also at exit) restores the descriptor and
    forwards what is left."""

    def __init__(self, prefixes: tuple[bytes, ...] = CHATTER, fd: int = 1):
        self.prefixes, self.fd = prefixes, fd
        sys.stdout.flush()
        self.original = os.dup(fd)
        self._read, write = os.pipe()
        os.dup2(write, fd)
        os.close(write)
        self._thread = threading.Thread(target=self._pump, name="stdout-filter", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def _write(self, data: bytes) -> None:
        while data:
            data = data[os.write(self.original, data):]

    def _pump(self) -> None:
        pending = b""
        while chunk := os.read(self._read, 1 << 16):
            *lines, pending = (pending + chunk).split(b"\n")
            kept = b"".join(line + b"\n" for line in lines if not line.startswith(self.prefixes))
            if kept:
                self._write(kept)
        if pending and not pending.startswith(self.prefixes):
            self._write(pending)
        os.close(self._read)

    def close(self) -> None:
        """Put the original descriptor back (the pipe then ends) and forward what is left."""
        if not self._thread.is_alive():
            return
        sys.stdout.flush()
        os.dup2(self.original, self.fd)
        self._thread.join(timeout=5)


def quiet(process_index: int) -> StdoutFilter:
    """Quiet this process of a multi-process run (module docstring); the stdout filter."""
    logging.get_absl_logger().addFilter(_not_read_only_note)
    if process_index != 0:
        logging.set_verbosity(logging.ERROR)
    return StdoutFilter()
