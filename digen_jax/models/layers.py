"""Layers shared by the diffusion transformers.

Every parameter carries logical axis names (`nn.with_logical_partitioning`); the mesh
rules that map them to device axes live in the configs (`configs/*.py`, key
`sharding`). The logical names used here:

| name         | dimension                                                        |
|--------------|------------------------------------------------------------------|
| `embed`      | the transformer's hidden size                                    |
| `heads`      | fused heads x head_dim of q/k/v projections and attention output |
| `mlp`        | the MLP hidden size                                              |
| `modulation` | AdaLN modulation outputs (k x hidden)                            |
| `cond`       | conditioning inputs: latent channels, text/pooled/frequency dims |
| `head_dim`   | per-head norm scales                                             |
| `layers`     | the stacked-block axis of scanned layers                         |

Blocks run in one of two layouts (`scan_blocks`): scanned, one parameter per weight with a
leading `layers` axis (the stored layout: compile time flat in depth), or unrolled, one
sub-tree per block named by its index (`blocks/0/...`, `blocks/1/...`). Unrolled programs
compile slower but skip the per-layer copy a scan makes when it slices each block's weights
out of the stacked arrays (on H100 about 0.45 ms per Qwen-Image block, 18% of its forward).
`relayout_blocks` converts parameter trees between the two.

Activations are constrained (`constrain`) with `activation_batch`, `activation_length`,
`activation_embed`, `activation_heads` and `activation_mlp`; the constraints act only where the
caller traces under a mesh and logical rules (the runtime sets both for programs whose weights
are sharded) and are no-ops otherwise.

Sequence parallelism (the video transformers): a model traced under `jax.set_mesh` of a mesh
with a `SEQ_AXIS` of size P > 1 splits each sample's video tokens over that axis
(`shard_tokens`; the compiler lays out every per-token op to match) and runs attention as
Ulysses (`token_parallel_attention`): q/k/v move from token shards to head shards by one
all-to-all, the local attention sees the whole sequence for its N/P heads, and one
all-to-all moves the output back. Outside such a mesh nothing is split. The mesh is the
runtime's (each role's); models only read it.

Numerics: norms, RoPE, timestep sinusoids and softmax run in float32 whatever the
compute dtype, then cast back (the same places the PyTorch reference upcasts).
"""
from __future__ import annotations

import math
from typing import Literal, Mapping, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jax.sharding import PartitionSpec

from digen_jax.models import fp8, splash_attention

AttentionImpl = Literal["auto", "cudnn", "xla", "splash"]

# cuDNN's fused attention backward rejects odd sequence lengths; padding to a
# multiple of 128 also keeps its tiles full. Padding is masked through lengths.
CUDNN_SEQ_MULTIPLE = 128


class AdaptableDense(nn.Dense):
    """`nn.Dense` that adds a factored low-rank term when the `lora` collection has one for it.

    With variables `{"params": ..., "lora": adapters}` where this module's entry holds
    `lora_a` (in, rank) and `lora_b` (rank, out), it computes `x @ W + b + (x @ A) @ B`
    (the adapter scale is folded into `lora_b` by the caller). Never materialising
    `W + A @ B` is what keeps LoRA training cheap: the backward pass needs `dx` through
    the frozen `W` and the small adapter gradients, not a kernel-sized `dW`. Without a
    `lora` entry it is exactly `nn.Dense`; `init` creates no `lora` variables.

    Where the params hold an FP8 kernel in place of `kernel` (`fp8.quantize_params`), the base
    product `x @ W` runs in FP8 (`fp8.fp8_matmul`, float32 accumulation, cast to `dtype`);
    the bias and the adapters' term stay in `dtype`.
    """

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        out = self._fp8_base(inputs) if self.has_variable("params", fp8.QUANTIZED) else super().__call__(inputs)
        if not self.has_variable("lora", "lora_a"):
            return out
        a, b = self.get_variable("lora", "lora_a"), self.get_variable("lora", "lora_b")
        x, a, b = nn.dtypes.promote_dtype(inputs, a, b, dtype=self.dtype)
        down = jnp.dot(x, a, precision=self.precision)
        return out + jnp.dot(down, b, precision=self.precision).astype(out.dtype)

    def _fp8_base(self, inputs: jax.Array) -> jax.Array:
        dtype = self.dtype or inputs.dtype
        kernel, scale = self.get_variable("params", fp8.QUANTIZED), self.get_variable("params", fp8.SCALE)
        out = fp8.fp8_matmul(inputs.astype(dtype), kernel, scale, dtype).astype(dtype)
        if self.use_bias:
            out = out + self.get_variable("params", "bias").astype(dtype)
        return out


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """`x` laid out by the logical names of its leading axes (the rest whole), under the rules and
    mesh the caller traces under (`nn.logical_axis_rules`, `jax.set_mesh`; the runtime sets both
    for programs whose weights are sharded). An axis that its mesh axes do not divide stays
    whole (a batch of 3 on 2 devices); nothing is constrained without rules or a mesh."""
    rules, mesh = nn.get_logical_axis_rules(), jax.sharding.get_abstract_mesh()
    if not rules or mesh.empty:
        return x
    table = dict(rules)
    spec = []
    for name, size in zip(tuple(names) + (None,) * (x.ndim - len(names)), x.shape):
        axes = table.get(name) if name is not None else None
        if isinstance(axes, (str, tuple)):
            ways = math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))
            axes = axes if size % ways == 0 else None
        spec.append(axes)
    return jax.lax.with_sharding_constraint(x, PartitionSpec(*spec))


def logical_dense(
    features: int,
    axes: tuple[str, str],
    *,
    name: str,
    dtype: jnp.dtype,
    param_dtype: jnp.dtype,
    use_bias: bool = True,
    kernel_init: nn.initializers.Initializer = nn.initializers.xavier_uniform(),
) -> AdaptableDense:
    """A dense layer whose kernel and bias carry the logical axis names `axes` (in, out).

    It is an `AdaptableDense`: LoRA adapters passed in the `lora` collection are applied
    factored, without merging them into the kernel.
    """
    return AdaptableDense(
        features,
        use_bias=use_bias,
        dtype=dtype,
        param_dtype=param_dtype,
        kernel_init=nn.with_logical_partitioning(kernel_init, axes),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), (axes[1],)),
        name=name,
    )


class RMSNorm(nn.Module):
    """RMS norm over the last axis with a learned scale, computed in float32."""

    eps: float = 1e-6
    axis_name: str = "head_dim"
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param(
            "scale",
            nn.with_logical_partitioning(nn.initializers.ones_init(), (self.axis_name,)),
            (x.shape[-1],),
            self.param_dtype,
        )
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        return (x32 * scale.astype(jnp.float32)).astype(x.dtype)


def layer_norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """LayerNorm without affine parameters over the last axis, in float32."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + eps)).astype(x.dtype)


class GroupNorm(nn.Module):
    """`torch.nn.GroupNorm` (affine, biased variance) on channels-last input, in float32.

    Statistics run over every non-batch position and the channels of each group, so one
    module serves images (B, H, W, C) and videos (B, T, H, W, C).
    """

    num_groups: int
    eps: float = 1e-6
    axis_name: str = "vae_channels"
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        channels = x.shape[-1]
        ones, zeros = nn.initializers.ones_init(), nn.initializers.zeros_init()
        scale = self.param("scale", nn.with_logical_partitioning(ones, (self.axis_name,)), (channels,), self.param_dtype)
        bias = self.param("bias", nn.with_logical_partitioning(zeros, (self.axis_name,)), (channels,), self.param_dtype)
        grouped = x.astype(jnp.float32).reshape(*x.shape[:-1], self.num_groups, channels // self.num_groups)
        axes = tuple(range(1, x.ndim - 1)) + (x.ndim,)  # positions and the channels within a group
        mean = jnp.mean(grouped, axis=axes, keepdims=True)
        var = jnp.mean(jnp.square(grouped - mean), axis=axes, keepdims=True)
        normed = ((grouped - mean) * jax.lax.rsqrt(var + self.eps)).reshape(x.shape)
        return (normed * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def modulate(x: jax.Array, shift: jax.Array, scale: jax.Array) -> jax.Array:
    """AdaLN modulation `x * (1 + scale) + shift` with per-sample (B, D) shift/scale."""
    return x * (1 + scale[:, None, :]) + shift[:, None, :]


class Modulation(nn.Module):
    """SiLU -> Dense(k * dim) -> k chunks: the AdaLN conditioning projection.

    The chunk order is the caller's business (FLUX double blocks: shift, scale, gate
    for attention then MLP; the final norm: scale, shift).
    """

    num_chunks: int
    dim: int
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, cond: jax.Array) -> list[jax.Array]:
        out = logical_dense(
            self.num_chunks * self.dim,
            ("embed", "modulation"),
            name="linear",
            dtype=self.dtype,
            param_dtype=self.param_dtype,
        )(nn.silu(cond.astype(self.dtype)))
        out = constrain(out, ("activation_batch",))
        return jnp.split(out, self.num_chunks, axis=-1)


def timestep_sinusoid(
    t: jax.Array,
    dim: int,
    *,
    flip_sin_to_cos: bool = True,
    downscale_freq_shift: float = 0.0,
    scale: float = 1.0,
    max_period: float = 10000.0,
) -> jax.Array:
    """Sinusoidal embedding of a (B,) vector of (possibly fractional) timesteps, float32.

    Frequencies `exp(-log(max_period) * k / (half - downscale_freq_shift))`; output
    [cos, sin] when `flip_sin_to_cos` else [sin, cos]; an odd `dim` is zero-padded.
    """
    half = dim // 2
    # float32 in the reference's order of operations: with timesteps up to 1000, one
    # ulp of difference in a frequency moves the angle by ~6e-5.
    exponent = np.float32(-math.log(max_period)) * np.arange(half, dtype=np.float32)
    freqs = jnp.exp(jnp.asarray(exponent / np.float32(half - downscale_freq_shift), jnp.float32))
    args = scale * (t.astype(jnp.float32)[:, None] * freqs[None, :])
    first, second = (jnp.cos(args), jnp.sin(args)) if flip_sin_to_cos else (jnp.sin(args), jnp.cos(args))
    emb = jnp.concatenate([first, second], axis=-1)
    if dim % 2:
        emb = jnp.pad(emb, ((0, 0), (0, 1)))
    return emb


class MLPEmbedder(nn.Module):
    """Dense -> SiLU -> Dense: embeds timesteps, guidance and pooled text vectors."""

    dim: int
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        x = constrain(logical_dense(self.dim, ("cond", "embed"), name="linear_1", **kw)(x.astype(self.dtype)), ("activation_batch",))
        return constrain(logical_dense(self.dim, ("embed", "embed"), name="linear_2", **kw)(nn.silu(x)), ("activation_batch",))


class FeedForward(nn.Module):
    """Dense -> activation -> Dense, the transformer feed-forward.

    `activation` is 'gelu_tanh' (every DiT MLP here) or 'silu' (HunyuanVideo's token refiner).
    """

    hidden_dim: int
    out_dim: int
    activation: str = "gelu_tanh"
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        h = logical_dense(self.hidden_dim, ("embed", "mlp"), name="proj_in", **kw)(x)
        if self.activation == "gelu_tanh":
            h = nn.gelu(h, approximate=True)
        elif self.activation == "silu":
            h = nn.silu(h)
        else:
            raise ValueError(f"FeedForward activation must be 'gelu_tanh' or 'silu', got {self.activation!r}")
        h = constrain(h, ("activation_batch", "activation_length", "activation_mlp"))
        return logical_dense(self.out_dim, ("mlp", "embed"), name="proj_out", **kw)(h)


class PatchEmbed3D(nn.Module):
    """Conv3d with kernel = stride = `patch` on (B, C, T, H, W), as patchify + one matmul.

    Returns (B, T'H'W', features) tokens in (t, h, w) order, like diffusers'
    `proj(x).flatten(2).transpose(1, 2)`. The kernel keeps the Flax conv layout
    (pt, ph, pw, C, features), so a PyTorch Conv3d weight converts with the 'conv'
    transform; the window axes are never sharded.
    """

    patch: tuple[int, int, int]
    features: int
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, c, t, h, w = x.shape
        pt, ph, pw = self.patch
        kernel = self.param(
            "kernel",
            nn.with_logical_partitioning(nn.initializers.xavier_uniform(), (None, None, None, "cond", "embed")),
            (pt, ph, pw, c, self.features),
            self.param_dtype,
        )
        bias = self.param(
            "bias", nn.with_logical_partitioning(nn.initializers.zeros_init(), ("embed",)), (self.features,), self.param_dtype
        )
        x = x.reshape(b, c, t // pt, pt, h // ph, ph, w // pw, pw)
        x = x.transpose(0, 2, 4, 6, 3, 5, 7, 1).reshape(b, -1, pt * ph * pw * c)  # (B, S, pt*ph*pw*C)
        out = jnp.dot(x.astype(self.dtype), kernel.reshape(-1, self.features).astype(self.dtype))
        return out + bias.astype(self.dtype)


def rope_frequencies(axes_dims: Sequence[int], theta: float, *, float32_exponent: bool = False) -> list[np.ndarray]:
    """Per-axis inverse frequencies `theta^(-2k/d)`, computed on the host.

    FLUX's reference builds them in float64. Qwen-Image's computes the exponent 2k/d and
    the reciprocal in float32 (`float32_exponent=True` reproduces it bit for bit): a few
    ulp apart, which shows at text positions in the thousands.
    """
    out = []
    for d in axes_dims:
        if d % 2:
            raise ValueError(f"every RoPE axis dim must be even, got axes_dims={tuple(axes_dims)}")
        if float32_exponent:
            exponent = np.arange(0, d, 2).astype(np.float32) / np.float32(d)
            out.append(np.float32(1.0) / (np.float64(theta) ** exponent.astype(np.float64)).astype(np.float32))
        else:
            out.append(1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    return out


def rope_tables(
    ids: jax.Array, axes_dims: Sequence[int], theta: float, *, float32_exponent: bool = False
) -> tuple[jax.Array, jax.Array]:
    """RoPE (cos, sin) tables of shape (S, sum(axes_dims)) for (S, n_axes) position ids.

    Each axis i rotates `axes_dims[i]` channels; pairs are interleaved, so every
    frequency is repeated twice along the channel axis. Float32 throughout.
    """
    if ids.shape[-1] != len(axes_dims):
        raise ValueError(f"position ids have {ids.shape[-1]} axes but axes_dims has {len(axes_dims)}")
    pos = ids.astype(jnp.float32)
    angles = [
        pos[:, i : i + 1] * jnp.asarray(np.repeat(f, 2), jnp.float32)[None, :]
        for i, f in enumerate(rope_frequencies(axes_dims, theta, float32_exponent=float32_exponent))
    ]
    angles = jnp.concatenate(angles, axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate interleaved channel pairs of x (B, S, N, H) by (S, H) tables, in float32."""
    x32 = x.astype(jnp.float32)
    pairs = x32.reshape(*x.shape[:-1], -1, 2)
    rotated = jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x.shape)
    out = x32 * cos[None, :, None, :] + rotated * sin[None, :, None, :]
    return out.astype(x.dtype)


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


# Mesh axes the models know of: the batch axis, and the axis a sample's tokens are split over
# (sequence parallelism). The runtime names its role meshes' axes with these.
DATA_AXIS = "data"
SEQ_AXIS = "seq"


def seq_parallel_size() -> int:
    """P, the devices a sample's tokens are split over: the size of `SEQ_AXIS` in the mesh the
    caller traces under (`jax.set_mesh`); 1 without one."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or SEQ_AXIS not in mesh.axis_names:
        return 1
    return mesh.shape[SEQ_AXIS]


def shard_tokens(x: jax.Array) -> jax.Array:
    """`x` (B, S, ...) with its token axis split over `SEQ_AXIS` (the batch and the other axes as
    the compiler lays them out); `x` itself without sequence parallelism."""
    if seq_parallel_size() == 1:
        return x
    free = PartitionSpec.UNCONSTRAINED
    return jax.lax.with_sharding_constraint(x, PartitionSpec(free, SEQ_AXIS, *([free] * (x.ndim - 2))))


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
    size = seq_parallel_size()
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


REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # Keeps each block's attention output (tagged `attn_out`); recomputes the rest.
    "save_attention": jax.checkpoint_policies.save_only_these_names("attn_out"),
}


def scan_blocks(block_cls: type[nn.Module], length: int, remat_policy: str, scan: bool = True):
    """`block_cls` repeated `length` times: `make(*block_args, name=...)(carry, *broadcast_args)`.

    With `scan`, an `nn.scan` (params on a leading `layers` axis, one compiled body);
    otherwise `UnrolledBlocks` (params under `name/0`, `name/1`, ...; one program per block,
    no per-layer weight slicing). `remat_policy` (a key of `REMAT_POLICIES`) wraps each
    block in `nn.remat` with that policy. The block's `__call__(carry, *broadcast_args)` must
    return `(carry, None)`. LoRA adapters in the `lora` collection follow the params' layout.
    """
    if remat_policy not in REMAT_POLICIES:
        raise ValueError(f"remat_policy must be one of {sorted(REMAT_POLICIES)}, got {remat_policy!r}")
    if remat_policy != "none":
        # Common-subexpression elimination may only merge a block's recomputation with its
        # forward where a loop boundary separates them, i.e. under scan.
        block_cls = nn.remat(block_cls, policy=REMAT_POLICIES[remat_policy], prevent_cse=not scan)
    if not scan:
        return lambda *block_args, name: UnrolledBlocks(block_cls, length, block_args, name=name)
    return nn.scan(
        block_cls,
        variable_axes={"params": 0, "lora": 0},
        split_rngs={"params": True},
        in_axes=nn.broadcast,
        length=length,
        metadata_params={nn.PARTITION_NAME: "layers"},
    )


class UnrolledBlocks(nn.Module):
    """`length` instances of `block_cls(*block_args)`, named "0".."length-1", run in order."""

    block_cls: type[nn.Module]
    length: int
    block_args: tuple

    @nn.compact
    def __call__(self, carry, *broadcast_args):
        for i in range(self.length):
            carry, _ = self.block_cls(*self.block_args, name=str(i))(carry, *broadcast_args)
        return carry, None


def _is_unrolled(node) -> bool:
    return isinstance(node, Mapping) and bool(node) and all(isinstance(k, str) and k.isdigit() for k in node)


def _stack_leaves(leaves: Sequence):
    if all(isinstance(x, np.ndarray) for x in leaves):
        return np.stack(leaves)
    return jnp.stack(leaves)


def unstack_leaf(leaf, n: int) -> list:
    """`relayout_blocks`' default `unstack`: the n slices along the leading (layers) axis."""
    return [leaf[i] for i in range(n)]


def unstack_consuming(leaf, n: int) -> list:
    """`relayout_blocks`' `unstack` that frees each stacked device array once it is split, so
    converting a model to the unrolled layout never holds it twice."""
    pieces = unstack_leaf(leaf, n)
    if isinstance(leaf, jax.Array):
        jax.block_until_ready(pieces)
        leaf.delete()
    return pieces


def relayout_blocks(tree, like, *, stack=_stack_leaves, unstack=unstack_leaf):
    """`tree` (params, adapters, shardings...) in the block layout of `like`.

    Walks both nested dicts together: where `like` holds per-block sub-trees ("0", "1", ...)
    and `tree` one stacked sub-tree, every leaf is split with `unstack(leaf, n)` and block i
    gets the i-th pieces; where `tree` holds per-block sub-trees and `like` a stacked one, the
    blocks' leaves are combined with `stack(leaves)`. Elsewhere the keys must match. Host
    (numpy) leaves are sliced as views.
    """
    if not isinstance(like, Mapping):
        return tree
    if not isinstance(tree, Mapping):
        raise ValueError(f"expected a sub-tree with keys {sorted(like)}, got a leaf")
    recurse = lambda t, l: relayout_blocks(t, l, stack=stack, unstack=unstack)  # noqa: E731
    if _is_unrolled(like) and not _is_unrolled(tree):
        pieces = jax.tree.map(lambda x: unstack(x, len(like)), tree)
        is_pieces = lambda v: isinstance(v, list)  # noqa: E731
        return {k: recurse(jax.tree.map(lambda p, k=k: p[int(k)], pieces, is_leaf=is_pieces), like[k]) for k in like}
    if _is_unrolled(tree) and not _is_unrolled(like):
        blocks = [tree[str(i)] for i in range(len(tree))]
        return recurse(jax.tree.map(lambda *xs: stack(xs), *blocks), like)
    if set(tree) != set(like):
        raise ValueError(f"parameter trees differ: keys {sorted(map(str, tree))} vs {sorted(map(str, like))}")
    return {k: recurse(tree[k], like[k]) for k in tree}
