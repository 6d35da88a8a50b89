"""Tracer timing: a task's start waits for its group and for the recorded tasks it depends on."""
import threading

import jax
import numpy as np

from digen_jax.runtime.plan import Task
from digen_jax.runtime.trace import Tracer


class Gate:
    """A stand-in output whose readiness the test controls."""

    def __init__(self):
        self.released = threading.Event()

    def block_until_ready(self):
        self.released.wait(30)
        return self


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _complete(tracer, clock, gate, at):
    """Make `gate` ready at clock time `at` and wait until the tracer stamped it."""
    done = len(tracer.events) + 1
    clock.now = at
    gate.released.set()
    for _ in range(3000):
        if len(tracer.events) >= done:
            return
        threading.Event().wait(0.01)
    raise AssertionError(f"only {len(tracer.events)} of {done} events")


def _span(tracer, kind):
    (e,) = [e for e in tracer.events if e["args"]["kind"] == kind]
    return e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6


def test_a_task_starts_when_its_cross_group_dependency_ends():
    clock = Clock()
    tracer = Tracer(None, clock=clock)
    update, sync = Gate(), Gate()
    tracer.record(Task("update", "train", 0, 0, 1), update, 0.0)
    tracer.record(Task("sync", "link", 1, 0, 1, deps=(("update", 0, 0),)), sync, 0.0)
    rollout = Gate()
    # Dispatched at 0.5 while the weights it needs were still in flight.
    tracer.record(Task("rollout", "rollout", 1, 0, 1, deps=(("sync", 1, 0),)), rollout, 0.5)
    _complete(tracer, clock, update, 2.0)
    _complete(tracer, clock, sync, 2.25)
    _complete(tracer, clock, rollout, 3.0)
    np.testing.assert_allclose(_span(tracer, "update"), (0.0, 2.0))
    np.testing.assert_allclose(_span(tracer, "sync"), (2.0, 2.25))  # not from its dispatch at 0
    np.testing.assert_allclose(_span(tracer, "rollout"), (2.25, 3.0))  # not from its dispatch at 0.5


def test_group_order_and_unrecorded_dependencies():
    clock = Clock()
    tracer = Tracer(None, clock=clock)
    first, second = Gate(), Gate()
    # A dependency that was never recorded (e.g. a previous run's update) does not hold a task back.
    tracer.record(Task("train", "train", 3, 0, 3, deps=(("update", 2, 0),)), first, 1.0)
    tracer.record(Task("train", "train", 3, 1, 3, deps=(("train", 3, 0),)), second, 1.5)
    _complete(tracer, clock, first, 4.0)
    _complete(tracer, clock, second, 6.0)
    spans = sorted((e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6) for e in tracer.events)
    np.testing.assert_allclose(spans, [(1.0, 4.0), (4.0, 6.0)])


def test_dispatch_time_is_recorded_and_summarised_per_group():
    """A dispatch call that returns only once its work is nearly done shows as dispatch_frac near 1;
    an asynchronous one as near 0."""
    from digen_jax.runtime.trace import iteration_summary

    clock = Clock()
    tracer = Tracer(None, clock=clock)
    blocking, asynchronous = Gate(), Gate()
    clock.now = 1.8  # the rollout's dispatch call returned at 1.8 (dispatched at 0, done at 2)
    tracer.record(Task("rollout", "rollout", 0, 0, 0), blocking, 0.0)
    clock.now = 0.51  # the training task's returned 0.01 s after its dispatch at 0.5
    tracer.record(Task("train", "train", 0, 0, 0, sample_version=0), asynchronous, 0.5)
    _complete(tracer, clock, blocking, 2.0)
    _complete(tracer, clock, asynchronous, 2.5)
    by_kind = {e["args"]["kind"]: e["args"]["dispatch_s"] for e in tracer.events}
    np.testing.assert_allclose([by_kind["rollout"], by_kind["train"]], [1.8, 0.01])
    summary = iteration_summary(tracer.events, 0, (0.0, 2.5), ["rollout", "train"])
    np.testing.assert_allclose(summary["dispatch_frac"]["rollout"], 1.8 / 2.0)
    np.testing.assert_allclose(summary["dispatch_frac"]["train"], 0.01 / 2.0)  # dispatched at 0.5, done at 2.5
