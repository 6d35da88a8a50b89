"""The planner: what every device group does in one iteration, in order, for each schedule mode.

A plan is an ordered list of tasks (docs/design.md section 4). The executor dispatches each
device group's tasks in this order (from the group's own host thread, `dispatch.py`); the
simulator (`schedule`) runs the same list against a cost model. Both read the same plan, so
what the simulator predicts is what the executor does.

Groups: `rollout` and `train` are the two device roles of a disaggregated run; colocated
runs use the single group `shared`; `reward` is the reward queue (host threads or reward
devices); `link` is the trainer -> rollout weight transfer.

Versions: weights of version v are the parameters after v optimizer updates. An iteration
makes U = `rl.num_updates_per_batch` updates, each on a consecutive share of its micro-batches,
so it starts at version k*U: the trainer holds it at the head of iteration k, and rollout holds
it once the sync that carries it (one per iteration, after the last update) has landed. A task
records the version of the weights it *uses*; a training task also records the version that
*generated* its samples (`sample_version`), so staleness = version - sample_version: u for the
u-th share of an iteration's own samples, U + u for samples prefetched in the iteration before.

Modes (docs/design.md section 4):
  colocated           one group rolls out the whole batch, then trains it.
  disagg_sync         rollout generates the whole batch; training starts when all of it is scored.
  gap                 training of micro-batch m starts as soon as m is scored.
  gap+tsp             as gap; training units are flattened over samples x steps and sharded
                      over every trainer device (an executor/cost difference, same task list).
  gap+tsp+tag         the trainer also rolls out `tag` pieces at the head of the iteration.
  gap+tsp+tag+tcss    rollout generates the next iteration's first `prefetch` micro-batches with
                      the current weights while the trainer finishes (one iteration stale).

Pieces: the trainer's share of the rollouts is counted in pieces, `grain` to a micro-batch (1:
whole micro-batches). When `tag` is not a multiple of `grain` the micro-batch at the boundary is
split: its first pieces are rolled out by the trainer (after its whole ones), the rest by the
rollout group (before its whole ones), each piece scored on its own; its training waits for both.
A piece covers consecutive samples and keeps their noise keys, so the samples (and, once the
micro-batch is whole again, its advantages) are the ones either group alone would make.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Mapping, Sequence

MODES = ("colocated", "disagg_sync", "gap", "gap+tsp", "gap+tsp+tag", "gap+tsp+tag+tcss")
GROUPS = ("shared", "rollout", "train", "reward", "link")

TaskKey = tuple  # (kind, iteration, microbatch-or-update-index)


@dataclasses.dataclass(frozen=True)
class ModeFlags:
    colocated: bool
    pipelined: bool  # gap: train a micro-batch as soon as it is scored
    tsp: bool
    tag: bool
    tcss: bool


def mode_flags(mode: str) -> ModeFlags:
    if mode not in MODES:
        raise ValueError(f"runtime.mode={mode!r} is unknown; known: {list(MODES)}, or 'auto' (launch/train.py chooses one)")
    return ModeFlags(
        colocated=mode == "colocated",
        pipelined=mode.startswith("gap"),
        tsp="tsp" in mode,
        tag="tag" in mode,
        tcss="tcss" in mode,
    )


# The modes by the part they play in reports and searches: the one-group mode, the synchronous
# disaggregated baseline that every pipelined mode is compared with, and every technique on.
COLOCATED, SYNC_BASELINE, BEST_MODE = MODES[0], MODES[1], MODES[-1]
DISAGGREGATED_MODES = tuple(m for m in MODES if not mode_flags(m).colocated)


def technique(mode: str) -> str | None:
    """What `mode` adds to the mode before it in `MODES`, as the ablation names it ('GAP', 'TSP',
    'TAG', 'TCSS'); None for the modes that add no technique (colocated and the sync baseline)."""
    mode_flags(mode)
    if mode in (COLOCATED, SYNC_BASELINE):
        return None
    return mode.rsplit("+", 1)[-1].upper()


@dataclasses.dataclass(frozen=True)
class Task:
    kind: str  # 'rollout' | 'reward' | 'train' | 'update' | 'sync'
    group: str  # one of GROUPS
    iteration: int  # the iteration whose batch (rollout/reward/train) or update this is
    index: int  # micro-batch (rollout/reward/train), update index (update), 0 (sync)
    version: int  # weights used (rollout, train), produced (update), carried (sync)
    sample_version: int | None = None  # train: the version that generated the micro-batch
    deps: tuple[TaskKey, ...] = ()
    # rollout/reward of part of a micro-batch: its pieces (first, end) of `grain`; None: all of it
    piece: tuple[int, int, int] | None = None  # (first, end, grain)

    @property
    def key(self) -> TaskKey:
        """(kind, iteration, index), and a piece's first piece index when it covers part of one."""
        base = (self.kind, self.iteration, self.index)
        return base if self.piece is None else (*base, self.piece[0])

    @property
    def share(self) -> float:
        """The part of its micro-batch the task covers (1.0: all of it)."""
        return 1.0 if self.piece is None else (self.piece[1] - self.piece[0]) / self.piece[2]


@dataclasses.dataclass(frozen=True)
class IterationPlan:
    iteration: int
    microbatches: int
    tasks: tuple[Task, ...]  # in dispatch order (a topological order)
    carried: int  # micro-batches of this iteration generated during the previous one
    tag: int  # pieces the trainer rolls out (`grain` to a micro-batch)
    prefetch: int  # micro-batches of the next iteration generated with this iteration's weights
    grain: int = 1  # pieces per micro-batch

    @property
    def tag_microbatches(self) -> float:
        """The trainer's rollouts in micro-batches (fractional when a micro-batch is split)."""
        return self.tag / self.grain

    def of_kind(self, kind: str) -> list[Task]:
        return [t for t in self.tasks if t.kind == kind]


def plan_iteration(
    mode: str, iteration: int, microbatches: int, *, carried: int = 0, tag: int = 0, prefetch: int = 0, updates: int = 1,
    grain: int = 1,
) -> IterationPlan:
    """The task list of `iteration`; `carried` micro-batches were prefetched by the last one; the
    trainer rolls out `tag` pieces, `grain` to a micro-batch."""
    flags = mode_flags(mode)
    k, m_total = iteration, microbatches
    if m_total < 1:
        raise ValueError(f"runtime.micro_batches must be >= 1, got {m_total}")
    if grain < 1:
        raise ValueError(f"the pieces per micro-batch must be >= 1, got {grain}")
    if updates < 1 or m_total % updates:
        raise ValueError(f"rl.num_updates_per_batch={updates} must divide runtime.micro_batches={m_total}")
    if (tag and not flags.tag) or (prefetch and not flags.tcss) or (carried and not flags.tcss):
        raise ValueError(f"runtime.mode={mode!r} has no trainer rollouts / prefetch (tag={tag}, prefetch={prefetch})")
    if not (0 <= carried <= m_total and 0 <= tag <= (m_total - carried) * grain and 0 <= prefetch <= m_total):
        raise ValueError(f"bad split of {m_total} micro-batches: carried={carried}, tag={tag}/{grain}, prefetch={prefetch}")
    if flags.colocated:
        return _plan_colocated(k, m_total, updates)

    start = k * updates  # the version the trainer holds at the head of iteration k
    weights_on_rollout = (("sync", k, 0),) if k > 0 else ()
    weights_on_train = (("update", k - 1, updates - 1),) if k > 0 else ()
    tasks: list[Task] = []
    # The trainer's rollouts first: their rewards must not queue behind the rollout group's. A
    # split micro-batch is the trainer's last rollout and the rollout group's first.
    whole, part = divmod(tag, grain)
    split = carried + whole if part else None
    for m in range(carried, carried + whole):
        tasks.append(Task("rollout", "train", k, m, start, deps=weights_on_train))
    if split is not None:
        tasks.append(Task("rollout", "train", k, split, start, deps=weights_on_train, piece=(0, part, grain)))
        tasks.append(Task("rollout", "rollout", k, split, start, deps=weights_on_rollout, piece=(part, grain, grain)))
    for m in range(carried + whole + (split is not None), m_total):
        tasks.append(Task("rollout", "rollout", k, m, start, deps=weights_on_rollout))
    for m in range(prefetch):
        tasks.append(Task("rollout", "rollout", k + 1, m, start, deps=weights_on_rollout))
    rewards: dict[int, tuple[TaskKey, ...]] = {}
    for t in list(tasks):
        reward = Task("reward", "reward", t.iteration, t.index, t.version, deps=(t.key,), piece=t.piece)
        tasks.append(reward)
        if t.iteration == k:
            rewards[t.index] = rewards.get(t.index, ()) + (reward.key,)
    for m in range(carried):  # carried: rolled out and scored in the iteration before
        rewards[m] = (("reward", k, m),)
    all_rewards = tuple(key for m in range(m_total) for key in rewards[m])
    # The trainer takes the micro-batches in index order: the carried ones (rolled out with the
    # previous iteration's weights), then its own rollouts', then the rollout group's. The sync
    # of this iteration's weights reads the trainer's weights when it is dispatched, behind the
    # rollout group's earlier tasks; the first update, which replaces them (donating their
    # buffers), waits for it however far ahead the trainer runs.
    tasks += _training(
        k, "train", start, m_total, updates, previous=weights_on_train, first_update_deps=weights_on_rollout,
        sample_version=lambda m: start - updates if m < carried else start,
        reward_deps=lambda m: rewards[m] if flags.pipelined else all_rewards,
    )
    # One sync per iteration, after its last update: the next iteration's rollouts sample the
    # weights at its head, like a colocated run's (docs/design.md section 4).
    sync = Task("sync", "link", k + 1, 0, start + updates, deps=(("update", k, updates - 1),))
    # The sync is dispatched from the rollout group's thread and replaces its weights: it goes
    # after every rollout of the old weights there, the prefetched ones of the next iteration
    # included, wherever the nominal order would put it (the device copy may still overlap them).
    ordered = list(_dispatch_order(tasks))
    after = max(i for i, t in enumerate(ordered) if t.kind == "update" or (t.kind == "rollout" and t.group == "rollout"))
    ordered.insert(after + 1, sync)
    return IterationPlan(k, m_total, tuple(ordered), carried, tag, prefetch, grain)


def pieces_per_microbatch(samples: int, batch_axes: Sequence[int]) -> int:
    """The grain of a split: the most pieces a micro-batch of `samples` is cut into, each piece a
    run of samples that every role's batch axis (`batch_axes`: its sizes) divides where it
    divides the micro-batch, so a piece spreads over a role's devices as evenly as the whole."""
    unit = 1
    for size in batch_axes:
        if samples % size == 0:
            unit = unit * size // math.gcd(unit, size)
    return samples // unit if samples % unit == 0 else 1


def replicated_work(mode: str, samples: int, grad_chunk_size: int, widths: Mapping[str, int]) -> dict[tuple[str, str], int]:
    """The work a run of `mode` computes whole on every device of a group instead of splitting
    it, as {(task kind, group): that group's data-axis size}. A batch whose size a group's data
    axis does not divide is replicated over the group (`mesh.batch_sharding`): each of its n
    devices computes all of it, n times the work. `samples`: one micro-batch's samples;
    `grad_chunk_size`: the units of a gradient chunk where units are cut by count (TSP,
    colocated), else a chunk is one trained step of every sample; `widths`: group -> its
    data-axis size ('shared' for colocated)."""
    flags = mode_flags(mode)
    rollout_group, train_group = ("shared", "shared") if flags.colocated else ("rollout", "train")
    chunk = grad_chunk_size if flags.tsp or flags.colocated else samples
    work = [("rollout", rollout_group, samples), ("train", train_group, chunk)]
    if flags.tag:  # the trainer's pieces: multiples of its axis only where that divides the micro-batch
        work.append(("rollout", "train", samples))
    return {(kind, group): widths[group] for kind, group, size in work if widths[group] > 1 and size % widths[group]}


def _dispatch_order(tasks: Sequence[Task]) -> tuple[Task, ...]:
    """`tasks` (each group's in its order) interleaved across groups by when they could start.

    The plan's order, as a single dispatching thread would run it. Such a thread
    blocks on a micro-batch's rewards before its training task, and inside any dispatch call
    that waits for its device; dispatching every rollout before the first training task would
    leave the trainer waiting for the last rollout to be enqueued. In this order each group
    is kept about one task ahead. Nominal costs suffice (only the order across groups
    changes, never a group's own order); every cost is positive, so a task starts strictly
    after its dependencies and the order stays topological.
    """
    plan = IterationPlan(0, 0, tuple(tasks), 0, 0, 0)
    start = schedule([plan], NOMINAL_COSTS).start
    return tuple(sorted(tasks, key=lambda t: start[t.key]))  # stable: ties keep the plan's order


def _plan_colocated(k: int, m_total: int, updates: int) -> IterationPlan:
    start = k * updates
    after_last_update = (("update", k - 1, updates - 1),) if k > 0 else ()
    tasks = [Task("rollout", "shared", k, m, start, deps=after_last_update) for m in range(m_total)]
    tasks += [Task("reward", "reward", k, m, start, deps=(("rollout", k, m),)) for m in range(m_total)]
    all_rewards = tuple(("reward", k, m) for m in range(m_total))
    tasks += _training(k, "shared", start, m_total, updates, sample_version=lambda m: start,
                       reward_deps=lambda m: all_rewards)
    return IterationPlan(k, m_total, tuple(tasks), 0, 0, 0)


def _training(k: int, group: str, start: int, m_total: int, updates: int, *, sample_version, reward_deps,
              previous: tuple[TaskKey, ...] = (), first_update_deps: tuple[TaskKey, ...] = ()) -> list[Task]:
    """Iteration k's training on `group`: its micro-batches in index order, cut into `updates`
    consecutive shares, each closed by an update. Share u trains with version `start + u` (the
    weights after the iteration's first u updates), so its samples, generated by
    `sample_version(m)`, are u versions staler than the first share's (Flow-GRPO's several
    optimizer steps per sampled batch)."""
    per_update = m_total // updates
    tasks = []
    for m in range(m_total):
        u = m // per_update
        tasks.append(Task("train", group, k, m, start + u, sample_version=sample_version(m),
                          deps=reward_deps(m) + previous))
        previous = (("train", k, m),)
        if (m + 1) % per_update == 0:
            tasks.append(Task("update", group, k, u, start + u + 1, deps=previous + (first_update_deps if u == 0 else ())))
            previous = (("update", k, u),)
    return tasks


# ------------------------------------------------------------------ cost model and schedule
@dataclasses.dataclass(frozen=True)
class Costs:
    """Seconds per task: rollout of one micro-batch per group, and the rest per micro-batch/update.

    A rollout of part of a micro-batch (a piece) costs its share of the whole, except for
    `rollout_fixed[group]`, the seconds of the whole that do not shrink with the batch (each
    denoising step's batch-independent part, `task_costs.Efficiency.block_s`): a piece pays
    them in full. Measured costs carry none (the executor measures pieces by their share)."""

    rollout: Mapping[str, float]  # group -> seconds per micro-batch ('rollout', 'train' or 'shared')
    reward: float
    train: float  # one micro-batch's forward+backward on the train (or shared) group
    update: float
    sync: float
    rollout_fixed: Mapping[str, float] = dataclasses.field(default_factory=dict)  # group -> seconds, part of `rollout`

    def of(self, task: Task) -> float:
        if task.kind == "rollout":
            whole = self.rollout[task.group]
            if task.share == 1.0:
                return whole
            fixed = min(self.rollout_fixed.get(task.group, 0.0), whole)
            return fixed + (whole - fixed) * task.share
        if task.kind == "reward":
            return self.reward * task.share
        return {"train": self.train, "update": self.update, "sync": self.sync}[task.kind]


NOMINAL_COSTS = Costs(rollout={"rollout": 1.0, "train": 1.0, "shared": 1.0}, reward=0.1, train=0.5, update=0.1, sync=0.05)


@dataclasses.dataclass(frozen=True)
class Timeline:
    start: dict[TaskKey, float]
    end: dict[TaskKey, float]
    group: dict[TaskKey, str]


def schedule(plans: Sequence[IterationPlan], costs: Costs, *, free_at: Mapping[str, float] | None = None) -> Timeline:
    """Start/end of every task when each group runs its tasks in plan order, waiting on deps.

    Dependencies on tasks outside `plans` count as done at time 0.
    """
    timeline = Timeline({}, {}, {})
    free = dict.fromkeys(GROUPS, 0.0)
    free.update(free_at or {})
    for plan in plans:
        _schedule_into(timeline, free, plan, costs)
    return timeline


def _schedule_into(timeline: Timeline, free: dict[str, float], plan: IterationPlan, costs: Costs) -> None:
    end = timeline.end
    for task in plan.tasks:
        key = task.key
        ready = max([free[task.group], *(end.get(d, 0.0) for d in task.deps)])
        done = ready + costs.of(task)
        timeline.start[key], end[key], timeline.group[key] = ready, done, task.group
        free[task.group] = done


def _same(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(abs(a), abs(b), 1.0)


@dataclasses.dataclass(frozen=True)
class SteadyState:
    """A schedule run until its update-to-update interval repeats, and its timed window."""

    timeline: Timeline
    iterations: int  # iterations scheduled (1..iterations)
    window: tuple[float, float]  # the last `period` iterations, update end to update end
    period: int  # iterations in the window: 1, or 2 when the intervals alternate
    iteration_s: float  # mean seconds per iteration inside the window


def steady_state(mode: str, microbatches: int, costs: Costs, *, tag: int = 0, prefetch: int = 0, updates: int = 1,
                 grain: int = 1, min_iterations: int = 6, max_iterations: int = 64) -> SteadyState:
    """Iterations with the same split, scheduled until the interval between their last updates
    repeats (the first starts with its carried micro-batches already done).

    A fixed short horizon is not enough: when the prefetching group is the bottleneck, it falls
    a little further behind every iteration, and the trainer only starts to wait for it after
    the head start it had is used up, many iterations in. Until then the updates come evenly at
    the trainer's pace, so repeating intervals are steady only when no group has more work per
    iteration (the sum of its tasks' seconds) than the interval; a run that has not settled
    by `max_iterations` takes the busiest group's work as its interval where that is longer.
    """
    if min_iterations < 4 or max_iterations < min_iterations:
        raise ValueError(f"need 4 <= min_iterations <= max_iterations, got {min_iterations}, {max_iterations}")
    timeline = Timeline({}, {}, {})
    free = dict.fromkeys(GROUPS, 0.0)
    last = updates - 1
    ends: list[float] = []
    busiest = 0.0  # the most seconds of work one group has per iteration
    for k in range(1, max_iterations + 1):
        plan = plan_iteration(mode, k, microbatches, carried=prefetch, tag=tag, prefetch=prefetch, updates=updates,
                              grain=grain)
        if k == 1:
            work: dict[str, float] = {}
            for task in plan.tasks:
                work[task.group] = work.get(task.group, 0.0) + costs.of(task)
            busiest = max(work.values())
        _schedule_into(timeline, free, plan, costs)
        ends.append(timeline.end[("update", k, last)])
        if k < min_iterations:
            continue
        gaps = [b - a for a, b in zip(ends[-5:], ends[-4:])]
        if _same(gaps[-1], gaps[-2]) and _same(gaps[-2], gaps[-3]) and not _lags(busiest, gaps[-1]):
            period = 1
            break
        if _same(gaps[-1], gaps[-3]) and _same(gaps[-2], gaps[-4]) and not _lags(busiest, (gaps[-1] + gaps[-2]) / 2):
            period = 2
            break
    else:
        period = 4  # still settling: the mean of the last intervals, at least the busiest group's work
    window = (ends[-1 - period], ends[-1])
    iteration_s = max((window[1] - window[0]) / period, busiest)
    return SteadyState(timeline, len(ends), window, period, iteration_s)


def _lags(work: float, interval: float) -> bool:
    """Whether a group with `work` seconds per iteration falls behind iterations `interval` apart."""
    return work > interval and not _same(work, interval)


def iteration_time(mode: str, microbatches: int, costs: Costs, *, tag: int = 0, prefetch: int = 0, updates: int = 1,
                   grain: int = 1) -> float:
    """Steady-state seconds per iteration (`steady_state`); `tag` in pieces, `grain` to a micro-batch."""
    return steady_state(mode, microbatches, costs, tag=tag, prefetch=prefetch, updates=updates, grain=grain).iteration_s


def choose_split(mode: str, microbatches: int, costs: Costs, *, fixed_tag: int | None = None, fixed_prefetch: int | None = None,
                 updates: int = 1, grain: int = 1, tolerance: float = 0.02,
                 keep: tuple[int, int] | None = None) -> tuple[int, int]:
    """(tag, prefetch) with the least trainer rollout and staleness among the splits predicted
    within `tolerance` of the fastest: gains smaller than the noise of measured costs are not
    worth moving work or training on stale samples. `tag` (and `fixed_tag`) counts pieces,
    `grain` to a micro-batch. `keep` (the split in use) stays while it is within `tolerance`:
    the costs' noise moves no work back and forth, and each new piece size compiles its rollout.

    Whole micro-batches are tried first; then, for the prefetches within `tolerance` there, the
    pieces within one micro-batch either side of their best whole share (an iteration's time
    falls, then rises, as the trainer takes more of the rollouts: its best lies next to the
    best whole share), in steps of about an eighth of a micro-batch and then one piece around
    the best step, so a fine grain adds some 20 schedules per prefetch, not microbatches * grain."""
    flags = mode_flags(mode)
    if not flags.tag:
        fixed_tag = 0
    prefetches = [fixed_prefetch] if fixed_prefetch is not None else (range(microbatches + 1) if flags.tcss else [0])
    predicted: dict[tuple[int, int], float] = {}

    def predict(tag: int, prefetch: int) -> None:
        if (tag, prefetch) not in predicted and 0 <= tag <= (microbatches - prefetch) * grain:
            predicted[(tag, prefetch)] = iteration_time(mode, microbatches, costs, tag=tag, prefetch=prefetch,
                                                        updates=updates, grain=grain)

    for prefetch in prefetches:
        for tag in [fixed_tag] if fixed_tag is not None else range(0, (microbatches - prefetch) * grain + 1, grain):
            predict(tag, prefetch)
    if not predicted:
        raise ValueError(f"no valid split of {microbatches} micro-batches for tag={fixed_tag}, prefetch={fixed_prefetch}")
    if fixed_tag is None and grain > 1:
        fastest = min(predicted.values())
        for prefetch in {p for (_, p), t in predicted.items() if t <= fastest * (1 + tolerance)}:
            step = max(1, grain // 8)
            for span, stride in ((grain - 1, step), (step - 1, 1)):
                best = min((t, tag) for (tag, p), t in predicted.items() if p == prefetch)[1]
                for tag in range(best - span, best + span + 1, stride):
                    predict(tag, prefetch)
    fastest = min(predicted.values())
    if keep is not None and (fixed_tag is None or keep[0] == fixed_tag) and keep[1] in prefetches:
        predict(*keep)
        if predicted.get(keep, math.inf) <= fastest * (1 + tolerance):
            return keep
    good = [split for split, t in predicted.items() if t <= fastest * (1 + tolerance)]
    return min(good, key=lambda split: (split[0] / grain + split[1], split[1], split[0]))


def busy_fractions(timeline: Timeline, keys: Iterable[TaskKey], window: tuple[float, float]) -> dict[str, float]:
    """Busy share of each group inside `window` over the tasks `keys`."""
    lo, hi = window
    span = max(hi - lo, 1e-12)
    busy: dict[str, float] = {}
    for key in keys:
        g = timeline.group[key]
        overlap = max(0.0, min(timeline.end[key], hi) - max(timeline.start[key], lo))
        busy[g] = busy.get(g, 0.0) + overlap
    return {g: min(1.0, b / span) for g, b in busy.items()}
