"""Per-group dispatch threads: plan order per group, cross-group dependencies, concurrency, errors."""
import threading
import time

import numpy as np
import pytest

from digen_jax.runtime import dispatch, plan


def run_lanes(tasks, handle):
    """Every task of `tasks` through `dispatch.Lanes` (one thread per lane), until all returned."""
    lanes = dispatch.Lanes()
    try:
        lanes.submit(tasks, handle=handle)
        lanes.drain()
    finally:
        lanes.close()


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
    run_lanes(p.tasks, handle)
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

    run_lanes(p.tasks, handle)
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
        run_lanes(p.tasks, handle)
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


def _sequences_and_moves(p, carried_on):
    sequences = {"rollout": [], "train": []}
    syncs = []
    for t in p.tasks:
        if t.kind == "reward":
            continue
        if t.kind == "sync":
            syncs.append(dispatch.Crossing(t, {n: len(s) for n, s in sequences.items()}))
        else:
            sequences[dispatch.lane(t)].append(t)
    rolled_on = dict(carried_on) | {(t.iteration, t.index): t.group for t in p.tasks if t.kind == "rollout"}
    moves = []
    for j, t in enumerate(sequences["train"]):
        if t.kind == "train" and rolled_on[(t.iteration, t.index)] == "rollout":
            produced = next((i for i, r in enumerate(sequences["rollout"]) if r.key == ("rollout", t.iteration, t.index)), -1)
            move = plan.Task("trajectory", "train", t.iteration, t.index, t.version, deps=(("rollout", t.iteration, t.index),))
            moves.append((move, "rollout", produced + 1, j))
    return sequences, moves, syncs


def test_moves_cross_where_both_streams_get_there_together():
    """Full mode, rollouts slower than training steps (as on two H100s): the carried micro-batch's
    trajectory, ready before the iteration, moves first on both streams (not at its training's
    place in the plan, behind every rollout); each move lies after its rollout and before its
    training in both lanes' orders, which agree; the estimated waits are well below those of
    moves at their trainings' places."""
    p = plan.plan_iteration("gap+tsp+tag+tcss", 2, 4, carried=1, tag=1, prefetch=1)
    costs = plan.Costs(rollout={"rollout": 5.5, "train": 5.4, "shared": 5.5}, reward=0.3, train=3.15, update=0.01, sync=0.01)
    sequences, moves, syncs = _sequences_and_moves(p, {(2, 0): "rollout"})
    crossings = dispatch.place_moves(sequences, moves, syncs, costs.of)
    at = {c.task.key: c.at for c in crossings}
    rollouts = [t.key for t in sequences["rollout"]]
    assert at[("trajectory", 2, 0)] == {"rollout": 0, "train": 0}
    for move, _, first, last in moves:
        assert first <= at[move.key]["rollout"] and at[move.key]["train"] <= last
    order = [c.task.key for c in crossings]
    for name in ("rollout", "train"):  # both lanes meet the crossings in the same order
        assert [k for k in order] == sorted(order, key=lambda k: (at[k][name], order.index(k)))

    def waits(places):  # estimated wait of the later stream at each crossing, times shifted by earlier waits
        ends = {n: np.concatenate([[0.0], np.cumsum([costs.of(t) for t in s])]) for n, s in sequences.items()}
        total = 0.0
        for c in places:
            wait = ends["rollout"][c.at["rollout"]] - ends["train"][c.at["train"]]
            late, i = ("train", c.at["train"]) if wait > 0 else ("rollout", c.at["rollout"])
            ends[late][i:] += abs(wait)
            total += abs(wait)
        return total

    at_training = [dispatch.Crossing(move, {"rollout": max(first, sum(1 for r in p.tasks[: [t.key for t in p.tasks].index(
        ("train", move.iteration, move.index))] if r.kind == "rollout" and r.group == "rollout")), "train": last})
        for move, _, first, last in moves]
    assert waits([c for c in crossings if c.task.kind == "trajectory"]) < 0.5 * waits(at_training)
    listed = dispatch.interleave(sequences, crossings)
    for name, seq in sequences.items():
        assert [t for t in listed if t in seq] == seq  # each lane's own order kept
    assert len(listed) == sum(map(len, sequences.values())) + len(crossings)
    assert rollouts == [t.key for t in sequences["rollout"]]
