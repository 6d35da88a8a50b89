"""A run's sizing from its config: what an iteration costs and the choices made from that.

The costs: exact FLOPs of one RL sample and the `IterationWork` the task cost model prices. The
choices, from the simulator and the memory plan: role sizes (launch/train.py --autosize), the
mode too (`runtime.mode='auto'`: chosen before the run by `choose_mode`, then once more by
`rerank` from the task costs the run's first iterations measured), and the 'auto' values of
`runtime.colocated_sampling` and `runtime.tag_precision`.

The runtime's task cost model and simulator (`digen_jax.runtime.task_costs`, `.simulator`) take
plain `IterationWork` values; this module reads them off a model-zoo config and its model zoo entry.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax.numpy as jnp
import ml_collections
import numpy as np

from digen_jax import model_flops
from digen_jax.app import families
from digen_jax.app.errors import ConfigError
from digen_jax.app.settings import step_settings
from digen_jax.app.workload import is_shapes
from digen_jax.models import FAMILIES
from digen_jax.rl.timesteps import plan_steps
from digen_jax.runtime import plan as plan_lib
from digen_jax.runtime import simulator
from digen_jax.runtime import mesh as mesh_lib
from digen_jax.runtime.task_costs import IterationWork, Pool, local_kind
from digen_jax.runtime.memory_plan import MemoryPlan
from digen_jax.runtime.memory_plan import colocated_sampling as plan_colocated_sampling
from digen_jax.runtime.memory_plan import memory_plan as plan_memory
from digen_jax.runtime.memory_plan import tag_precision as plan_tag_precision


def sample_flops(config, model_cfg) -> dict[str, int] | None:
    """Exact FLOPs of one RL sample (rollout steps + trained units) of `config` with the transformer
    config `model_cfg`, None for the shapes task.

    Flow-GRPO (`rl.algorithm='grpo'`): SDE rollout steps and trained steps with the config's CFG.
    DiffusionNFT ('nft'): ODE rollout steps without CFG (validation requires cfg_scale 1), K
    trained noise levels per sample, each unit also running the old policy's forward. Either
    runs the frozen reference's forward per unit where rl.kl_beta > 0."""
    if is_shapes(config):  # the shapes task: no transformer FLOP model
        return None
    family = config.model.family
    zoo = families.ZOO[family]
    s, rl = config.sampling, config.rl
    trained = _trained_steps(config)
    lora_targets = list(rl.lora_targets) if rl.lora_rank else []
    return model_flops.rl_sample_flops(
        family,
        model_cfg,
        height=s.height,
        width=s.width,
        frames=s.num_frames if zoo.video else 1,
        text_len=config.data.text_len,
        num_steps=s.num_steps,
        trained_steps=trained,
        cfg_forwards=2 if s.cfg_scale != 1.0 else 1,
        lora_rank=rl.lora_rank,
        lora_targets=lora_targets,
        old_policy_forward=_is_nft(rl),
        reference_forward=rl.kl_beta > 0,
    )


def iteration_work(config) -> IterationWork:
    """The `IterationWork` of a model-zoo config (configs/{flux,qwenimage,wan21,hunyuanvideo}.py, configs/paper/*)."""
    if is_shapes(config):
        raise ValueError("the simulator needs a model-zoo config (a `data` section); the shapes task has no FLOP model")
    family = config.model.family
    if family not in families.ZOO:
        raise ValueError(f"model.family={family!r} is unknown; known: {sorted(families.ZOO)}")
    model_cfg = _model_config(config)
    s, rl = config.sampling, config.rl
    frames = s.num_frames if families.ZOO[family].video else 1
    per_sample = sample_flops(config, model_cfg)
    trained = _trained_steps(config)
    terms = model_flops.model_terms(family, model_cfg, batch=1, height=s.height, width=s.width, frames=frames, text_len=config.data.text_len)
    # The terms are one transformer's; a policy of experts (Wan2.2-A14B) holds each of them.
    experts = 1 if getattr(model_cfg, "boundary_ratio", None) is None else 2
    params = experts * float(sum(m.layers * m.fan_in * m.fan_out for m in terms.matmuls))
    if rl.lora_rank:
        adapted = terms.adapted(list(rl.lora_targets))
        trainable = experts * float(sum(m.layers * rl.lora_rank * (m.fan_in + m.fan_out) for m in adapted))
        adapted_weights = experts * float(sum(m.layers * m.fan_in * m.fan_out for m in adapted))
    else:
        trainable, adapted_weights = params, 0.0
    return IterationWork(
        family=family,
        prompts=rl.prompts_per_iteration,
        group_size=rl.group_size,
        num_steps=s.num_steps,
        trained_steps=trained,
        step_flops=per_sample["rollout"] / s.num_steps,
        unit_flops=per_sample["train"] / max(trained, 1),
        params=params,
        trainable=trainable,
        adapted_weights=adapted_weights,
        lora_rank=rl.lora_rank,
        merge_for_sampling=bool(rl.lora_rank) and rl.lora_merge_for_sampling,
        pixels=s.height * s.width * frames,
        updates=rl.num_updates_per_batch,
        unit_forwards=1 + int(_is_nft(rl)) + int(rl.kl_beta > 0),
        rollout_precision=config.model.get("rollout_precision", "bf16"),
        lora_base_precision=config.model.get("lora_base_precision", "bf16"),
        experts=experts,
        **_memory_terms(config, terms),
    )


def _dtype_bytes(name: str) -> int:
    return int(np.dtype(jnp.dtype(name)).itemsize)


def _memory_terms(config, terms: model_flops.ModelTerms) -> dict:
    """The `IterationWork` fields the memory plan reads: dtypes, layouts, copies and activation sizes.

    Activations per sample, from the matmul terms of one forward: a block stack's residual stream
    is its token rows (each stream's distinct row count) x the model width (the output
    projection's fan-in); with remat 'full' training keeps it once per block, otherwise every
    matmul output of every block; one block's working set is the sum of its matmul outputs.
    """
    rl, rt, model = config.rl, config.runtime, config.model
    act = _dtype_bytes(model.dtype)
    width = next(m.fan_in for m in terms.matmuls if m.stack == "out")
    stacks = [s for s in terms.stacks if s != "out"]
    layers, saved, layer_outputs = 0, 0.0, 0.0
    for stack in stacks:
        ms = [m for m in terms.matmuls if m.stack == stack]
        depth = max(m.layers for m in ms)
        outputs = sum(m.rows * m.fan_out for m in ms) * act
        residual = sum({m.rows for m in ms if m.reads == "trunk"}) * width * act
        layers += depth
        saved += depth * (residual if model.remat_policy == "full" else outputs)
        layer_outputs = max(layer_outputs, outputs)
    state_dtype = rl.get("optimizer_state_dtype", "param")
    sharding = config.sharding
    return dict(
        param_bytes=_dtype_bytes(model.param_dtype),
        optimizer_state_bytes=4 if state_dtype == "float32" else 0,
        offload_optimizer=bool(rt.get("offload_optimizer", False)),
        colocated_sampling=rt.get("colocated_sampling", "auto"),
        tag_precision=rt.get("tag_precision", "auto"),
        train_sharded=mesh_lib.shards_weights(tuple(sharding.train_rules)),
        rollout_sharded=mesh_lib.shards_weights(tuple(sharding.rollout_rules)),
        ema=bool(rl.ema),
        kl_reference=rl.kl_beta > 0,
        old_policy=_is_nft(rl),
        layers=layers,
        grad_chunk_size=rl.grad_chunk_size,
        cfg_forwards=2 if config.sampling.cfg_scale != 1.0 else 1,
        saved_activation_bytes=saved,
        layer_activation_bytes=layer_outputs,
        seq_parallel=int(rt.get("seq_parallel", 1)),
    )


def memory_plan(config, pool: Pool, mode: str | None = None) -> MemoryPlan:
    """The memory plan (`runtime.memory_plan`) of `config` in `mode` (default `runtime.mode`) on `pool`."""
    mode = mode or config.runtime.mode
    return plan_memory(iteration_work(config), pool, mode, config.runtime.micro_batches)


def colocated_sampling(config, devices: Sequence[Any]) -> str:
    """What `runtime.colocated_sampling='auto'` is for a colocated run of `config` on `devices`:
    the memory plan's pick (`memory_plan.colocated_sampling`), or 'sharded' where the plan has no
    figure (CPU devices, kinds the device table lacks, the shapes task)."""
    pools = local_pool(config, devices, plan_lib.COLOCATED)
    if pools is None:
        return "sharded"
    work = dataclasses.replace(iteration_work(config), colocated_sampling="auto")
    return plan_colocated_sampling(work, pools[0], config.runtime.micro_batches, colocated_devices=pools[1])


def tag_precision(config, devices: Sequence[Any]) -> str:
    """What `runtime.tag_precision='auto'` is for a run of `config` on `devices` (its trainer-assisted
    rollouts' precision): the memory plan's pick (`memory_plan.tag_precision`) for the full mode,
    or 'rollout' where the plan has no figure (CPU devices, kinds the device table lacks, the
    shapes task)."""
    pools = local_pool(config, devices, plan_lib.BEST_MODE)
    if pools is None:
        return "rollout"
    work = dataclasses.replace(iteration_work(config), tag_precision="auto")
    return plan_tag_precision(work, pools[0], config.runtime.micro_batches)


def local_pool(config, devices: Sequence[Any], mode: str) -> tuple[Pool, int | None] | None:
    """The `Pool` of a run of `config` in `mode` on `devices` and its colocated device count
    (None when disaggregated); None where the memory plan has no figure for them (also a
    disaggregated mode on devices too few for both roles: one GPU runs colocated only)."""
    if is_shapes(config) or devices[0].platform == "cpu":
        return None
    try:
        kind = local_kind(devices[0].device_kind)
    except ValueError:
        return None
    rt, n = config.runtime, len(devices)
    if plan_lib.mode_flags(mode).colocated:
        return Pool(kind, 1, kind, 1), rt.train_devices or n
    rollout = rt.rollout_devices or (n - rt.reward_devices) // 2
    train = rt.train_devices or (n - rt.reward_devices - rollout)
    if rollout < 1 or train < 1:
        return None
    return Pool(kind, rollout, kind, train), None


def _is_nft(rl) -> bool:
    return rl.get("algorithm", "grpo") == "nft"


def _trained_steps(config) -> int:
    """Trajectory steps trained per sample (the count `rl.timesteps.plan_steps` draws for one)."""
    s = config.sampling
    return plan_steps(step_settings(config), s.num_steps, s.noise_level, 1, 0, np.random.default_rng(0)).trained.shape[1]


def _model_config(config):
    """The transformer config of `config`: its checkpoint's, or the named variant's at the depth
    `model.num_layers` / `model.num_single_layers` ask for (no weights read)."""
    if config.model.checkpoint:
        return families.model_config(config)
    variants = FAMILIES[config.model.family].variants
    if config.model.variant not in variants:
        raise ValueError(f"model.variant={config.model.variant!r} is unknown for {config.model.family}; known: {sorted(variants)}")
    return dataclasses.replace(variants[config.model.variant], **families.depth_overrides(config.model))


AUTO_MODE = "auto"  # runtime.mode: chosen by `choose_mode`


def _pool(spec: str, devices: Sequence[Any]) -> Pool:
    """The pool `spec` names (`Pool.parse`), or for 'local' `devices` (their kind and count); it must
    have as many devices as the run."""
    if spec == "local":
        spec = f"{local_kind(devices[0].device_kind)}:{len(devices)}"
    pool = Pool.parse(spec)
    if pool.total != len(devices):
        raise ValueError(f"the pool {spec!r} has {pool.total} devices, this run {len(devices)}")
    return pool


def _runs(config):
    """Whether a run of `config` accepts `m` micro-batches (`validate_runtime_config`'s rules)."""
    rl = config.rl
    units = rl.prompts_per_iteration * rl.group_size * _trained_steps(config)
    return lambda m: rl.prompts_per_iteration % m == 0 and (units // m) % rl.grad_chunk_size == 0


def choose_mode(config, spec: str, devices: Sequence[Any]) -> str:
    """`runtime.mode='auto'`: the mode, role sizes and micro-batch count the simulator predicts
    fastest for `config` on the pool `spec` names ('local': `devices`), colocated included,
    applied to `config` in place; the split (trainer rollouts, prefetch) stays elastic, chosen
    every iteration from measured costs. Returns one line: what was chosen, its predicted speed
    and the runners-up's. A ConfigError (one line) where the simulator cannot price the run."""
    try:
        pool = _pool(spec, devices)
        ranked = simulator.choose_mode(iteration_work(config), pool, allowed=_runs(config))
    except ValueError as e:
        raise ConfigError(f"runtime.mode='auto' is chosen from the simulator's predictions, which fail here: {e} "
                          "(launch/train.py --autosize=KIND:N names a pool), or set runtime.mode") from None
    apply_sizing(config, ranked[0])
    return mode_line(pool, ranked)


# The runtime keys a choice of `runtime.mode='auto'` sets (`apply_sizing`): what a checkpoint records
# of it, so that a resumed run goes on with the choice (`auto_runtime`, `apply_runtime`).
AUTO_KEYS = ("mode", "micro_batches", "rollout_devices", "train_devices", "tag_microbatches", "prefetch_microbatches")


def apply_sizing(config, sizing: simulator.Sizing) -> None:
    """Set `config`'s runtime to `sizing`: its mode, role sizes (none colocated: every device
    shares the one group) and micro-batches; the split stays elastic, chosen every iteration
    from measured costs."""
    rt = config.runtime
    rt.mode = sizing.prediction.mode
    rt.micro_batches = sizing.microbatches
    colocated = plan_lib.mode_flags(rt.mode).colocated
    rt.rollout_devices, rt.train_devices = (0, 0) if colocated else (sizing.rollout_devices, sizing.train_devices)
    rt.tag_microbatches, rt.prefetch_microbatches = -1, -1


def auto_runtime(config) -> dict:
    """The runtime keys `runtime.mode='auto'` chose for `config` (`AUTO_KEYS`), as JSON values."""
    return {key: config.runtime[key] for key in AUTO_KEYS}


def apply_runtime(config, values: dict) -> None:
    """Set `config`'s runtime keys to `values` (`auto_runtime`'s, read back from a checkpoint)."""
    for key in AUTO_KEYS:
        config.runtime[key] = values[key]


def mode_line(pool: Pool, ranked: Sequence[simulator.Sizing]) -> str:
    """What `choose_mode` chose and the runners-up, predicted samples/s (and against the choice)."""
    best = ranked[0].prediction

    def sizing(s: simulator.Sizing) -> str:
        p = s.prediction
        roles = "" if p.mode == plan_lib.COLOCATED else f"{s.rollout_devices}+{s.train_devices} devices, "
        split = f", predicted split tag={s.tag:g} prefetch={s.prefetch}" if plan_lib.mode_flags(p.mode).tag else ""
        return f"{p.mode} ({roles}{s.microbatches} micro-batches{split})"

    runners = "; ".join(
        f"{s.prediction.mode} {s.prediction.samples_per_s:.3f} ({s.prediction.samples_per_s / best.samples_per_s:.2f}x)"
        + ("" if s.prediction.fits else " does not fit") for s in ranked[1:])
    fits = "" if best.fits else " (no mode fits the memory plan: the fastest is run)"
    return (f"runtime.mode='auto' on {pool.describe()}: {sizing(ranked[0])} at {best.samples_per_s:.3f} samples/s "
            f"predicted{fits}; runners-up: {runners or 'none'}")


def size_config(config, spec: str, devices: Sequence[Any]) -> tuple[Pool, simulator.Sizing]:
    """`simulator.autosize` for `config`'s `runtime.mode`, applied to `config` in place: role sizes
    and micro-batch count. The TAG share and prefetch stay as configured (-1: chosen every iteration
    from measured costs, which track the real devices better than a prediction).

    `spec`: a pool (`Pool.parse`, e.g. 'h100:8') or 'local' for `devices` (the run's devices:
    their kind and count). The pool must have as many devices as the run.
    """
    if plan_lib.mode_flags(config.runtime.mode).colocated:
        raise ValueError("it sizes the roles of a disaggregated runtime.mode; 'colocated' has one group")
    pool = _pool(spec, devices)
    sizing = simulator.autosize(iteration_work(config), pool, mode=config.runtime.mode, allowed=_runs(config))
    overrides = sizing.runtime_overrides()
    for key in ("rollout_devices", "train_devices", "micro_batches"):
        config.runtime[key] = overrides[key]
    return pool, sizing


# ------------------------------------------------------------------ the measured re-rank of 'auto'
@dataclasses.dataclass(frozen=True)
class Rerank:
    """Every mode re-ranked from a run's measured task costs (`rerank`): what it runs now, every
    mode at its best sizing, and what to go on with."""

    measured: dict[str, float]  # seconds per micro-batch (per update for 'update'), by task kind
    calibration: simulator.Calibration  # measured over the cost model's costs of the running sizing
    running: simulator.Sizing  # the running mode at its own sizing, predicted from the measured costs
    ranked: list[simulator.Sizing]  # every mode at its best sizing from the calibrated costs, best first
    choice: simulator.Sizing  # `running`, or the fastest by more than `margin`
    margin: float

    @property
    def switch(self) -> bool:
        return self.choice is not self.running


def _same_sizing(a: simulator.Sizing, b: simulator.Sizing) -> bool:
    keys = ("mode", "rollout_devices", "train_devices", "micro_batches")
    return all(a.runtime_overrides()[k] == b.runtime_overrides()[k] for k in keys)


def rerank(work: IterationWork, pool: Pool, running: dict, measured: dict[str, float], *, margin: float,
           allowed=lambda m: True) -> Rerank:
    """`runtime.mode='auto'` once more, from measured costs: every mode, colocated included, each at
    its best sizing on `pool`, priced by the cost model calibrated with `measured` (the running
    mode's task costs, by kind as `simulator.Calibration.of` takes them); the run goes on with the
    fastest where it is predicted faster than `running` by more than `margin` (a fraction: 0.03
    is 3%), else with `running`. Pure: no devices, no config.

    `running`: the running sizing, {'mode', 'rollout_devices', 'train_devices', 'micro_batches'}
    (role sizes ignored when colocated). At that sizing the calibrated costs are the measured
    ones, so its speed is predicted as `launch/simulate.py --profile` predicts a bench run's;
    it runs, so the memory plan does not rule it out. `allowed`: the micro-batch counts the
    run accepts. ValueError where the simulator cannot price the running sizing."""
    mode, microbatches = running["mode"], int(running["micro_batches"])
    colocated = plan_lib.mode_flags(mode).colocated
    own = pool if colocated else dataclasses.replace(pool, rollout_devices=int(running["rollout_devices"]),
                                                     train_devices=int(running["train_devices"]))
    model = simulator.simulate(work, own, mode, microbatches=microbatches)
    calibration = simulator.Calibration.of(measured, model.costs, colocated=colocated)
    now = dataclasses.replace(simulator.simulate(work, own, mode, microbatches=microbatches, calibration=calibration),
                              memory=None)
    current = simulator.Sizing(0 if colocated else own.rollout_devices, own.total if colocated else own.train_devices,
                               microbatches, now.tag, now.prefetch, now)
    ranked = simulator.choose_mode(work, pool, allowed=allowed, calibration=calibration)
    best = ranked[0]
    faster = (best.prediction.fits and not _same_sizing(best, current)
              and best.prediction.samples_per_s > now.samples_per_s * (1 + margin))
    return Rerank(dict(measured), calibration, current, ranked, best if faster else current, margin)


def _sizing_words(s: simulator.Sizing) -> str:
    p = s.prediction
    roles = "" if plan_lib.mode_flags(p.mode).colocated else f"{s.rollout_devices}+{s.train_devices} devices, "
    return f"{p.mode} ({roles}{s.microbatches} micro-batches)"


def rerank_line(r: Rerank, measured_in: str) -> str:
    """One line: the measured costs, what the run goes on with and why, the runners-up's predicted
    speeds. `measured_in`: where the costs were measured ('after 3 measured iterations')."""
    costs = ", ".join(f"{kind} {seconds:.4g} s" for kind, seconds in r.measured.items())
    now = r.running.prediction.samples_per_s
    if r.switch:
        choice = r.choice.prediction.samples_per_s
        verdict = (f"switches to {_sizing_words(r.choice)} at {choice:.3f} samples/s predicted, {choice / now:.2f}x "
                   f"{_sizing_words(r.running)} at {now:.3f} from its measured costs (margin {r.margin:.0%})")
    else:
        verdict = (f"keeps {_sizing_words(r.running)} at {now:.3f} samples/s predicted from its measured costs "
                   f"(nothing faster by more than {r.margin:.0%})")
    best = r.choice.prediction.samples_per_s
    runners = "; ".join(
        f"{_sizing_words(s)} {s.prediction.samples_per_s:.3f} ({s.prediction.samples_per_s / best:.2f}x)"
        + ("" if s.prediction.fits else " does not fit") for s in r.ranked if not _same_sizing(s, r.choice))
    return (f"runtime.mode='auto' re-ranked {measured_in} (task costs per micro-batch: "
            f"{costs or 'none measured'}): {verdict}; runners-up: {runners or 'none'}")


def rerank_config(config, spec: str, devices: Sequence[Any], measured: dict[str, float], margin: float) -> Rerank:
    """`rerank` for a run of `config` on `devices` (the pool `spec` names, as `choose_mode` took it)
    in its `runtime` sizing. ValueError where the simulator cannot price the run."""
    return _rerank_on(config, _pool(spec, devices), measured, margin)


def rerank_record(record: dict, name: str, margin: float = 0.03) -> Rerank:
    """What `runtime.mode='auto'` would choose after measuring the task costs that mode `name` of a
    system bench record (`launch/bench.py --mode=system`) measured, on the record's devices and
    config (`launch/simulate.py --profile`). ValueError where the record cannot be priced."""
    try:
        m, config = record["modes"][name], ml_collections.ConfigDict(record["config"])
        mode = name.split(" ")[0]
        config.runtime.mode, config.runtime.micro_batches = mode, int(m["micro_batches"])
        pool = Pool.parse(f"{local_kind(record['gpu'])}:{int(m['devices'])}")
        costs, colocated = m["costs"], plan_lib.mode_flags(mode).colocated
        measured = {"rollout": costs["rollout"]["shared" if colocated else "rollout"],
                    **{k: costs[k] for k in ("train", "update", "reward")}}
        if not colocated:
            measured["sync"] = costs["sync"]
            if plan_lib.mode_flags(mode).tag:  # measured only where the trainer rolled out
                measured["trainer_rollout"] = costs["rollout"]["train"]
        return _rerank_on(config, pool, measured, margin)
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"bench record mode {name!r} cannot be re-ranked: it lacks {e}") from None


def _rerank_on(config, pool: Pool, measured: dict[str, float], margin: float) -> Rerank:
    rt = config.runtime
    rollout = rt.rollout_devices or (pool.total - rt.reward_devices) // 2
    train = rt.train_devices or (pool.total - rt.reward_devices - rollout)
    running = {"mode": rt.mode, "rollout_devices": rollout, "train_devices": train, "micro_batches": rt.micro_batches}
    return rerank(iteration_work(config), pool, running, measured, margin=margin, allowed=_runs(config))
