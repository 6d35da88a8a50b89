"""The memory plan: bytes per device of every role of a mode, stated before any compute.

For an iteration's work (`task_costs.IterationWork`) on a pool (`task_costs.Pool`), each role
(colocated: 'shared'; disaggregated: 'rollout' and 'train') holds, per device:

* weights: what it trains (sharded over the role when the train rules shard weights, FSDP),
  and with LoRA the frozen base beside the adapters (one byte per weight with
  `model.lora_base_precision='fp8'`); the rollout role its sampling copy (bf16, or
  e4m3 with `model.rollout_precision='fp8'`), replicated unless the rollout rules shard it;
* gradients: the running sum of an update's gradients, sharded like the trainable weights;
* optimizer: AdamW's two moments per trainable weight in `rl.optimizer_state_dtype`, on the
  devices or, with `runtime.offload_optimizer`, in host memory between updates (`host` bytes);
  the update program still brings them through the devices, so the update phase counts them;
* copies: the frozen reference of full fine-tuning with `rl.kl_beta > 0`, the EMA, DiffusionNFT's
  old policy, each sharded like the trainable weights;
* rollout copy: the FP8 quantised copy of the weights sampling reads on the train role (colocated,
  or disaggregated trainer-assisted rollouts in the rollout precision, `runtime.tag_precision`);
* colocated sampling (`runtime.colocated_sampling`, full fine-tuning with FSDP train rules):
  'sharded' samples from the sharded weights, gathering each layer at every step; 'gathered'
  holds one whole copy of the sampling weights (bf16, or e4m3 with FP8 rollouts) while the
  iteration's rollouts run and drops it before training, so it counts in sampling's working set;
  'auto' picks 'gathered' where the shared role still fits with it, else 'sharded';
* activations (an estimate): the working set of the largest phase beyond the state above, per
  device: training keeps each unit's block inputs (remat 'full') and one block's outputs while
  it is recomputed, the FSDP gathers of one layer's weights (and the next one's, prefetched),
  and a chunk's gradients beside their running sum; sampling keeps one block's outputs per
  sample and CFG branch (no gradients are alive then) and the gathered copy if any; the
  update's check holds float32 temporaries of a third of the trainable bytes (XLA's figure for
  Qwen-Image-20B) and offloaded moments brought onto the devices;
* sync buffers: the rollout role receives each new version while its rollouts still read the
  old one (one-step-stale rollouts overlap the sync), so it holds a second copy of its weights
  (adapters only with LoRA).

Host memory (`host_bytes`): a process holds the initial trainable weights until they are placed
and the offloaded moments of its devices; a one-process run is refused when they exceed
`USABLE_HOST` of the host's physical memory (`host_advice`).

A role fits when its device bytes are at most `Efficiency.usable_hbm` of the device's memory
(the rest: XLA's workspace, fragmentation, the VAE decoder). The simulator predicts no speed for
a mode that does not fit; the launchers refuse it with the line `advice` gives.
"""
from __future__ import annotations

import dataclasses

from digen_jax.runtime import plan as plan_lib
from digen_jax.runtime.task_costs import GIB, Efficiency, IterationWork, Pool

# `runtime.colocated_sampling` values (module docstring).
COLOCATED_SAMPLING = ("auto", "sharded", "gathered")
# runtime.tag_precision: what the train role's own rollouts (trainer-assisted generation) sample
# in: the rollout role's precision (with FP8 rollouts a quantised copy of the weights beside the
# ones training reads), the training precision, or 'auto': the rollout's where the train role fits the copy.
TAG_PRECISION = ("auto", "rollout", "training")

# The rollout's recompute factor of one block: its matmul outputs, and the inputs and outputs of
# the elementwise work between them, live at once.
ROLLOUT_LAYER_FACTOR = 2
# Training recomputes one block (remat 'full') and differentiates it: its outputs, their
# gradients and the float32 attention statistics and norms between them.
TRAIN_LAYER_FACTOR = 3


@dataclasses.dataclass(frozen=True)
class RoleMemory:
    """Bytes per device of one role (see the module docstring for each field)."""

    role: str
    devices: int
    capacity: float  # usable bytes of one device (Efficiency.usable_hbm x its memory)
    weights: float
    gradients: float
    optimizer: float
    copies: float
    rollout_copy: float
    activations: float
    sync_buffers: float
    host: float  # optimizer state kept in host memory, per device
    weight_shards: int = 1  # devices one copy of the weights is split over

    FIELDS = ("weights", "gradients", "optimizer", "copies", "rollout_copy", "activations", "sync_buffers")

    @property
    def device_bytes(self) -> float:
        return sum(getattr(self, f) for f in self.FIELDS)

    @property
    def fits(self) -> bool:
        return self.device_bytes <= self.capacity

    def as_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d.update(device_bytes=self.device_bytes, fits=self.fits)
        return d


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    mode: str
    roles: tuple[RoleMemory, ...]
    colocated_sampling: str | None = None  # colocated: 'sharded' or 'gathered' (`colocated_sampling`)

    @property
    def fits(self) -> bool:
        return all(r.fits for r in self.roles)

    def role(self, name: str) -> RoleMemory:
        return next(r for r in self.roles if r.role == name)

    def table(self) -> str:
        """A markdown table: GiB per device of every role and field."""
        head = "| role | devices | " + " | ".join(f.replace("_", " ") for f in RoleMemory.FIELDS) + \
            " | total | usable | host | fits |"
        lines = [head, "|---|---:|" + "---:|" * (len(RoleMemory.FIELDS) + 3) + "---|"]
        for r in self.roles:
            cells = " | ".join(f"{getattr(r, f) / GIB:.1f}" for f in RoleMemory.FIELDS)
            lines.append(f"| {r.role} | {r.devices} | {cells} | {r.device_bytes / GIB:.1f} | {r.capacity / GIB:.1f} | "
                         f"{r.host / GIB:.1f} | {'yes' if r.fits else 'NO'} |")
        if self.colocated_sampling is not None:
            lines.append(f"colocated sampling: {self.colocated_sampling} (runtime.colocated_sampling)")
        return "\n".join(lines)

    def over(self) -> RoleMemory | None:
        """The first role over its usable memory, or None."""
        return next((r for r in self.roles if not r.fits), None)


def advice(w: IterationWork, pool: Pool, mode: str, microbatches: int, eff: Efficiency = Efficiency(), *,
           colocated_devices: int | None = None) -> str | None:
    """None when `mode`'s plan fits `pool`, else one line: the role over its memory and the config
    changes whose plans fit (each tried alone), or that more devices are needed."""
    plan = memory_plan(w, pool, mode, microbatches, eff, colocated_devices=colocated_devices)
    r = plan.over()
    if r is None:
        return None
    fixes = []
    candidates = [
        ("--config.runtime.offload_optimizer=True", dict(offload_optimizer=True)),
        ("FSDP train rules (--config.sharding.train_rules=\"(('activation_batch','data'),('embed','data'))\")",
         dict(train_sharded=True)),
        ("--config.model.rollout_precision=fp8", dict(rollout_precision="fp8")),
        ("--config.model.rollout_precision=fp8 --config.model.lora_base_precision=fp8",
         dict(rollout_precision="fp8", lora_base_precision="fp8")),
        ("--config.rl.optimizer_state_dtype=param", dict(optimizer_state_bytes=0)),
        ("--config.runtime.colocated_sampling=sharded", dict(colocated_sampling="sharded")),
    ]
    for text, change in candidates:
        if all(getattr(w, k) == v for k, v in change.items()):
            continue
        if memory_plan(dataclasses.replace(w, **change), pool, mode, microbatches, eff,
                       colocated_devices=colocated_devices).fits:
            fixes.append(text)
    if not plan_lib.mode_flags(mode).colocated and memory_plan(w, pool, plan_lib.COLOCATED, microbatches, eff).fits:
        fixes.append("--config.runtime.mode=colocated")
    fixes = fixes or [f"more {'train ' if r.role == 'train' else ''}devices, or a smaller rl.grad_chunk_size"]
    return (f"runtime.mode={mode!r}: the {r.role} role needs {r.device_bytes / GIB:.1f} GiB per device of "
            f"{r.capacity / GIB:.1f} GiB usable (launch/simulate.py prints the plan); try {' or '.join(fixes)} "
            "(runtime.check_memory=False runs anyway)")


# The share of a host's physical memory `host_bytes` may plan on. The rest is the process's own:
# FLUX.1-dev full fine-tuning colocated on one H200 (offloaded bf16 moments, a 125 GiB host;
# benchmarks/README.md) peaked at 119 GiB where `host_bytes` counts 66.5: the runtime's and the
# placement's own memory came on top (1.79x; one measurement).
USABLE_HOST = 0.55


def host_bytes(w: IterationWork, plan: MemoryPlan) -> float:
    """Host memory one process that drives every device of `plan` holds for the model: the
    initial trainable weights (on an accelerator they wait in host memory until the executor
    places them, `Run.initial_state`) and every device's offloaded Adam moments (`host`)."""
    return w.trainable * w.param_bytes + sum(r.host * r.devices for r in plan.roles)


def host_advice(w: IterationWork, plan: MemoryPlan, host_memory: float) -> str | None:
    """None when `host_bytes` fits `USABLE_HOST` of `host_memory` (a host's physical bytes), else one line."""
    need, usable = host_bytes(w, plan), USABLE_HOST * host_memory
    if need <= usable:
        return None
    moments = sum(r.host * r.devices for r in plan.roles)
    fixes = ["more devices (the moments shard over the train devices of every host)"]
    if w.optimizer_bytes > w.param_bytes:
        fixes.insert(0, "--config.rl.optimizer_state_dtype=param")
    return (f"runtime.mode={plan.mode!r}: the host needs {need / GIB:.1f} GiB for the model ({w.trainable * w.param_bytes / GIB:.1f} "
            f"GiB of initial weights, {moments / GIB:.1f} GiB of offloaded Adam moments), over the {usable / GIB:.1f} GiB "
            f"planned of its {host_memory / GIB:.1f} GiB ({USABLE_HOST:.0%}, memory_plan.USABLE_HOST); try {' or '.join(fixes)} "
            "(runtime.check_memory=False runs anyway)")


def memory_plan(w: IterationWork, pool: Pool, mode: str, microbatches: int, eff: Efficiency = Efficiency(), *,
                colocated_devices: int | None = None) -> MemoryPlan:
    """The per-device bytes of every role of `mode` at `microbatches` micro-batches per iteration;
    a colocated mode runs on `colocated_devices` (default: the whole pool)."""
    flags = plan_lib.mode_flags(mode)
    samples = w.samples // microbatches
    if flags.colocated:
        kind, n = pool.slowest, colocated_devices or pool.total
        choice = colocated_sampling(w, pool, microbatches, eff, colocated_devices=colocated_devices)
        role = _train_role(w, "shared", n, kind.hbm_bytes * eff.usable_hbm, pool, samples, colocated=True,
                           gathered=choice == "gathered")
        return MemoryPlan(mode, (role,), colocated_sampling=choice)
    r_kind, t_kind = pool.kind("rollout"), pool.kind("train")
    train = _train_role(w, "train", pool.train_devices, t_kind.hbm_bytes * eff.usable_hbm, pool, samples, colocated=False,
                        fp8_rollouts=flags.tag and w.tag_precision == "rollout")
    return MemoryPlan(mode, (_rollout_role(w, pool.rollout_devices, r_kind.hbm_bytes * eff.usable_hbm, samples), train))


def colocated_sampling(w: IterationWork, pool: Pool, microbatches: int, eff: Efficiency = Efficiency(), *,
                       colocated_devices: int | None = None) -> str:
    """How a colocated run of `w` samples (`runtime.colocated_sampling`, module docstring): as
    configured, or for 'auto' 'gathered' where the shared role fits with the gathered copy, else
    'sharded'. 'sharded' wherever nothing would be gathered: LoRA, or train rules that do not
    shard the weights."""
    if w.lora or not w.train_sharded:
        return "sharded"
    if w.colocated_sampling != "auto":
        return w.colocated_sampling
    gathered = dataclasses.replace(w, colocated_sampling="gathered")
    fits = memory_plan(gathered, pool, plan_lib.COLOCATED, microbatches, eff, colocated_devices=colocated_devices).fits
    return "gathered" if fits else "sharded"


def tag_precision(w: IterationWork, pool: Pool, microbatches: int, eff: Efficiency = Efficiency()) -> str:
    """What the train role's own rollouts sample in (`runtime.tag_precision`, resolved): as
    configured, or for 'auto' 'rollout' where the rollout precision is the training one or the
    train role of the full mode fits the quantised copy beside training, else 'training'."""
    if w.tag_precision != "auto":
        return w.tag_precision
    if w.rollout_precision != "fp8":
        return "rollout"
    with_copy = dataclasses.replace(w, tag_precision="rollout")
    return "rollout" if memory_plan(with_copy, pool, plan_lib.BEST_MODE, microbatches, eff).fits else "training"


def _shard(w: IterationWork, devices: int, pool: Pool, sharded: bool) -> int:
    """Devices one copy is split over: the role's devices inside a host (hybrid sharding), or 1."""
    return min(devices, pool.devices_per_host) if sharded else 1


def _train_role(w: IterationWork, name: str, n: int, capacity: float, pool: Pool, samples: int, *,
                colocated: bool, gathered: bool = False, fp8_rollouts: bool = False) -> RoleMemory:
    shard = _shard(w, n, pool, w.train_sharded)
    pb = w.param_bytes
    trainable = w.trainable * pb / shard
    fp8_base = w.lora and w.lora_base_precision == "fp8"  # the LoRA base held in e4m3 only
    weights = trainable + (w.params * (1 if fp8_base else pb) / shard if w.lora else 0.0)
    gradients = trainable  # the update's running sum
    moments = 2 * w.trainable * w.optimizer_bytes / shard
    copies = trainable * (int(w.ema) + int(w.old_policy)) + (w.params * pb / shard if w.kl_reference and not w.lora else 0.0)
    fp8 = (colocated or fp8_rollouts) and w.rollout_precision == "fp8"
    # e4m3: one byte per weight, sharded like the weights; gathered, the whole copy is sampling's;
    # an FP8 LoRA base is itself the copy the rollouts read
    rollout_copy = w.params / shard if fp8 and not gathered and not fp8_base else 0.0
    gathered_layers = 2 * 2 * w.forward_params * pb / max(w.layers, 1) if shard > 1 else 0.0  # one layer and the next, forward and backward
    units = -(-w.grad_chunk_size * w.seq_parallel // n) / w.seq_parallel  # a unit's tokens split over a sequence group
    chunks = _chunks_per_update(w)
    # Working sets beyond the resident state, per phase. Training: a chunk's gradients beside the
    # running sum (several chunks per update), its units' activations and the gathered layers.
    train_act = (trainable if chunks > 1 else 0.0) + gathered_layers + \
        units * (w.saved_activation_bytes + TRAIN_LAYER_FACTOR * w.layer_activation_bytes)
    # Sampling (colocated, or trainer-assisted rollouts): no gradients are alive.
    # Gathered colocated sampling: the whole copy instead of one layer's gathers at a time.
    sampling_weights = w.params * (1 if fp8 else pb) if gathered else gathered_layers / 2
    rollout_act = _per_device(samples, n, w.seq_parallel) * w.cfg_forwards * ROLLOUT_LAYER_FACTOR * w.layer_activation_bytes \
        + sampling_weights - gradients
    # The update (two programs, `Trainer.apply_update`): the check's float32 temporaries, a third of
    # the trainable weights' bytes as XLA compiled it for Qwen-Image-20B full fine-tuning with bf16
    # weights and moments (the in-place step needs almost none; docs/design.md, Memory plan);
    # and offloaded moments brought onto the devices.
    update_act = trainable / 3 + (moments if w.offload_optimizer else 0.0)
    activations = max(train_act, rollout_act, update_act)
    return RoleMemory(
        role=name, devices=n, capacity=capacity, weights=weights, gradients=gradients,
        optimizer=0.0 if w.offload_optimizer else moments, copies=copies, rollout_copy=rollout_copy,
        activations=activations, sync_buffers=0.0, host=moments if w.offload_optimizer else 0.0, weight_shards=shard,
    )


def _rollout_role(w: IterationWork, n: int, capacity: float, samples: int) -> RoleMemory:
    shard = n if w.rollout_sharded else 1
    sampling = w.params * (1 if w.rollout_precision == "fp8" else w.param_bytes) / shard
    moved = w.trainable * w.param_bytes if w.lora else sampling  # what each sync brings while the old copy serves
    activations = _per_device(samples, n, w.seq_parallel) * w.cfg_forwards * ROLLOUT_LAYER_FACTOR * w.layer_activation_bytes
    return RoleMemory(
        role="rollout", devices=n, capacity=capacity, weights=sampling + (w.trainable * w.param_bytes if w.lora else 0.0),
        gradients=0.0, optimizer=0.0, copies=0.0, rollout_copy=0.0, activations=activations,
        sync_buffers=moved, host=0.0, weight_shards=shard,
    )


def _per_device(samples: int, devices: int, seq_parallel: int) -> float:
    """Samples' worth of activations on one device: whole samples spread over the sequence groups,
    each sample's tokens split over its group's `seq_parallel` devices."""
    return -(-samples // max(devices // seq_parallel, 1)) / seq_parallel


def _chunks_per_update(w: IterationWork) -> int:
    units = w.samples * w.trained_steps // max(w.updates, 1)
    return max(1, -(-units // max(w.grad_chunk_size, 1)))
