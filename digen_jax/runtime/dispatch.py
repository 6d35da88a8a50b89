"""Dispatching a plan: each device group's tasks from that group's own host thread.

The executor's task handlers enqueue device programs and return; JAX runs them
asynchronously. That holds only while a dispatch call returns before its program ends, and
on the lent H100s (jax 0.11.2) it did not for the model's programs: a rollout step or a
gradient micro-batch returned from its jit call only about when it had run (the GPU client
also admits at most 32 programs in flight per device; a dispatch beyond that waits for one
to finish). One host thread dispatching every group then ran the groups one after the
other, whatever the plan said. With one thread per group a dispatch that waits holds up
only its own group.

Order: a group's tasks are dispatched in plan order by its thread, so every device gets
its programs in the plan's order (programs with collectives need one order on every
device of a mesh). A task waits until the tasks it depends on in other groups have been
*dispatched* (their outputs exist as arrays; JAX orders the device work itself).
"""
from __future__ import annotations

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

    With `threaded` and more than one lane, each lane runs on its own thread and this returns
    once every handler has returned; otherwise the calling thread runs them in list order (as
    a multi-process run must: cross-process transfers need every process to issue them in the
    same order). The first error of any handler is raised here, after the other lanes stopped.
    """
    tasks = [t for t in tasks if t.kind != "reward"]
    lanes: dict[str, list[Task]] = {}
    for task in tasks:
        lanes.setdefault(lane(task), []).append(task)
    if not threaded or len(lanes) < 2:
        for task in tasks:
            handle(task)
        return
    done = {task.key: threading.Event() for task in tasks}
    failed: list[BaseException] = []

    def run(own: list[Task]) -> None:
        try:
            for task in own:
                for dep in task.deps:
                    waited = done.get(producer(tuple(dep)))
                    while waited is not None and not waited.wait(_POLL_S):
                        if failed:
                            return
                if failed:
                    return
                handle(task)
                done[task.key].set()
        except BaseException as e:  # re-raised on the calling thread
            failed.append(e)

    threads = [threading.Thread(target=run, args=(own,), name=f"dispatch-{name}", daemon=True)
               for name, own in lanes.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failed:
        raise failed[0]
