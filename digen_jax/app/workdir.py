"""The run's workdir: the lock that keeps a second run out, the history an earlier run left, and
faults of the disk under it as one-line messages.

History: nothing a run wrote is removed. A workdir holding a run's history but no checkpoint to
resume stops the run (`refuse_history`); `train.start_over` moves it all to
`WORKDIR/previous_runs/N/` first (`start_over`).

Disk faults: a full disk or a permission error stops the run with one message naming the path
(`disk_message`).
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import time
from typing import Callable

import jax
from jax.experimental import multihost_utils

from digen_jax.app.errors import RunStopped

LOCK_FILE = "run.lock"
CORRUPT_DIR = "corrupt_checkpoints"
PREVIOUS_DIR = "previous_runs"  # earlier runs of a workdir, moved there by train.start_over
START_OVER_HINT = ("to start the run over, keeping this history in {workdir}/" + PREVIOUS_DIR
                   + "/, rerun with --config.train.start_over=true (once), or use another --workdir.")
_DISK_ERRNOS = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
                errno.EACCES: "permission denied", errno.EPERM: "operation not permitted",
                errno.EROFS: "the file system is read-only"}
_DISK_TEXTS = {"No space left on device": errno.ENOSPC, "Disk quota exceeded": errno.EDQUOT,
               "Permission denied": errno.EACCES, "Read-only file system": errno.EROFS}


class WorkdirLock:
    """An exclusive `flock` on WORKDIR/run.lock for the run's lifetime. The kernel drops it when
    its process dies, so the lock of a killed run never blocks the next; the file records the
    holder (pid, host, start time) for the message a second run gets. On a file system without
    `flock` the run goes on unlocked and `unsupported` says why."""

    def __init__(self, workdir: str):
        os.makedirs(workdir, exist_ok=True)
        self.path = os.path.join(os.path.abspath(workdir), LOCK_FILE)
        self._fd, self.unsupported = None, None
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = json.loads(os.read(fd, 4096) or b"{}")
            except ValueError:
                holder = {}
            os.close(fd)
            raise RunStopped(
                f"workdir {os.path.dirname(self.path)} is in use by another run (pid {holder.get('pid', '?')} on "
                f"{holder.get('host', '?')}, started {holder.get('started', '?')}): two runs in one workdir would "
                "interleave its metrics and checkpoints. Wait for that run to end, stop it, or use another --workdir."
            ) from None
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            os.close(fd)
            self.unsupported = f"{self.path} cannot be locked here ({e.strerror}): nothing keeps a second run out"
            return
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def history(workdir: str) -> list[str]:
    """What an earlier run left in `workdir` that a run starting at iteration 0 would mix with its
    own: metrics rows, trace events, checkpoints set aside (as words, empty when none)."""
    found = []
    metrics = os.path.join(workdir, "metrics.jsonl")
    if os.path.exists(metrics) and os.path.getsize(metrics):
        with open(metrics, "rb") as f:
            found.append(f"metrics.jsonl ({sum(1 for line in f if line.strip())} rows)")
    trace = os.path.join(workdir, "trace.json")
    if os.path.exists(trace):
        with open(trace) as f:  # the header and thread names of a run that recorded no event are not history
            if any(line.strip() not in ("", "[") and '"ph": "M"' not in line for line in f):
                found.append("trace.json")
    corrupt = os.path.join(workdir, CORRUPT_DIR)
    if os.path.isdir(corrupt) and os.listdir(corrupt):
        found.append(f"{CORRUPT_DIR}/ ({len(os.listdir(corrupt))} set aside)")
    return found


def refuse_history(workdir: str) -> None:
    """RunStopped when `workdir` holds an earlier run's history (`history`) and no checkpoint to
    resume it from: starting at iteration 0 there would mix two runs' outputs or replace them."""
    found = history(workdir)
    if found:
        raise RunStopped(f"{workdir} holds an earlier run's {', '.join(found)} but no checkpoint to resume it from; "
                         + START_OVER_HINT.format(workdir=workdir))


def start_over(workdir: str, log: Callable[[str], None]) -> None:
    """`train.start_over`: move everything in `workdir` (but its lock) to a new
    WORKDIR/previous_runs/N/, so that the run starts at iteration 0 and loses nothing."""
    entries = sorted(name for name in os.listdir(workdir) if name not in (LOCK_FILE, PREVIOUS_DIR))
    if entries and jax.process_index() == 0:
        n = 1
        while os.path.exists(os.path.join(workdir, PREVIOUS_DIR, str(n))):
            n += 1
        dest = os.path.join(workdir, PREVIOUS_DIR, str(n))
        os.makedirs(dest)
        for name in entries:
            shutil.move(os.path.join(workdir, name), os.path.join(dest, name))
        log(f"train.start_over: moved {', '.join(entries)} to {dest}; starting at iteration 0")
    if jax.process_count() > 1:  # the others look at the workdir once process 0 has cleared it
        multihost_utils.sync_global_devices("start over")


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def short_reason(exc: BaseException) -> str:
    """The innermost cause of `exc` in one line, without tensorstore's spec dumps."""
    root = list(_chain(exc))[-1]
    text = str(root).strip().splitlines()[0] if str(root).strip() else type(root).__name__
    for cut in (" [tensorstore_spec", " [source locations", ". See full TensorStore details"):
        text = text.split(cut)[0]
    return text[:400]


def disk_error(exc: BaseException) -> tuple[int, str] | None:
    """(errno, path or '') when `exc` comes from a full disk or a permission error, else None."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in _DISK_ERRNOS:
            return e.errno, e.filename or ""
        for text, code in _DISK_TEXTS.items():
            if text in str(e):
                return code, ""
    return None


def disk_message(exc: BaseException, workdir: str, what: str) -> str:
    code, path = disk_error(exc)
    where = f" ({path})" if path else ""
    fix = "free space there" if code in (errno.ENOSPC, errno.EDQUOT) else "make it writable by this user"
    return (f"{what} failed: {_DISK_ERRNOS[code]}{where}; {fix} in or under {workdir}, then rerun the same "
            f"command to resume from the last checkpoint.")
