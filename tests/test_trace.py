"""Tracer timing: a task's start waits for its group and for the recorded tasks it depends on."""
import threading

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


def _span_of(e):
    return e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6


def _span(tracer, kind):
    (e,) = [e for e in tracer.events if e["args"]["kind"] == kind]
    return _span_of(e)


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


def test_host_work_timed_elsewhere_counts_until_its_event_comes_and_holds_no_task_back():
    """A reward another process scores (`expect_elsewhere`): its iteration waits for its event
    (`record_elsewhere`, with that process's times), a training task depending on it is stamped
    without it, and one that never comes (its process failed) is done with no event."""
    clock = Clock()
    tracer = Tracer(None, clock=clock)
    reward = Task("reward", "reward", 0, 1, 0)
    tracer.expect_elsewhere(reward)
    train = Gate()
    tracer.record(Task("train", "train", 0, 1, 0, deps=(("reward", 0, 1),)), train, 1.0)
    _complete(tracer, clock, train, 3.0)
    np.testing.assert_allclose(_span(tracer, "train"), (1.0, 3.0))  # no wait for the remote reward
    waited = threading.Event()
    waiter = threading.Thread(target=lambda: (tracer.wait_through(0), waited.set()))
    waiter.start()
    assert not waited.wait(0.3)  # the iteration still counts the reward as running
    tracer.record_elsewhere(reward, 1.5, 2.5, process=1, sample_ids=[2, 3])
    assert waited.wait(10)
    (event,) = [e for e in tracer.events if e["args"]["kind"] == "reward"]
    assert _span_of(event) == (1.5, 2.5) and event["args"]["process"] == 1 and event["args"]["sample_ids"] == [2, 3]
    lost = Task("reward", "reward", 1, 0, 1)
    tracer.expect_elsewhere(lost)
    tracer.record_elsewhere(lost)
    tracer.wait_through(1)
    tracer.close()
    assert len([e for e in tracer.events if e["args"]["kind"] == "reward"]) == 1


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


def test_each_row_counts_the_sync_carrying_its_update_once_across_resumes(tmp_path):
    """A run's starting sync, named for the iteration whose rollouts wait for it, carries no
    update of that run: no row counts it, so every row of a run resumed (twice) from checkpoint 1
    counts the one sync carrying its update, as an uninterrupted run's rows do. The second resume
    supersedes the first one's starting sync, not the sync of the checkpointed update."""
    from digen_jax.runtime.trace import iteration_summary, read_trace

    path, clock = str(tmp_path / "trace.json"), Clock()

    def attempt(resume_from, tasks):
        tracer = Tracer(path, clock=clock)
        if resume_from is not None:
            tracer.resume(resume_from, kept=set())
        for task, extra in tasks:
            start = tracer.now()
            tracer.record_done(task, start, start + 1.0, **extra)
        tracer.close()

    def sync(k, starting=False):
        return Task("sync", "link", k, 0, k), {"bytes": 10, **({"starting": True} if starting else {})}

    update = lambda k: (Task("update", "train", k, 0, k + 1), {})  # noqa: E731
    attempt(None, [sync(0, starting=True), update(0), sync(1)])  # killed in iteration 1
    attempt(1, [sync(1, starting=True)])  # killed again before its update
    attempt(1, [sync(1, starting=True), update(1), sync(2)])
    events = read_trace(path)
    for k in (0, 1):
        summary = iteration_summary(events, k, (0.0, 1e3), ["rollout", "train"])
        assert summary["sync_bytes"] == 10 and summary["sync_s"] == 1.0, (k, summary)
    superseded = [e["args"] for e in read_trace(path, superseded=True) if e["args"].get("superseded")]
    assert superseded == [{**sync(1, starting=True)[1], "group": "link", "kind": "sync", "iteration": 1,
                           "microbatch": 0, "version": 1, "superseded": True}]


# ---------------------------------------------------------------------------- several processes


class FakeStore:
    """The key-value store of a `jax.distributed` client, in memory, shared by the tracers of the
    processes a test plays."""

    def __init__(self):
        self.values = {}
        self._changed = threading.Condition()

    def key_value_set(self, key, value, allow_overwrite=False):
        with self._changed:
            assert allow_overwrite or key not in self.values, key
            self.values[key] = value
            self._changed.notify_all()

    def blocking_key_value_get(self, key, timeout_in_ms):
        with self._changed:
            if not self._changed.wait_for(lambda: key in self.values, timeout_in_ms / 1000):
                raise RuntimeError(f"DEADLINE_EXCEEDED: GetKeyValue() timed out with key: {key}")
            return self.values[key]

    def key_value_delete(self, key):
        with self._changed:
            del self.values[key]


class Device:
    def __init__(self, process_index):
        self.process_index = process_index


class Sharding:
    def __init__(self, *processes):
        self.device_set = {Device(p) for p in processes}


class Held(Gate):
    """Outputs with shards on `processes`' devices, as the process holding them sees them."""

    def __init__(self, *processes):
        super().__init__()
        self.sharding = Sharding(*processes)


class Elsewhere:
    """The same outputs on a process holding none of their shards: waiting on them is a mistake
    (it would return at once on a real array)."""

    def __init__(self, *processes):
        self.sharding = Sharding(*processes)

    def block_until_ready(self):
        raise AssertionError("a process waited for outputs it holds no shard of")


class Time:
    """One moment, read by each process's clocks: perf_counter-like clocks with their own
    origins, wall clocks that agree (hosts in sync)."""

    def __init__(self):
        self.t = 0.0

    def perf(self, offset):
        return lambda: self.t + offset

    def wall(self):
        return self.t + 1.7e9


def _when(condition, what):
    for _ in range(3000):
        if condition():
            return
        threading.Event().wait(0.01)
    raise AssertionError(f"never: {what}")


def _spans(tracer, kinds=("rollout", "trajectory", "train", "update", "sync")):
    """(kind, iteration) -> (start, end, the process that timed it) of the tracer's events."""
    return {(e["args"]["kind"], e["args"]["iteration"]): (*_span_of(e), e["args"]["process"])
            for e in tracer.events if e["args"]["kind"] in kinds}


def test_owner_is_the_lowest_process_holding_a_shard():
    import jax.numpy as jnp

    from digen_jax.runtime.trace import EventExchange

    assert EventExchange.owner((Elsewhere(1), Elsewhere(2, 1))) == 1
    assert EventExchange.owner({"a": Elsewhere(3), "b": [Elsewhere(2, 0)]}) == 0
    assert EventExchange.owner(jnp.ones(2)) == 0
    assert EventExchange.owner((np.ones(2), 3)) is None  # no device arrays: each process times it


def test_two_processes_each_time_their_own_devices_and_share_the_events(tmp_path):
    """One iteration of a disaggregated run as two processes see it (rollout and the weights'
    arrival on process 0's devices; the trajectory's arrival, training and the update on process
    1's): each stamps only its own devices' tasks (never waiting on the others' outputs), both
    end with the same events on one clock (their perf_counter origins differ), a start waits
    for a dependency stamped on the other process, rewards stay with the process that scored
    them, process 0's `wait_through` waits for process 1's events, and its trace holds them."""
    from digen_jax.runtime.trace import EventExchange, Tracer, read_trace

    store, time_ = FakeStore(), Time()
    peers = [EventExchange(store, p, 2, instance=0) for p in range(2)]
    trace = str(tmp_path / "trace.json")
    tracers = [Tracer(trace, clock=time_.perf(10.0), peers=peers[0], wall=time_.wall)]
    time_.t = 0.3  # process 1 starts its tracer later, on a clock with another origin
    tracers.append(Tracer(None, clock=time_.perf(1000.0), peers=peers[1], wall=time_.wall))
    np.testing.assert_allclose([t.now() for t in tracers], [0.3, 0.3], atol=1e-6)

    owners = {"rollout": 0, "trajectory": 1, "train": 1, "update": 1, "sync": 0}
    tasks = [Task("rollout", "rollout", 0, 0, 0), Task("trajectory", "link", 0, 0, 0, deps=(("rollout", 0, 0),)),
             Task("train", "train", 0, 0, 0, sample_version=0, deps=(("reward", 0, 0),)),
             Task("update", "train", 0, 0, 1, deps=(("train", 0, 0),)),
             Task("sync", "link", 1, 0, 1, deps=(("update", 0, 0),))]
    gates = {}
    for task in tasks:
        for p, tracer in enumerate(tracers):
            owner = owners[task.kind]
            outputs = Held(owner) if p == owner else Elsewhere(owner)
            if p == owner:
                gates[task.kind] = outputs
            tracer.record(task, outputs, 0.3)

    def complete(kind, at):
        time_.t = at
        gates[kind].released.set()
        _when(lambda: all(any(e["args"]["kind"] == kind for e in t.events) for t in tracers), f"{kind} on both")

    complete("rollout", 1.0)
    complete("trajectory", 1.25)
    for tracer, scored in zip(tracers, (1.5, 1.75)):  # each process scores the rewards itself
        tracer.record_done(Task("reward", "reward", 0, 0, 0), 1.0, scored)
    waiting = threading.Thread(target=tracers[0].wait_through, args=(0,))
    waiting.start()
    waiting.join(0.3)
    assert waiting.is_alive()  # process 1's training and update are still to come
    complete("train", 3.0)
    complete("update", 4.0)
    complete("sync", 4.5)
    waiting.join(10)
    assert not waiting.is_alive()
    for tracer in tracers:
        tracer.close()  # raises a watcher's error: one that waited on outputs held elsewhere

    want = {("rollout", 0): (0.3, 1.0, 0),
            ("trajectory", 0): (1.0, 1.25, 1),  # from the end of the rollout stamped on process 0
            ("train", 0): (1.75, 3.0, 1),  # from the end of process 1's own rewards
            ("update", 0): (3.0, 4.0, 1),
            ("sync", 1): (4.0, 4.5, 0)}  # from the end of the update stamped on process 1
    for tracer in tracers:
        spans = _spans(tracer)
        assert spans.keys() == want.keys()
        for key, (start, end, process) in want.items():
            np.testing.assert_allclose(spans[key][:2], (start, end), atol=1e-6, err_msg=str(key))
            assert spans[key][2] == process, key
    for tracer, (end, process) in zip(tracers, ((1.5, 0), (1.75, 1))):
        start_end_process = _spans(tracer, ("reward",))[("reward", 0)]
        np.testing.assert_allclose(start_end_process[:2], (1.0, end), atol=1e-6)
        assert start_end_process[2] == process
    written = read_trace(trace, kinds=("rollout", "trajectory", "train", "update", "sync", "reward"))
    assert sorted(map(str, written)) == sorted(map(str, tracers[0].events))
    assert all("/origin/" in key for key in store.values)  # every exchanged copy was read and deleted


def test_a_resumed_tracer_keeps_the_processes_on_one_clock(tmp_path):
    """Process 0 resumes its trace (its clock goes on from the trace's last timestamp); process
    1, which writes none, follows its clock."""
    from digen_jax.runtime.trace import EventExchange, Tracer

    store, time_ = FakeStore(), Time()
    trace = tmp_path / "trace.json"
    trace.write_text('[\n{"name": "update it0 mb0", "ph": "X", "pid": 0, "tid": 2, "ts": 5000000.0, "dur": 1000000.0, '
                     '"args": {"group": "train", "kind": "update", "iteration": 0, "microbatch": 0, "version": 1}},\n')
    tracers = [Tracer(str(trace), clock=time_.perf(10.0), peers=EventExchange(store, 0, 2, 0), wall=time_.wall),
               Tracer(None, clock=time_.perf(-40.0), peers=EventExchange(store, 1, 2, 0), wall=time_.wall)]
    time_.t = 2.0
    for tracer in tracers:
        tracer.resume(1, kept=set())
    np.testing.assert_allclose([t.now() for t in tracers], [6.0, 6.0], atol=1e-6)
    time_.t = 2.5
    np.testing.assert_allclose([t.now() for t in tracers], [6.5, 6.5], atol=1e-6)


def test_closing_waits_a_bounded_time_for_another_process_s_events(monkeypatch):
    """A process whose peer stopped sending events (it failed) still closes its tracer, once its
    own tasks are done and the bound on the others' has passed."""
    from digen_jax.runtime import trace

    monkeypatch.setattr(trace, "_DEP_WAIT_S", 0.2)
    time_ = Time()
    tracer = trace.Tracer(None, clock=time_.perf(0.0), peers=trace.EventExchange(FakeStore(), 0, 2, 0), wall=time_.wall)
    own = Held(0)
    tracer.record(Task("rollout", "rollout", 0, 0, 0), own, 0.0)
    tracer.record(Task("train", "train", 0, 0, 0, sample_version=0), Elsewhere(1), 0.0)
    closing = threading.Thread(target=tracer.close)
    closing.start()
    closing.join(0.5)
    assert closing.is_alive()  # its own rollout is not done
    time_.t = 1.0
    own.released.set()
    closing.join(10)
    assert not closing.is_alive()
    assert [e["args"]["kind"] for e in tracer.events] == ["rollout"]
