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
"""
from __future__ import annotations

import queue
import threading
from typing import Callable, Sequence

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
    kind, iteration, index = key
    return ("rollout", iteration, index) if kind == "reward" else key


def dispatch(tasks: Sequence[Task], handle: Callable[[Task], None], *, threaded: bool = True) -> None:
    """Call `handle(task)` for every task but rewards: per `lane` in list order, each after the
    handlers of its dependencies in other lanes returned (dependencies outside `tasks` are done).

    With `threaded` and more than one lane, each lane runs on its own thread (`Lanes`) and this
    returns once every handler has returned; otherwise the calling thread runs them in list
    order (as a multi-process run must: cross-process transfers need every process to issue
    them in the same order). The first error of any handler is raised here, after the other
    lanes stopped.
    """
    tasks = [t for t in tasks if t.kind != "reward"]
    if not threaded or len({lane(t) for t in tasks}) < 2:
        for task in tasks:
            handle(task)
        return
    lanes = Lanes()
    try:
        lanes.submit(tasks, handle)
        lanes.drain()
    finally:
        lanes.close()


class Lanes:
    """One long-lived dispatching thread per lane, fed batches of tasks (one iteration's plan
    after another) that it runs in submission order.

    A batch need not wait for the previous one: a lane that finished its share of iteration k
    starts on iteration k + 1 while another lane still works through iteration k, and a task
    waits only for the handlers of its dependencies, in this batch or an earlier one, to
    return (dependencies never submitted count as done). After a handler fails, every lane
    stops and `wait`, `drain` and `submit` raise its error.
    """

    def __init__(self):
        self._queues: dict[str, queue.SimpleQueue] = {}
        self._threads: list[threading.Thread] = []
        self._done: dict[TaskKey, threading.Event] = {}
        self._failed: list[BaseException] = []

    def submit(self, tasks: Sequence[Task], handle: Callable[[Task], None]) -> None:
        """Queue `tasks` (rewards skipped) behind everything submitted before."""
        self._raise_failure()
        tasks = [t for t in tasks if t.kind != "reward"]
        for task in tasks:  # all registered before any runs, so dependencies inside the batch wait
            self._done[task.key] = threading.Event()
        for task in tasks:
            self._queue(lane(task)).put((task, handle))

    def wait(self, keys) -> None:
        """Block until the handlers of the submitted tasks `keys` returned."""
        for key in keys:
            event = self._done.get(tuple(key))
            while event is not None and not event.wait(_POLL_S):
                self._raise_failure()
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
