"""FLUX.1 and SD3 VAE decoder (the decoder half of diffusers `AutoencoderKL`) in flax.linen.

FLUX.1 and SD3 / SD3.5 ship the same architecture with different latent constants
(`scaling_factor`, `shift_factor`, read from each `vae/config.json`; `VARIANTS` has both), and
both pipelines de-normalise the same way.

Computes what `AutoencoderKL.decode(z).sample` computes (fp32 parity is tested):
an optional 1x1 `post_quant_conv` (FLUX.1 has none: `use_post_quant_conv=False`),
`conv_in`, a mid block (ResNet, single-head self-attention with its own GroupNorm
and a residual connection, ResNet), one up block per level (`layers_per_block + 1`
ResNets, then nearest 2x upsampling and a 3x3 conv on all but the last level), and
GroupNorm -> SiLU -> `conv_out`. `decode_latents` adds the FLUX / SD3 pipelines' latent
de-normalisation `z / scaling_factor + shift_factor` in front. The output is not
clamped, as in diffusers; the pipeline's image processor maps [-1, 1] to pixels.

Only the decoder is ported: rollouts and rewards need images from latents, and the
encoder is optional in this design. The family declares the encoder keys
(`IGNORED_PREFIXES`) as ignored, so a full `AutoencoderKL` state dict converts;
any other unknown key is still an error.

Layout: NCHW at the API boundary (as diffusers), NHWC inside (flax convolutions).
Numerics: every GroupNorm (eps 1e-6, as diffusers) and the attention softmax run in
float32 whatever the compute dtype, then cast back.

Logical axis names of the parameters:

| name          | dimension                                          |
|---------------|----------------------------------------------------|
| `conv_kernel` | spatial dimensions of a convolution kernel         |
| `channels_in` | input channels of a convolution or attention dense |
| `channels`    | output channels; norm scales and biases            |

Deliberate differences from the PyTorch pipeline, none of which changes fp32 output:
* `decode_latents` de-normalises in float32; the FLUX pipeline does it in the
  latents' dtype (bf16 in practice) before the VAE casts to its own.
* The mid-block attention has one head of `block_out_channels[-1]` (512) channels,
  beyond cuDNN's fused-kernel limit, so it always runs XLA's attention.
"""
from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from digen_jax.models import layers
from digen_jax.models.conversion import ModelFamily, WeightRule, linear_rules

# Keys of a full `AutoencoderKL` state dict that belong to the encoder side; the
# encoder is optional in this design, so conversion skips them explicitly.
IGNORED_PREFIXES = ("encoder.", "quant_conv.")

GROUP_NORM_EPS = 1e-6  # diffusers' `resnet_eps` for every norm of the VAE decoder
_group_norm = functools.partial(layers.GroupNorm, eps=GROUP_NORM_EPS, axis_name="channels")
CONV_AXES = ("conv_kernel", "conv_kernel", "channels_in", "channels")


@dataclasses.dataclass(frozen=True)
class VAEConfig:
    """Architecture (the diffusers `AutoencoderKL` config fields) plus the execution policy.

    Defaults are the released FLUX.1 `vae/config.json`. `in_channels`,
    `down_block_types` and `use_quant_conv` describe the encoder and `sample_size`
    and `force_upcast` are pipeline hints (tiling, fp16 upcast); they are kept so a
    full diffusers config converts, and do not change the decoder.
    """

    in_channels: int = 3
    out_channels: int = 3
    down_block_types: tuple[str, ...] = ("DownEncoderBlock2D",) * 4
    up_block_types: tuple[str, ...] = ("UpDecoderBlock2D",) * 4
    block_out_channels: tuple[int, ...] = (128, 256, 512, 512)
    layers_per_block: int = 2
    act_fn: str = "silu"
    latent_channels: int = 16
    norm_num_groups: int = 32
    sample_size: int | tuple[int, ...] = 1024
    scaling_factor: float = 0.3611
    shift_factor: float | None = 0.1159
    latents_mean: tuple[float, ...] | None = None
    latents_std: tuple[float, ...] | None = None
    force_upcast: bool = True
    use_quant_conv: bool = False
    use_post_quant_conv: bool = False
    mid_block_add_attention: bool = True
    # Execution policy: not part of the weights.
    dtype: str = "bfloat16"  # compute dtype of convolutions, attention and activations
    param_dtype: str = "float32"  # master weights

    def __post_init__(self):
        for name in ("down_block_types", "up_block_types", "block_out_channels"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if isinstance(self.sample_size, list):
            object.__setattr__(self, "sample_size", tuple(self.sample_size))
        if len(self.up_block_types) != len(self.block_out_channels):
            raise ValueError(
                f"up_block_types has {len(self.up_block_types)} entries but block_out_channels has "
                f"{len(self.block_out_channels)}: diffusers pairs them one to one"
            )
        unsupported = sorted(set(self.up_block_types) - {"UpDecoderBlock2D"})
        if unsupported:
            raise ValueError(f"up block types {unsupported} are not implemented; FLUX uses UpDecoderBlock2D")
        if self.act_fn not in ("silu", "swish"):
            raise ValueError(f"act_fn {self.act_fn!r} is not implemented; FLUX uses 'silu'")
        bad = [c for c in self.block_out_channels if c % self.norm_num_groups]
        if bad:
            raise ValueError(f"block_out_channels {bad} do not divide into norm_num_groups={self.norm_num_groups}")
        # A per-channel mean/std de-normalisation would replace scaling/shift; silently
        # applying scaling/shift instead would decode wrong images.
        if self.latents_mean is not None or self.latents_std is not None:
            raise ValueError("latents_mean/latents_std de-normalisation is not implemented (FLUX sets them to None)")

    @property
    def kw(self) -> dict:
        return dict(dtype=jnp.dtype(self.dtype), param_dtype=jnp.dtype(self.param_dtype))


VARIANTS = {
    # FLUX.1-dev and FLUX.1-schnell ship the same VAE.
    "flux1": VAEConfig(),
    # SD3 / SD3.5 (every release): the same architecture with its own latent scaling and shift.
    "sd3": VAEConfig(scaling_factor=1.5305, shift_factor=0.0609),
    # The released structure with 8-channel bases (docs/models.md section 4), for CPU tests.
    "tiny": VAEConfig(block_out_channels=(8, 16, 32, 32), latent_channels=4, norm_num_groups=4, dtype="float32"),
}


def _conv(cfg: VAEConfig, features: int, kernel: int, name: str) -> nn.Conv:
    """A stride-1 'same' convolution, as every `nn.Conv2d` of the decoder is."""
    pad = kernel // 2
    return nn.Conv(
        features,
        (kernel, kernel),
        padding=((pad, pad), (pad, pad)),
        kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), CONV_AXES),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), ("channels",)),
        name=name,
        **cfg.kw,
    )


class ResnetBlock(nn.Module):
    """diffusers `ResnetBlock2D` without time embedding: two GN-SiLU-conv stages plus a skip.

    The skip is a 1x1 `conv_shortcut` where the channel count changes.
    """

    cfg: VAEConfig
    out_channels: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        norm_kw = dict(num_groups=cfg.norm_num_groups, param_dtype=cfg.kw["param_dtype"])
        h = nn.silu(_group_norm(name="norm1", **norm_kw)(x))
        h = _conv(cfg, self.out_channels, 3, "conv1")(h)
        h = nn.silu(_group_norm(name="norm2", **norm_kw)(h))
        h = _conv(cfg, self.out_channels, 3, "conv2")(h)
        if x.shape[-1] != self.out_channels:
            x = _conv(cfg, self.out_channels, 1, "conv_shortcut")(x)
        return x + h


class MidAttention(nn.Module):
    """The mid block's `Attention`: GroupNorm, one head over all pixels, residual add.

    diffusers builds it with `heads = channels // attention_head_dim` where
    `attention_head_dim = channels`, so there is exactly one head; the
    `rescale_output_factor` is 1.
    """

    cfg: VAEConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        b, h, w, c = x.shape
        normed = _group_norm(num_groups=cfg.norm_num_groups, param_dtype=cfg.kw["param_dtype"], name="group_norm")(x)
        tokens = normed.reshape(b, h * w, c)
        dense = functools.partial(layers.logical_dense, c, ("channels_in", "channels"), **cfg.kw)
        q, k, v = (dense(name=n)(tokens).reshape(b, h * w, 1, c) for n in ("to_q", "to_k", "to_v"))
        out = jax.nn.dot_product_attention(q, k, v, implementation="xla").reshape(b, h * w, c)
        return x + dense(name="to_out")(out).reshape(b, h, w, c)


class MidBlock(nn.Module):
    """diffusers `UNetMidBlock2D` with one layer: ResNet, (attention), ResNet."""

    cfg: VAEConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        channels = x.shape[-1]
        x = ResnetBlock(self.cfg, channels, name="resnets_0")(x)
        if self.cfg.mid_block_add_attention:
            x = MidAttention(self.cfg, name="attentions_0")(x)
        return ResnetBlock(self.cfg, channels, name="resnets_1")(x)


class UpBlock(nn.Module):
    """diffusers `UpDecoderBlock2D`: ResNets, then optionally nearest 2x upsampling + conv."""

    cfg: VAEConfig
    out_channels: int
    add_upsample: bool

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for j in range(self.cfg.layers_per_block + 1):
            x = ResnetBlock(self.cfg, self.out_channels, name=f"resnets_{j}")(x)
        if self.add_upsample:
            # F.interpolate(scale_factor=2, mode="nearest") repeats every pixel 2x2.
            x = jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)
            x = _conv(self.cfg, self.out_channels, 3, "upsamplers_0")(x)
        return x


class Decoder(nn.Module):
    """diffusers `vae.Decoder` (group norm variant) on NHWC latents."""

    cfg: VAEConfig

    @nn.compact
    def __call__(self, z: jax.Array) -> jax.Array:
        cfg = self.cfg
        channels = cfg.block_out_channels[::-1]
        x = _conv(cfg, channels[0], 3, "conv_in")(z)
        x = MidBlock(cfg, name="mid_block")(x)
        for i, out in enumerate(channels):
            x = UpBlock(cfg, out, add_upsample=i < len(channels) - 1, name=f"up_blocks_{i}")(x)
        x = nn.silu(_group_norm(num_groups=cfg.norm_num_groups, param_dtype=cfg.kw["param_dtype"], name="conv_norm_out")(x))
        return _conv(cfg, cfg.out_channels, 3, "conv_out")(x)


class VAEDecoder(nn.Module):
    """`AutoencoderKL.decode`: (B, latent_channels, h, w) -> (B, out_channels, 8h, 8w), NCHW.

    Takes latents already de-normalised (what the pipeline passes to `vae.decode`);
    `decode_latents` starts from the transformer's latents instead.
    """

    cfg: VAEConfig

    @nn.compact
    def __call__(self, z: jax.Array) -> jax.Array:
        cfg = self.cfg
        if z.ndim != 4 or z.shape[1] != cfg.latent_channels:
            raise ValueError(f"z must have shape (B, {cfg.latent_channels}, h, w), got {z.shape}")
        x = jnp.transpose(z, (0, 2, 3, 1)).astype(cfg.kw["dtype"])
        if cfg.use_post_quant_conv:
            x = _conv(cfg, cfg.latent_channels, 1, "post_quant_conv")(x)
        x = Decoder(cfg, name="decoder")(x)
        return jnp.transpose(x, (0, 3, 1, 2))


@functools.partial(jax.jit, static_argnums=0)
def decode_latents(cfg: VAEConfig, params: dict, latents: jax.Array) -> jax.Array:
    """Decode the transformer's (unpacked) latents to images, as the FLUX and SD3 pipelines do.

    Applies `latents / scaling_factor + shift_factor`, then the decoder. Returns
    (B, out_channels, 8h, 8w) in `cfg.dtype`, unclamped (nominally [-1, 1]).
    """
    z = latents.astype(jnp.float32) / cfg.scaling_factor + (cfg.shift_factor or 0.0)
    return VAEDecoder(cfg).apply({"params": params}, z)


def example_inputs(cfg: VAEConfig, batch: int = 1, height: int = 8, width: int = 8) -> dict:
    """Abstract inputs (ShapeDtypeStructs) for `init`/`eval_shape`; sizes in latent pixels."""
    return dict(z=jax.ShapeDtypeStruct((batch, cfg.latent_channels, height, width), jnp.float32))


def weight_rules(cfg: VAEConfig) -> list[WeightRule]:
    """Every Flax parameter and the diffusers `AutoencoderKL` key it comes from.

    Covers exactly the decoder (and `post_quant_conv` where the config has one);
    keys under `IGNORED_PREFIXES` have no rule.
    """

    def conv(path, key):
        return [WeightRule(path + ("kernel",), f"{key}.weight", "conv"), WeightRule(path + ("bias",), f"{key}.bias")]

    def norm(path, key):
        return [WeightRule(path + ("scale",), f"{key}.weight"), WeightRule(path + ("bias",), f"{key}.bias")]

    def resnet(path, key, shortcut):
        rules = norm(path + ("norm1",), f"{key}.norm1") + conv(path + ("conv1",), f"{key}.conv1")
        rules += norm(path + ("norm2",), f"{key}.norm2") + conv(path + ("conv2",), f"{key}.conv2")
        if shortcut:
            rules += conv(path + ("conv_shortcut",), f"{key}.conv_shortcut")
        return rules

    rules = conv(("post_quant_conv",), "post_quant_conv") if cfg.use_post_quant_conv else []
    d, dk = ("decoder",), "decoder"
    rules += conv(d + ("conv_in",), f"{dk}.conv_in")
    mid, midk = d + ("mid_block",), f"{dk}.mid_block"
    for j in range(2):
        rules += resnet(mid + (f"resnets_{j}",), f"{midk}.resnets.{j}", shortcut=False)
    if cfg.mid_block_add_attention:
        attn, attnk = mid + ("attentions_0",), f"{midk}.attentions.0"
        rules += norm(attn + ("group_norm",), f"{attnk}.group_norm")
        for flax_name, key_name in (("to_q", "to_q"), ("to_k", "to_k"), ("to_v", "to_v"), ("to_out", "to_out.0")):
            rules += linear_rules(attn + (flax_name,), f"{attnk}.{key_name}")
    channels = cfg.block_out_channels[::-1]
    prev = channels[0]
    for i, out in enumerate(channels):
        up, upk = d + (f"up_blocks_{i}",), f"{dk}.up_blocks.{i}"
        for j in range(cfg.layers_per_block + 1):
            in_channels = prev if j == 0 else out
            rules += resnet(up + (f"resnets_{j}",), f"{upk}.resnets.{j}", shortcut=in_channels != out)
        if i < len(channels) - 1:
            rules += conv(up + ("upsamplers_0",), f"{upk}.upsamplers.0.conv")
        prev = out
    rules += norm(d + ("conv_norm_out",), f"{dk}.conv_norm_out")
    rules += conv(d + ("conv_out",), f"{dk}.conv_out")
    return rules


def decode_frames(params: dict, cfg: VAEConfig, latents: jax.Array) -> jax.Array:
    """`decode_latents` of (B, C, H, W) latents as one-frame videos (B, 3, 1, H, W)."""
    return decode_latents(cfg, params, latents)[:, :, None]


FAMILY = ModelFamily(
    name="vae_flux",
    diffusers_class="AutoencoderKL",
    config_cls=VAEConfig,
    module_cls=VAEDecoder,
    weight_rules=weight_rules,
    example_inputs=example_inputs,
    variants=VARIANTS,
    ignored_prefixes=IGNORED_PREFIXES,
    decode_frames=decode_frames,
)
