"""A dead process is an error, not a hang: heartbeats between the processes of a multi-process run.

Without it a process whose peer died waits in a collective (NCCL) or, once a collective fails
(gloo), in `jax.distributed`'s shutdown barrier, until JAX's coordination service notices the
missing heartbeats (100 s by default) and aborts it with a C++ stack dump.

Every process of a multi-process run starts one `PeerWatchdog` (`multihost.initialize`), two
daemon threads beside the training loop, which therefore never waits for them:

* the beat thread writes `HEARTBEAT_KEY/<process id>` = "<count> <host name>" into the key-value
  store of JAX's coordination service (it lives in process 0) every `timeout_s / 10` seconds
  and reads every process's entry back in the same round (one directory read);
* the judge thread, as often, compares: a process whose count has not moved over the last
  `0.7 * timeout_s` of this process's reads is lost, and so is the coordinator when no read
  has succeeded for as long. It then prints one line, "stopped: <which process, its host, how
  long it has been silent>", to stderr, flushes what it can and ends this process with exit
  status 1 (`os._exit`: the training thread may be stuck in a collective that never returns).

A process that stops on an error says so in the store (`end_after_failure`); the others then
stop within an interval, naming it and its error. `start` makes every exception that leaves a
watched process's main thread do that (its traceback printed first, through `sys.excepthook`),
so that no program of several processes leaves the others waiting in a collective, nor itself
in `jax.distributed`'s shutdown barrier (minutes) for processes that no longer come; Ctrl-C
(`digen_jax.cli.run`) and `launch/train.py`'s expected faults call it themselves.

A lost process is so noticed between 0.6 and 1.0 `timeout_s` after it died (the last beat it
wrote, the read that saw it and the judge's tick each lag by up to an interval). Silence is
measured on this process's clock between its own reads, so hosts need no common time.
Compilations, saves and collectives happen on other threads; JAX's compiler and device waits
release the GIL, so a healthy process keeps beating through them.
`jax.distributed` is given a heartbeat timeout of at least twice `timeout_s`, so that this
watchdog speaks first (`jax_heartbeat_timeout_s`).

Process 0 also runs the coordination service: when it dies, JAX terminates every other process
at once (its error polling sees the service go: SIGABRT, with JAX's own message and a C++ stack
dump). jaxlib's hook for that moment, `missed_heartbeat_callback`, is no way out: in jaxlib
0.10.2 a Python callback there ends the process with std::bad_cast when called. The watchdog
covers a coordinator that stops answering without closing its connections (a lost host or
network).
"""
from __future__ import annotations

import math
import os
import socket
import sys
import threading
import time
from typing import Callable

from jax._src.distributed import global_state

PEER_TIMEOUT_S = 120.0  # configs/sections.py: runtime.peer_timeout_s
HEARTBEAT_KEY = "digen_jax/heartbeat/"
FAILED_KEY = "digen_jax/failed/"  # <process id> -> "<host> <message>" of a process that stopped on an error
ACKNOWLEDGED_KEY = "digen_jax/acknowledged/"  # <process id> -> "" once it has read a failure
LOST_STATUS = 1  # the exit status of launch/train.py's other faults
_JAX_HEARTBEAT_DEFAULT_S = 100  # jax.distributed.initialize's default heartbeat_timeout_seconds
_FLUSH_TIMEOUT_S = 2.0  # a flush blocked by a stuck thread must not keep the process alive
_ACKNOWLEDGED_GRACE_S = 0.5


def jax_heartbeat_timeout_s(timeout_s: float) -> int:
    """The `heartbeat_timeout_seconds` for `jax.distributed.initialize`: JAX's default, or twice
    the watchdog's timeout where that is longer, so that the watchdog reports a lost process first."""
    return max(_JAX_HEARTBEAT_DEFAULT_S, math.ceil(2 * timeout_s))


def check_timeout(timeout_s) -> float:
    """`runtime.peer_timeout_s` as seconds, or a ValueError naming the key."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"runtime.peer_timeout_s must be a number of seconds > 0, got {timeout_s!r}")
    return float(timeout_s)


def stop_process(message: str) -> None:
    """Print "stopped: `message`" on stderr and end this process with `LOST_STATUS`, whatever its
    other threads are doing (stdout and stderr are flushed first, if that returns in time)."""
    flush = threading.Thread(target=_flush_streams, daemon=True)
    flush.start()
    flush.join(_FLUSH_TIMEOUT_S)
    os.write(2, f"stopped: {message}\n".encode())
    os._exit(LOST_STATUS)


def _flush_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 (a closed or broken stream: nothing left to save)
            pass


class PeerWatchdog:
    """Heartbeats of this process and the verdict on the others (module docstring).

    client: the `jax.distributed` client (the key-value store); process_id, num_processes: this
    process and the run's size; coordinator_address: 'host:port' of process 0, named when it is lost.
    """

    def __init__(self, client, process_id: int, num_processes: int, timeout_s: float, coordinator_address: str,
                 on_lost: Callable[[str], None] = stop_process):
        self.timeout_s = check_timeout(timeout_s)
        self.interval_s = self.timeout_s / 10
        self.silence_s = self.timeout_s - 3 * self.interval_s  # + up to 3 intervals to notice it
        self._client, self._me, self._num, self._on_lost = client, process_id, num_processes, on_lost
        self._coordinator = coordinator_address
        now = time.monotonic()
        self._lock = threading.Lock()
        self._contact = now  # the end of the last successful read
        self._count = {p: -1 for p in range(num_processes) if p != process_id}  # the last count read
        self._since = dict.fromkeys(self._count, now)  # when that count was first read
        self._hosts = {process_id: socket.gethostname()}
        self._failure = ""  # why the last read failed
        self._failed: dict[int, tuple[str, str, str]] = {}  # process -> (host, " ", message) of `end_after_failure`
        self._stop = threading.Event()
        self._wake = threading.Event()  # a failure was read: judge now, not at the next tick
        for name, target in (("beat", self._beat), ("judge", self._judge)):
            threading.Thread(target=target, name=f"peer-watchdog-{name}", daemon=True).start()

    def alive(self) -> bool:
        """Whether it still watches (it ends with `jax.distributed.shutdown` or `close`)."""
        return not self._stop.is_set() and global_state.client is self._client

    def close(self) -> None:
        self._stop.set()
        self._wake.set()

    def _beat(self) -> None:
        key, count = f"{HEARTBEAT_KEY}{self._me}", 0
        while self.alive():
            try:
                self._client.key_value_set(key, f"{count} {self._hosts[self._me]}", allow_overwrite=True)
                entries = self._client.key_value_dir_get(HEARTBEAT_KEY)
                failed = self._client.key_value_dir_get(FAILED_KEY)
            except Exception as e:  # noqa: BLE001 (the coordinator does not answer: the judge decides)
                with self._lock:
                    self._failure = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            else:
                self._read(entries, time.monotonic(), failed)
            count += 1
            self._stop.wait(self.interval_s)

    def _read(self, entries, now: float, failed=()) -> None:
        with self._lock:
            self._contact, self._failure = now, ""
            for key, value in failed:
                process = int(key.rsplit("/", 1)[-1])
                if process != self._me and process not in self._failed:
                    self._failed[process] = value.partition(" ")
                    self._wake.set()
            for key, value in entries:
                process, (count, _, host) = int(key.rsplit("/", 1)[-1]), value.partition(" ")
                self._hosts[process] = host
                if process in self._count and int(count) != self._count[process]:
                    self._count[process], self._since[process] = int(count), now

    def _judge(self) -> None:
        while True:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if not self.alive():
                return
            message = self.lost()
            if message is not None:
                self.close()
                if self._failed:  # the failed process 0 waits for this before it exits
                    try:
                        self._client.key_value_set(f"{ACKNOWLEDGED_KEY}{self._me}", "", allow_overwrite=True)
                    except Exception:  # noqa: BLE001 (it is gone already)
                        pass
                self._on_lost(message)
                return

    def lost(self) -> str | None:
        """The message naming a lost process (the coordinator first), or None while all answer."""
        now = time.monotonic()
        rerun = "rerun the same command on every process to resume from the last checkpoint"
        with self._lock:
            for process, (host, _, message) in sorted(self._failed.items()):
                return f"process {process} of {self._num} (host {host}) failed: {message}; {rerun}"
            if now - self._contact > self.silence_s:
                host = self._hosts.get(0, self._coordinator.rsplit(":", 1)[0])
                return (f"lost the coordinator, process 0 of {self._num} (host {host}): its key-value store at "
                        f"{self._coordinator} has not answered for {now - self._contact:.0f} s "
                        f"(runtime.peer_timeout_s={self.timeout_s:g}; {self._failure or 'no answer'}); {rerun}")
            for process, since in sorted(self._since.items()):
                silent = self._contact - since
                if silent > self.silence_s:
                    host = f" (host {self._hosts[process]})" if process in self._hosts else ""
                    return (f"lost process {process} of {self._num}{host}: no heartbeat for {silent:.0f} s "
                            f"(runtime.peer_timeout_s={self.timeout_s:g}); it died, froze or lost its network; {rerun}")
        return None

    def counts(self) -> dict[int, int]:
        """The last heartbeat count read of every other process (-1: none yet)."""
        with self._lock:
            return dict(self._count)


_watchdog: PeerWatchdog | None = None


def start(process_id: int, num_processes: int, timeout_s: float, coordinator_address: str) -> PeerWatchdog:
    """Watch the other processes of the initialised `jax.distributed` run (once per run), and
    publish an exception that ends this process (`_publish_uncaught`)."""
    global _watchdog
    if _watchdog is None or not _watchdog.alive():
        _watchdog = PeerWatchdog(global_state.client, process_id, num_processes, timeout_s, coordinator_address)
    if sys.excepthook is not _publish_uncaught:
        global _previous_excepthook
        _previous_excepthook, sys.excepthook = sys.excepthook, _publish_uncaught
    return _watchdog


_previous_excepthook = sys.excepthook


def one_line(error: BaseException) -> str:
    """`Type: first line of the message`, as the other processes are told it."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def _publish_uncaught(kind, error, tb) -> None:
    """`sys.excepthook` of a watched process: the traceback as usual, then `end_after_failure`."""
    _previous_excepthook(kind, error, tb)
    end_after_failure(one_line(error))


def watching() -> bool:
    """Whether this process watches others (a multi-process run that has not ended)."""
    return _watchdog is not None and _watchdog.alive()


def end_after_failure(message: str, status: int = LOST_STATUS) -> None:
    """In a multi-process run: tell the other processes that this one stopped (`message`, one
    line; their watchdogs end them within an interval, naming it), then end this process with
    `status` without `jax.distributed`'s shutdown barrier, which would wait minutes for
    processes that no longer come. Call it once the error is shown and the run's files are
    written. Returns at once without a watchdog (one process: exit as usual).

    Process 0 holds the store the others read: it waits, up to two beat intervals, until each
    has read the failure (an acknowledgement in the store), since its exit would otherwise end
    them first, with JAX's abort and stack dump instead of the line naming it."""
    watchdog = _watchdog
    if watchdog is None or not watchdog.alive():
        return
    watchdog.close()
    client, me = watchdog._client, watchdog._me
    try:
        client.key_value_set(f"{FAILED_KEY}{me}", f"{watchdog._hosts[me]} {message}", allow_overwrite=True)
        deadline = time.monotonic() + 2 * watchdog.interval_s + 1
        while me == 0 and time.monotonic() < deadline:
            if len(client.key_value_dir_get(ACKNOWLEDGED_KEY)) >= watchdog._num - 1:
                time.sleep(_ACKNOWLEDGED_GRACE_S)  # each acknowledges just before its own exit
                break
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 (no coordinator: the others' watchdogs find this process silent)
        pass
    _flush_streams()
    os._exit(status)


def await_verdict() -> None:
    """After a failed collective: wait until the watchdog finds a lost process (it then ends this
    one) or has seen every other process beat since the call (they are alive: the failure has
    another cause), at most the peer timeout. Returns at once without a watchdog."""
    watchdog = _watchdog
    if watchdog is None or not watchdog.alive():
        return
    # Two more beats: the second was written after this call, whatever the phase of the reads.
    wanted = {p: c + 2 for p, c in watchdog.counts().items()}
    deadline = time.monotonic() + watchdog.timeout_s
    while time.monotonic() < deadline and watchdog.alive():
        if all(watchdog.counts()[p] >= c for p, c in wanted.items()):
            return
        time.sleep(watchdog.interval_s / 2)
