"""Splash attention (`attention_impl='splash'`, Pallas' TPU kernel run interpreted on the CPU)
against the XLA path: each family's attention calls at its tiny variant's heads and head_dim,
with masked text and odd lengths padded to blocks, forward and gradients in float32; the same
under a sequence-parallel (Ulysses) mesh and, through launch/check_splash.py, a data-parallel
one; and the block and kernel choice."""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from digen_jax.models import FAMILIES, attention, splash_attention

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMG, TXT = 30, 7  # image/video tokens and text tokens: odd joint lengths, padded to a 128 block
TEXT_LENGTHS = jnp.array([TXT, 3], jnp.int32)  # the second sample's text is right-padded


def _qkv(rng, family: str, length: int, batch: int = 2):
    cfg = FAMILIES[family].variants["tiny"]
    shape = (batch, length, cfg.num_attention_heads, cfg.attention_head_dim)
    return tuple(jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(3))


def _family_attention(family: str, impl: str):
    """(inputs, f): the attention calls `family`'s model makes, as one function of its q/k/v
    inputs returning every output (on 2 samples; text masked where the family masks it)."""
    rng = np.random.default_rng(0)

    def dot(q, k, v, lengths=None):
        return attention.dot_product_attention(q, k, v, kv_lengths=lengths, impl=impl)

    if family == "flux":  # joint [text, image], no mask
        return _qkv(rng, family, TXT + IMG), lambda q, k, v: (dot(q, k, v),)
    if family == "qwenimage":  # joint [image, text], the text padding masked through key lengths
        return _qkv(rng, family, IMG + TXT), lambda q, k, v: (dot(q, k, v, IMG + TEXT_LENGTHS),)
    if family == "wan":  # self-attention of the video tokens, cross-attention to unmasked text
        inputs = _qkv(rng, family, IMG) + _qkv(rng, family, TXT)[1:]

        def wan(q, k, v, tk, tv):
            return (attention.token_parallel_attention(q, k, v, impl=impl),
                    attention.token_parallel_attention(q, tk, tv, impl=impl, cross=True))

        return inputs, wan
    # HunyuanVideo: [video, text] with the text appended and masked; the token refiner's masked text self-attention
    inputs = _qkv(rng, family, IMG) + _qkv(rng, family, TXT)

    def hunyuan(q, k, v, tq, tk, tv):
        lengths = IMG + TEXT_LENGTHS
        joint = attention.token_parallel_attention(q, k, v, kv_lengths=lengths, appended=(tq, tk, tv), impl=impl)
        return (*joint, dot(tq, tk, tv, TEXT_LENGTHS))

    return inputs, hunyuan


def _value_and_grads(f, inputs, program: list | None = None):
    """f's outputs and the gradients of a non-linear scalar of them with respect to every input
    (the compiled program's text appended to `program`)."""
    def loss(*args):
        outs = f(*args)
        return sum(jnp.sum(jnp.sin(3 * o)) for o in outs), outs

    grad = jax.value_and_grad(loss, argnums=tuple(range(len(inputs))), has_aux=True)
    compiled = jax.jit(grad).lower(*inputs).compile()
    if program is not None:
        program.append(compiled.as_text())
    (_, outs), grads = compiled(*inputs)
    return outs, grads


def _relative(a, b) -> float:
    """Largest |a - b| over the trees relative to the largest |b|."""
    diff = max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    return diff / max(float(jnp.max(jnp.abs(y))) for y in jax.tree.leaves(b))


@pytest.mark.parametrize("family", ["flux", "qwenimage", "wan", "hunyuan_video"])
def test_splash_matches_xla_forward_and_gradients(family):
    inputs, splash_fn = _family_attention(family, "splash")
    _, xla_fn = _family_attention(family, "xla")
    outs, grads = _value_and_grads(splash_fn, inputs)
    ref_outs, ref_grads = _value_and_grads(xla_fn, inputs)
    assert [o.shape for o in outs] == [o.shape for o in ref_outs]
    assert _relative(outs, ref_outs) <= 1e-5
    assert _relative(grads, ref_grads) <= 1e-5
    if family == "qwenimage":  # the text mask matters: without it the output differs
        assert _relative(outs, (attention.dot_product_attention(*inputs, impl="xla"),)) > 1e-2


def test_splash_under_ulysses_matches_xla():
    """HunyuanVideo's joint attention as Ulysses over a (data 4, seq 2) mesh (the kernel runs
    inside the all-to-all shard_map): splash equals XLA, forward and gradients."""
    joint_inputs, _ = _family_attention("hunyuan_video", "xla")

    def ulysses(impl):
        return lambda q, k, v, tq, tk, tv: attention.token_parallel_attention(
            q, k, v, kv_lengths=IMG + TEXT_LENGTHS, appended=(tq, tk, tv), impl=impl)

    seq_mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "seq"))
    program = []
    with jax.set_mesh(seq_mesh):
        outs, grads = _value_and_grads(ulysses("splash"), joint_inputs, program)
        ref_outs, ref_grads = _value_and_grads(ulysses("xla"), joint_inputs)
    assert "all-to-all" in program[0]  # Ulysses ran
    assert _relative(outs, ref_outs) <= 1e-5 and _relative(grads, ref_grads) <= 1e-5


def test_check_script_passes_on_a_data_mesh():
    """launch/check_splash.py (the first command on a TPU) at tiny shapes on 2 CPU devices: masked
    joint attention with the batch split over a data mesh (the kernel runs per device in its own
    shard_map) equals XLA's to 1e-5, forward and gradients."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2", PYTHONPATH=ROOT)
    args = ["--tokens=30", "--text=7", "--heads=2", "--head_dim=16", "--dtype=float32", "--repeats=1",
            "--tolerance=1e-5"]
    out = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "check_splash.py"), *args],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "backend cpu, 2 x cpu; batch 4" in out.stdout and "matches XLA's within 1e-05" in out.stdout


def test_block_sizes_and_kernel_choice(monkeypatch):
    assert splash_attention.block_size(37) == 128
    assert splash_attention.block_size(1000) == 512  # 24 tokens of padding (at most 1000 / 8)
    assert splash_attention.block_size(1792) == 256  # 512 would pad 256 tokens, 256 none
    assert splash_attention.block_size(4096 + 512) == 512
    assert splash_attention.block_size(640) == 128  # 512 or 256 would pad 384 / 128 tokens (> 80)
    assert attention.resolve_attention_impl("splash", jnp.float32, 12) == "splash"  # interpreted off a TPU
    assert attention.resolve_attention_impl("auto", jnp.float32, 12) == "xla"
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert attention.resolve_attention_impl("auto", jnp.bfloat16, 128) == "splash"
