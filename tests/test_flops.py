"""Exact FLOP counts: against the traced program's own matmuls, XLA's cost analysis and docs/models.md.

The analytic count (`model_flops.model_terms`) is built from the configs alone; the checks trace
the real modules (`jax.make_jaxpr` on abstract inputs, no FLOPs run) and sum every
dot_general, forward and differentiated, so a missed, misnamed or miscounted layer fails.
"""
import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import traverse_util

from configs.sections import ATTENTION_MLP_TARGETS
from digen_jax import model_flops
from digen_jax.models import FAMILIES
from digen_jax.rl import lora

BATCH, TEXT_LEN, RANK = 2, 6, 3
# Pixel shapes giving a non-square 4 x 2 token grid (2 latent frames for the videos).
SHAPES = {
    "flux": dict(height=64, width=32),
    "qwenimage": dict(height=64, width=32),
    "sd3": dict(height=64, width=32),
    "wan": dict(height=64, width=32, frames=5),
    "hunyuan_video": dict(height=64, width=32, frames=5),
}


def abstract_model(family, cfg, shape, batch=BATCH, text_len=TEXT_LEN):
    """(module, abstract params, abstract inputs) of `family` at a pixel `shape`."""
    fam = FAMILIES[family]
    frames, rows, cols = model_flops.latent_grid(family, cfg, **shape)
    if family in ("flux", "qwenimage", "sd3"):
        inputs = fam.example_inputs(cfg, batch, rows * cols, text_len)
    else:
        inputs = fam.example_inputs(cfg, batch, frames=frames, height=rows, width=cols, text_seq_len=text_len)
    module = fam.module_cls(cfg)
    params = jax.eval_shape(lambda x: nn.unbox(module.init(jax.random.key(0), **x))["params"], inputs)
    return module, params, inputs


@pytest.mark.parametrize("family", sorted(SHAPES))
def test_counts_equal_the_traced_matmuls(family):
    cfg = FAMILIES[family].variants["tiny"]
    module, params, inputs = abstract_model(family, cfg, SHAPES[family])
    terms = model_flops.model_terms(family, cfg, batch=BATCH, text_len=TEXT_LEN, **SHAPES[family])

    # Every kernel of the model is one term, with its (layers, in, out) shape.
    kernels = {p[: -len("/kernel")]: v.shape for p, v in traverse_util.flatten_dict(params, sep="/").items()
               if p.endswith("/kernel")}
    by_path = {m.path: m for m in terms.matmuls}
    assert sorted(by_path) == sorted(kernels)
    for path, shape in kernels.items():
        m = by_path[path]
        lead = 1 if m.stack not in (None, "out") else 0  # scanned stacks carry a layers axis
        assert shape[:lead] == (m.layers,) * lead
        assert (math.prod(shape[lead:-1]), shape[-1]) == (m.fan_in, m.fan_out), path

    forward = lambda p, x: module.apply({"params": p}, **x)  # noqa: E731
    assert model_flops.jaxpr_matmul_flops(forward, params, inputs) == terms.forward().total

    targets = ATTENTION_MLP_TARGETS[family]
    adapters = jax.eval_shape(lambda p: lora.init_lora(p, rank=RANK, target_patterns=targets, key=jax.random.key(0)), params)
    lora_loss = lambda a, p, x: jnp.sum(module.apply(lora.factored_variables(p, a, scale=0.5), **x))  # noqa: E731
    assert model_flops.jaxpr_matmul_flops(lora_loss, adapters, params, inputs) == terms.lora_forward(RANK, targets).total
    assert model_flops.jaxpr_matmul_flops(jax.grad(lora_loss), adapters, params, inputs) == terms.lora_fwd_bwd(RANK, targets).total

    full_loss = lambda p, x: jnp.sum(forward(p, x))  # noqa: E731
    full = terms.full_fwd_bwd()
    assert model_flops.jaxpr_matmul_flops(jax.grad(full_loss), params, inputs) == full.total
    forward_total = terms.forward().total
    assert full.attention == 3 * terms.forward().attention and 2.5 * forward_total < full.total < 3 * forward_total


def test_xla_cost_analysis_agrees_on_the_forward():
    # One block per stack (XLA counts a scan body once) and a width where matmuls dominate:
    # XLA's count adds the elementwise work (norms, RoPE, softmax) on top of ours.
    cfg = dataclasses.replace(
        FAMILIES["flux"].variants["tiny"], num_layers=1, num_single_layers=1, num_attention_heads=8,
        attention_head_dim=64, axes_dims_rope=(16, 24, 24), joint_attention_dim=512,
    )
    shape = dict(height=128, width=64)
    module, params, inputs = abstract_model("flux", cfg, shape, text_len=8)
    cost = jax.jit(lambda p, x: module.apply({"params": p}, **x)).lower(params, inputs).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    ours = model_flops.model_terms("flux", cfg, batch=BATCH, text_len=8, **shape).forward().total
    assert ours <= cost["flops"] <= 1.02 * ours


# docs/models.md section 7: (family, variant, height, width, frames, text) -> exact, linear, attention TFLOP.
MODELS_MD = [
    ("flux", "dev", 512, 512, 1, 512, 21.5, 19.9, 1.7),
    ("flux", "dev", 1024, 1024, 1, 512, 74.4, 59.5, 14.9),
    ("qwenimage", "qwen-image", 512, 512, 1, 128, 16.7, 15.7, 1.0),
    ("qwenimage", "qwen-image", 1024, 1024, 1, 128, 70.6, 57.4, 13.2),
    ("wan", "t2v-14b", 480, 832, 33, 512, 505.2, 337.9, 167.4),
    ("wan", "t2v-14b", 480, 832, 81, 512, 1678, 785, 893),
    ("wan", "t2v-14b", 720, 1280, 81, 512, 6523, 1810, 4714),
    ("hunyuan_video", "t2v", 480, 848, 33, 256, 354.5, 198.1, 156.4),
    ("hunyuan_video", "t2v", 480, 848, 81, 256, 1292, 457.4, 834.6),
    ("hunyuan_video", "t2v", 720, 1280, 129, 256, 12069, 1618, 10450),
]


@pytest.mark.parametrize("family,variant,height,width,frames,text,total,linear,attention", MODELS_MD)
def test_full_size_forward_reproduces_models_md(family, variant, height, width, frames, text, total, linear, attention):
    cfg = FAMILIES[family].variants[variant]
    got = model_flops.model_terms(family, cfg, batch=1, height=height, width=width, frames=frames, text_len=text).forward()
    for value, want in ((got.total, total), (got.linear, linear), (got.attention, attention)):
        assert abs(value / 1e12 - want) <= 0.051 * (1 if want < 100 else 10), (value / 1e12, want)


@pytest.mark.parametrize("family,variant,shape,text_len", [
    ("flux", "dev", dict(height=512, width=512), 512),
    ("qwenimage", "qwen-image", dict(height=512, width=512), 128),
    ("sd3", "sd3.5-medium", dict(height=512, width=512), 77 + 128),  # Flow-GRPO's T5 length
    ("wan", "t2v-14b", dict(height=480, width=832, frames=33), 512),
    ("hunyuan_video", "t2v", dict(height=480, width=848, frames=33), 256),
])
def test_full_size_counts_equal_the_traced_program(family, variant, shape, text_len):
    """At full size (traced on abstract bf16 weights, nothing allocated): forward and rank-64
    LoRA forward+backward, the benchmark's two main measurements."""
    cfg = dataclasses.replace(FAMILIES[family].variants[variant], dtype="bfloat16", param_dtype="bfloat16")
    module, params, inputs = abstract_model(family, cfg, shape, batch=1, text_len=text_len)
    terms = model_flops.model_terms(family, cfg, batch=1, text_len=text_len, **shape)
    forward = lambda p, x: module.apply({"params": p}, **x)  # noqa: E731
    assert model_flops.jaxpr_matmul_flops(forward, params, inputs) == terms.forward().total
    targets = ATTENTION_MLP_TARGETS[family]
    adapters = jax.eval_shape(lambda p: lora.init_lora(p, rank=64, target_patterns=targets, key=jax.random.key(0)), params)
    lora_loss = lambda a, p, x: jnp.sum(module.apply(lora.factored_variables(p, a, scale=2.0), **x))  # noqa: E731
    assert model_flops.jaxpr_matmul_flops(jax.grad(lora_loss), adapters, params, inputs) == terms.lora_fwd_bwd(64, targets).total


def test_rl_sample_of_the_qwen_image_setting():
    """Issue #8's reference setting: 512x512, 10 steps, true CFG, 2 trained steps (SDE window 2):
    about 534 TFLOP per image when training counts 3x the forward."""
    cfg = FAMILIES["qwenimage"].variants["qwen-image"]
    common = dict(height=512, width=512, text_len=128, num_steps=10, trained_steps=2, cfg_forwards=2)
    full = model_flops.rl_sample_flops("qwenimage", cfg, **common)
    forward = model_flops.model_terms("qwenimage", cfg, batch=1, height=512, width=512, text_len=128).forward().total
    assert full["rollout"] == 20 * forward and full["train_full_convention"] == 12 * forward
    assert abs(full["rollout"] + full["train_full_convention"] - 534e12) < 0.005 * 534e12
    assert full["train"] < full["train_full_convention"]  # no input gradients for the embedders
    lora64 = model_flops.rl_sample_flops(
        "qwenimage", cfg, **common, lora_rank=64, lora_targets=ATTENTION_MLP_TARGETS["qwenimage"]
    )
    assert lora64["rollout"] == full["rollout"] and 0.6 * full["train"] < lora64["train"] < 0.8 * full["train"]


def test_bad_input_is_named():
    cfg = FAMILIES["wan"].variants["tiny"]
    with pytest.raises(ValueError, match="multiples of 16"):
        model_flops.model_terms("wan", cfg, batch=1, height=60, width=64, frames=5, text_len=4)
    with pytest.raises(ValueError, match="4k \\+ 1"):
        model_flops.model_terms("wan", cfg, batch=1, height=64, width=64, frames=4, text_len=4)
    with pytest.raises(ValueError, match="model family"):
        model_flops.model_terms("sdxl", cfg, batch=1, height=64, width=64, text_len=4)
    terms = model_flops.model_terms("wan", cfg, batch=1, height=64, width=64, frames=5, text_len=4)
    with pytest.raises(ValueError, match="matches no matmul"):
        terms.lora_fwd_bwd(4, ["attn3/"])
    with pytest.raises(ValueError, match="blocks and proj_out"):
        terms.lora_fwd_bwd(4, ["time_proj"])


# ------------------------------------------------------------------ one RL sample, against the trainers' programs
def _tiny_run(tmp_path, module, **rl):
    """A `loop.Run` of `configs/<module>.py:tiny` without remat (the traced program then has model
    FLOPs only), with `rl` overrides."""
    import importlib

    from digen_jax.app import loop

    config = importlib.import_module(f"configs.{module}").get_config("tiny")
    config.model.remat_policy = "none"
    config.rl.update(rl)
    return config, loop.Run(config, str(tmp_path))


@pytest.mark.parametrize("kl_beta", [1e-4, 0.0])
def test_nft_sample_counts_equal_the_trainer_programs(tmp_path, kl_beta):
    """DiffusionNFT (configs/qwenimage_nft.py:tiny): a rollout is one CFG-free forward per step with
    either ODE solver; a training unit is the LoRA forward+backward of the trained adapters, the
    old adapters' forward and, with rl.kl_beta > 0, the base model's forward, as the traced
    programs of `NftTrainer.rollout` and its loss gradient say."""
    from digen_jax.app.run_sizing import _trained_steps, sample_flops
    from digen_jax.rl.nft_trainer import NftConfig, NftTrainer
    from digen_jax.rl.rollout import FinalSamples

    config, run = _tiny_run(tmp_path, "qwenimage_nft", kl_beta=kl_beta)
    counted = sample_flops(config, run.workload.model_cfg)
    trainer, state = run.trainer, run.state
    _, cond = run.prompt_batch(0)
    batch, steps, k = cond.text.shape[0], config.sampling.num_steps, _trained_steps(config)
    keys = jax.random.split(jax.random.key(0), batch)

    merged = trainer.sampling_params(state.old)  # a plain tree: the rollout's matmuls are the model's own
    for solver in ("euler", "dpm2"):
        solver_trainer = NftTrainer(trainer.sampler, trainer.frozen, trainer.optimizer, trainer.cfg,
                                    NftConfig(solver, config.rl.nft_beta, config.rl.nft_decay))
        rollout = lambda p: solver_trainer.rollout(p, cond, keys, None, run.latent_shape, 0).final  # noqa: E731
        assert model_flops.jaxpr_matmul_flops(rollout, merged) == batch * counted["rollout"], solver

    samples = FinalSamples(final=jnp.zeros((batch, *run.latent_shape)), sample_keys=keys, version=jnp.int32(0))
    trained = jnp.tile(jnp.arange(k, dtype=jnp.int32), (batch, 1))
    units = trainer.build_units(samples, cond, jnp.zeros((batch,)), trained)
    grad = jax.value_and_grad(trainer._loss, has_aux=True)
    traced = model_flops.jaxpr_matmul_flops(grad, state.trainable, state.old, trainer.frozen, units)
    assert traced == batch * counted["train"]
    model_cfg = run.workload.model_cfg
    terms = model_flops.model_terms("qwenimage", model_cfg, batch=1, height=config.sampling.height,
                              width=config.sampling.width, text_len=config.data.text_len)
    targets = list(config.rl.lora_targets)
    rank = config.rl.lora_rank
    by_hand = terms.lora_fwd_bwd(rank, targets).total + terms.lora_forward(rank, targets).total
    by_hand += terms.forward().total if kl_beta > 0 else 0
    assert counted["train"] == k * by_hand and counted["rollout"] == steps * terms.forward().total


def test_grpo_unit_counts_the_reference_forward(tmp_path):
    """Flow-GRPO with rl.kl_beta > 0 (configs/qwenimage.py:tiny, true CFG): a training unit is the
    guided LoRA forward+backward plus the frozen base's guided forward, as the traced loss
    gradient says."""
    import numpy as np

    from digen_jax.app.run_sizing import _trained_steps, sample_flops
    from digen_jax.rl.rollout import Trajectory

    config, run = _tiny_run(tmp_path, "qwenimage", kl_beta=0.01)
    counted = sample_flops(config, run.workload.model_cfg)
    trainer, state = run.trainer, run.state
    _, cond = run.prompt_batch(0)
    batch, steps, k = cond.text.shape[0], config.sampling.num_steps, _trained_steps(config)
    latent = tuple(run.latent_shape)
    traj = Trajectory(
        latents=jnp.zeros((batch, steps + 1, *latent)), log_probs=jnp.zeros((batch, steps)),
        means=jnp.zeros((batch, steps, *latent)), noise_levels=jnp.ones((steps,)),
        sample_keys=jax.random.split(jax.random.key(0), batch), version=jnp.int32(0),
    )
    units = trainer.build_units(traj, cond, jnp.zeros((batch,)), jnp.tile(jnp.arange(k, dtype=jnp.int32), (batch, 1)))
    grad = jax.value_and_grad(trainer._loss, has_aux=True)
    traced = model_flops.jaxpr_matmul_flops(grad, state.trainable, trainer.frozen, units, np.bool_(False))
    assert traced == batch * counted["train"]
    terms = model_flops.model_terms("qwenimage", run.workload.model_cfg, batch=2, height=config.sampling.height,
                              width=config.sampling.width, text_len=config.data.text_len)
    without_reference = k * terms.lora_fwd_bwd(config.rl.lora_rank, list(config.rl.lora_targets)).total
    assert counted["train"] == without_reference + k * terms.forward().total
