"""Dispatching a plan: each device group's tasks from that group's own host thread.

The executor's task handlers enqueue device programs and return; JAX runs them
asynchronously. That holds only while a dispatch call returns before its program ends, which
is not guaranteed: on GPUs a large program's jit call can return only about when it has run,
and the client admits a bounded number of programs in flight per device (32), beyond which a
dispatch waits for one to finish (docs/known_issues.md). One host thread dispatching every
group would then run the groups one after the other, whatever the plan says; with one thread
per group a dispatch that waits holds up only its own group.

Order: a group's tasks are dispatched in plan order by its thread, so every device gets
its programs in the plan's order (programs with collectives need one order on every
device of a mesh). A task waits until the tasks it depends on in other groups have been
*dispatched* (their outputs exist as arrays; JAX orders the device work itself). The
threads outlive an iteration (`Lanes`): a group that finished its part of iteration k goes
on with k + 1 while the other still works, so no group waits at an iteration boundary for
work it does not depend on.

Several processes: a program whose devices belong to several processes (a trajectory or a
weight sync crossing between roles on different hosts) runs on every one of its devices in
their stream order, so every device must get such programs in one order, the same on every
process, or two devices each wait in a different program for the other. Each group's thread
keeps plan order; a task whose program crosses processes names the other lanes of this
process whose devices it touches (`meets`), and those lanes stop at the task's place in plan
order (a meeting) until its handler issued the program (`Lanes.crossing`). So every lane
issues the crossing programs in plan order, between the same local tasks on every process.
"""
from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
from typing import Callable, Iterator, Sequence

import numpy as np

from digen_jax.runtime.plan import Task, TaskKey

_POLL_S = 0.5  # how often a waiting thread checks whether another group has failed


def lane(task: Task) -> str:
    """The thread a task is dispatched from: the device group its programs run on.

    A weight sync runs on the rollout group's thread, ahead of the rollouts that use it.
    Reward tasks are host work started by their rollout (no dispatch of their own).
    """
    return "rollout" if task.kind == "sync" else task.group


def producer(key: TaskKey) -> TaskKey:
    """The dispatched task whose outputs satisfy a dependency on `key`: a reward is ready to
    wait for once its rollout has been dispatched (the rollout hands it to the reward threads)."""
    kind, *rest = key
    return ("rollout", *rest) if kind == "reward" else key


@dataclasses.dataclass(frozen=True)
class Crossing:
    """A program two lanes issue together (each from its own thread, at the same point of the
    order of crossings): `task` is dispatched by `owner`'s lane; on the other lane's sequence it
    comes before index `at[lane]` (the other's tasks from there on come after it)."""

    task: Task
    at: dict[str, int]


def place_moves(sequences: dict[str, list[Task]], moves: Sequence[tuple[Task, str, int, int]],
                syncs: Sequence[Crossing], cost: Callable[[Task], float]) -> list[Crossing]:
    """Where each move crosses the two lanes' sequences, so that both streams reach it about together.

    sequences: the two lanes' own tasks in plan order ('train' and a source lane). moves: (task,
    source lane, first index of the source sequence it may come before (after its producer),
    last index of the train sequence it may come before (its consumer)), in the consumer's
    order. syncs: crossings whose places are fixed. cost: estimated seconds of a task.
    A program spanning both lanes' devices starts on each when both got there, so each move
    takes, among the places allowed, the pair whose estimated times differ least (earliest on
    ties), after the moves before it; the later lane's times then shift by the wait. A place
    is allowed when no task before it on one lane depends on a task after it on the other.
    Returns every crossing (syncs included) in one order that both lanes follow.
    """
    names = sorted(sequences)
    index = {t.key: (name, i) for name in names for i, t in enumerate(sequences[name])}
    ends = {name: np.concatenate([[0.0], np.cumsum([cost(t) for t in sequences[name]])]) for name in names}
    # needs[name][i]: for the first i tasks of lane `name`, how far the other lane must have got.
    needs = {}
    for name in names:
        reach, needs[name] = 0, [0]
        for task in sequences[name]:
            for dep in task.deps:
                other, j = index.get(producer(tuple(dep)), (name, -1))
                if other != name:
                    reach = max(reach, j + 1)
            needs[name].append(reach)
    floor = dict.fromkeys(names, 0)
    placed: list[Crossing] = []
    for task, source, first, last in moves:
        best = None
        for i in range(max(first, floor[source]), len(sequences[source]) + 1):
            for j in range(floor["train"], last + 1):
                if needs[source][i] > j or needs["train"][j] > i or any(
                        (c.at[source] - i) * (c.at["train"] - j) < 0 for c in syncs):  # crossed orders
                    continue
                gap = abs(ends[source][i] - ends["train"][j])
                if best is None or gap < best[0] - 1e-9:
                    best = (gap, i, j)
        if best is None:
            raise ValueError(f"no place for {task.key} between the lanes' tasks")
        _, i, j = best
        wait = ends[source][i] - ends["train"][j]  # > 0: the train lane waits
        late = "train" if wait > 0 else source
        ends[late][(j if late == "train" else i):] += abs(wait)
        placed.append(Crossing(task, {source: i, "train": j}))
        floor = {source: i, "train": j}
    return sorted([*placed, *syncs], key=lambda c: (c.at[names[0]], c.at[names[1]]))


def interleave(sequences: dict[str, list[Task]], crossings: Sequence[Crossing]) -> list[Task]:
    """One list of the lanes' tasks and the crossings, each crossing after the tasks it follows
    on each lane (`Crossing.at`), in `crossings`' order: what `Lanes.submit` takes."""
    out, cursor = [], dict.fromkeys(sequences, 0)
    for crossing in crossings:
        for name, seq in sequences.items():
            out += seq[cursor[name]:crossing.at[name]]
            cursor[name] = max(cursor[name], crossing.at[name])
        out.append(crossing.task)
    for name, seq in sequences.items():
        out += seq[cursor[name]:]
    return out


class Lanes:
    """One long-lived dispatching thread per lane, fed batches of tasks (one iteration's plan
    after another) that it runs in submission order.

    A batch need not wait for the previous one: a lane that finished its share of iteration k
    starts on iteration k + 1 while another lane still works through iteration k, and a task
    waits only for the handlers of its dependencies, in this batch or an earlier one, to
    return (dependencies never submitted count as done). After a handler fails, every lane
    stops and `wait`, `drain` and `submit` raise its error.

    Meetings (several processes, see the module docstring): `submit`'s `meets(task)` names the
    lanes besides the task's own that stop at the task's place in their queues until its handler
    left `crossing(task)`, inside which the handler issues the program they share.
    """

    def __init__(self):
        self._queues: dict[str, queue.SimpleQueue] = {}
        self._threads: list[threading.Thread] = []
        self._done: dict[TaskKey, threading.Event] = {}
        self._failed: list[BaseException] = []
        self._meetings: dict[TaskKey, _Meeting] = {}

    def submit(self, tasks: Sequence[Task], meets: Callable[[Task], frozenset[str]] | None = None, *,
               handle: Callable[[Task], None]) -> None:
        """Queue `tasks` (rewards skipped) behind everything submitted before; `meets(task)`: the
        other lanes that meet the task's crossing (default: none)."""
        self._raise_failure()
        tasks = [t for t in tasks if t.kind != "reward"]
        for task in tasks:  # all registered before any runs, so dependencies inside the batch wait
            self._done[task.key] = threading.Event()
        for task in tasks:  # in list order: a meeting takes the task's place in plan order in every lane
            others = sorted((meets(task) if meets else frozenset()) - {lane(task)})
            if others:
                meeting = self._meetings[task.key] = _Meeting(len(others))
                for name in others:
                    self._queue(name).put((task, meeting))
            self._queue(lane(task)).put((task, handle))

    @contextlib.contextmanager
    def crossing(self, task: Task) -> Iterator[None]:
        """Called by `task`'s handler around the programs it shares with the lanes that meet it:
        enters once every one of them stopped at the task's place, and lets them go on when left
        (also when the body raised). A no-op for a task nobody meets."""
        meeting = self._meetings.pop(task.key, None)
        if meeting is None:
            yield
            return
        try:
            self._until(meeting.all_arrived)
            yield
        finally:
            meeting.left.set()

    def wait(self, keys) -> None:
        """Block until the handlers of the submitted tasks `keys` returned."""
        for key in keys:
            event = self._done.get(tuple(key))
            if event is not None:
                self._until(event)
        self._raise_failure()

    def _until(self, event: threading.Event) -> None:
        """Wait for `event`; raise the first handler error if one fails meanwhile."""
        while not event.wait(_POLL_S):
            self._raise_failure()

    def drain(self) -> None:
        """Block until every submitted task's handler returned; then forget them."""
        self.wait(list(self._done))
        self._done.clear()

    def forget(self, before_iteration: int) -> None:
        """Drop the finished tasks of iterations before `before_iteration` (later dependencies on
        them then count as done)."""
        for key in [k for k, e in self._done.items() if k[1] < before_iteration and e.is_set()]:
            del self._done[key]

    def close(self) -> None:
        """Stop the threads once their queues are empty (call `drain` first to see errors)."""
        for q in self._queues.values():
            q.put(None)
        for thread in self._threads:
            thread.join()
        self._queues.clear()
        self._threads.clear()

    def _raise_failure(self) -> None:
        if self._failed:
            raise self._failed[0]

    def _queue(self, name: str) -> queue.SimpleQueue:
        if name not in self._queues:
            self._queues[name] = queue.SimpleQueue()
            thread = threading.Thread(target=self._run, args=(self._queues[name],), name=f"dispatch-{name}", daemon=True)
            self._threads.append(thread)
            thread.start()
        return self._queues[name]

    def _run(self, own: queue.SimpleQueue) -> None:
        while (item := own.get()) is not None:
            task, handle = item
            if self._failed:
                continue  # drain the queue without running anything
            try:
                if isinstance(handle, _Meeting):
                    handle.arrive()
                    self._until(handle.left)
                    continue
                for dep in task.deps:
                    waited = self._done.get(producer(tuple(dep)))
                    while waited is not None and not waited.wait(_POLL_S):
                        if self._failed:
                            break
                if self._failed:
                    continue
                handle(task)
                self._done[task.key].set()
            except BaseException as e:  # re-raised on the waiting thread
                self._failed.append(e)


class _Meeting:
    """The lanes that stop at one task's place: they `arrive`, then wait for `left`."""

    def __init__(self, lanes: int):
        self._count, self._lock = lanes, threading.Lock()
        self.all_arrived, self.left = threading.Event(), threading.Event()

    def arrive(self) -> None:
        with self._lock:
            self._count -= 1
            if self._count == 0:
                self.all_arrived.set()
