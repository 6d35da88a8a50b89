"""Wan2.2 at the model level: the T2V-A14B pair of experts routed by timestep, its conversion,
and the released configs' shapes."""
import dataclasses
import importlib.util
import json
import os

import flax.linen as nn
from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import WanTransformer3DModel

from digen_jax.app import families, loop
from digen_jax.app.errors import ConfigError
from digen_jax.models import FAMILIES, convert_expert_pair, from_diffusers, load_checkpoint, make_apply_fn, wan, wan22
from digen_jax.models.wan import vae as vae_wan
from digen_jax.models.conversion import ConversionError, convert_weights, torch_state_dict_arrays
from digen_jax.rl import lora
from digen_jax.rl.rollout import Conditioning, make_denoiser
from test_wan import port, random_wan, rel_err, to_numpy, wan_inputs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def experts():
    """Two different tiny diffusers experts, the pair converted from them, and each alone."""
    high, low = random_wan(10), random_wan(11)
    cfg = dataclasses.replace(
        wan22.FAMILY.config_from_diffusers(dict(high.config), dtype="float32", param_dtype="float32"),
        boundary_ratio=0.875,
    )
    weights = wan22.expert_weights(torch_state_dict_arrays(high), torch_state_dict_arrays(low))
    params = convert_weights(wan22.FAMILY, cfg, weights, source="tiny experts")
    return high, low, make_apply_fn(wan22.FAMILY, cfg), params


def reference(high, low, inputs, boundary=875.0):
    """What diffusers' WanPipeline does per step: `transformer` for t >= boundary, else `transformer_2`."""
    with torch.no_grad():
        return np.concatenate([
            (high if float(t) >= boundary else low)(**{k: v[i : i + 1] for k, v in inputs.items()}).sample.numpy()
            for i, t in enumerate(inputs["timestep"])
        ])


@pytest.mark.parametrize("timesteps", [(880.0, 999.0), (875.0, 875.0), (874.9, 300.0), (900.0, 874.0)])
def test_each_step_uses_the_expert_of_its_side_of_the_boundary(experts, timesteps):
    """Both on the high side (the boundary itself included), both low, and a batch straddling
    the boundary, against the diffusers experts chosen as the pipeline chooses them."""
    high, low, apply_fn, params = experts
    inputs = wan_inputs(high, 2, 2, 4, 4, 5)
    inputs["timestep"] = torch.tensor(timesteps)
    ref = reference(high, low, inputs)
    out = np.asarray(apply_fn(params, **to_numpy(inputs)))
    assert rel_err(out, ref) <= 1e-5
    # The other expert gives something else, so the routing is what the comparison checks.
    other = reference(low, high, inputs)
    assert rel_err(out, other) > 1e-2


def test_uniform_batch_trains_its_expert_only(experts):
    """Gradients reach only the expert that ran; a step below the boundary trains the low-noise one."""
    high, _, _, params = experts
    cfg = dataclasses.replace(wan22.VARIANTS["tiny-a14b"], in_channels=4, out_channels=4)
    module = wan22.make_module(cfg)
    inputs = to_numpy(wan_inputs(high, 1, 1, 4, 4, 3))
    grad = jax.jit(jax.grad(lambda p, x: module.apply({"params": p}, **x).sum()))
    for t, trained, frozen in ((950.0, "transformer", "transformer_2"), (100.0, "transformer_2", "transformer")):
        grads = grad(params, {**inputs, "timestep": np.asarray([t], np.float32)})
        norm = lambda tree: float(sum(np.abs(np.asarray(g)).sum() for g in jax.tree.leaves(tree)))  # noqa: E731
        assert norm(grads[trained]) > 0 and norm(grads[frozen]) == 0


def test_per_token_timesteps_route_by_the_step(experts):
    """TI2V-style per-token timesteps (clean first frame at 0): the step's timestep decides."""
    high, low, apply_fn, params = experts
    inputs = wan_inputs(high, 1, 2, 4, 4, 5)
    per_token = torch.full((1, 8), 900.0)
    per_token[0, :4] = 0.0
    inputs["timestep"] = per_token
    with torch.no_grad():
        ref = high(**inputs).sample.numpy()
    assert rel_err(apply_fn(params, **to_numpy(inputs)), ref) <= 1e-5


def test_one_transformer_is_the_wan_module():
    model = random_wan(12)
    cfg = wan22.FAMILY.config_from_diffusers(dict(model.config), dtype="float32", param_dtype="float32")
    assert cfg.boundary_ratio is None and isinstance(wan22.make_module(cfg), wan.WanTransformer)
    _, direct = port(model)
    params = convert_weights(wan22.FAMILY, cfg, torch_state_dict_arrays(model))
    jax.tree.map(np.testing.assert_array_equal, params, direct)


def count(family, cfg):
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nn.unbox(family.abstract_params(cfg))))


def test_released_variants():
    assert FAMILIES["wan22"] is wan22.FAMILY
    ti2v = wan22.VARIANTS["ti2v-5b"]
    assert (ti2v.inner_dim, ti2v.num_layers, ti2v.in_channels, ti2v.ffn_dim) == (3072, 30, 48, 14336)
    fields = ("num_attention_heads", "attention_head_dim", "in_channels", "out_channels", "ffn_dim", "num_layers")
    with torch.device("meta"):
        released = WanTransformer3DModel(**{f: getattr(ti2v, f) for f in fields})
    assert count(wan22.FAMILY, ti2v) == sum(p.numel() for p in released.parameters())
    # Each A14B expert is the Wan2.1-14B architecture.
    a14b = wan22.VARIANTS["t2v-a14b"]
    assert count(wan22.FAMILY, a14b) == 2 * 14_288_491_584
    assert a14b.boundary_timestep == 875.0
    with pytest.raises(ValueError, match="boundary_ratio"):
        dataclasses.replace(a14b, boundary_ratio=1.5)


def wan22_config(size):
    spec = importlib.util.spec_from_file_location("config_wan22", os.path.join(ROOT, "configs", "wan22.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(size)


@pytest.mark.parametrize("size,shape,vae_variant", [
    ("ti2v_5b", (48, 9, 30, 52), "wan2.2"),  # 480x832, 33 frames: 16x spatial, 4x temporal
    ("t2v_a14b", (16, 9, 60, 104), "wan2.1"),
])
def test_full_size_configs_validate_and_fit_their_models(size, shape, vae_variant):
    """No weights: the config validates, the latents fit the transformer (both experts for A14B)
    and the VAE (jax.eval_shape), the LoRA targets match inside every expert."""
    c = wan22_config(size)
    assert c.model.family == "wan22" and not c.model.random_init
    c.model.random_init = c.data.random_embeddings = True
    loop.validate_config(c, this_machine=False)
    model_cfg, vae_cfg = families.model_config(c), families.vae_config(c)
    assert vae_cfg == dataclasses.replace(vae_wan.VARIANTS[vae_variant], dtype=c.model.dtype)
    assert families.latent_shape(c, vae_cfg) == shape
    params = nn.unbox(wan22.FAMILY.abstract_params(model_cfg))
    targets = lora.match_lora_targets(params, list(c.rl.lora_targets))
    assert {path.split("/")[0] for path in targets} == ({"transformer", "transformer_2"} if size == "t2v_a14b" else {"blocks"})
    module = wan22.make_module(model_cfg)
    cond = Conditioning(jax.ShapeDtypeStruct((1, c.data.text_len, 4096), jnp.float32), None, None)
    latents = jax.ShapeDtypeStruct((1, *shape), jnp.float32)
    velocity = jax.eval_shape(make_denoiser(wan22.FAMILY, module), params, latents, cond,
                              jax.ShapeDtypeStruct((1,), jnp.float32))
    assert velocity.shape == (1, *shape)
    vae_params = nn.unbox(vae_wan.FAMILY.abstract_params(vae_cfg))
    frames = jax.eval_shape(families.decoder("wan22", vae_cfg, c.sampling.height, c.sampling.width), vae_params, latents)
    assert frames.shape == (1, 3, c.sampling.num_frames, c.sampling.height, c.sampling.width)


def test_bad_wan22_inputs_are_named(tmp_path):
    """Sides that do not fit the Wan2.2 VAE, and image conditioning where it cannot run or has no
    image or encoder: one ConfigError naming the key, before any device work. An image list's
    image loads at the video's size in [-1, 1]."""
    from PIL import Image

    from digen_jax.data.first_frames import ImageList

    def refused(c, match):
        with pytest.raises(ConfigError, match=match):
            loop.validate_config(c)

    c = wan22_config("tiny")
    c.sampling.height = 48  # a multiple of 16, not of the Wan2.2 VAE's 32
    refused(c, "sampling.height=48 must be a multiple of 32")
    c = wan22_config("tiny_a14b")
    c.data.first_frames = "synthetic"
    refused(c, r"data.first_frames='synthetic': image conditioning is Wan2.2-TI2V's")
    c = wan22_config("tiny")
    c.rl.algorithm = "nft"
    refused(c, r"data.first_frames='synthetic' trains with rl.algorithm='grpo' only")
    Image.new("RGB", (40, 24), (255, 0, 0)).save(tmp_path / "red.png")
    (tmp_path / "images.txt").write_text("red.png\n" * 15 + "missing.png\n")  # 16 prompts: the last lacks its file
    c = wan22_config("tiny")
    c.data.first_frames = str(tmp_path / "images.txt")
    refused(c, r"data.first_frames: .*images.txt line 16: no image file .*missing.png")
    pixels = ImageList(str(tmp_path / "images.txt"), 32, 64)([0, 3])
    assert pixels.shape == (2, 3, 32, 64) and np.allclose(pixels[:, 0], 1) and np.allclose(pixels[:, 1:], -1)
    c = wan22_config("tiny")
    c.model.random_init, c.model.checkpoint, c.model.vae_checkpoint = False, str(tmp_path), str(tmp_path)
    refused(c, "model.vae_encoder_checkpoint is not set: the converted VAE encoder")


def b_norm(adapters, expert):
    """Sum of |B| over the expert's adapters (B starts at 0, so > 0 once trained)."""
    flat = traverse_util.flatten_dict(adapters, sep="/")
    found = [np.abs(np.asarray(x)).sum() for path, x in flat.items() if path.startswith(f"{expert}/") and path.endswith(f"/{lora._B}")]
    assert found, f"no adapters of {expert}"
    return float(sum(found))


@pytest.mark.parametrize("size,mode", [("tiny", "colocated"), ("tiny", "gap+tsp+tag+tcss"), ("tiny_a14b", "colocated")])
def test_tiny_iteration_through_train(size, mode, tmp_path, monkeypatch):
    """configs/wan22.py's tiny sizes through the real entry point. TI2V (tiny Wan2.2 VAE) starts
    each prompt's videos from its synthetic image: the VAE encoder encodes it, and every video the
    run decodes (the rollouts' finals) has that latent as its frame 0, colocated and in the full
    disaggregated pipeline. For the A14B pair the ladder's flow shift is 3, so the 4 steps'
    timesteps are 1000, 900 (high-noise expert) and 750, 500 (low-noise): the trained steps 0-2
    fall on both sides, and one LoRA update moves both experts' adapters (B starts at 0). The
    update is on-policy (ratio exactly 1), and the rollout's log-probabilities match the
    trainer's: rollout and training ran the same inputs (the clean frame, its timestep-0 tokens,
    the same expert)."""
    from digen_jax.app import workload

    encoded, finals = [], []
    encode, decode = vae_wan.encode_latents, workload.ModelZooWorkload.decode
    monkeypatch.setattr(vae_wan, "encode_latents", lambda *a: encoded.append(np.asarray(encode(*a))) or encode(*a))
    monkeypatch.setattr(workload.ModelZooWorkload, "decode",
                        lambda self, x, p=None: finals.append(np.asarray(x)) or decode(self, x, p))
    c = wan22_config(size)
    c.runtime.mode = mode
    if mode != "colocated":
        c.runtime.rollout_devices = c.runtime.train_devices = 4
    if size == "tiny_a14b":
        c.sampling.ladder_options = {"flow_shift": 3.0}
    state = loop.train(c, str(tmp_path), log=lambda _: None)
    with open(os.path.join(tmp_path, "metrics.jsonl")) as f:
        (row,) = [json.loads(line) for line in f]
    assert row["step"] == 1 and row["skipped"] == 0 and row["ratio_mean"] == 1 and row["grad_norm"] > 0
    assert row["rollout_logp_gap_max"] < 1e-5, row
    if size == "tiny":
        frames = np.concatenate(encoded)  # the iteration's prompts and the eval prompts
        assert frames.shape[1:] == (8, 1, 2, 2) and finals
        for x in np.concatenate(finals):
            assert np.min(np.abs(frames - x[None, :, :1]).max(axis=(1, 2, 3, 4))) == 0
    else:
        assert not encoded
        b_norms = {e: b_norm(state.trainable, e) for e in wan22.EXPERTS}
        assert all(v > 0 for v in b_norms.values()), b_norms


def test_pair_converts_from_a_pipeline_folder(experts, tmp_path):
    """The pipeline's transformer/ and transformer_2/ folders into one wan22 checkpoint of the
    pair, the boundary read from model_index.json; configs that differ are refused."""
    high, low, _, direct = experts
    high.save_pretrained(tmp_path / "transformer")
    low.save_pretrained(tmp_path / "transformer_2")
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline", "boundary_ratio": 0.875}))
    convert_expert_pair(str(tmp_path / "transformer"), str(tmp_path / "transformer_2"), str(tmp_path / "out"),
                        log=lambda _: None)
    family, cfg, params = load_checkpoint(str(tmp_path / "out"), dtype="float32", param_dtype="float32")
    assert family is wan22.FAMILY and cfg.boundary_ratio == 0.875
    jax.tree.map(np.testing.assert_array_equal, params, direct)
    random_wan(13, num_layers=1).save_pretrained(tmp_path / "other")
    with pytest.raises(ConversionError, match=r"configs differ in \['num_layers'\]"):
        convert_expert_pair(str(tmp_path / "transformer"), str(tmp_path / "other"), str(tmp_path / "x"),
                            log=lambda _: None)


def test_per_token_timesteps_split_over_a_seq_mesh():
    """Sequence parallelism with per-token timesteps: the per-token modulations follow the tokens'
    split (Ulysses all-to-all in the program), and the forward equals the unsplit one."""
    cfg = wan22.VARIANTS["tiny"]
    module = wan22.make_module(cfg)
    inputs = wan22.FAMILY.example_inputs(cfg, batch=2, frames=2, height=4, width=4, text_seq_len=6)
    keys = iter(jax.random.split(jax.random.key(0), 4))
    inputs = {k: jax.random.normal(next(keys), v.shape, v.dtype) for k, v in inputs.items()}
    inputs["timestep"] = jnp.concatenate([jnp.zeros((2, 16)), jnp.full((2, 16), 700.0)], axis=1)  # clean first frame
    params = module.init(jax.random.key(1), **inputs)["params"]
    forward = jax.jit(lambda p, x: module.apply({"params": p}, **x))
    ref = forward(params, inputs)
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(-1, 2), ("data", "seq"))
    with jax.set_mesh(mesh):
        compiled = forward.lower(params, inputs).compile()
        out = compiled(params, inputs)
    assert "all-to-all" in compiled.as_text()
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5)


def test_low_noise_steps_take_the_second_guidance_scale():
    """`sampling.cfg_scale_2` (diffusers' guidance_scale_2): samples whose timestep is below the
    boundary are guided with it, the others with cfg_scale; it needs a pair and CFG on."""
    from digen_jax.rl.rollout import SamplerSpec, guided_velocity

    def denoiser(params, latents, cond, sigma):  # v = text: negative 0, positive 1
        return jnp.broadcast_to(cond.text.mean(axis=(1, 2)).reshape(-1, 1, 1, 1, 1), latents.shape)

    spec = SamplerSpec("wan", 4.0, False, cfg_scale_2=3.0, boundary_timestep=875.0)
    cond = Conditioning(jnp.ones((3, 2, 4)), None, None)
    negative = Conditioning(jnp.zeros((1, 2, 4)), None, None)
    sigma = jnp.asarray([0.9, 0.875, 0.874])
    v = guided_velocity(denoiser, spec, None, jnp.zeros((3, 4, 1, 2, 2)), cond, sigma, negative)
    np.testing.assert_array_equal(np.asarray(v[:, 0, 0, 0, 0]), [4.0, 4.0, 3.0])
    with pytest.raises(ValueError, match="one transformer"):
        SamplerSpec("wan", 4.0, False, cfg_scale_2=3.0)
    with pytest.raises(ValueError, match="needs true CFG"):
        SamplerSpec("wan", 1.0, False, cfg_scale_2=3.0, boundary_timestep=875.0)


@pytest.mark.gpu
def test_full_size_ti2v_5b_forward_matches_diffusers_on_gpu():
    """Wan2.2-TI2V-5B at full size (random weights, float32, highest matmul precision on both
    sides) on the same card: a 480x832 clip of 9 frames (3 latent frames, 1170 tokens), the
    first frame's tokens at timestep 0 as TI2V keeps a conditioning frame clean, 512 text
    tokens. CPU counterparts: test_wan.py's test_parity_with_diffusers and
    test_per_token_timesteps_route_by_the_step (tiny configs, per-token timesteps)."""
    cfg = wan22.VARIANTS["ti2v-5b"]
    fields = ("num_attention_heads", "attention_head_dim", "in_channels", "out_channels", "ffn_dim", "num_layers")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    with torch.device("cuda"):  # the default init of 5 B parameters, on the card
        model = WanTransformer3DModel(**{f: getattr(cfg, f) for f in fields}).eval()
    frames, rows, cols = 3, 30, 52
    inputs = wan_inputs(model, 1, frames, rows, cols, 512)
    tokens_per_frame = rows // 2 * cols // 2
    per_token = torch.full((1, frames * tokens_per_frame), 700.5)
    per_token[0, :tokens_per_frame] = 0.0
    inputs["timestep"] = per_token
    with torch.no_grad():
        ref = model(**{k: v.cuda() for k, v in inputs.items()}).sample.cpu().numpy()
    model = model.cpu()
    torch.cuda.empty_cache()
    apply_fn, params = from_diffusers(model, family="wan22", attention_impl="xla")
    del model
    with jax.default_matmul_precision("highest"):
        out = apply_fn(params, **to_numpy(inputs))
    err = rel_err(out, ref)
    print(f"Wan2.2-TI2V-5B 3x480x832 fp32 forward, JAX vs diffusers on {jax.devices()[0].device_kind}: rel err {err:.2e}")
    assert err <= 1e-4


def test_first_frame_step_matches_the_ti2v_pipeline():
    """One denoising step with a conditioning first frame against diffusers' Wan2.2-TI2V path
    (`WanImageToVideoPipeline` with `expand_timesteps`): the transformer's input keeps the
    condition on latent frame 0 (`(1 - mask) * condition + mask * latents`), its timestep is
    `mask[:, ::2, ::2] * t` per token, CFG runs both halves on that input, the scheduler steps
    the latents and the frame is put back. Ours: the per-token timesteps, an ODE step (the
    pipeline's Euler scheduler) and an SDE step, whose log-prob is the Wan step's over the
    generated frames alone."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from digen_jax import diffusion
    from digen_jax.rl.rollout import Sampler, SamplerSpec

    model = random_wan(14, in_channels=8, out_channels=8)
    cfg = wan22.FAMILY.config_from_diffusers(dict(model.config), dtype="float32", param_dtype="float32")
    params = convert_weights(wan22.FAMILY, cfg, torch_state_dict_arrays(model), source="tiny ti2v")
    scheduler = FlowMatchEulerDiscreteScheduler(shift=5.0)
    scheduler.set_timesteps(4)
    step, guidance = 1, 5.0
    g = torch.Generator().manual_seed(3)
    latents, condition = torch.randn(2, 8, 3, 4, 6, generator=g), torch.randn(2, 8, 1, 4, 6, generator=g)
    text, negative = torch.randn(2, 5, 32, generator=g), torch.randn(1, 5, 32, generator=g)
    # diffusers (pipeline_wan_i2v.py, expand_timesteps): latents keep frame 0 at the condition.
    mask = torch.ones(1, 1, 3, 4, 6)
    mask[:, :, 0] = 0
    latents = (1 - mask) * condition + mask * latents
    t = scheduler.timesteps[step]
    timestep = (mask[0][0][:, ::2, ::2] * t).flatten().unsqueeze(0).expand(2, -1)
    model_input = (1 - mask) * condition + mask * latents
    with torch.no_grad():
        cond_v = model(model_input, timestep, text).sample
        uncond_v = model(model_input, timestep, negative.expand(2, -1, -1)).sample
    velocity = uncond_v + guidance * (cond_v - uncond_v)
    scheduler._step_index = step
    stepped = scheduler.step(velocity, t, latents, return_dict=False)[0]
    reference = ((1 - mask) * condition + mask * stepped).numpy()

    sigmas = scheduler.sigmas.numpy()
    ours_t = wan.transformer.first_frame_timesteps(cfg, latents.shape, jnp.full((2,), float(t)))
    assert rel_err(ours_t, timestep.numpy()) <= 1e-6 and float(ours_t[0, 0]) == 0.0
    sampler = Sampler(make_denoiser(wan22.FAMILY, wan22.make_module(cfg)), SamplerSpec("wan", guidance), sigmas,
                      Conditioning(jnp.asarray(negative.numpy())))
    cond = Conditioning(jnp.asarray(text.numpy()), first_frame=jnp.asarray(condition.numpy()))
    x, keys = jnp.asarray(latents.numpy()), jax.random.split(jax.random.key(0), 2)
    ode, log_prob, _ = sampler.step(params, x, cond, step, 0.0, keys)  # noise level 0: the Euler step
    assert rel_err(ode, reference) <= 1e-4, rel_err(ode, reference)
    np.testing.assert_array_equal(np.asarray(ode[:, :, :1]), condition.numpy())
    assert not np.any(np.asarray(log_prob))
    # The SDE step: the frame stays; mean and log-prob are the Wan step's on the generated frames.
    sde, log_prob, mean = sampler.step(params, x, cond, step, 1.0, keys)
    np.testing.assert_array_equal(np.asarray(sde[:, :, :1]), condition.numpy())
    expected = diffusion.flow_grpo_wan_step(x[:, :, 1:], jnp.asarray(velocity.numpy())[:, :, 1:], sigmas, step,
                                            prev_sample=sde[:, :, 1:])
    assert mean.shape == (2, 8, 2, 4, 6) and rel_err(mean, np.asarray(expected.mean)) <= 1e-4
    assert rel_err(log_prob, np.asarray(expected.log_prob)) <= 1e-4
