"""Splash attention: JAX's Pallas TPU attention kernel behind `attention_impl='splash'`.

`attention` computes what `attention.py`'s `dot_product_attention` computes (softmax(q k^T / sqrt(d)) v
over (B, T, N, H) queries and (B, S, N, H) keys/values, keys at positions >= `kv_lengths`
masked) with `jax.experimental.pallas.ops.tpu.splash_attention`:

* The kernel does not scale the logits: q is multiplied by 1/sqrt(d) first.
* Sequences are zero-padded to a multiple of the block size (`block_size`, chosen from the
  length); the padded keys and the keys past `kv_lengths` are masked as a second segment
  (segment ids: queries all 0, keys 0 where valid and 1 where not). Every query row thus
  keeps at least one key (a length of 0 is not supported); padded query rows are dropped.
* The kernel works on one sample (heads, length, head_dim); the batch is `jax.vmap`ped.
* Off a TPU the kernel runs in Pallas' interpret mode (the same program, executed by XLA on
  the backend at hand: slow, for tests). Forward and backward are the kernel's own
  (`custom_vjp` with its dq and dkv kernels).

A Pallas kernel is one device's program: traced under a mesh whose axes are not already manual
(`jax.set_mesh`: the runtime's FSDP and sequence-parallel programs), `attention` runs it inside
`shard_map` with the batch split over the data axis (when it divides) and everything else whole
on each device; inside a `shard_map` (Ulysses attention) it runs as it is.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.sharding import PartitionSpec

# Block sizes tried, largest first. A TPU tile is 128 lanes wide: the key blocks (and the key
# segment-id tiles) must be multiples of 128.
BLOCK_SIZES = (512, 256, 128)


def block_size(length: int) -> int:
    """The block (queries and keys alike) for a sequence of `length` tokens: the largest of
    `BLOCK_SIZES` whose padding adds at most 1/8 of the length, else the smallest."""
    for block in BLOCK_SIZES:
        if -length % block <= length / 8:
            return block
    return BLOCK_SIZES[-1]


def _kernel(heads: int, q_len: int, kv_len: int, block_q: int, block_kv: int, interpret: bool):
    """The splash kernel of one sample: `heads` heads, every query sees every key (the padding
    is masked by segment ids), the same blocks forward and backward."""
    mask = splash.MultiHeadMask([splash.FullMask((q_len, kv_len))] * heads)
    sizes = splash.BlockSizes(
        block_q=block_q, block_kv=block_kv, block_kv_compute=block_kv,
        block_q_dkv=block_q, block_kv_dkv=block_kv, block_kv_dkv_compute=block_kv,
        block_q_dq=block_q, block_kv_dq=block_kv,
    )
    return splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)


def _pad_tokens(x: jax.Array, length: int) -> jax.Array:
    """(B, T, N, H) -> (B, N, length, H), zero-padded along the tokens."""
    x = jnp.swapaxes(x, 1, 2)
    return jnp.pad(x, ((0, 0), (0, 0), (0, length - x.shape[2]), (0, 0)))


def local_attention(q: jax.Array, k: jax.Array, v: jax.Array, kv_lengths: jax.Array | None = None) -> jax.Array:
    """Splash attention on the arrays as they are (one device's program); see the module doc."""
    batch, q_len, heads, head_dim = q.shape
    kv_len = k.shape[1]
    block_q, block_kv = block_size(q_len), block_size(kv_len)
    q_pad, kv_pad = q_len + -q_len % block_q, kv_len + -kv_len % block_kv
    kernel = _kernel(heads, q_pad, kv_pad, block_q, block_kv, interpret=jax.default_backend() != "tpu")
    scaled = (q.astype(jnp.float32) * (1.0 / math.sqrt(head_dim))).astype(q.dtype)
    q, k, v = _pad_tokens(scaled, q_pad), _pad_tokens(k, kv_pad), _pad_tokens(v, kv_pad)
    if kv_lengths is None and kv_pad == kv_len:
        out = jax.vmap(kernel)(q, k, v)
    else:
        lengths = jnp.full((batch,), kv_len, jnp.int32) if kv_lengths is None else kv_lengths.astype(jnp.int32)
        kv_ids = (jnp.arange(kv_pad, dtype=jnp.int32)[None, :] >= lengths[:, None]).astype(jnp.int32)
        q_ids = jnp.zeros((batch, q_pad), jnp.int32)
        run = lambda q, k, v, qi, ki: kernel(q, k, v, segment_ids=splash.SegmentIds(q=qi, kv=ki))  # noqa: E731
        out = jax.vmap(run)(q, k, v, q_ids, kv_ids)
    return jnp.swapaxes(out, 1, 2)[:, :q_len]


def attention(
    q: jax.Array, k: jax.Array, v: jax.Array, kv_lengths: jax.Array | None = None, *, data_axis: str = "data"
) -> jax.Array:
    """Splash attention (see the module doc) on (B, T, N, H) q and (B, S, N, H) k, v; `kv_lengths`
    (B,) masks keys at positions >= length. Under a mesh, per device inside `shard_map` with the
    batch split over `data_axis` where it divides."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or set(mesh.manual_axes) == set(mesh.axis_names):
        return local_attention(q, k, v, kv_lengths)
    batch = q.shape[0]
    axis = data_axis if data_axis in mesh.axis_names and batch % mesh.shape[data_axis] == 0 else None
    lengths = jnp.full((batch,), -1, jnp.int32) if kv_lengths is None else kv_lengths.astype(jnp.int32)
    spec = PartitionSpec(axis)

    def run(q, k, v, lengths):
        return local_attention(q, k, v, None if kv_lengths is None else lengths)

    # Pallas kernels declare no varying mesh axes of their outputs: the program runs unchecked (check_vma).
    return jax.shard_map(run, mesh=mesh, in_specs=(spec,) * 4, out_specs=spec, check_vma=False)(q, k, v, lengths)
