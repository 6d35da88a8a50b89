"""SD3 / SD3.5 port: fp32 parity with diffusers `SD3Transformer2DModel` (SD3: plain MMDiT; SD3.5:
dual-attention blocks and RMS qk-norm) and with `AutoencoderKL` at SD3's latent constants, the
packed-token layout the runtime feeds, full-size parameter counts, and config errors."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL, SD3Transformer2DModel

from digen_jax import diffusion
from digen_jax.models import from_diffusers, sd3
from digen_jax.models.flux import vae as vae_flux
from digen_jax.models.conversion import convert_weights, torch_state_dict_arrays

TINY = dict(
    sample_size=16,
    patch_size=2,
    in_channels=4,
    num_layers=3,
    attention_head_dim=8,
    num_attention_heads=2,
    joint_attention_dim=32,
    caption_projection_dim=16,
    pooled_projection_dim=32,
    out_channels=4,
    pos_embed_max_size=24,
)
SD35 = dict(dual_attention_layers=(0, 1), qk_norm="rms_norm")


def random_sd3(seed: int, **overrides) -> SD3Transformer2DModel:
    """A tiny diffusers SD3 with every weight perturbed (norm scales and biases non-trivial,
    so a wrong mapping shows)."""
    torch.manual_seed(seed)
    model = SD3Transformer2DModel(**{**TINY, **overrides}).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def sd3_inputs(model, batch: int, height: int, width: int, text_len: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    c = model.config
    return dict(
        hidden_states=torch.randn(batch, c.in_channels, height, width, generator=g),
        encoder_hidden_states=torch.randn(batch, text_len, c.joint_attention_dim, generator=g),
        pooled_projections=torch.randn(batch, c.pooled_projection_dim, generator=g),
        timestep=1000 * torch.rand(batch, generator=g),  # the pipeline passes sigma * 1000
    )


def to_numpy(inputs):
    return {k: v.numpy() for k, v in inputs.items()}


def rel_err(a, b):
    return float(np.abs(np.asarray(a) - b).max() / np.abs(b).max())


@pytest.mark.parametrize(
    "overrides,batch,hw,text_len",
    [
        ({}, 2, (6, 10), 7),  # SD3: no qk-norm, no dual attention; a non-square grid off the table's centre
        (SD35, 3, (8, 4), 5),  # SD3.5-M style: dual blocks, joint blocks and the final block
        ({**SD35, "dual_attention_layers": (0, 1, 2)}, 1, (4, 4), 3),  # every block dual, the last one too
    ],
)
def test_parity_with_diffusers(overrides, batch, hw, text_len):
    model = random_sd3(0, **overrides)
    inputs = sd3_inputs(model, batch, *hw, text_len)
    with torch.no_grad():
        ref = model(**inputs).sample.numpy()
    apply_fn, params = from_diffusers(model)  # the state dict's full-grid pos_embed buffer is skipped
    out = apply_fn(params, **to_numpy(inputs), return_dict=False)
    chex.assert_shape(out, ref.shape)
    assert out.dtype == jnp.float32
    assert rel_err(out, ref) <= 1e-5


def test_packed_tokens_give_the_packed_velocity():
    """The runtime's layout (2x2-packed tokens with image_grid) computes the same function as
    (B, C, H, W) latents, and its output is packed in the same (c, dy, dx) channel order."""
    model = random_sd3(1, **SD35)
    inputs = to_numpy(sd3_inputs(model, 2, 6, 4, 5))
    cfg = sd3.FAMILY.config_from_diffusers(dict(model.config), dtype="float32", param_dtype="float32")
    params = convert_weights(sd3.FAMILY, cfg, torch_state_dict_arrays(model))
    module = sd3.SD3Transformer(cfg)
    latents = jax.jit(lambda x: module.apply({"params": params}, **x))(inputs)
    packed_inputs = {**inputs, "hidden_states": diffusion.pack_latents(inputs["hidden_states"])}
    packed = jax.jit(lambda x: module.apply({"params": params}, **x, image_grid=(3, 2)))(packed_inputs)
    np.testing.assert_allclose(packed, diffusion.pack_latents(latents), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("variant,params", [("sd3-medium", 2_028_328_000), ("sd3.5-medium", 2_243_171_520),
                                            ("sd3.5-large", 8_056_627_520)])
def test_full_size_parameter_count(variant, params):
    """Every parameter of the released transformer (diffusers on the meta device; the position
    table is a buffer, not a parameter), and the block runs the family's stacks split into."""
    cfg = sd3.VARIANTS[variant]
    arch = {k: getattr(cfg, k) for k in TINY} | {"dual_attention_layers": cfg.dual_attention_layers, "qk_norm": cfg.qk_norm}
    with torch.device("meta"):
        model = SD3Transformer2DModel(**arch)
    assert sum(p.numel() for p in model.parameters()) == params
    abstract = jax.tree.leaves(sd3.FAMILY.abstract_params(cfg), is_leaf=lambda x: hasattr(x, "names"))
    assert sum(int(np.prod(x.value.shape)) for x in abstract) == params
    assert all(len(x.names) == x.value.ndim for x in abstract)
    runs = {name: count for name, _, count, _ in cfg.stacks}
    assert runs == ({"dual_blocks": 13, "joint_blocks": 10, "final_block": 1} if variant == "sd3.5-medium"
                    else {"joint_blocks": cfg.num_layers - 1, "final_block": 1})


def test_vae_parity_at_sd3_constants():
    """SD3's VAE is the FLUX VAE module at SD3's scaling 1.5305 and shift 0.0609: decode_latents
    equals diffusers' `vae.decode(latents / scaling + shift)`, as StableDiffusion3Pipeline calls it."""
    torch.manual_seed(0)
    model = AutoencoderKL(block_out_channels=(8, 16, 32, 32), latent_channels=4, norm_num_groups=4,
                          down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                          layers_per_block=2, scaling_factor=1.5305, shift_factor=0.0609,
                          use_quant_conv=False, use_post_quant_conv=False).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    latents = torch.randn(2, 4, 3, 5, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model.decode(latents / 1.5305 + 0.0609).sample.numpy()
    cfg = vae_flux.FAMILY.config_from_diffusers(dict(model.config), dtype="float32", param_dtype="float32")
    assert (cfg.scaling_factor, cfg.shift_factor) == (vae_flux.VARIANTS["sd3"].scaling_factor,
                                                      vae_flux.VARIANTS["sd3"].shift_factor)
    params = convert_weights(vae_flux.FAMILY, cfg, torch_state_dict_arrays(model))
    out = vae_flux.decode_latents(cfg, params, jnp.asarray(latents.numpy()))
    assert rel_err(out, ref) <= 1e-5


def test_bad_config_and_inputs_fail_with_named_field():
    with pytest.raises(ValueError, match="dual_attention_layers must be the first k blocks"):
        sd3.SD3Config(num_layers=4, dual_attention_layers=(1, 2))
    # As in diffusers, indices past the last block are ignored: a shortened SD3.5-M keeps its first blocks.
    assert sd3.SD3Config(num_layers=2, dual_attention_layers=range(13)).dual_attention_layers == (0, 1)
    with pytest.raises(ValueError, match="caption_projection_dim=32 must equal"):
        sd3.SD3Config(num_attention_heads=2, attention_head_dim=8, caption_projection_dim=32)
    with pytest.raises(ValueError, match="qk_norm"):
        sd3.SD3Config(qk_norm="layer_norm")
    with pytest.raises(ValueError, match="exceeds pos_embed_max_size=16"):
        sd3.position_table(sd3.VARIANTS["tiny"], 17, 4)
    cfg = sd3.VARIANTS["tiny"]
    inputs = {k: jnp.zeros(v.shape) for k, v in sd3.example_inputs(cfg, 1, 4, 3).items()}
    params = jax.eval_shape(sd3.SD3Transformer(cfg).init, jax.random.key(0), **inputs)
    with pytest.raises(ValueError, match="hidden_states"):
        jax.eval_shape(sd3.SD3Transformer(cfg).apply, params, **{**inputs, "hidden_states": jnp.zeros((1, 4, 5, 4))})
    with pytest.raises(ValueError, match="pooled_projections"):
        jax.eval_shape(sd3.SD3Transformer(cfg).apply, params, **{**inputs, "pooled_projections": jnp.zeros((1, 8))})


def test_sd35_config_adapts_the_reference_lora_modules():
    """configs/sd35.py's LoRA targets are Flow-GRPO's peft `target_modules` (joint attention of
    every block) mapped through the conversion rules, less the last block's text query
    projection, which gets no gradient there (its text outputs are discarded)."""
    import re

    from configs import sd35

    reference = ("attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "attn.to_k",
                 "attn.to_out.0", "attn.to_q", "attn.to_v")
    model = random_sd3(3, **SD35, num_layers=4)
    peft = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.endswith(reference)}
    cfg = sd3.FAMILY.config_from_diffusers(dict(model.config))
    ours = set()
    for rule in sd3.FAMILY.weight_rules(cfg):
        if rule.path[-1] == "kernel" and any(re.search(p, "/".join(rule.path)) for p in sd35.get_config().rl.lora_targets):
            for name, first, count, _ in cfg.stacks:
                if rule.path[0] == name:
                    ours |= {rule.key.removesuffix(".weight").format(i=i + first) for i in range(count)}
    assert ours == peft - {"transformer_blocks.3.attn.add_q_proj"}


@pytest.mark.gpu
def test_full_size_sd35_medium_forward_matches_diffusers_on_gpu():
    """SD3.5-M at full size (random weights, float32, highest matmul precision on both sides) on
    the same card: 512x512, Flow-GRPO's 77 + 128 text positions, batch 2. CPU counterpart:
    test_parity_with_diffusers (tiny configs with the same block kinds)."""
    cfg = sd3.VARIANTS["sd3.5-medium"]
    arch = {k: getattr(cfg, k) for k in TINY} | {"dual_attention_layers": list(cfg.dual_attention_layers),
                                                 "qk_norm": cfg.qk_norm}
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    model = SD3Transformer2DModel(**arch).eval().cuda()
    inputs = sd3_inputs(model, 2, 64, 64, 77 + 128)
    with torch.no_grad():
        ref = model(**{k: v.cuda() for k, v in inputs.items()}).sample.cpu().numpy()
    model = model.cpu()
    torch.cuda.empty_cache()
    apply_fn, params = from_diffusers(model, attention_impl="xla")
    with jax.default_matmul_precision("highest"):
        out = apply_fn(params, **to_numpy(inputs))
    err = rel_err(out, ref)
    print(f"SD3.5-M 512x512 fp32 forward, JAX vs diffusers on {jax.devices()[0].device_kind}: rel err {err:.2e}")
    assert err <= 1e-4
