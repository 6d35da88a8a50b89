"""The simulator: the planner's task lists run against task costs instead of devices.

docs/design.md section 6. The executor and the simulator read the same plans (`plan.plan_iteration`)
and the same schedule semantics (`plan.schedule`: each group runs its tasks in plan order,
waiting on dependencies), so a prediction differs from a run only by its task costs. Costs
(`plan.Costs`: seconds per task kind) come from one of two places:

* the cost model (`task_costs.model_costs`): an iteration's work (`task_costs.IterationWork`,
  built from a config by `digen_jax.app.run_sizing`) on a device pool;
* a measured profile (`predict_from_profile`): the per-task means a system bench run recorded.

On top of them: `predict` (one mode in steady state), `simulate` (a mode at its best
micro-batch count), `autosize` (role sizes, micro-batches and TAG share) and `choose_mode`
(every mode, colocated included, each at its best sizing: what `runtime.mode='auto'` runs).
A `Calibration` scales the cost model's task costs by what a run measured against what the model
predicted for that run's own sizing, so the searches above price every mode and sizing from a
running mode's measured costs (what `runtime.mode='auto'` re-ranks from after its first iterations).
The TAG share counts pieces of a micro-batch as the executor does (`plan.pieces_per_microbatch`
of the roles' device counts), so a prediction may split a micro-batch between the roles.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Sequence

from digen_jax.runtime import plan as plan_lib
from digen_jax.runtime.task_costs import Efficiency, IterationWork, Pool, model_costs
from digen_jax.runtime.memory_plan import MemoryPlan, memory_plan, tag_precision


# ---------------------------------------------------------------------------------------- simulate
@dataclasses.dataclass(frozen=True)
class Prediction:
    """One simulated mode: throughput, per-group bubbles and the steady-state iteration's tasks."""

    mode: str
    style: str | None
    microbatches: int
    tag: float  # micro-batches the trainer rolls out (a fraction: one split between the roles)
    prefetch: int
    iteration_s: float
    samples_per_s: float
    devices: int
    bubble_frac: dict[str, float]
    costs: plan_lib.Costs
    # tasks overlapping the timed window: group, kind, iteration, index, start, end (s from the
    # window's start) and `timed` (the task belongs to the timed iteration, not a neighbour)
    timeline: list[dict]
    mfu: float | None = None
    dollars_per_hour: float | None = None
    memory: MemoryPlan | None = None  # bytes per device of every role (cost-model predictions)

    @property
    def fits(self) -> bool:
        """Whether every role fits its devices' memory (a speed is predicted only for those)."""
        return self.memory is None or self.memory.fits

    @property
    def samples_per_s_per_device(self) -> float:
        return self.samples_per_s / self.devices

    @property
    def samples_per_dollar(self) -> float | None:
        return None if not self.dollars_per_hour else self.samples_per_s * 3600 / self.dollars_per_hour

    def as_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("costs", "timeline", "memory")}
        d["costs"] = dataclasses.asdict(self.costs)
        d["fits"] = self.fits
        if self.memory is not None:
            d["memory"] = [r.as_dict() for r in self.memory.roles]
            if self.memory.colocated_sampling is not None:
                d["colocated_sampling"] = self.memory.colocated_sampling
        d["samples_per_s_per_device"] = self.samples_per_s_per_device
        d["samples_per_dollar"] = self.samples_per_dollar
        return d


def predict(mode: str, costs: plan_lib.Costs, *, batch: int, microbatches: int, devices: int, updates: int = 1,
            tag: int | None = None, prefetch: int | None = None, grain: int = 1, style: str | None = None,
            flops_per_sample: float | None = None, peak_flops: float | None = None,
            dollars_per_hour: float | None = None) -> Prediction:
    """`mode` with `costs` in steady state (`plan.steady_state`): throughput, bubbles, timeline.

    The (tag, prefetch) split is chosen by `plan.choose_split` (as the elastic executor does
    from measured costs) unless given; `tag` counts pieces, `grain` to a micro-batch.
    """
    flags = plan_lib.mode_flags(mode)
    grain = grain if flags.tag else 1
    if tag is None or prefetch is None:
        tag, prefetch = plan_lib.choose_split(mode, microbatches, costs, fixed_tag=tag, fixed_prefetch=prefetch,
                                              updates=updates, grain=grain)
    steady = plan_lib.steady_state(mode, microbatches, costs, tag=tag, prefetch=prefetch, updates=updates, grain=grain)
    timeline, (start, end) = steady.timeline, steady.window
    timed = range(steady.iterations - steady.period + 1, steady.iterations + 1)
    groups = ("shared",) if flags.colocated else ("rollout", "train")
    busy = plan_lib.busy_fractions(timeline, list(timeline.start), (start, end))
    tasks = [
        {"group": timeline.group[k], "kind": k[0], "iteration": k[1], "index": k[2],
         "start": timeline.start[k] - start, "end": timeline.end[k] - start, "timed": k[1] in timed}
        for k in timeline.start
        if timeline.end[k] > start and timeline.start[k] < end and timeline.end[k] > timeline.start[k]
    ]
    rate = batch / steady.iteration_s
    mfu = rate * flops_per_sample / peak_flops if flops_per_sample and peak_flops else None
    return Prediction(
        mode=mode, style=style if flags.colocated else None, microbatches=microbatches, tag=tag / grain, prefetch=prefetch,
        iteration_s=steady.iteration_s, samples_per_s=rate, devices=devices,
        bubble_frac={g: 1.0 - busy.get(g, 0.0) for g in groups}, costs=costs, timeline=tasks,
        mfu=mfu, dollars_per_hour=dollars_per_hour,
    )


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Measured over predicted seconds per task kind, measured on one sizing of one mode and
    applied to the cost model's costs of any other (`simulate`'s `calibration`): the model
    supplies how a task's time changes with the mode, role sizes and micro-batch size, the
    measurement how far the model is off on these devices. At the measured sizing the
    calibrated costs are the measured ones (a replay, as `predict_from_profile` does), for every
    kind that was measured; a kind never measured (a colocated run's sync, the trainer's
    rollouts of a mode without TAG) keeps the nearest measured factor or the model's figure."""

    rollout: float = 1.0  # the rollout role's (or the shared group's) rollouts
    trainer_rollout: float = 1.0  # the train role's own rollouts (TAG)
    train: float = 1.0
    update: float = 1.0
    reward: float = 1.0
    sync: float = 1.0

    @classmethod
    def of(cls, measured: Mapping[str, float], model: plan_lib.Costs, *, colocated: bool) -> "Calibration":
        """The factors of `measured` (seconds per micro-batch or update, by kind: 'rollout' (the
        rollout role's or, colocated, the shared group's), 'trainer_rollout', 'train', 'update',
        'reward', 'sync'; a kind absent was not measured) against `model`, the cost model's costs
        of the measured sizing (the shared group's when `colocated`)."""
        predicted = {
            "rollout": model.rollout["shared" if colocated else "rollout"],
            "trainer_rollout": model.rollout.get("train", math.inf) if not colocated else math.inf,
            "train": model.train, "update": model.update, "reward": model.reward, "sync": model.sync,
        }
        factors = {}
        for kind, p in predicted.items():
            m = measured.get(kind)
            if m is not None and 0 < p < math.inf and m >= 0 and math.isfinite(m):
                factors[kind] = m / p
        if "trainer_rollout" not in factors and "rollout" in factors:
            factors["trainer_rollout"] = factors["rollout"]  # the same model on the other role's devices
        return cls(**factors)

    def apply(self, costs: plan_lib.Costs) -> plan_lib.Costs:
        factor = {g: self.trainer_rollout if g == "train" else self.rollout for g in costs.rollout}
        return plan_lib.Costs(rollout={g: c * factor[g] for g, c in costs.rollout.items()},
                              reward=costs.reward * self.reward, train=costs.train * self.train,
                              update=costs.update * self.update, sync=costs.sync * self.sync,
                              rollout_fixed={g: c * factor[g] for g, c in costs.rollout_fixed.items() if g in factor})


def _resolved(w: IterationWork, pool: Pool, microbatches: int, eff: Efficiency) -> IterationWork:
    """`w` with `tag_precision` as a run on `pool` resolves 'auto' (`memory_plan.tag_precision`)."""
    return dataclasses.replace(w, tag_precision=tag_precision(w, pool, microbatches, eff))


def microbatch_choices(prompts: int, limit: int = 16) -> list[int]:
    """Micro-batch counts the executor accepts (they hold whole groups): divisors of the prompts, <= limit."""
    return [m for m in range(1, min(prompts, limit) + 1) if prompts % m == 0]


def simulate(w: IterationWork, pool: Pool, mode: str, *, microbatches: int | None = None, style: str = "fsdp_sampling",
             eff: Efficiency = Efficiency(), max_microbatches: int = 16,
             allowed: Callable[[int], bool] = lambda m: True, calibration: Calibration | None = None) -> Prediction:
    """Predict `mode` of the iteration work `w` on `pool` (the cost model's task costs scaled by
    `calibration`, where given: a run's measured costs against the model's).

    `microbatches`: fixed, or None for the best of `microbatch_choices` (each mode at its own
    best pipeline depth; those `allowed` says a run accepts) among those whose memory plan fits. Returns a `Prediction` (samples/s,
    per device, bubble fraction per device group, MFU against the datasheet peaks, $/hour, the
    timed iteration's timeline, the memory plan); when no choice fits, `Prediction.fits` is
    False and its speed is no prediction.
    """
    flags = plan_lib.mode_flags(mode)
    # Every mode makes the config's `rl.num_updates_per_batch` updates per iteration, each on
    # its share of whole micro-batches.
    updates = w.updates
    if microbatches and microbatches % updates:
        raise ValueError(f"rl.num_updates_per_batch={updates} must divide runtime.micro_batches={microbatches}")
    if w.prompts % updates:
        raise ValueError(f"rl.num_updates_per_batch={updates} must divide rl.prompts_per_iteration={w.prompts} "
                         "(each update trains whole micro-batches of whole groups)")
    choices = [microbatches] if microbatches else [
        m for m in microbatch_choices(w.prompts, max_microbatches) if m % updates == 0 and allowed(m)] or [w.prompts]
    if flags.colocated and not microbatches:
        # the shared group does everything in turn: more micro-batches than updates only add calls
        choices = [min(choices)]
    peak = sum(pool.kind(r).bf16_flops * getattr(pool, f"{r}_devices") for r in ("rollout", "train"))
    best = None
    for m in choices:
        costs = _replicated(model_costs(_resolved(w, pool, m, eff), pool, mode, m, style=style, eff=eff), w, pool, mode, m)
        if calibration is not None:
            costs = calibration.apply(costs)
        grain = plan_lib.pieces_per_microbatch(
            w.samples // m, [max(getattr(pool, f"{r}_devices") // w.seq_parallel, 1) for r in ("rollout", "train")])
        p = predict(mode, costs, batch=w.samples, microbatches=m, devices=pool.total, updates=updates, grain=grain,
                    style=style, flops_per_sample=w.flops_per_sample, peak_flops=peak,
                    dollars_per_hour=pool.dollars_per_hour())
        p = dataclasses.replace(p, memory=memory_plan(_resolved(w, pool, m, eff), pool, mode, m, eff))
        if best is None or (p.fits, p.samples_per_s) > (best.fits, best.samples_per_s * (1 + 1e-9)):
            best = p
    return best


def _replicated(costs: plan_lib.Costs, w: IterationWork, pool: Pool, mode: str, microbatches: int) -> plan_lib.Costs:
    """`costs` with the work a group computes whole on each of its devices (`plan.replicated_work`)
    multiplied by the group's data-axis size: each device does all of it."""
    widths = {"shared": max(pool.total // w.seq_parallel, 1),
              **{r: max(getattr(pool, f"{r}_devices") // w.seq_parallel, 1) for r in ("rollout", "train")}}
    rollout, train = dict(costs.rollout), costs.train
    for (kind, group), n in plan_lib.replicated_work(mode, w.samples // microbatches, w.grad_chunk_size, widths).items():
        if kind == "rollout":  # every device computes all the samples; each step's fixed part stays once
            fixed = costs.rollout_fixed.get(group, 0.0)
            rollout[group] = fixed + n * (rollout[group] - fixed)
        else:
            train *= n
    return dataclasses.replace(costs, rollout=rollout, train=train)


# ---------------------------------------------------------------------------------------- autosize
@dataclasses.dataclass(frozen=True)
class Sizing:
    """A searched configuration: role sizes, micro-batches and the split they predict best."""

    rollout_devices: int  # colocated: 0 (every device shares the one group)
    train_devices: int
    microbatches: int
    tag: float
    prefetch: int
    prediction: Prediction

    def runtime_overrides(self) -> dict:
        """The `runtime` config keys that reproduce this sizing."""
        return {
            "mode": self.prediction.mode,
            "rollout_devices": self.rollout_devices,
            "train_devices": self.train_devices,
            "micro_batches": self.microbatches,
            "tag_microbatches": self.tag,
            "prefetch_microbatches": self.prefetch,
        }


def autosize(w: IterationWork, pool: Pool, *, mode: str = plan_lib.BEST_MODE, eff: Efficiency = Efficiency(),
             max_microbatches: int = 16, role_step: int = 1, allowed: Callable[[int], bool] = lambda m: True,
             calibration: Calibration | None = None) -> Sizing:
    """Search role sizes, micro-batch count and TAG share (and prefetch) for the best predicted throughput.

    A homogeneous pool's devices are re-split between rollout and trainer (every split in
    steps of `role_step`); a heterogeneous pool keeps its roles (the kinds decide them). For
    each split every micro-batch count of `microbatch_choices` is simulated, and
    `plan.choose_split` picks the TAG share and prefetch for it. Splits whose memory plan fits
    come first; when none does, the fastest is returned with `prediction.fits` False.
    """
    if plan_lib.mode_flags(mode).colocated:
        raise ValueError("autosize searches role sizes of a disaggregated mode; runtime.mode='colocated' has one group")
    if pool.heterogeneous:
        splits = [pool]
    else:
        splits = [dataclasses.replace(pool, rollout_devices=r, train_devices=pool.total - r)
                  for r in range(role_step, pool.total, role_step)]
    best = None
    for candidate in splits:
        try:
            p = simulate(w, candidate, mode, eff=eff, max_microbatches=max_microbatches, allowed=allowed,
                         calibration=calibration)
        except ValueError:  # e.g. weights that do not fit this role size
            continue
        if best is None or (p.fits, p.samples_per_s) > (best[1].fits, best[1].samples_per_s * (1 + 1e-9)):
            best = (candidate, p)
    if best is None:
        raise ValueError(f"no role split of {pool.describe()} can run {mode}")
    chosen, p = best
    return Sizing(chosen.rollout_devices, chosen.train_devices, p.microbatches, p.tag, p.prefetch, p)


def choose_mode(w: IterationWork, pool: Pool, *, modes: Sequence[str] = plan_lib.MODES, eff: Efficiency = Efficiency(),
                max_microbatches: int = 16, role_step: int = 1, allowed: Callable[[int], bool] = lambda m: True,
                calibration: Calibration | None = None) -> list[Sizing]:
    """Every mode of `modes` on `pool`'s devices at its best sizing (`autosize`; colocated at its
    best micro-batch count on all of them), best first: those whose memory plan fits, by
    predicted samples/s (`runtime.mode='auto'` runs the first). Modes that cannot run the pool
    (weights that fit no role split) are left out; a ValueError when none can. `allowed`: the
    micro-batch counts a run accepts; `calibration`: costs scaled by a run's measured ones."""
    ranked = []
    for mode in modes:
        try:
            if plan_lib.mode_flags(mode).colocated:
                # The shared group does everything in turn: its best count is searched all the same,
                # since a count the memory plan fits may not be the smallest.
                best = None
                for m in [c for c in microbatch_choices(w.prompts, max_microbatches) if c % w.updates == 0 and allowed(c)]:
                    p = simulate(w, pool, mode, microbatches=m, eff=eff, calibration=calibration)
                    if best is None or (p.fits, p.samples_per_s) > (best.fits, best.samples_per_s * (1 + 1e-9)):
                        best = p
                if best is None:
                    continue
                ranked.append(Sizing(0, pool.total, best.microbatches, 0, 0, best))
            else:
                ranked.append(autosize(w, pool, mode=mode, eff=eff, max_microbatches=max_microbatches, role_step=role_step,
                                       allowed=allowed, calibration=calibration))
        except ValueError:
            continue
    if not ranked:
        raise ValueError(f"no mode can run on {pool.describe()}")
    return sorted(ranked, key=lambda s: (not s.prediction.fits, -s.prediction.samples_per_s))


# ---------------------------------------------------------------------------------------- profiles
def costs_from_profile(costs: Mapping[str, Any]) -> plan_lib.Costs:
    """`plan.Costs` from a bench record's `costs` entry; rollout groups it never measured cost infinity
    (a split that would use them is never chosen)."""
    try:
        rollout = {g: float(v) for g, v in costs["rollout"].items()}
        values = {k: float(costs[k]) for k in ("reward", "train", "update", "sync")}
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"bench record costs need rollout{{group: s}}, reward, train, update, sync: {e!r}") from None
    if "rollout" in rollout:
        rollout.setdefault("shared", rollout["rollout"])
    if "shared" in rollout:
        rollout.setdefault("rollout", rollout["shared"])
    rollout.setdefault("train", math.inf)
    return plan_lib.Costs(rollout=rollout, **values)


def predict_from_profile(record: Mapping[str, Any]) -> dict[str, float]:
    """Predicted samples/s of every mode of a system bench record, from its recorded task costs.

    `record`: {"modes": {name: {"costs": ..., "micro_batches": M, "splits": [...]?}}, "batch": B
    or "config": {"rl": ...}}; a name is a schedule mode, or a mode and a variant after a space
    (`'colocated onpolicy_anchor=trainer'`). The split of a mode is the one its timed iterations
    used most (the executor chose it from measured costs), else `plan.choose_split`'s.
    """
    batch, updates = _record_batch(record)
    out = {}
    for name, r in record["modes"].items():
        mode = name.split(" ")[0]
        try:
            microbatches = int(r["micro_batches"])
            costs = costs_from_profile(r["costs"])
        except KeyError as e:
            raise ValueError(f"bench record mode {name!r} lacks {e}") from None
        split = _recorded_split(r.get("splits"))
        tag, prefetch = split if split else (None, None)
        grain = 1 if tag is None else next(g for g in range(1, 65) if abs(tag * g - round(tag * g)) < 1e-9 or g == 64)
        p = predict(mode, costs, batch=batch, microbatches=microbatches, devices=int(r.get("devices", 1)),
                    updates=updates, tag=None if tag is None else round(tag * grain), prefetch=prefetch, grain=grain)
        out[name] = p.samples_per_s
    return out


def _record_batch(record: Mapping[str, Any]) -> tuple[int, int]:
    rl = (record.get("config") or {}).get("rl") or {}
    batch = record.get("batch") or (rl.get("prompts_per_iteration", 0) * rl.get("group_size", 0))
    if not batch:
        raise ValueError("bench record needs 'batch' or config.rl.prompts_per_iteration and group_size")
    return int(batch), int(rl.get("num_updates_per_batch", 1))


def _recorded_split(splits: Sequence[Mapping[str, float]] | None) -> tuple[float, int] | None:
    """The (tag in micro-batches, a fraction where one was split; prefetch) the splits hold most."""
    if not splits:
        return None
    counts: dict[tuple[float, int], int] = {}
    for s in splits:
        key = (float(s.get("tag", 0)), int(s.get("prefetch", 0)))
        counts[key] = counts.get(key, 0) + 1
    return max(counts, key=lambda k: (counts[k], -k[0], -k[1]))
