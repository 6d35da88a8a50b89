"""Attention of the diffusion transformers: the kernel choice and sequence-parallel attention.

`dot_product_attention` runs one of three kernels (`model.attention_impl`, resolved by
`resolve_attention_impl`): cuDNN's fused attention, XLA's, or splash (`splash_attention.py`,
Pallas' TPU kernel). Softmax runs in float32 whatever the compute dtype.

Under sequence parallelism (a mesh whose `SEQ_AXIS` has size P > 1; `partitioning.py`), the
video tokens' attention runs as Ulysses (`token_parallel_attention`): q/k/v move from token
shards to head shards by one all-to-all, the local attention sees the whole sequence for its
N/P heads, and one all-to-all moves the output back.
"""
from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from jax.sharding import PartitionSpec

from digen_jax.models import partitioning, splash_attention
from digen_jax.models.partitioning import DATA_AXIS, SEQ_AXIS

AttentionImpl = Literal["auto", "cudnn", "xla", "splash"]

# cuDNN's fused attention backward rejects odd sequence lengths; padding to a
# multiple of 128 also keeps its tiles full. Padding is masked through lengths.
CUDNN_SEQ_MULTIPLE = 128


def resolve_attention_impl(impl: AttentionImpl, dtype: jnp.dtype, head_dim: int) -> str:
    """Pick the attention kernel: `auto` takes splash on a TPU, cuDNN where it applies, else XLA.

    cuDNN's fused kernel needs a GPU, fp16/bf16 inputs and head_dim % 8 == 0 up to 256 (Hopper);
    asking for it where it cannot run is an error. Splash runs interpreted off a TPU (tests)."""
    cudnn_ok = (
        jax.default_backend() == "gpu"
        and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        and head_dim % 8 == 0
        and head_dim <= 256
    )
    if impl == "auto":
        return "splash" if jax.default_backend() == "tpu" else "cudnn" if cudnn_ok else "xla"
    if impl == "cudnn" and not cudnn_ok:
        raise ValueError(
            f"attention_impl='cudnn' needs a GPU, bf16/fp16 and head_dim % 8 == 0 <= 256; "
            f"got backend={jax.default_backend()}, dtype={jnp.dtype(dtype).name}, head_dim={head_dim}"
        )
    if impl not in ("cudnn", "xla", "splash"):
        raise ValueError(f"attention_impl must be one of 'auto', 'cudnn', 'xla', 'splash', got {impl!r}")
    return impl


def _pad_axis(x: jax.Array, axis: int, multiple: int) -> jax.Array:
    pad = -x.shape[axis] % multiple
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def dot_product_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    kv_lengths: jax.Array | None = None,
    impl: AttentionImpl = "auto",
    seq_multiple: int | None = None,
) -> jax.Array:
    """Scaled dot-product attention on (B, T, N, H) queries and (B, S, N, H) keys/values.

    `kv_lengths` (B,) masks key positions >= length (right padding). Sequences are zero-padded
    to a multiple of `seq_multiple` (default: `CUDNN_SEQ_MULTIPLE` for cuDNN, 1 for XLA; splash
    picks its blocks) and the padding masked through sequence lengths, so odd lengths never
    reach cuDNN's backward pass; the output keeps the original T."""
    backend = resolve_attention_impl(impl, q.dtype, q.shape[-1])
    if backend == "splash":  # pads to its own blocks
        return splash_attention.attention(q, k, v, kv_lengths, data_axis=DATA_AXIS)
    multiple = seq_multiple or (CUDNN_SEQ_MULTIPLE if backend == "cudnn" else 1)
    batch, t_len, s_len = q.shape[0], q.shape[1], k.shape[1]
    if multiple == 1 or (t_len % multiple == 0 and s_len % multiple == 0):
        q_lengths = None
    else:
        q_lengths = jnp.full((batch,), t_len, jnp.int32)
        if kv_lengths is None:
            kv_lengths = jnp.full((batch,), s_len, jnp.int32)
        q, k, v = (_pad_axis(a, 1, multiple) for a in (q, k, v))
    out = jax.nn.dot_product_attention(
        q,
        k,
        v,
        query_seq_lengths=q_lengths,
        key_value_seq_lengths=None if kv_lengths is None else kv_lengths.astype(jnp.int32),
        implementation=backend,
    )
    return out[:, :t_len]


def check_seq_parallel(num_heads: int, num_tokens: int, size: int) -> None:
    """Whether Ulysses attention can split `num_tokens` tokens and `num_heads` heads over `size`
    devices (ValueError naming what does not divide). No ring-attention fallback is built, so
    the heads must divide too."""
    if num_heads % size:
        raise ValueError(
            f"sequence parallelism over {size} devices needs the attention heads ({num_heads}) divisible by {size} "
            "(Ulysses attention splits the heads; there is no ring-attention fallback)"
        )
    if num_tokens % size:
        raise ValueError(
            f"sequence parallelism over {size} devices needs the video token count ({num_tokens}) divisible by {size}"
        )


def token_parallel_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    impl: AttentionImpl = "auto",
    kv_lengths: jax.Array | None = None,
    appended: tuple[jax.Array, jax.Array, jax.Array] | None = None,
    cross: bool = False,
):
    """Attention of the video tokens, split over `SEQ_AXIS` under sequence parallelism.

    q (B, S, N, H) are the video tokens' queries. Self-attention (`cross=False`): k, v (B, S, N, H)
    of the same tokens, and `appended` optionally the (q, k, v) of L tokens that every device
    holds whole (HunyuanVideo's text), which attend jointly after the video tokens ([video,
    text] order, `kv_lengths` (B,) masking keys as in `dot_product_attention`); returns the
    video tokens' output (B, S, N, H), and with `appended` also the appended tokens' (B, L, N, H).
    Cross-attention (`cross=True`): k, v (B, L, N, H) of tokens every device holds whole; the
    queries' token split needs no communication.

    With sequence parallelism (P > 1, `seq_parallel_size`), Ulysses inside `shard_map`: the video
    q/k/v arrive split on tokens, an all-to-all regroups them as N/P heads of the whole sequence,
    each device takes its N/P heads of the appended tokens, `dot_product_attention` runs locally
    (its kernel choice kept), and an all-to-all returns the video output to token shards; the
    appended tokens' output leaves split on heads. The heads must divide by P (no ring attention)."""
    size = partitioning.seq_parallel_size()
    batch, tokens, heads, _ = q.shape
    if size == 1:
        if appended is None:
            return dot_product_attention(q, k, v, kv_lengths=kv_lengths, impl=impl)
        q, k, v = (jnp.concatenate(pair, axis=1) for pair in zip((q, k, v), appended))
        out = dot_product_attention(q, k, v, kv_lengths=kv_lengths, impl=impl)
        return out[:, :tokens], out[:, tokens:]
    check_seq_parallel(heads, tokens, size)
    mesh = jax.sharding.get_abstract_mesh()
    data = DATA_AXIS if DATA_AXIS in mesh.axis_names and batch % mesh.shape[DATA_AXIS] == 0 else None
    split, whole = PartitionSpec(data, SEQ_AXIS), PartitionSpec(data)
    lengths = jnp.full((batch,), -1, jnp.int32) if kv_lengths is None else kv_lengths.astype(jnp.int32)
    local_heads = heads // size

    def to_heads(a):  # (b, S/P, N, H) -> (b, S, N/P, H)
        return jax.lax.all_to_all(a, SEQ_AXIS, split_axis=2, concat_axis=1, tiled=True)

    def to_tokens(a):  # (b, S, N/P, H) -> (b, S/P, N, H)
        return jax.lax.all_to_all(a, SEQ_AXIS, split_axis=1, concat_axis=2, tiled=True)

    def my_heads(a):  # (b, L, N, H) held whole -> this device's N/P heads
        start = jax.lax.axis_index(SEQ_AXIS) * local_heads
        return jax.lax.dynamic_slice_in_dim(a, start, local_heads, axis=2)

    def attend(q, k, v, lengths, *rest):
        lengths = None if kv_lengths is None else lengths
        if cross:
            return dot_product_attention(q, k, v, kv_lengths=lengths, impl=impl)
        q, k, v = to_heads(q), to_heads(k), to_heads(v)
        if not rest:
            return to_tokens(dot_product_attention(q, k, v, kv_lengths=lengths, impl=impl))
        q, k, v = (jnp.concatenate([a, my_heads(b)], axis=1) for a, b in zip((q, k, v), rest))
        out = dot_product_attention(q, k, v, kv_lengths=lengths, impl=impl)
        return to_tokens(out[:, :tokens]), out[:, tokens:]

    kv_spec = whole if cross else split
    in_specs = (split, kv_spec, kv_spec, whole) + ((whole,) * 3 if appended is not None else ())
    # The appended tokens' output leaves split on heads; the compiler gathers it where it is used.
    out_specs = (split, PartitionSpec(data, None, SEQ_AXIS)) if appended is not None else split
    checked = resolve_attention_impl(impl, q.dtype, q.shape[-1]) != "splash"  # Pallas outputs carry no vma types
    run = jax.shard_map(attend, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=checked)
    return run(q, k, v, lengths, *(appended or ()))
