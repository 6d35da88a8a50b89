"""Shared layers vs their diffusers / PyTorch counterparts, and the attention backends."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers.models.embeddings import apply_rotary_emb, get_timestep_embedding
from diffusers.models.transformers.transformer_flux import FluxPosEmbed

from digen_jax.models import attention, layers, rope


def test_rope_tables_and_rotation_match_diffusers():
    rng = np.random.default_rng(0)
    ids = np.concatenate([np.zeros((5, 3)), np.stack([np.zeros(12), *np.divmod(np.arange(12), 4)], -1)]).astype(np.float32)
    axes = (4, 6, 6)
    ref_cos, ref_sin = FluxPosEmbed(theta=10000, axes_dim=list(axes))(torch.from_numpy(ids))
    cos, sin = rope.rope_tables(jnp.asarray(ids), axes, 10000.0)
    np.testing.assert_allclose(cos, ref_cos.numpy(), atol=1e-6)
    np.testing.assert_allclose(sin, ref_sin.numpy(), atol=1e-6)

    x = rng.standard_normal((2, 17, 3, 16)).astype(np.float32)
    ref = apply_rotary_emb(torch.from_numpy(x), (ref_cos, ref_sin), sequence_dim=1).numpy()
    np.testing.assert_allclose(rope.apply_rope(jnp.asarray(x), cos, sin), ref, atol=1e-6)


def test_odd_rope_axis_rejected():
    with pytest.raises(ValueError, match="even"):
        rope.rope_tables(jnp.zeros((3, 2)), (4, 5), 10000.0)


@pytest.mark.parametrize("flip,shift,dim", [(True, 0, 256), (False, 1, 64), (True, 1, 33)])
def test_timestep_sinusoid_matches_diffusers(flip, shift, dim):
    t = torch.tensor([0.0, 1.0, 37.5, 999.0, 1000.0])
    ref = get_timestep_embedding(t, dim, flip_sin_to_cos=flip, downscale_freq_shift=shift).numpy()
    out = layers.timestep_sinusoid(jnp.asarray(t.numpy()), dim, flip_sin_to_cos=flip, downscale_freq_shift=shift)
    assert out.shape == ref.shape
    # Arguments up to 1000 rad: a float32 cos is good to ~1 ulp of the argument.
    np.testing.assert_allclose(out, ref, atol=1e-4)


def test_norms_match_torch():
    x = np.random.default_rng(1).standard_normal((2, 5, 16)).astype(np.float32) * 3 + 1
    rms = torch.nn.RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        rms.weight.normal_()
    params = {"params": {"scale": jnp.asarray(rms.weight.detach().numpy())}}
    np.testing.assert_allclose(layers.RMSNorm().apply(params, jnp.asarray(x)), rms(torch.from_numpy(x)).detach().numpy(), atol=1e-5)
    ref_ln = torch.nn.functional.layer_norm(torch.from_numpy(x), (16,), eps=1e-6).numpy()
    np.testing.assert_allclose(layers.layer_norm(jnp.asarray(x)), ref_ln, atol=1e-5)


def _reference_attention(q, k, v, kv_lengths):
    logits = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    mask = np.arange(k.shape[1])[None, :] < kv_lengths[:, None]
    logits = np.where(mask[:, None, None, :], logits, -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return np.einsum("bnts,bsnh->btnh", w, v)


@pytest.mark.parametrize("seq_multiple", [None, 8])
def test_attention_padding_masks_through_lengths(seq_multiple):
    """kv_lengths masks right padding; padding to a multiple (the cuDNN path) changes nothing."""
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((2, n, 3, 8)).astype(np.float32) for n in (13, 11, 11))
    lengths = np.array([11, 6], np.int32)
    out = attention.dot_product_attention(*map(jnp.asarray, (q, k, v)), kv_lengths=jnp.asarray(lengths), impl="xla", seq_multiple=seq_multiple)
    assert out.shape == q.shape
    np.testing.assert_allclose(out, _reference_attention(q, k, v, lengths), atol=1e-5)


def test_padded_attention_gradients_match_unpadded():
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 7, 2, 8)), jnp.float32) for _ in range(3))

    def loss(q, k, v, multiple):
        return jnp.sum(jnp.sin(attention.dot_product_attention(q, k, v, impl="xla", seq_multiple=multiple)))

    g_plain = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, 1)
    g_padded = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, 16)
    for a, b in zip(g_padded, g_plain):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_attention_backend_selection():
    assert attention.resolve_attention_impl("auto", jnp.bfloat16, 128) == ("cudnn" if jax.default_backend() == "gpu" else "xla")
    assert attention.resolve_attention_impl("auto", jnp.float32, 128) == "xla"
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="needs a GPU"):
            attention.resolve_attention_impl("cudnn", jnp.bfloat16, 128)
    with pytest.raises(ValueError, match="attention_impl must be one of"):
        attention.resolve_attention_impl("flash", jnp.bfloat16, 128)


@pytest.mark.gpu
def test_cudnn_attention_matches_xla_with_odd_lengths_forward_and_backward():
    """On GPU: cuDNN with odd T/S (padded inside) agrees with XLA, backward included.

    CPU counterpart: test_attention_padding_masks_through_lengths and
    test_padded_attention_gradients_match_unpadded exercise the same padding path with XLA.
    """
    rng = np.random.default_rng(4)
    q = jnp.asarray(rng.standard_normal((2, 333, 4, 64)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((2, 77, 4, 64)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((2, 77, 4, 64)), jnp.bfloat16)
    lengths = jnp.array([77, 40], jnp.int32)

    def loss(q, k, v, impl):
        out = attention.dot_product_attention(q, k, v, kv_lengths=lengths, impl=impl)
        return jnp.sum(out.astype(jnp.float32) ** 2), out

    (l_c, out_c), g_c = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v, "cudnn")
    (l_x, out_x), g_x = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v, "xla")
    np.testing.assert_allclose(np.asarray(out_c, np.float32), np.asarray(out_x, np.float32), atol=2e-2)
    for a, b in zip(g_c, g_x):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=5e-2, rtol=5e-2)
