"""Sequence parallelism (`runtime.seq_parallel`) on 8 fake CPU devices: the video transformers
split over a `seq` mesh axis give the velocities and gradients of the unsplit model, the
runtime's rollouts and updates match `seq_parallel=1` in every schedule mode, and bad values
are config errors naming the key."""
import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from digen_jax.app import loop
from digen_jax.app.errors import ConfigError
from digen_jax.app.settings import run_settings
from digen_jax.app.validation import validate_config
from digen_jax.models import FAMILIES, partitioning
from digen_jax.runtime import mesh as mesh_lib
from digen_jax.runtime import plan as plan_lib
from digen_jax.runtime.executor import Executor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_configs import get_config as zoo_config  # noqa: E402

VIDEO_FAMILIES = ("hunyuan_video", "wan")
# The tiny variants with four heads of the same width, so that 4 devices can split them.
FOUR_HEADS = {
    "wan": dict(num_attention_heads=4, attention_head_dim=6),
    "hunyuan_video": dict(num_attention_heads=4, attention_head_dim=8, rope_axes_dim=(2, 2, 4)),
}


def four_head_tiny(family: str):
    return dataclasses.replace(FAMILIES[family].variants["tiny"], **FOUR_HEADS[family])


def tiny_config(family: str):
    return zoo_config(family, "tiny")


def seq_mesh(size: int) -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(-1, size), ("data", "seq"))


def _max_diff(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _relative_diff(a, b) -> float:
    """The largest difference of two trees relative to the largest magnitude of `b` (at least 1)."""
    return _max_diff(a, b) / max(1.0, max(float(np.max(np.abs(np.asarray(y)))) for y in jax.tree.leaves(b)))


# ---------------------------------------------------------------- the model, split over a mesh
def _model_inputs(family: str, cfg):
    """Batch 2, 2 x 4 x 4 patches (32 video tokens), text of 6 tokens (right-padded for HunyuanVideo)."""
    inputs = FAMILIES[family].example_inputs(cfg, batch=2, frames=2, height=4, width=4, text_seq_len=6)
    keys = iter(jax.random.split(jax.random.PRNGKey(0), 8))
    out = {}
    for name, spec in inputs.items():
        if spec is None:
            out[name] = None
        elif name == "encoder_attention_mask":
            out[name] = (jnp.arange(spec.shape[1])[None] < jnp.array([[6], [3]])).astype(spec.dtype)
        elif name in ("timestep", "guidance"):
            out[name] = jnp.array([300.0, 800.0])
        else:
            out[name] = jax.random.normal(next(keys), spec.shape, spec.dtype)
    return out


@pytest.mark.parametrize("family", VIDEO_FAMILIES)
def test_split_forward_and_gradient_match_the_unsplit_model(family):
    """Velocities and weight gradients with the tokens split over 2 and 4 devices equal the
    unsplit model's (fp32), on meshes where the batch splits over `data` and where it cannot."""
    cfg = four_head_tiny(family)
    module = FAMILIES[family].module_cls(cfg)
    inputs = _model_inputs(family, cfg)
    params = module.init(jax.random.PRNGKey(1), **inputs)["params"]

    def loss(params):
        out = module.apply({"params": params}, **inputs)
        return jnp.sum(jnp.sin(out)), out

    grad = jax.jit(jax.value_and_grad(loss, has_aux=True))
    forward = jax.jit(lambda params: loss(params)[1])
    (_, ref_out), ref_grads = grad(params)
    assert float(jnp.std(ref_out)) > 0.1 and _max_diff(ref_grads, jax.tree.map(jnp.zeros_like, ref_grads)) > 1e-3
    with jax.set_mesh(seq_mesh(2)):  # (4, 2): the batch of 2 stays whole over `data`
        compiled = forward.lower(params).compile()
        out = compiled(params)
    assert "all-to-all" in compiled.as_text()  # Ulysses ran, not an unsplit program
    assert _max_diff(out, ref_out) < 1e-5
    with jax.set_mesh(seq_mesh(4)):  # (2, 4): the batch splits over `data` too
        (_, out), grads = grad(params)
    assert _max_diff(out, ref_out) < 1e-5
    assert _relative_diff(grads, ref_grads) < 1e-5


# ---------------------------------------------------------------- the runtime in every mode
# (family, mode, seq_parallel sizes compared with the colocated unsplit run). Wan runs every mode
# at 2 and 4 devices per sequence group; HunyuanVideo (whose split model the test above checks at
# both sizes) the colocated mode at 4. The disaggregated modes of one size share their role meshes
# and so their compiled programs; each size and family compiles its own: this is the suite's cost.
CASES = [("wan", mode, (2, 4)) for mode in plan_lib.MODES]
CASES += [("hunyuan_video", "colocated", (4,))]


def runtime_config(family: str, mode: str, seq_parallel: int, lora: bool = True):
    """The tiny config in `mode`: two micro-batches (one trainer rollout in tag modes, one
    prefetched in tcss), roles of 4 + 4 devices, the tokens split over `seq_parallel`; gradient
    chunks of 2 units in every mode (one trained step of a micro-batch's 2 samples without TSP),
    so the modes share their training programs."""
    c = tiny_config(family)
    c.runtime.mode = mode
    c.runtime.micro_batches = 2
    c.rl.grad_chunk_size = 2
    if mode != "colocated":
        c.runtime.rollout_devices = c.runtime.train_devices = 4
    c.runtime.tag_microbatches = 1 if "tag" in mode else 0
    c.runtime.prefetch_microbatches = 1 if "tcss" in mode else 0
    c.runtime.seq_parallel = seq_parallel
    c.runtime.trace = False
    if not lora:
        c.rl.lora_rank = 0
    return c


def first_iteration(run, config) -> dict:
    """The rollout log-probs and the weights after iteration 0 of `config`'s mode, from `run`."""
    executor = Executor(run, settings=run_settings(config), trace_path=os.devnull, log=lambda _: None)
    try:
        executor.iteration(0)
        executor.drain()
        log_probs = [np.asarray(jax.device_get(mb.traj.log_probs)) for mb in executor._last]
        return {"log_probs": log_probs, "trainable": jax.device_get(executor.state.trainable)}
    finally:
        executor.close()


@pytest.fixture(scope="module")
def iteration(compile_cache, tmp_path_factory):
    """`iteration(family, mode, size, lora)`: `first_iteration` of the four-head tiny variant, from
    one Run per (family, lora) (every mode and size starts from its weights and shares its
    jitted steps), computed once."""
    runs, results, traced = {}, {}, set()
    size_of = partitioning.seq_parallel_size

    def result(family, mode, size, lora=True):
        with pytest.MonkeyPatch.context() as patch:
            patch.setitem(FAMILIES[family].variants, "tiny", four_head_tiny(family))
            patch.setattr(partitioning, "seq_parallel_size", lambda: traced.add(size_of()) or size_of())
            if (family, lora) not in runs:
                config = runtime_config(family, "colocated", 1, lora)
                runs[family, lora] = loop.Run(config, str(tmp_path_factory.mktemp(family)), log=lambda _: None)
            if (family, mode, size, lora) not in results:
                config = runtime_config(family, mode, size, lora)
                validate_config(config)
                results[family, mode, size, lora] = first_iteration(runs[family, lora], config)
        return results[family, mode, size, lora]

    result.initial = lambda family, lora=True: jax.device_get(runs[family, lora].state.trainable)
    result.traced = traced  # the sequence-group sizes the models were traced with
    return result


def _assert_same_as_unsplit(iteration, family, mode, sizes, lora=True):
    base = iteration(family, "colocated", 1, lora)
    moved = _max_diff(base["trainable"], iteration.initial(family, lora))
    assert moved > 1e-5  # the update did something
    for size in sizes:
        split = iteration(family, mode, size, lora)
        assert size in iteration.traced  # the executor ran the model under its role's (data, seq) mesh
        assert _max_diff(split["log_probs"], base["log_probs"]) < 1e-5, size
        assert _max_diff(split["trainable"], base["trainable"]) < 1e-5 * max(moved, 1.0), size


@pytest.mark.parametrize("family, mode, sizes", CASES)
def test_lora_rollouts_and_updates_match_the_unsplit_run(iteration, family, mode, sizes):
    """Rollout log-probs and the first LoRA update with each sample's tokens split over 2 or 4
    devices of its role equal those of the unsplit colocated run (every mode makes that run's
    first update: the same samples, advantages and weights)."""
    _assert_same_as_unsplit(iteration, family, mode, sizes)


def test_full_fine_tuning_matches_the_unsplit_run(iteration):
    """Full fine-tuning (the whole trainable tree synced to the rollout role) split over 2 devices."""
    _assert_same_as_unsplit(iteration, "wan", "gap+tsp", (2,), lora=False)


# ---------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "family, overrides, match",
    [
        ("wan", dict(seq_parallel=0), "runtime.seq_parallel"),
        ("wan", dict(seq_parallel=2, train_devices=3), r"runtime.seq_parallel=2 must divide the 3 devices of the train"),
        ("wan", dict(seq_parallel=2, mode="gap", rollout_devices=3, train_devices=5),
         r"runtime.seq_parallel=2 must divide the 3 devices of the rollout role"),
        ("wan", dict(seq_parallel=4), r"runtime.seq_parallel=4: .*attention heads \(2\).*no ring-attention fallback"),
        ("hunyuan_video", dict(seq_parallel=8), r"runtime.seq_parallel=8: .*attention heads \(2\)"),
    ],
)
def test_bad_seq_parallel_names_the_key(family, overrides, match):
    c = tiny_config(family)
    c.runtime.update(overrides)
    with pytest.raises(ConfigError, match=match):
        validate_config(c)


def test_tokens_not_divisible_and_image_families_are_config_errors():
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(FAMILIES["wan"].variants, "tiny", four_head_tiny("wan"))
        c = tiny_config("wan")
        c.sampling.height = c.sampling.width = 48  # 2 x 3 x 3 = 18 video tokens
        c.runtime.seq_parallel = 4
        with pytest.raises(ConfigError, match=r"runtime.seq_parallel=4: .*token count \(18\)"):
            validate_config(c)
    c = zoo_config("flux", "tiny")
    c.runtime.seq_parallel = 2
    with pytest.raises(ConfigError, match="runtime.seq_parallel=2: sequence parallelism is built for the video"):
        validate_config(c)


def test_role_meshes_split_devices_into_sequence_groups():
    from configs import schema

    assert (mesh_lib.AXIS, mesh_lib.SEQ_AXIS) == (partitioning.DATA_AXIS, partitioning.SEQ_AXIS)  # what the models read
    rt = schema.config().runtime
    rt.mode, rt.micro_batches = "gap", 2
    rt.rollout_devices, rt.train_devices, rt.seq_parallel = 4, 4, 2
    meshes = mesh_lib.build_role_meshes(rt)
    for mesh in (meshes.rollout, meshes.train):
        assert dict(mesh.shape) == {"data": 2, "seq": 2}
    assert not set(meshes.rollout.devices.flat) & set(meshes.train.devices.flat)
    # The batch splits over `data` only (replicated over `seq`); a batch `data` does not divide stays whole.
    assert mesh_lib.batch_sharding(meshes.train, (6, 3)).spec == jax.sharding.PartitionSpec("data")
    assert mesh_lib.batch_sharding(meshes.train, (3, 3)).spec == jax.sharding.PartitionSpec()
