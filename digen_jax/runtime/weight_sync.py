"""Weight placement and sync: where each role's weights live, and the trainer -> rollout transfer.

The train role holds the train state (sharded by `sharding.train_rules`) and, with LoRA or a KL
reference, the frozen base. The rollout role samples with its own copy: with LoRA only the
adapters cross at each sync (onto a frozen base placed there once); full fine-tuning moves the
whole trainable tree (sharded by `sharding.rollout_rules`). Colocated runs sample with the train
state where it lives, or, for full fine-tuning with FSDP train rules and
`runtime.colocated_sampling='gathered'`, from one copy placed by the rollout rules on the
shared mesh (replicated: one all-gather per iteration instead of every step gathering each
layer), made at the iteration's first rollout and dropped before its training, its programs
traced under the rollout rules like the rollout role's. Decoders (VAE weights) are replicated
on every group that decodes.

FP8 rollouts (`model.rollout_precision='fp8'`; numerics in `models/fp8.py`, the tree in
`rl/quantized_params.py`): the rollout role samples with the blocks' kernels quantised to e4m3. With
LoRA the frozen base is quantised once where it is placed (on the rollout role; colocated, once
beside the train role's copy, which training keeps using) and the adapters stay in their dtype,
applied factored on top (the config validation rejects merging them); full fine-tuning
quantises the trainable weights each time sampling weights are made from them: at every sync on
the train role, before they cross, so only the e4m3 tree moves (and alike before a colocated
gathered copy is placed).
The train role's own rollouts of a disaggregated run (trainer-assisted generation) sample in the
rollout precision where `fp8_on_train` (`runtime.tag_precision` resolved to 'rollout': the same
numerics and speed as the rollout role's), else in the training precision (`RoleWeights.on_train`).
With `model.lora_base_precision='fp8'` the frozen base is quantised where it is placed on the
train role and its bf16 form dropped: training, colocated rollouts and trainer-assisted ones all
read that one e4m3 copy, and the rollout role receives it as it is.

Several processes: every process builds the same frozen base and decoder weights (same
checkpoint, seed and pretraining cache), so each places its own copy on its own devices of
every role (`transfer.put_own_copy`); nothing crosses between processes for them, and a
role receiving the 20B base needs it once per card, not the buffers of a move. What lives on
one role only (the trainable weights at each sync) moves with `transfer.transfer`.
"""
from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax

from digen_jax.rl import lora, quantized_params
from digen_jax.rl.trainer import Trainer, TrainState, is_unbuilt
from digen_jax.runtime import mesh as mesh_lib
from digen_jax.runtime.settings import ShardingRules
from digen_jax.runtime.transfer import own_copy_everywhere, put_in_pieces, put_own_copy, transfer


class RoleWeights:
    """The weights of every role of one run, and the sync that carries a version to rollout."""

    def __init__(self, meshes: mesh_lib.RoleMeshes, rules: ShardingRules, abstract_params: Any, trainer: Trainer,
                 merge_for_sampling: bool, offload_optimizer: bool = False, gathered_sampling: bool = False,
                 fp8_on_train: bool = False):
        """`abstract_params`: the model's boxed abstract parameters (their logical axes name the
        shardings); `rules`: the roles' logical-axis rules (the config's `sharding` section); `offload_optimizer`
        (`runtime.offload_optimizer`): the optimizer state lives in pinned host memory;
        `gathered_sampling` (`runtime.colocated_sampling` resolved to 'gathered'): colocated full
        fine-tuning with FSDP train rules samples from one gathered copy per version (module
        docstring); elsewhere it changes nothing; `fp8_on_train`: a disaggregated train role's own
        rollouts sample in the rollout precision too (`on_train`)."""
        self.meshes, self.trainer, self.fp8_on_train = meshes, trainer, fp8_on_train
        self.offload_optimizer = offload_optimizer
        self.merge_for_sampling = merge_for_sampling
        self.lora_scale = trainer.cfg.lora_scale
        self.rules = {"train": tuple(rules.train_rules), "rollout": tuple(rules.rollout_rules)}
        self.sharding = {role: mesh_lib.param_shardings(abstract_params, getattr(meshes, role), self.rules[role])
                         for role in ("train", "rollout")}
        # Colocated, the rollout mesh is the shared one: the gathered copy lies by `sharding['rollout']`.
        self.gathered = (gathered_sampling and meshes.colocated and self.lora_scale is None
                         and mesh_lib.shards_weights(self.rules["train"]))
        self._gathered, self._gathered_version = None, -1  # the colocated copy of one version (`shared_sampling`)
        self._merge = jax.jit(functools.partial(lora.merge_lora, scale=self.lora_scale)) if self.lora_scale else None
        self._quantize = None
        if trainer.cfg.rollout_precision == "fp8":
            paths = quantized_params.quantized_kernel_paths(abstract_params)
            self._quantize = jax.jit(lambda params: quantized_params.quantize_params(params, paths))
            self._fp8_paths = paths
        # LoRA trained through the FP8 base: the trainer's frozen base is the quantised one
        self.fp8_base = trainer.cfg.lora_base_precision == "fp8"
        # per role, the shardings of that base (its structure: e4m3 kernels and their scales)
        self._fp8_base_sharding = {role: quantized_params.quantized_shardings(self.sharding[role], nn.unbox(abstract_params),
                                                                         self._fp8_paths)
                                   for role in ("train", "rollout")} if self.fp8_base else None
        self._fp8_sharding = None  # `_fp8_rollout_sharding`, made once
        self._frozen_fp8_on_train = None  # FP8 LoRA sampling on the train role: the frozen base quantised once
        self.frozen_on_rollout = None
        self.decoders: dict[str, Any] = {}
        self.rollout_params = None
        self.rollout_version = -1

    def model_mesh(self, group: str):
        """`mesh_lib.model_mesh` for the transformer programs of plan group `group`: its mesh, and
        the rules its weights lie by (the train rules on the train or shared mesh, the rollout
        rules for gathered colocated sampling)."""
        by_rollout_rules = group == "rollout" or (group == "shared" and self.gathered)
        return mesh_lib.model_mesh(self.meshes.for_group(group), self.rules["rollout" if by_rollout_rules else "train"])

    def state_sharding(self, state: TrainState) -> TrainState:
        """Shardings of a train state laid out like `state` on the train mesh; with
        `offload_optimizer` the optimizer state's in pinned host memory, sharded alike (the
        trainer's update streams it through the devices, `Trainer.pin_state_sharding`)."""
        train_mesh = self.meshes.train
        trainable_sh = mesh_lib.like_params(state.trainable, self.sharding["train"], train_mesh)
        opt_sh = mesh_lib.optimizer_state_shardings(self.trainer.optimizer, state.trainable, trainable_sh, train_mesh)
        if self.offload_optimizer:
            opt_sh = jax.tree.map(lambda s: s.with_memory_kind(mesh_lib.HOST_MEMORY), opt_sh)
        return TrainState(
            version=mesh_lib.replicated(train_mesh),
            trainable=trainable_sh,
            opt_state=opt_sh,
            ema=None if state.ema is None else trainable_sh,
            nonfinite_streak=mesh_lib.replicated(train_mesh),
            old=None if state.old is None else trainable_sh,
        )

    def own_frozen(self) -> Any:
        """This process's own copy of the frozen base, before `place_frozen_on_train` places it,
        when the run spans several processes and every one holds the whole base itself; else
        None (one process, no frozen base, or a base already placed). Every process calls it
        at the same point (`transfer.own_copy_everywhere`)."""
        frozen = self.trainer.frozen
        if jax.process_count() == 1 or frozen is None or not own_copy_everywhere(frozen):
            return None
        return frozen

    def place_frozen_on_train(self, own: Any = None) -> None:
        """The trainer's frozen base (if any) onto the train mesh; with `own` (`own_frozen`) each
        process places its own devices' part from its own copy."""
        put = jax.device_put if own is None else put_own_copy
        if self.fp8_base and quantized_params.is_quantized(self.trainer.frozen, self._fp8_paths):
            # already e4m3: placed for another executor of the same run (the bench's modes)
            self.trainer.place_frozen(self._fp8_base_sharding["train"], put=put)
            return
        self.trainer.place_frozen(self.sharding["train"], put=put)
        if self.fp8_base:  # the placed bf16 base goes as soon as its e4m3 form exists
            self.trainer.frozen = self._quantize(self.trainer.frozen)

    def place_frozen_on_rollout(self, own: Any = None) -> None:
        """Disaggregated with LoRA: the frozen base, once, onto the rollout role (syncs carry
        adapters only). From `own` (`own_frozen`) each process places its own devices' part and
        nothing crosses between processes; otherwise it moves from the train mesh."""
        if self.lora_scale is not None and not self.meshes.colocated:
            if own is None and self.fp8_base:  # already e4m3 on the train role: it moves as it is
                self.frozen_on_rollout = transfer(self.trainer.frozen, self._fp8_base_sharding["rollout"])
                return
            if own is None:
                self.frozen_on_rollout = transfer(self.trainer.frozen, self.sharding["rollout"])
            else:
                self.frozen_on_rollout = put_own_copy(own, self.sharding["rollout"])
            if self._quantize is not None:
                self.frozen_on_rollout = self._quantize(self.frozen_on_rollout)

    def place_decoders(self, decoder_params: Any) -> None:
        """The decoder's weights replicated on every group that decodes (none in pixel space).
        Several processes that each hold them whole place their own copies; nothing moves."""
        meshes = self.meshes
        groups = {"shared": meshes.train} if meshes.colocated else {"rollout": meshes.rollout, "train": meshes.train}
        if meshes.reward is not None:
            groups["reward"] = meshes.reward
        if decoder_params is not None:
            own = jax.process_count() > 1 and own_copy_everywhere(decoder_params)
            put = put_own_copy if own else transfer
            self.decoders = {g: put(decoder_params, mesh_lib.replicated(m)) for g, m in groups.items()}

    def for_sampling(self, trainable, frozen, fp8: bool = True):
        """Sampling weights from trainable (+ frozen base for LoRA, already quantised for FP8
        rollouts) where they live; `fp8=False`: in the training precision whatever the config."""
        quantize = self._quantize if fp8 else None
        if self.lora_scale is None:
            return trainable if quantize is None else quantize(trainable)
        if self.merge_for_sampling and quantize is None:  # FP8 keeps adapters factored
            return self._merge(frozen, trainable)
        return lora.LoraWeights(frozen, trainable, self.lora_scale)

    def to_rollout(self, trainable):
        """`trainable` (on the train role) moved to the rollout role: the tree that moved (only
        adapters with LoRA) and the sampling weights made from it there."""
        if self.lora_scale is None:
            moved = self._sampling_copy(trainable)
            return moved, moved
        moved = transfer(trainable, mesh_lib.replicated(self.meshes.rollout))
        return moved, self.for_sampling(moved, self.frozen_on_rollout)

    def _sampling_copy(self, trainable):
        """Full fine-tuning's sampling weights of `trainable` in one placement onto the rollout
        rules' layout (on the rollout role; colocated, on the shared mesh). FP8 rollouts quantise
        where the trainer holds the weights (sharded), so only the e4m3 tree moves and no bf16
        copy is held beside the FP8 one; per-channel maxima are exact, so the result equals
        quantising the placed copy."""
        if self._quantize is None:
            return transfer(trainable, self.sharding["rollout"])
        return transfer(self._quantize(trainable), self._fp8_rollout_sharding(trainable))

    def _fp8_rollout_sharding(self, trainable):
        """Rollout-rules shardings of the quantised tree of `trainable` (`quantized_params.quantized_shardings`)."""
        if self._fp8_sharding is None:
            self._fp8_sharding = quantized_params.quantized_shardings(self.sharding["rollout"], trainable, self._fp8_paths)
        return self._fp8_sharding

    def colocated_sampling(self, trainable):
        """Colocated sampling weights of `trainable`: a gathered copy (`gathered`), else `on_train`'s."""
        return self._sampling_copy(trainable) if self.gathered else self.on_train(trainable)

    def shared_sampling(self, trainable, version: int):
        """`colocated_sampling` for the colocated rollouts of `version`: a gathered copy is made
        once, at the version's first rollout, and held until `release_gathered`."""
        if not self.gathered:
            return self.on_train(trainable)
        if self._gathered_version != version:
            self._gathered = None  # the old version's copy goes before the new one is placed
            self._gathered = self._sampling_copy(trainable)
            self._gathered_version = version
        return self._gathered

    def release_gathered(self) -> None:
        """Drop the gathered copy (before training: it must not sit beside training's working set).
        Rollouts already dispatched keep its buffers until they finish."""
        self._gathered, self._gathered_version = None, -1

    def sync(self, trainable, version: int):
        """Carry `version` (the trainable tree rollouts sample with, `Trainer.rollout_weights`) to the
        rollout role (asynchronous); the tree that moved."""
        moved, self.rollout_params = self.to_rollout(trainable)
        self.rollout_version = version
        return moved

    def on_train(self, trainable):
        """Sampling weights of `trainable` on the train role.

        Colocated, that role is the rollout role too and samples in `model.rollout_precision`.
        Disaggregated, the train role's own rollouts (trainer-assisted generation) sample in it
        with `fp8_on_train`, else in the training precision: FP8 there holds a quantised copy of
        the base beside the one training reads (Qwen-Image-20B: 20 GB on top of 41 GB, which ran an
        80 GB card out of memory with training's activations; the memory plan decides,
        `memory_plan.tag_precision`). Each rollout records the log-probabilities of the numerics
        it ran, so the decoupled loss weighs both kinds correctly. Over an FP8 LoRA base
        (`fp8_base`) every role samples in FP8 from the one base training reads.
        """
        fp8 = self.meshes.colocated or self.fp8_on_train or self.fp8_base
        frozen = self.trainer.frozen
        if fp8 and self._quantize is not None and self.lora_scale is not None and not self.fp8_base:
            if self._frozen_fp8_on_train is None:
                self._frozen_fp8_on_train = self._quantize(frozen)
            frozen = self._frozen_fp8_on_train
        return self.for_sampling(trainable, frozen, fp8=fp8)

    def fresh_state(self, state: TrainState, sharding: TrainState) -> TrainState:
        """`state` copied onto `sharding` in bounded pieces (`transfer.put_in_pieces`): the update
        donates the state it is given, so the caller's copy survives (a resume, or other modes of
        one run). An unbuilt initial state (`Trainer.unbuilt_state`) has only its trainable weights
        copied; the rest is made on `sharding`."""
        if is_unbuilt(state):
            return self.trainer.build_state(put_in_pieces(state.trainable, sharding.trainable), sharding)
        return put_in_pieces(state, sharding)
