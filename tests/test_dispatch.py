"""Per-group dispatch threads: plan order per group, cross-group dependencies, concurrency, errors."""
import threading
import time

import pytest

from digen_jax.runtime import dispatch, plan


def _recording_handler(delay_s: float = 0.0):
    log, lock = [], threading.Lock()

    def handle(task):
        with lock:
            log.append(("start", task.key, threading.current_thread().name))
        if delay_s and task.kind == "rollout":
            time.sleep(delay_s)
        with lock:
            log.append(("end", task.key, threading.current_thread().name))

    return log, handle


@pytest.mark.parametrize("mode,tag,prefetch", [("gap+tsp", 0, 0), ("gap+tsp+tag+tcss", 2, 1), ("disagg_sync", 0, 0)])
def test_each_group_keeps_plan_order_and_waits_for_its_dependencies(mode, tag, prefetch):
    p = plan.plan_iteration(mode, 1, 6, carried=prefetch, tag=tag, prefetch=prefetch)
    log, handle = _recording_handler(delay_s=0.002)
    dispatch.dispatch(p.tasks, handle)
    handled = [t for t in p.tasks if t.kind != "reward"]
    ends = {key: i for i, (what, key, _) in enumerate(log) if what == "end"}
    starts = {key: i for i, (what, key, _) in enumerate(log) if what == "start"}
    assert sorted(ends) == sorted(t.key for t in handled)  # every task once, rewards not dispatched
    for task in handled:
        same_lane = [t.key for t in handled if dispatch.lane(t) == dispatch.lane(task)]
        threads = {name for what, key, name in log if key in same_lane}
        assert len(threads) == 1, threads  # a group's programs come from one thread
        for dep in task.deps:
            dep = dispatch.producer(tuple(dep))
            if dep in ends:  # a dependency inside this plan returned before the task started
                assert ends[dep] < starts[task.key], (dep, task.key)
    for name in {dispatch.lane(t) for t in handled}:
        own = [t.key for t in handled if dispatch.lane(t) == name]
        assert sorted(own, key=lambda k: starts[k]) == own  # plan order within the group


def test_groups_dispatch_concurrently():
    """A rollout handler that waits for the trainer's handler to run would deadlock a single
    dispatching thread; with one thread per group it does not."""
    p = plan.plan_iteration("gap+tsp+tag", 1, 4, tag=1)
    trainer_ran = threading.Event()

    def handle(task):
        if task.kind == "rollout" and task.group == "rollout" and task.index == 3:
            assert trainer_ran.wait(10), "the train group's thread never ran while the rollout thread waited"
        if task.kind == "train":
            trainer_ran.set()

    dispatch.dispatch(p.tasks, handle)
    assert trainer_ran.is_set()


@pytest.mark.parametrize("mode,tag,prefetch", [("gap+tsp+tag+tcss", 1, 1), ("disagg_sync", 0, 0)])
def test_met_crossings_keep_plan_order_in_every_lane(mode, tag, prefetch):
    """Tasks whose programs cross processes (trajectories of the rollout group's micro-batches,
    syncs) are met by the other lane: it handles nothing between the plan's tasks around the
    crossing while the handler is inside it, so each lane issues its tasks and the crossings in
    plan order."""
    p = plan.plan_iteration(mode, 1, 4, carried=prefetch, tag=tag, prefetch=prefetch)
    rolled_on = {(t.iteration, t.index): t.group for t in p.tasks if t.kind == "rollout"}
    crosses = {t.key for t in p.tasks if t.kind == "sync"
               or (t.kind == "train" and rolled_on.get((t.iteration, t.index), "rollout") == "rollout")}
    other = {"rollout": "train", "train": "rollout"}
    meets = lambda t: frozenset({other[dispatch.lane(t)]}) if t.key in crosses else frozenset()  # noqa: E731
    lanes, log, lock = dispatch.Lanes(), [], threading.Lock()

    def handle(task):
        with lock:
            log.append(("task", task.key, dispatch.lane(task)))
        with lanes.crossing(task):
            if task.key in crosses:
                with lock:
                    log.append(("cross", task.key, None))
                time.sleep(0.002)  # the other lane would run ahead here if it did not meet

    try:
        lanes.submit(p.tasks, meets, handle=handle)
        lanes.drain()
    finally:
        lanes.close()
    handled = [t for t in p.tasks if t.kind != "reward"]
    assert crosses and sorted(k for what, k, _ in log if what == "cross") == sorted(crosses)
    position = {t.key: i for i, t in enumerate(handled)}
    at = {(what, key): i for i, (what, key, _) in enumerate(log)}
    for key in crosses:
        meeting_lane = other[dispatch.lane(next(t for t in handled if t.key == key))]
        for t in handled:
            if dispatch.lane(t) != meeting_lane:
                continue
            if position[t.key] < position[key]:
                assert at[("task", t.key)] < at[("cross", key)], (t.key, key)
            else:
                assert at[("task", t.key)] > at[("cross", key)], (t.key, key)


def test_a_failing_handler_stops_every_group_and_raises_its_error():
    p = plan.plan_iteration("gap+tsp", 1, 6)
    handled = []

    class Boom(Exception):
        pass

    def handle(task):
        if task.kind == "rollout" and task.index == 2:
            raise Boom("rollout 2 failed")
        handled.append(task.key)

    with pytest.raises(Boom, match="rollout 2 failed"):
        dispatch.dispatch(p.tasks, handle)
    assert ("rollout", 1, 3) not in handled  # its group stopped at the failure
    assert ("train", 1, 2) not in handled and ("update", 1, 0) not in handled  # they needed rollout 2


def test_lanes_go_on_into_the_next_batch_while_another_lane_finishes_the_last():
    """The trainer starts iteration 2 on its carried micro-batches while the rollout thread is
    still held in iteration 1's last prefetch; what depends on that prefetch waits for it."""
    first = plan.plan_iteration("gap+tsp+tag+tcss", 1, 2, carried=2, prefetch=2)
    second = plan.plan_iteration("gap+tsp+tag+tcss", 2, 2, carried=2, prefetch=2)
    release, trained_ahead, order = threading.Event(), threading.Event(), []

    def handle(task):
        if task.key == ("rollout", 2, 1):  # iteration 1's last prefetch
            assert release.wait(10)
        if task.key == ("train", 2, 0):
            trained_ahead.set()
        order.append(task.key)

    lanes = dispatch.Lanes()
    try:
        lanes.submit(first.tasks, handle=handle)
        lanes.wait([t.key for t in first.tasks if t.iteration == 1 and t.kind != "reward"])
        lanes.submit(second.tasks, handle=handle)
        assert trained_ahead.wait(10)
        assert ("rollout", 2, 1) not in order and ("train", 2, 1) not in order
        release.set()
        lanes.drain()
    finally:
        release.set()
        lanes.close()
    assert order.index(("rollout", 2, 1)) < order.index(("train", 2, 1)) < order.index(("update", 2, 0))
    assert order.index(("sync", 2, 0)) < order.index(("update", 2, 0))
