"""Task timing without blocking the dispatching thread, the Chrome trace, per-iteration metrics.

The executor dispatches a task and hands its output arrays to `Tracer.record`; one watcher
thread per device group waits for them (`block_until_ready`) in dispatch order and stamps
the end time. A group runs its tasks in dispatch order and a task runs once its inputs
exist, so a task starts at the latest of: its dispatch, the end of the group's previous
task, and the ends of the recorded tasks it depends on (`Task.deps`; a rollout waits for
the weight sync, a sync for the update). Without the last term a task's duration would
include the wait for another group, and the measured costs that choose the elastic splits
would be wrong. The dispatching thread never waits on a device here.

Besides the plan's tasks, the `link` track carries the trajectory moves (`TRAJECTORY`): a
micro-batch rolled out on another role crossing to the trainer, timed like a task of the
`link` group, with its bytes in `args.bytes` (sync tasks carry theirs too).

Which iteration an event belongs to (`iteration_of`): its own, except a sync, which belongs to
the iteration whose update it carries, the one before the iteration it names (whose rollouts
wait for it). The sync a run starts with, initial or resumed (`args.starting`), carries no
update of that run: it belongs to the iteration it starts. An iteration's row of figures
(`iteration_summary`) counts the sync carrying its update, one per iteration of a disaggregated
run, the last one's too, and no starting sync: a resumed run's rows count the syncs the
uninterrupted run's do, and the first row of either counts one sync like every other (the
starting sync's time is part of its `seconds`). The starting sync stays in the trace, and in
the task costs measured from it (the first of its kind, taken as compilation).

`trace.json` is a Chrome trace (JSON array format, opens in Perfetto or chrome://tracing).
Events are appended as they complete, one per line, and the closing bracket is left out
(the format allows it), so the trace of a killed run is still readable (`read_trace`). A
resumed run goes on in the same file (`Tracer.resume`): an instant event marks the resume,
the earlier run's events past the checkpoint are marked superseded, and timestamps go on
from the last one.

Several processes (multi-controller JAX: every process records every task, its own devices'
and the others'): a task whose outputs have no shards on this process's devices would be
ready at once here, so only its owner times it, the process holding its outputs (for a
transfer the receiving side; where several do, the lowest process index). The owner's
watcher stamps it as above and publishes the event in the key-value store of
`jax.distributed` (`EventExchange`); the other processes' watchers take it from there, in
the same group order, instead of waiting for the outputs (never through a device program:
one issued from a watcher thread would change the order in which processes issue programs).
So every process holds every task's event, `wait_through(k)` waits for the other processes'
events of iteration k too, and the figures read from them (bubbles, measured costs) are the
same everywhere; process 0 writes them all to the trace, each with `args.process`, the
process that timed it. Host work is timed with `record_done` by the process that did it; a
reward, which one process scores for all, reaches the others with the rewards themselves (the
executor's shared values) and is added there with `record_elsewhere`, announced beforehand by
`expect_elsewhere` so that `wait_through` and `wait` wait for it. It is no dependency of any
timing (a reward thread, not a group's watcher, brings it), so a late score never holds a
watcher. The clocks are made one: each
process's `now()` counts from process 0's origin, which process 0 publishes as wall time
when its tracer starts (and again when it resumes); the others offset their own clocks by
it, which assumes the hosts' wall clocks agree to well under a task's duration (NTP keeps
them within milliseconds). Every process must build its tracers in the same order (they run
the same loop): the n-th tracer of each process exchanges with the n-th of the others.
"""
from __future__ import annotations

import itertools
import json
import os
import queue
import threading
import time
from typing import Any, Iterable, Sequence

import jax
from jax._src.distributed import global_state

from digen_jax.runtime.plan import GROUPS, Task

_THREAD_IDS = {g: i for i, g in enumerate(GROUPS)}
TASK_KINDS = ("rollout", "reward", "train", "update", "sync")  # the plan's tasks (plan.Task.kind)
TRAJECTORY = "trajectory"  # the kind of a trajectory move's event: not a plan task
_DEP_WAIT_S = 60.0  # bound on waiting for a dependency's stamp (a failed task never gets one)
EXCHANGE_KEY = "digen_jax/trace/"  # key-value store prefix of the events exchanged between processes
_ORIGIN_WAIT_S = 600.0  # bound on waiting for process 0's clock origin (its tracer starts at the same point)
_POLL_S = 10.0  # a wait for another process's event is cut into such pieces (the store bounds each call)
_exchanges = itertools.count()  # this process's tracers of a multi-process run, in construction order


def _key(task: Task) -> tuple:
    return task.key


class EventExchange:
    """Task events between the processes of a run, through the `jax.distributed` key-value store.

    `client`: the store (`global_state.client`; anything with its `key_value_set`,
    `blocking_key_value_get` and `key_value_delete`); `process` of `processes`: this process;
    `instance`: which of the run's tracers this serves (the same on every process). The owner of
    an event writes one copy per other process and each reader deletes its own once read, so
    the store does not grow with the run.
    """

    def __init__(self, client, process: int, processes: int, instance: int):
        self.client, self.process, self.processes = client, process, processes
        self.prefix = f"{EXCHANGE_KEY}{instance}/"

    @classmethod
    def for_run(cls) -> "EventExchange | None":
        """The exchange of this process's next tracer in a multi-process run, None in one process."""
        if jax.process_count() == 1:
            return None
        return cls(global_state.client, jax.process_index(), jax.process_count(), next(_exchanges))

    @staticmethod
    def owner(outputs: Any) -> int | None:
        """The process that times a task with these outputs: the lowest process index holding a
        shard of them; None when they hold no device arrays (each process times it itself)."""
        shardings = {leaf.sharding for leaf in jax.tree.leaves(outputs) if hasattr(leaf, "sharding")}
        return min((d.process_index for s in shardings for d in s.device_set), default=None)

    def origin(self, epoch: int, wall: float) -> float:
        """Process 0's clock origin as wall time, the `epoch`-th time it is set: process 0 gives its
        own (`wall`), the others wait for it."""
        key = f"{self.prefix}origin/{epoch}"
        if self.process == 0:
            self.client.key_value_set(key, repr(wall))
            return wall
        return float(self._get(key, _ORIGIN_WAIT_S))

    def publish(self, slot: str, event: dict) -> None:
        """Give every other process the event stamped here for `slot`."""
        line = json.dumps(event)
        for process in range(self.processes):
            if process != self.process:
                self.client.key_value_set(f"{self.prefix}{process}/{slot}", line)

    def fetch(self, slot: str) -> dict:
        """The event its owner stamped for `slot`; waits for it as long as the task runs."""
        key = f"{self.prefix}{self.process}/{slot}"
        event = json.loads(self._get(key, None))
        self.client.key_value_delete(key)
        return event

    def _get(self, key: str, timeout_s: float | None) -> str:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            wait = _POLL_S if deadline is None else min(_POLL_S, deadline - time.monotonic())
            if wait <= 0:
                raise TimeoutError(f"no {key!r} from another process in {timeout_s:g} s (does every process "
                                   "build the same tracers in the same order?)")
            try:
                return self.client.blocking_key_value_get(key, max(1, int(wait * 1000)))
            except Exception as e:  # noqa: BLE001 (only the store's time-out is retried)
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise


class Tracer:
    """`path`: the trace file (None: events kept in memory only); `clock`: seconds, any origin;
    `peers`: the exchange with the run's other processes (None in one process); `wall`: wall
    time, which aligns the clocks of several processes."""

    def __init__(self, path: str | None, *, clock=time.perf_counter, peers: EventExchange | None = None,
                 wall=time.time):
        self.clock, self.wall = clock, wall
        self.origin = clock()
        self._peers = peers
        self._alignments = 0
        self._slots: dict[tuple, int] = {}  # (kind, iteration, index) -> times recorded (exchange slots)
        self._remote = 0  # recorded tasks another process times whose events have not come yet
        self.events: list[dict] = []  # completed task events (args included), in completion order
        self._lock = threading.Lock()
        self._queues: dict[str, queue.Queue] = {}
        self._threads: list[threading.Thread] = []
        self._last_end: dict[str, float] = {}
        self._pending: dict[int, int] = {}  # iteration -> recorded tasks not yet completed
        self._recorded: set[tuple] = set()  # (kind, iteration, index) of every recorded task
        self._ends: dict[tuple, float] = {}  # (kind, iteration, index) -> end time of completed tasks
        self._idle = threading.Condition(self._lock)
        self._error: BaseException | None = None
        self._file = None
        self._path = path
        if path:
            fresh = not os.path.exists(path) or os.path.getsize(path) == 0
            self._file = open(path, "a")
            if fresh:
                self._file.write("[\n")
                for group, tid in _THREAD_IDS.items():
                    meta = {"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": group}}
                    self._file.write(json.dumps(meta) + ",\n")
            self._file.flush()
        self._align()

    def now(self) -> float:
        return self.clock() - self.origin

    def _align(self) -> None:
        """Several processes: count from process 0's origin (module docstring)."""
        if self._peers is None:
            return
        wall = self._peers.origin(self._alignments, self.wall() - self.now())
        self._alignments += 1
        if self._peers.process != 0:
            self.origin = self.clock() - (self.wall() - wall)

    def resume(self, iteration: int, kept: set[tuple[int, int]]) -> None:
        """Mark the trace as resumed from the checkpoint taken before `iteration` (call it before
        recording anything). The earlier run's events past that checkpoint (of iterations >=
        `iteration`, by `iteration_of`), which this run does again, get
        `args.superseded = true`, except the rollouts and rewards of the `kept` (iteration,
        micro-batch) pairs, which the checkpoint holds; a line cut by a kill is dropped. This run's
        clock goes on from the trace's last timestamp, and an instant event marks the resume (the
        other processes of a run go on from process 0's clock: call it on every process)."""
        if self._file is not None:
            self._resume_file(iteration, kept)
        self._align()

    def _resume_file(self, iteration: int, kept: set[tuple[int, int]]) -> None:
        self._file.close()
        lines, end_us = [], 0.0  # microseconds, as the events hold them: the marker lands exactly at the last end
        with open(self._path) as f:
            for line in f:
                line = line.strip().rstrip(",")
                if line in ("", "[", "]"):
                    continue
                try:
                    event = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if event.get("ph") == "X":
                    args = event["args"]
                    held = args["kind"] in ("rollout", "reward") and (args["iteration"], args["microbatch"]) in kept
                    if iteration_of(args) >= iteration and not held:
                        args["superseded"] = True
                    end_us = max(end_us, event["ts"] + event["dur"])
                elif "ts" in event:
                    end_us = max(end_us, event["ts"])
                lines.append(json.dumps(event))
        tmp = f"{self._path}.tmp"
        with open(tmp, "w") as f:
            f.write("[\n" + "".join(line + ",\n" for line in lines))
        os.replace(tmp, self._path)
        self._file = open(self._path, "a")
        self.origin = self.clock() - end_us / 1e6
        marker = {"name": f"resume from checkpoint {iteration}", "ph": "i", "s": "g", "pid": 0, "tid": 0,
                  "ts": end_us, "args": {"resumed_from": iteration}}
        self._file.write(json.dumps(marker) + ",\n")
        self._file.flush()

    # ------------------------------------------------------------------ recording
    def record(self, task: Task, outputs: Any, dispatched: float, **args: Any) -> None:
        """Time `task` by waiting (in the group's watcher) for `outputs` to be ready.

        Called right after the task's programs were dispatched: the host time since
        `dispatched` goes into the event as `dispatch_s` (near the task's duration when
        dispatch waits for the device, see `iteration_summary`'s dispatch_frac).
        """
        self._check()
        args = {**args, "dispatch_s": round(self.now() - dispatched, 6)}
        owner = None if self._peers is None else self._peers.owner(outputs)
        with self._lock:
            self._count(task, +1)
            self._recorded.add(_key(task))
            slot = None
            if owner is not None:  # exchanged: the n-th record of a task key is the same task everywhere
                n = self._slots[_key(task)] = self._slots.get(_key(task), -1) + 1
                slot = "/".join(str(part) for part in (*_key(task), n))
                self._remote += owner != self._peers.process
            q = self._queues.get(task.group)
            if q is None:
                q = self._queues[task.group] = queue.Queue()
                thread = threading.Thread(target=self._watch, args=(q,), daemon=True, name=f"trace-{task.group}")
                thread.start()
                self._threads.append(thread)
        q.put((task, outputs, dispatched, args, owner, slot))

    def record_done(self, task: Task, start: float, end: float, **args: Any) -> None:
        """A task timed by whoever ran it (host work such as rewards)."""
        with self._lock:
            self._count(task, +1)
            self._recorded.add(_key(task))
        self._finish(task, start, end, args)

    def expect_elsewhere(self, task: Task) -> None:
        """Host work another process does and times (a micro-batch's rewards), whose event comes
        with `record_elsewhere`: until then its iteration counts it as running."""
        with self._lock:
            self._count(task, +1)
            self._remote += 1

    def record_elsewhere(self, task: Task, start: float | None = None, end: float | None = None, *,
                         process: int | None = None, **args: Any) -> None:
        """The event of a task announced by `expect_elsewhere`, as process `process` timed it on the
        common clock; without times it is done with no event (its process failed)."""
        event = None if start is None else self._event(task, start, end, {**args, "process": process})
        self._add(task, event, end, remote=True)

    def _watch(self, q: queue.Queue) -> None:
        while True:
            task, outputs, dispatched, args, owner, slot = q.get()
            if owner is not None and owner != self._peers.process:
                self._take(task, slot)
                continue
            try:
                jax.block_until_ready(outputs)
            except BaseException as e:  # surfaced to the dispatching thread on its next call
                self._error = e
            end = self.now()
            start = max(dispatched, self._last_end.get(task.group, 0.0), self._deps_end(task))
            self._last_end[task.group] = end
            event = self._finish(task, start, end, args)
            if slot is not None:
                try:
                    self._peers.publish(slot, event)
                except BaseException as e:  # the store is gone (a lost coordinator): surfaced like a device error
                    self._error = e

    def _take(self, task: Task, slot: str) -> None:
        """The event of a task another process times, as that process stamped it."""
        try:
            event = self._peers.fetch(slot)
        except BaseException as e:  # surfaced to the dispatching thread; the task counts as done
            self._error = e
            self._add(task, None, None, remote=True)
            return
        end = (event["ts"] + event["dur"]) / 1e6
        self._last_end[task.group] = end
        self._add(task, event, end, remote=True)

    def _deps_end(self, task: Task) -> float:
        """Latest end of `task`'s recorded dependencies. They were recorded before it and its
        outputs are ready, so theirs are too: their watchers stamp them momentarily."""
        with self._lock:
            recorded = [dep for dep in task.deps if tuple(dep) in self._recorded]
            self._idle.wait_for(lambda: all(tuple(dep) in self._ends for dep in recorded), timeout=_DEP_WAIT_S)
            return max((self._ends.get(tuple(dep), 0.0) for dep in recorded), default=0.0)

    def _finish(self, task: Task, start: float, end: float, args: dict) -> dict:
        if self._peers is not None:
            args = {**args, "process": self._peers.process}
        event = self._event(task, start, end, args)
        self._add(task, event, end)
        return event

    @staticmethod
    def _event(task: Task, start: float, end: float, args: dict) -> dict:
        return {
            "name": f"{task.kind} it{task.iteration} mb{task.index}"
                    + ("" if task.piece is None else " pieces {}-{}/{}".format(*task.piece)),
            "ph": "X",
            "pid": 0,
            "tid": _THREAD_IDS[task.group],
            "ts": round(start * 1e6, 3),
            "dur": round(max(end - start, 0.0) * 1e6, 3),
            "args": {
                "group": task.group,
                "kind": task.kind,
                "iteration": task.iteration,
                "microbatch": task.index,
                "version": task.version,
                **({"sample_version": task.sample_version} if task.sample_version is not None else {}),
                **args,
            },
        }

    def _add(self, task: Task, event: dict | None, end: float | None, remote: bool = False) -> None:
        """Count `task` (`remote`: timed by another process) done with its `event` ending at `end`
        (None: it has none)."""
        with self._lock:
            self._remote -= remote
            if event is not None:
                self._ends[_key(task)] = end
                self.events.append(event)
                try:
                    if self._file is not None:
                        self._file.write(json.dumps(event) + ",\n")
                        self._file.flush()
                except OSError as e:  # a full disk, say: surfaced to the dispatching thread, the watcher goes on
                    self._error = e
                    self._file = None
            self._count(task, -1)
            self._idle.notify_all()

    def _count(self, task: Task, delta: int) -> None:
        # A starting sync counts here with the iteration before the one it starts (the task does
        # not say it is one): `wait_through` of its own iteration waits for it all the same.
        it = iteration_of({"kind": task.kind, "iteration": task.iteration})
        self._pending[it] = self._pending.get(it, 0) + delta

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def wait(self) -> None:
        """Block until every recorded task has completed. Once this process's own have, the events
        still due from other processes are waited for at most `_DEP_WAIT_S`: a process that failed
        may never complete its tasks, and this one must not outlive it here."""
        with self._lock:
            self._idle.wait_for(lambda: sum(self._pending.values()) == self._remote)
            self._idle.wait_for(lambda: not self._remote, timeout=_DEP_WAIT_S)
        self._check()

    def wait_through(self, iteration: int) -> None:
        """Block until the tasks of iterations <= `iteration` have completed (later ones may run on)."""
        with self._lock:
            self._idle.wait_for(lambda: not any(n for it, n in self._pending.items() if it <= iteration))
        self._check()

    def close(self) -> None:
        self.wait()
        if self._file is not None:
            self._file.close()
            self._file = None


def iteration_of(args: dict) -> int:
    """The iteration a task belongs to, from its event's `args` (module docstring): its own, but
    the one before for a sync that is no run's starting sync."""
    return args["iteration"] - 1 if args["kind"] == "sync" and not args.get("starting") else args["iteration"]


def read_trace(path: str, *, superseded: bool = False, phases: tuple[str, ...] = ("X",),
               kinds: tuple[str, ...] = TASK_KINDS) -> list[dict]:
    """Events of a trace written by `Tracer` (tolerates a missing bracket and a cut last line):
    task events, without those a resumed run superseded (`Tracer.resume`) unless `superseded`;
    `phases` picks other event types (`("i",)`: the resume markers), `kinds` other kinds of
    events (`(TRAJECTORY,)`: the trajectory moves)."""
    events = []
    with open(path) as f:
        for line in f:
            line = line.strip().rstrip(",")
            if line in ("", "[", "]"):
                continue
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by a kill
    def wanted(e: dict) -> bool:
        args = e.get("args", {})
        return (e.get("ph") in phases and (superseded or not args.get("superseded"))
                and ("kind" not in args or args["kind"] in kinds))

    return [e for e in events if wanted(e)]


def group_busy(events: Iterable[dict], window: tuple[float, float]) -> dict[str, float]:
    """Busy seconds of each group inside `window` (seconds) from trace events."""
    lo, hi = window
    busy: dict[str, float] = {}
    for e in events:
        start, end = e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6
        group = e["args"]["group"]
        busy[group] = busy.get(group, 0.0) + max(0.0, min(end, hi) - max(start, lo))
    return busy


def iteration_summary(events: Sequence[dict], iteration: int, window: tuple[float, float], device_groups: Sequence[str]) -> dict:
    """bubble_frac per device group, staleness histogram, weight-sync and trajectory-move time
    and bytes of one iteration, and dispatch_frac per device group: host time spent in its tasks'
    dispatch calls over their device time (near 0 when dispatch is asynchronous, near 1 when
    each call waits for its work). The sync counted is the one carrying the iteration's update (a
    run's starting sync is in no row: module docstring), the trajectory moves those of the
    micro-batches it trained."""
    span = max(window[1] - window[0], 1e-12)
    busy = group_busy(events, window)
    dispatch, device = dict.fromkeys(device_groups, 0.0), dict.fromkeys(device_groups, 0.0)
    for e in events:
        group = e["args"]["group"]
        if group in dispatch and "dispatch_s" in e["args"] and window[0] <= e["ts"] / 1e6 < window[1]:
            dispatch[group] += e["args"]["dispatch_s"]
            device[group] += e["dur"] / 1e6
    trained = [e for e in events if e["args"]["kind"] == "train" and e["args"]["iteration"] == iteration]
    staleness: dict[str, int] = {}
    for e in trained:
        lag = str(e["args"]["version"] - e["args"]["sample_version"])
        staleness[lag] = staleness.get(lag, 0) + len(e["args"].get("sample_ids", ()))  # trained samples
    syncs = [e for e in events if e["args"]["kind"] == "sync" and not e["args"].get("starting")
             and iteration_of(e["args"]) == iteration]
    moves = [e for e in events if e["args"]["kind"] == TRAJECTORY and e["args"]["iteration"] == iteration]
    return {
        "bubble_frac": {g: max(0.0, 1.0 - busy.get(g, 0.0) / span) for g in device_groups},
        "dispatch_frac": {g: dispatch[g] / device[g] if device[g] else 0.0 for g in device_groups},
        "staleness_hist": staleness,
        "staleness_max": max((int(s) for s in staleness), default=0),
        "sync_s": sum(e["dur"] / 1e6 for e in syncs),
        "sync_bytes": sum(e["args"].get("bytes", 0) for e in syncs),
        "trajectory_bytes": sum(e["args"].get("bytes", 0) for e in moves),
        "trajectory_s": sum(e["dur"] / 1e6 for e in moves),
    }
