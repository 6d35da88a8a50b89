"""Task costs, the simulator's cost model: seconds per task of one iteration's work (`IterationWork`)
on a device pool.

`model_costs` gives the `plan.Costs` (seconds per task kind) the simulator schedules: exact
FLOPs of the config's model (`IterationWork`, built by `digen_jax.app.run_sizing`) and a device table
(`DEVICES`), divided by the devices a task runs on and an achieved-efficiency factor per task
kind (`Efficiency`), plus bytes over bandwidths for weight transfers, FSDP all-gathers and
offload.

Work spreads over a group's devices at the grain of a sample (rollout) or a training unit,
ceil(items / devices) on the busiest device (the executor needs the count to divide; a config
for the pool chooses it so). Rollout keeps a weight replica per device (tensor-parallel
replicas when the weights do not fit); training shards the weights (FSDP) and all-gathers
them per gradient chunk, forward and backward; trainer-assisted rollouts (TAG) run on those
FSDP weights, gathered every step. Without TSP the training grain is the trajectory step:
one trained step of all the micro-batch's samples at a time, split over samples only; with
TSP (and colocated, as the executor does) units are flattened over samples x steps first.
Chunks hold at most `Efficiency.train_units_per_device` units per device (activation memory)
rather than `rl.grad_chunk_size`, which is sized for the devices a config was written for.
Every forward pays a batch-independent part (`Efficiency.block_s` per block) besides its FLOPs,
so smaller per-device batches (colocated's, the trainer's rollout pieces) cost more per sample;
a piece of a micro-batch pays a whole one's batch-independent seconds (`plan.Costs.rollout_fixed`).

Colocated runs come in two styles: `fsdp_sampling` (the executor's own colocated mode, as in
GenRL: sampling with the FSDP training weights, all-gathered every step) and `offload` (as in
veRL-Omni: the rollout engine holds full replicated weights; around rollout the training
state is offloaded to host memory and back, and the rollout weights loaded and dropped).
These phase switches happen once per iteration on the one shared group; they are charged to
the update task (the shared group runs its tasks one after another, so where in its list the
seconds sit does not change the iteration time).

Approximations, stated once: decode (VAE) runs on the generating group's devices but is
scheduled on the reward queue (as the executor's reward threads wait for it); the VAE
decoder's FLOPs are `Efficiency.decode_flops_per_pixel` per output pixel (frame); memory is
checked for rollout weight replicas only, and tensor-parallel replicas scale without
communication; collectives use a ring model, bytes x (n-1)/n at the link's bandwidth; a
group spanning hosts shards its weights inside each host and replicates across hosts (hybrid
sharding), so only gradient reductions cross the network.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Mapping

from digen_jax.runtime import plan as plan_lib

GIB = 2**30


# ---------------------------------------------------------------------------------------- hardware
@dataclasses.dataclass(frozen=True)
class DeviceKind:
    """One accelerator model. Bandwidths are bytes/s per device and direction.

    `link_bw`: device-to-device inside a host (NVLink, or PCIe for cards without it);
    `host_bw`: device <-> host memory (PCIe), what offloading moves over;
    `dollars_per_hour`: rental price per device (a parameter: override it with `with_prices`).
    """

    name: str
    bf16_flops: float  # datasheet dense bf16 tensor-core peak, FLOP/s (no sparsity)
    hbm_bytes: float
    hbm_bw: float
    link_bw: float
    host_bw: float
    dollars_per_hour: float


# Datasheet figures. Prices are illustrative on-demand cloud rates per GPU-hour (late 2025);
# they only scale the cost tables and are meant to be overridden.
DEVICES: dict[str, DeviceKind] = {
    "h100": DeviceKind("H100 SXM", 989.4e12, 80e9, 3.35e12, 450e9, 55e9, 2.50),
    "h100_pcie": DeviceKind("H100 PCIe", 756e12, 80e9, 2.0e12, 64e9, 55e9, 2.00),
    "h200": DeviceKind("H200 SXM", 989.4e12, 141e9, 4.8e12, 450e9, 55e9, 3.50),
    "h800": DeviceKind("H800 SXM", 989.4e12, 80e9, 3.35e12, 200e9, 55e9, 2.00),
    "a100": DeviceKind("A100 SXM 80GB", 312e12, 80e9, 2.04e12, 300e9, 25e9, 1.30),
    "l40s": DeviceKind("L40S", 362e12, 48e9, 0.864e12, 32e9, 25e9, 0.90),
    # Cloud TPU chips (Google's published per-chip bf16 peak, HBM size and bandwidth, ICI bandwidth
    # as link_bw: v5e 197 TFLOP/s, 16 GB, 819 GB/s, 1,600 Gb/s; v5p 459 TFLOP/s, 95 GB, 2,765 GB/s,
    # 4,800 Gb/s; v6e 918 TFLOP/s, 32 GB, 1,640 GB/s, 3,584 Gb/s; on-demand $ per chip-hour 1.20,
    # 4.20, 2.70). Host bandwidth is not published per chip: 25 GB/s assumed. A slice's chips all
    # share ICI: plan a slice with launch/simulate.py --devices_per_host=<its chips>.
    "v5e": DeviceKind("TPU v5e", 197e12, 16e9, 0.819e12, 200e9, 25e9, 1.20),
    "v5p": DeviceKind("TPU v5p", 459e12, 95e9, 2.765e12, 600e9, 25e9, 4.20),
    "v6e": DeviceKind("TPU v6e", 918e12, 32e9, 1.64e12, 448e9, 25e9, 2.70),
}
# JAX's `device_kind` of the TPU chips in `DEVICES`.
TPU_DEVICE_KINDS = {"tpu v5 lite": "v5e", "tpu v5": "v5p", "tpu v5p": "v5p", "tpu v6 lite": "v6e", "tpu v6e": "v6e"}


def device_kind(name: str) -> DeviceKind:
    """The `DEVICES` entry `name` (case-insensitive); a ValueError naming the known ones."""
    key = name.lower()
    if key not in DEVICES:
        raise ValueError(f"unknown device kind {name!r}; known: {sorted(DEVICES)}")
    return DEVICES[key]


def local_kind(jax_device_kind: str) -> str:
    """The `DEVICES` key of a JAX `device_kind` ('NVIDIA H100 80GB HBM3' -> 'h100', 'NVIDIA H100 PCIe'
    -> 'h100_pcie', 'TPU v5 lite' -> 'v5e'); a ValueError for kinds the table lacks (then name a pool, e.g. 'h100:8')."""
    name = jax_device_kind.lower()
    if name in TPU_DEVICE_KINDS:
        return TPU_DEVICE_KINDS[name]
    for key in sorted(DEVICES, key=len, reverse=True):  # 'h100_pcie' before 'h100'
        model, _, variant = key.partition("_")
        if model in name and (not variant or variant in name):
            return key
    raise ValueError(f"device kind {jax_device_kind!r} has no entry in the simulator's table {sorted(DEVICES)}; "
                     "name a pool instead (e.g. h100:8)")


def with_prices(prices: Mapping[str, float]) -> dict[str, DeviceKind]:
    """A copy of `DEVICES` with `prices` ($/device-hour by kind) replacing the defaults."""
    table = dict(DEVICES)
    for name, price in prices.items():
        table[name.lower()] = dataclasses.replace(device_kind(name), dollars_per_hour=float(price))
    return table


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """Achieved fractions of peak per task kind, and fixed per-call costs.

    A device's seconds for a batch are a batch-independent part plus the batch's FLOPs at a
    fraction of the peak, so its cost per sample falls as its batch grows: a forward pays
    `block_s` per transformer block whatever its batch (dispatch and kernel latency, kernels
    too small to fill the device), a denoising step `step_call_s` more, a gradient chunk
    `train_call_s` plus `block_s` per block for each of its passes (forward, recomputation,
    backward). `rollout` and `train` are the fractions the FLOPs reach once the batch is large.

    Defaults: `rollout`, `block_s` and `gather_exposed` are a least-squares fit (relative error)
    of that form to the rollout task durations of the five Qwen-Image-20B LoRA pairs on H200s
    (benchmarks/results/system_qwenimage_{2xh200_1_1,4xh200_2_2}_{bf16,fp8}_pair.json and
    system_qwenimage_4xh200_1_3_fp8_pair.json, their `costs` and the pieces in their *_traces):
    1 to 24 samples per device, the rollout role's replicated weights and the sharded ones of
    colocated and of the trainer's rollouts on 1 to 4 devices. They fit within 6.1%: 0.0375 s per
    step of the 60-block transformer whatever the batch (0.002 of it `step_call_s`, the rest
    5.9e-4 s per block), 0.060 s per bf16 sample and step (56% of the peak), and 28% of a
    step's weight all-gather not hidden behind its compute. The same numbers price training:
    a chunk's three passes pay 0.11 s of fixed seconds, and at `train` 0.40 the pairs' training
    tasks (8 to 16 units per device per chunk, 1 to 4 devices) come out within 8%, except the
    3-device train role of the 1+3 pair (10% under). The batch-independent part per block is
    one model's on one card; other families and cards are assumed to pay the same per block.
    The forward-only model bench agrees on H100s: 0.15 s at batch 4 and 0.48 s at batch 16
    (results/model_qwenimage_h100_b4_512_peer.json, model_qwenimage_h100_b16_512_fp8.json, runs
    of different days) put a forward's batch-independent part near 0.04 s. On the committed
    2-GPU system runs not fitted (Qwen-Image on H100s and H200s, the 24-block SD3.5-Medium on
    H200s) the model lands -8% to +17% of the measured samples/s.
    The VAE decoder is convolution-heavy and lower. Memory-bound work (optimizer update, LoRA
    merge) reaches ~70% of HBM bandwidth, collectives and transfers ~80% of link bandwidth.
    """

    rollout: float = 0.56
    train: float = 0.40
    decode: float = 0.30
    memory: float = 0.70
    link: float = 0.80
    step_call_s: float = 0.002  # one denoising step of a micro-batch (dispatch)
    block_s: float = 5.9e-4  # one forward of one transformer block, whatever its batch (fit above)
    gather_exposed: float = 0.28  # share of an FSDP all-gather's seconds that overlapping compute does not hide (fit above)
    train_call_s: float = 0.005  # one gradient chunk
    update_call_s: float = 0.005
    reward_s_per_sample: float = 0.002  # host-side scoring after decode (a cheap reward)
    decode_flops_per_pixel: float = 5e6  # VAE decoder, per output pixel (and frame)
    usable_hbm: float = 0.85  # share of HBM a rollout weight replica (+ activations) may take
    # A rollout forward with FP8 block matmuls (`model.rollout_precision='fp8'`) against bf16:
    # 1.25x for Qwen-Image-20B (batch 16) and 1.27x for FLUX.1 (batch 8) at 512x512 on one H100
    # (launch/bench.py --mode=model --what=forward,forward_fp8; benchmarks/README.md). The H200
    # pairs above fit 1.29-1.30 on the per-sample part; the H100 figure stays, being the lower.
    fp8_rollout_speedup: float = 1.25
    # training units one device holds in a gradient chunk (activation memory); each chunk pays
    # its passes' batch-independent seconds. The H200 LoRA pairs' chunks held 4 to 16 units per
    # device (rl.grad_chunk_size over the role's devices), 8 in five of their ten training tasks.
    train_units_per_device: int = 8

    def __post_init__(self):
        for field in dataclasses.fields(self):
            if getattr(self, field.name) < 0:
                raise ValueError(f"Efficiency.{field.name} must be >= 0, got {getattr(self, field.name)}")
        if self.fp8_rollout_speedup <= 0:
            raise ValueError(f"Efficiency.fp8_rollout_speedup must be > 0, got {self.fp8_rollout_speedup}")
        if self.train_units_per_device < 1:
            raise ValueError(f"Efficiency.train_units_per_device must be >= 1, got {self.train_units_per_device}")
        for name in ("rollout", "train", "decode", "memory", "link", "usable_hbm"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"Efficiency.{name} must be in (0, 1], got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class Pool:
    """Devices per role, and how they are wired.

    Roles take devices in order (rollout first, then train), `devices_per_host` to a host; a
    colocated run uses all of them as one group (bounded by the slowest kind, since its
    data-parallel steps run in lockstep). `cross_host_bw`: bytes/s per device between hosts
    (the NIC share of one GPU). Heterogeneous pools (different kinds per role) are separate
    machines, so role-to-role transfers always cross hosts.
    """

    rollout_kind: str
    rollout_devices: int
    train_kind: str
    train_devices: int
    devices_per_host: int = 8
    cross_host_bw: float = 25e9  # 200 Gb/s per GPU
    devices: Mapping[str, DeviceKind] = dataclasses.field(default_factory=lambda: DEVICES, compare=False, repr=False)

    def __post_init__(self):
        for role in ("rollout", "train"):
            kind, count = getattr(self, f"{role}_kind"), getattr(self, f"{role}_devices")
            if kind.lower() not in self.devices:
                raise ValueError(f"pool: unknown {role} device kind {kind!r}; known: {sorted(self.devices)}")
            if count < 1:
                raise ValueError(f"pool: {role} needs >= 1 device, got {count}")
        if self.devices_per_host < 1 or self.cross_host_bw <= 0:
            raise ValueError(f"pool: devices_per_host and cross_host_bw must be positive, got {self.devices_per_host}, {self.cross_host_bw}")

    @classmethod
    def parse(cls, spec: str, **kwargs) -> "Pool":
        """`h100:16` (an even role split), `h100:16/rollout=10` or `rollout=h800:16,train=l40s:16`."""
        spec = spec.replace(" ", "").lower()
        if spec.startswith("rollout="):
            try:
                roles = dict(part.split("=", 1) for part in spec.split(","))
                (rk, rn), (tk, tn) = (roles["rollout"].split(":"), roles["train"].split(":"))
                return cls(rk, int(rn), tk, int(tn), **kwargs)
            except (KeyError, ValueError):
                raise ValueError(f"pool spec {spec!r}: expected rollout=KIND:N,train=KIND:N") from None
        match = re.fullmatch(r"([a-z0-9_]+):(\d+)(?:/rollout=(\d+))?", spec)
        if not match:
            raise ValueError(f"pool spec {spec!r}: expected KIND:N, KIND:N/rollout=R or rollout=KIND:N,train=KIND:N")
        kind, total = match.group(1), int(match.group(2))
        rollout = int(match.group(3)) if match.group(3) else total // 2
        if total < 2:
            raise ValueError(f"pool spec {spec!r}: the simulator models pools of 2 or more devices (a rollout and a "
                             "train role); one device runs colocated only: measure it with launch/bench.py "
                             "--mode=system --modes=colocated")
        if not 0 < rollout < total:
            raise ValueError(f"pool spec {spec!r}: rollout devices must be in [1, {total - 1}]")
        return cls(kind, rollout, kind, total - rollout, **kwargs)

    def kind(self, role: str) -> DeviceKind:
        return self.devices[getattr(self, f"{role}_kind").lower()]

    @property
    def total(self) -> int:
        return self.rollout_devices + self.train_devices

    @property
    def heterogeneous(self) -> bool:
        return self.rollout_kind.lower() != self.train_kind.lower()

    @property
    def slowest(self) -> DeviceKind:
        return min((self.kind("rollout"), self.kind("train")), key=lambda k: (k.bf16_flops, k.hbm_bytes))

    def dollars_per_hour(self) -> float:
        return sum(self.kind(r).dollars_per_hour * getattr(self, f"{r}_devices") for r in ("rollout", "train"))

    def describe(self) -> str:
        if self.heterogeneous:
            return f"{self.rollout_devices}x{self.kind('rollout').name} rollout + {self.train_devices}x{self.kind('train').name} train"
        return f"{self.total}x{self.kind('rollout').name} ({self.rollout_devices} rollout / {self.train_devices} train)"

    def fsdp_gather_s(self, kind: DeviceKind, devices: int, nbytes: float, eff: "Efficiency") -> float:
        """All-gather of `nbytes` of weights sharded over `devices` of `kind`.

        A group that spans hosts shards inside each host and replicates across hosts (hybrid
        sharding): the per-layer gathers stay on NVLink/PCIe, only gradients cross hosts.
        """
        return _ring_s(nbytes, min(devices, self.devices_per_host), kind.link_bw, eff)

    def cross_host_reduce_s(self, devices: int, nbytes: float, eff: "Efficiency") -> float:
        """All-reduce of `nbytes` of gradients between the hosts a group of `devices` spans."""
        hosts = -(-devices // self.devices_per_host)
        return 2 * _ring_s(nbytes, hosts, self.cross_host_bw, eff)

    def role_link_bw(self) -> float:
        """Trainer -> rollout bandwidth per device: NVLink/PCIe when both roles share one host."""
        if not self.heterogeneous and self.total <= self.devices_per_host:
            return self.kind("train").link_bw
        return min(self.cross_host_bw, self.kind("train").link_bw, self.kind("rollout").link_bw)


# ---------------------------------------------------------------------------------------- work
@dataclasses.dataclass(frozen=True)
class IterationWork:
    """What one iteration of a config computes: FLOPs per step and per training unit, sizes."""

    family: str
    prompts: int
    group_size: int
    num_steps: int
    trained_steps: int
    step_flops: float  # one denoising step of one sample (CFG included)
    unit_flops: float  # one training unit: forward+backward, plus any old-policy and reference forwards (CFG included)
    params: float  # matmul weights of the transformer(s) (biases and norms are < 0.1%), every expert's
    trainable: float  # LoRA adapter parameters, or `params` for full fine-tuning
    adapted_weights: float  # base weights under LoRA adapters (what a merge rewrites)
    lora_rank: int  # 0: full fine-tuning
    merge_for_sampling: bool  # LoRA merged into the rollout weights after each sync (else applied factored)
    pixels: int  # output pixels (x frames) per sample, what the VAE decodes
    updates: int  # optimizer updates per iteration in colocated mode
    param_bytes: int = 2  # bf16 weights
    # model forwards per training unit: the trained pass, plus the old policy's (DiffusionNFT) and
    # the frozen reference's (rl.kl_beta > 0); each all-gathers the FSDP weights
    unit_forwards: int = 1
    # numerics of the rollout role's forwards (`model.rollout_precision`): 'fp8' runs them
    # `Efficiency.fp8_rollout_speedup` times faster from weights of one byte; the train role's own
    # rollouts (trainer-assisted generation) too where `tag_precision` is 'rollout'
    rollout_precision: str = "bf16"
    # `model.lora_base_precision`: 'fp8' holds the LoRA base only in e4m3 (one byte per weight),
    # and the train role's own rollouts then sample in FP8 as well
    lora_base_precision: str = "bf16"
    tag_precision: str = "auto"  # runtime.tag_precision ('auto': the memory plan resolves it, `memory_plan.tag_precision`)
    # What the memory plan (runtime/memory_plan.py) reads besides the sizes above.
    optimizer_state_bytes: int = 0  # bytes per Adam moment element; 0: param_bytes ('param')
    offload_optimizer: bool = False  # runtime.offload_optimizer: the moments in host memory
    colocated_sampling: str = "auto"  # runtime.colocated_sampling: 'auto' | 'sharded' | 'gathered'
    train_sharded: bool = True  # the train rules shard the weights (FSDP)
    rollout_sharded: bool = False  # the rollout rules shard the weights
    ema: bool = False  # an EMA copy of the trainable weights
    kl_reference: bool = False  # rl.kl_beta > 0: a frozen reference copy (full fine-tuning)
    old_policy: bool = False  # DiffusionNFT's old-policy copy of the trainable weights
    layers: int = 1  # transformer blocks (the FSDP gathers move one at a time)
    grad_chunk_size: int = 1  # training units per gradient chunk (rl.grad_chunk_size)
    cfg_forwards: int = 1  # forwards per rollout step (2 with CFG)
    saved_activation_bytes: float = 0.0  # per training unit: the block inputs kept for the backward pass
    layer_activation_bytes: float = 0.0  # per sample: one block's matmul outputs
    seq_parallel: int = 1  # runtime.seq_parallel: each sample's tokens (and activations) split over this many devices
    # transformers of one policy, one of which runs each forward (Wan2.2-A14B: 2 experts switched
    # at a timestep boundary): a copy holds, syncs and trains all of them, a forward reads one
    experts: int = 1

    @property
    def forward_params(self) -> float:
        """Weights one forward reads (what an FSDP forward gathers): one expert's."""
        return self.params / self.experts

    @property
    def optimizer_bytes(self) -> int:
        return self.optimizer_state_bytes or self.param_bytes

    @property
    def lora(self) -> bool:
        return self.lora_rank > 0

    @property
    def samples(self) -> int:
        return self.prompts * self.group_size

    @property
    def flops_per_sample(self) -> float:
        return self.num_steps * self.step_flops + self.trained_steps * self.unit_flops


# ---------------------------------------------------------------------------------------- cost model
def _split(items: int, devices: int) -> int:
    """Items the busiest device computes when `items` (samples or units) spread over `devices`."""
    return -(-items // devices)


def _ring_s(nbytes: float, devices: int, bw: float, eff: Efficiency) -> float:
    """Seconds of an all-gather (or reduce-scatter) of `nbytes` over `devices` at `bw` per device."""
    return 0.0 if devices <= 1 else nbytes * (devices - 1) / devices / (bw * eff.link)


def _replica_size(w: IterationWork, kind: DeviceKind, devices: int, eff: Efficiency, fp8: bool = False) -> int:
    """Devices per rollout weight replica: 1, or the least power of two whose share of the weights fits."""
    weights = w.params * (1 if fp8 else w.param_bytes)
    size = 1
    while weights / size > eff.usable_hbm * kind.hbm_bytes:
        size *= 2
        if size > devices:
            raise ValueError(f"{weights / GIB:.0f} GiB of weights do not fit on {devices} x {kind.name}")
    return size


def forward_fixed_s(w: IterationWork, eff: Efficiency) -> float:
    """The batch-independent seconds of one forward pass of the transformer (`Efficiency.block_s` per block)."""
    return w.layers * eff.block_s


def rollout_fixed_s(w: IterationWork, eff: Efficiency) -> float:
    """The seconds of a rollout that do not shrink with its batch: every denoising step's call and
    forward overhead. A piece of a micro-batch pays them in full (`plan.Costs.rollout_fixed`)."""
    return w.num_steps * (eff.step_call_s + forward_fixed_s(w, eff))


def rollout_mb_s(w: IterationWork, samples: int, kind: DeviceKind, devices: int, eff: Efficiency, *,
                 sharded_in: Pool | None = None, fp8: bool = False) -> float:
    """Seconds to roll out `samples` on `devices` of `kind`.

    Replicated weights (rollout role, offload-style colocated) by default; with `sharded_in`
    (the pool) the weights stay FSDP-sharded and every step all-gathers them, overlapped with
    the step's compute (trainer rollouts, GenRL-style colocated). `fp8`: the forwards run FP8
    block matmuls (`Efficiency.fp8_rollout_speedup`) from one-byte weights. Each step costs
    its batch-independent part (`rollout_fixed_s`) plus the busiest device's samples at
    `Efficiency.rollout` of the peak, so a device's cost per sample falls as its batch grows.
    """
    rate = kind.bf16_flops * eff.rollout * (eff.fp8_rollout_speedup if fp8 else 1.0)
    if sharded_in is None:
        replica = _replica_size(w, kind, devices, eff, fp8)
        per_replica = _split(samples, devices // replica)
        step = per_replica * w.step_flops / (replica * rate)
    else:
        compute = _split(samples, devices) * w.step_flops / rate
        weight_bytes = w.forward_params * (1 if fp8 else w.param_bytes)
        gather = sharded_in.fsdp_gather_s(kind, devices, weight_bytes, eff)
        step = max(compute, gather) + eff.gather_exposed * gather
    return w.num_steps * step + rollout_fixed_s(w, eff)


def train_mb_s(w: IterationWork, samples: int, kind: DeviceKind, devices: int, pool: Pool, eff: Efficiency, *,
               tsp: bool) -> float:
    """Seconds of one micro-batch's forward+backward on an FSDP group (gradients accumulated).

    A device holds at most `eff.train_units_per_device` units per gradient chunk (memory).
    Without TSP the grain is the trajectory step: each trained step's samples are spread over
    the devices and chunked on their own, so a step with fewer samples than devices leaves
    devices idle and every step pays its own chunks; with TSP the units of all steps are
    flattened first. Each chunk pays its passes' batch-independent part (`forward_fixed_s`
    per pass: the forward, its recomputation and the backward, and once more per extra
    forward) and all-gathers the weights for its forward and again for its
    backward (and reduce-scatters the trainable weights' gradients), overlapped with compute;
    a unit with more forwards (`w.unit_forwards`: DiffusionNFT's old policy, a reference model)
    gathers once per forward. Over an FP8 LoRA base (`model.lora_base_precision='fp8'`) the
    forwards' share of a unit's FLOPs runs `eff.fp8_rollout_speedup` times faster; the
    backward's, through the dequantised base, does not (models/fp8.py).
    """
    cap = eff.train_units_per_device
    if tsp:
        per_device = [_split(samples * w.trained_steps, devices)]
    else:
        per_device = [_split(samples, devices)] * w.trained_steps
    chunks = [min(cap, n - i) for n in per_device for i in range(0, n, cap)]
    comm = pool.fsdp_gather_s(kind, devices, (w.unit_forwards + 1) * w.forward_params * w.param_bytes + 4 * w.trainable, eff)
    per_unit = w.unit_flops / (kind.bf16_flops * eff.train)
    if w.lora and w.lora_base_precision == "fp8":
        forward_share = w.unit_forwards / (w.unit_forwards + 1)  # a LoRA backward through the base ~ one forward
        per_unit *= forward_share / eff.fp8_rollout_speedup + (1 - forward_share)
    fixed = eff.train_call_s + (w.unit_forwards + 2) * forward_fixed_s(w, eff)
    return sum(max(c * per_unit, comm) + eff.gather_exposed * comm + fixed for c in chunks)


def update_s(w: IterationWork, kind: DeviceKind, devices: int, pool: Pool, eff: Efficiency) -> float:
    """AdamW over the sharded trainable weights (fp32 params, grads and two moments read, three
    written) after the gradients are reduced between hosts."""
    shard = min(devices, pool.devices_per_host)
    moved = 7 * 4 * w.trainable / shard
    return moved / (kind.hbm_bw * eff.memory) + pool.cross_host_reduce_s(devices, 4 * w.trainable / shard, eff) + eff.update_call_s


def sync_s(w: IterationWork, pool: Pool, eff: Efficiency) -> float:
    """Trainer -> rollout weights: adapters (fp32) or full weights to every rollout device; then the LoRA merge."""
    nbytes = 4 * w.trainable if w.lora else w.params * w.param_bytes
    senders = min(pool.train_devices, pool.rollout_devices)
    transfer = nbytes * pool.rollout_devices / senders / (pool.role_link_bw() * eff.link)
    rollout = pool.kind("rollout")
    merge = 0.0
    if w.merge_for_sampling:  # W + s B A on every replica: a rank-r matmul per adapted kernel and one read/write of it
        merge = 2 * w.lora_rank * w.adapted_weights / (rollout.bf16_flops * eff.rollout) + 2 * w.adapted_weights * w.param_bytes / (rollout.hbm_bw * eff.memory)
    return transfer + merge


def reward_mb_s(w: IterationWork, samples: int, kind: DeviceKind, devices: int, eff: Efficiency) -> float:
    """VAE decode on the generating group's devices, then host scoring."""
    decode = _split(samples, devices) * w.pixels * eff.decode_flops_per_pixel / (kind.bf16_flops * eff.decode)
    return decode + samples * eff.reward_s_per_sample


COLOCATED_STYLES = ("fsdp_sampling", "offload")


def model_costs(w: IterationWork, pool: Pool, mode: str, microbatches: int, *, style: str = "fsdp_sampling",
                eff: Efficiency = Efficiency()) -> plan_lib.Costs:
    """`plan.Costs` of `mode` at `microbatches` micro-batches per iteration, from FLOPs and the device table."""
    flags = plan_lib.mode_flags(mode)
    if microbatches < 1 or w.prompts % microbatches:
        raise ValueError(f"runtime.micro_batches={microbatches} must divide rl.prompts_per_iteration={w.prompts}")
    if style not in COLOCATED_STYLES:
        raise ValueError(f"colocated style {style!r} is unknown; known: {COLOCATED_STYLES}")
    samples = w.samples // microbatches
    fp8 = w.rollout_precision == "fp8"
    if flags.colocated:
        kind, n = pool.slowest, pool.total
        rollout = rollout_mb_s(w, samples, kind, n, eff, sharded_in=None if style == "offload" else pool, fp8=fp8)
        update = update_s(w, kind, n, pool, eff)
        if style == "offload":
            update += _phase_switch_s(w, kind, n, pool, eff) / w.updates
        return plan_lib.Costs(
            rollout={"shared": rollout},
            reward=reward_mb_s(w, samples, kind, n, eff),
            train=train_mb_s(w, samples, kind, n, pool, eff, tsp=True),
            update=update,
            sync=0.0,
            rollout_fixed={"shared": rollout_fixed_s(w, eff)},
        )
    r_kind, t_kind = pool.kind("rollout"), pool.kind("train")
    r_n, t_n = pool.rollout_devices, pool.train_devices
    return plan_lib.Costs(
        rollout={
            "rollout": rollout_mb_s(w, samples, r_kind, r_n, eff, fp8=fp8),
            "train": rollout_mb_s(w, samples, t_kind, t_n, eff, sharded_in=pool,
                                  fp8=fp8 and (w.tag_precision == "rollout" or w.lora_base_precision == "fp8")),
        },
        reward=reward_mb_s(w, samples, r_kind, r_n, eff),
        train=train_mb_s(w, samples, t_kind, t_n, pool, eff, tsp=flags.tsp),
        update=update_s(w, t_kind, t_n, pool, eff),
        sync=sync_s(w, pool, eff),
        rollout_fixed={g: rollout_fixed_s(w, eff) for g in ("rollout", "train")},
    )


def _phase_switch_s(w: IterationWork, kind: DeviceKind, devices: int, pool: Pool, eff: Efficiency) -> float:
    """Offload-style colocation, once per iteration: the sharded training state (bf16 base, fp32
    trainable weights, gradients and two moments) to host memory and back, and the replicated
    rollout weights loaded from host memory (dropped afterwards, free)."""
    train_state = (w.params * w.param_bytes + 16 * w.trainable) / min(devices, pool.devices_per_host)
    rollout_weights = w.params * w.param_bytes
    return (2 * train_state + rollout_weights) / (kind.host_bw * eff.link)
