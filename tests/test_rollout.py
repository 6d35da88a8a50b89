"""Rollout and trainer: on-policy ratio 1, per-sample determinism, step plans, guarded updates."""
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from digen_jax import diffusion
from digen_jax.models import flux
from digen_jax.rl import lora, optim
from digen_jax.rl.rollout import Conditioning, Sampler, SamplerSpec, make_denoiser
from digen_jax.app.validation import validate_step_selection
from digen_jax.rl.timesteps import StepSettings, plan_steps
from digen_jax.rl.grpo_trainer import GrpoTrainer, build_units
from digen_jax.rl.trainer import LossConfig

RES, TEXT_LEN, STEPS = 8, 4, 4
CFG = dataclasses.replace(flux.VARIANTS["tiny"], in_channels=12, num_layers=1, num_single_layers=1)
LATENT_SHAPE = ((RES // 2) ** 2, 12)


def make_params(seed=0):
    inputs = {k: (None if v is None else jnp.zeros(v.shape, v.dtype)) for k, v in flux.example_inputs(CFG, 1, 16, TEXT_LEN).items()}
    params = nn.unbox(flux.FluxTransformer(CFG).init(jax.random.key(seed), **inputs))["params"]
    return jax.tree.map(lambda p: p + 0.05 * jax.random.normal(jax.random.key(seed + 1), p.shape), params)


def make_sampler(spec=SamplerSpec(), negative=None):
    sigmas = diffusion.sigma_ladder("flux", STEPS, image_seq_len=LATENT_SHAPE[0]).sigmas
    denoiser = make_denoiser(flux.FAMILY, flux.FluxTransformer(CFG), guidance=3.5, image_grid=(RES // 2, RES // 2))
    return Sampler(denoiser, spec, sigmas, negative)


def make_cond(batch, seed=3):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return Conditioning(
        jax.random.normal(k1, (batch, TEXT_LEN, CFG.joint_attention_dim)), jax.random.normal(k2, (batch, CFG.pooled_projection_dim))
    )


def rl_config(**overrides):
    return StepSettings(**(
        dict(step_selection="fraction", timestep_fraction=0.99, sde_window_size=2, sde_window_range=(0, 3), window_shift_every=2)
        | overrides
    ))


@pytest.mark.parametrize(
    "spec,noise",
    [(SamplerSpec("sde"), 0.7), (SamplerSpec("cps"), 0.8), (SamplerSpec("dance"), 0.3), (SamplerSpec("wan"), 1.0),
     (SamplerSpec("sde", cfg_scale=4.0, cfg_rescale=True), 1.2)],
)
def test_on_policy_ratio_is_one(spec, noise):
    """The trainer recomputes exactly the behaviour log-prob: ratio 1 to 1e-6 in fp32."""
    negative = make_cond(1, seed=9) if spec.cfg_scale > 1 else None
    sampler = make_sampler(spec, negative)
    params, batch = make_params(), 4
    cond = make_cond(batch)
    keys = jax.random.split(jax.random.key(5), batch)
    traj = sampler.rollout(params, cond, keys, np.full(STEPS, noise, np.float32), LATENT_SHAPE, 0)
    trained = jnp.tile(jnp.arange(STEPS - 1), (batch, 1))
    units = build_units(traj, cond, jnp.zeros(batch), trained)
    trainer = GrpoTrainer(sampler, None, optim.make_optimizer(1e-3), LossConfig())
    log_prob = trainer.log_prob_fn(params, units)
    assert np.isfinite(np.asarray(units.old_log_prob)).all()
    np.testing.assert_allclose(np.exp(np.asarray(log_prob - units.old_log_prob)), 1.0, atol=1e-6)


def test_trajectories_are_per_sample_deterministic():
    """A sample's trajectory depends on its key, not on the batch it was generated in."""
    sampler, params = make_sampler(), make_params()
    cond = make_cond(4)
    keys = jax.random.split(jax.random.key(1), 4)
    noise = np.full(STEPS, 0.7, np.float32)
    full = sampler.rollout(params, cond, keys, noise, LATENT_SHAPE, 0)
    part = sampler.rollout(params, cond.take(jnp.array([2, 0])), keys[jnp.array([2, 0])], noise, LATENT_SHAPE, 0)
    np.testing.assert_allclose(part.latents, full.latents[jnp.array([2, 0])], atol=1e-5)
    assert int(full.version) == 0 and full.latents.shape == (4, STEPS + 1, *LATENT_SHAPE)


def test_zero_noise_rollout_is_the_euler_ode():
    sampler, params = make_sampler(), make_params()
    cond = make_cond(2)
    keys = jax.random.split(jax.random.key(2), 2)
    traj = sampler.rollout(params, cond, keys, np.zeros(STEPS, np.float32), LATENT_SHAPE, 0)
    x = traj.latents[:, 0]
    for i in range(STEPS):
        x = x + (sampler.sigmas[i + 1] - sampler.sigmas[i]) * sampler.velocity(params, x, cond, i)
    np.testing.assert_allclose(traj.final, x, atol=2e-4)  # jit vs eager rounding; a wrong step is O(1) off
    np.testing.assert_array_equal(traj.log_probs, 0.0)


def test_step_plans():
    rng = np.random.default_rng(0)
    frac = plan_steps(rl_config(), 10, 0.7, 3, 0, rng)
    assert frac.trained.tolist() == [list(range(9))] * 3 and (frac.noise_levels == 0.7).all()
    win = plan_steps(rl_config(step_selection="window", sde_window_range=(0, 5)), 10, 1.2, 2, 0, rng)
    start = win.trained[0, 0]
    assert 0 <= start <= 3 and win.trained.tolist() == [[start, start + 1]] * 2
    assert (win.noise_levels[start : start + 2] == 1.2).all() and win.noise_levels.sum() == pytest.approx(2.4)
    mix = [plan_steps(rl_config(step_selection="mixgrpo"), 6, 0.7, 1, it, rng).trained[0, 0] for it in range(6)]
    assert mix == [0, 0, 1, 1, 0, 0]  # window (size 2 in [0, 3)) advances every 2 iterations and wraps
    dance = plan_steps(rl_config(step_selection="random", timestep_fraction=0.6), 11, 0.3, 4, 0, rng)
    assert dance.trained.shape == (4, 6) and dance.trained.max() <= 9
    assert len({tuple(r) for r in dance.trained}) > 1  # a different subset per sample


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(timestep_fraction=1.0), "trains the last step"),
        (dict(step_selection="window", sde_window_range=(2, 9)), "sde_window_size"),
        (dict(step_selection="bogus"), "rl.step_selection"),
        (dict(step_selection="random", timestep_fraction=0.01), "rl.timestep_fraction"),
    ],
)
def test_step_selection_outside_ladder_is_rejected(overrides, match):
    with pytest.raises(ValueError, match=match):
        validate_step_selection(rl_config(**overrides), 8)


def _units(sampler, params, batch=8):
    cond = make_cond(batch)
    traj = sampler.rollout(params, cond, jax.random.split(jax.random.key(4), batch), np.full(STEPS, 0.7, np.float32), LATENT_SHAPE, 0)
    adv = jnp.linspace(-1.5, 1.5, batch)
    return build_units(traj, cond, adv, jnp.tile(jnp.arange(STEPS - 1), (batch, 1)))


def test_update_does_not_depend_on_micro_batching():
    sampler, params = make_sampler(), make_params()
    units = _units(sampler, params)
    results = []
    for micro in (units.size, units.size // 4):
        # Plain SGD, so parameters differ exactly by the (accumulated) gradients.
        trainer = GrpoTrainer(sampler, None, optax.sgd(1e-2), LossConfig(clip_range=0.2))
        state, metrics = trainer.update(trainer.init_state(jax.tree.map(jnp.copy, params)), units, micro, True)
        assert int(state.version) == 1 and int(metrics["skipped"]) == 0
        results.append(state.trainable)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8), *results)
    changed = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), results[0], params)
    assert all(jax.tree.leaves(changed))


def test_nonfinite_rewards_skip_the_update():
    sampler, params = make_sampler(), make_params()
    units = _units(sampler, params)
    trainer = GrpoTrainer(sampler, None, optim.make_optimizer(1e-3), LossConfig())
    state = trainer.init_state(jax.tree.map(jnp.copy, params))  # the update donates its state
    for streak in (1, 2):
        state, metrics = trainer.update(state, units, units.size, jnp.bool_(False))
        assert int(metrics["skipped"]) == 1 and int(state.nonfinite_streak) == streak and int(state.version) == 0
    jax.tree.map(np.testing.assert_array_equal, state.trainable, params)
    state, _ = trainer.update(state, units, units.size, jnp.bool_(True))
    assert int(state.nonfinite_streak) == 0 and int(state.version) == 1


def test_lora_training_moves_only_adapters_and_kl_starts_at_zero():
    sampler, params = make_sampler(), make_params()
    units = _units(sampler, params)
    adapters = lora.init_lora(params, rank=2, target_patterns=["attn/to_"], key=jax.random.key(0))
    trainer = GrpoTrainer(sampler, params, optim.make_optimizer(1e-2), LossConfig(kl_beta=0.1, lora_scale=lora.lora_scale(2, 4.0)))
    state = trainer.init_state(adapters)
    state, metrics = trainer.update(state, units, units.size, True)
    assert float(metrics["kl"]) < 1e-10  # B = 0 at init: the policy is the reference
    merged = trainer.params_for(state.trainable)
    q = merged["double_blocks"]["attn"]["to_q"]["kernel"]
    assert float(jnp.abs(q - params["double_blocks"]["attn"]["to_q"]["kernel"]).max()) > 0
    np.testing.assert_array_equal(merged["proj_out"]["kernel"], params["proj_out"]["kernel"])
    _, metrics = trainer.update(state, units, units.size, True)
    assert float(metrics["kl"]) > 1e-8


def test_lora_applied_on_the_fly_equals_merged_weights():
    sampler, params = make_sampler(), make_params()
    adapters = lora.init_lora(params, rank=2, target_patterns=["attn/to_", "proj_mlp"], key=jax.random.key(3))
    adapters = jax.tree.map(lambda a: a + 0.1, adapters)  # non-zero B, so the adapters matter
    cond = make_cond(2)
    x = jax.random.normal(jax.random.key(4), (2, *LATENT_SHAPE))
    merged = lora.merge_lora(params, adapters, scale=0.5)
    on_the_fly = sampler.velocity(lora.LoraWeights(params, adapters, 0.5), x, cond, 1)
    np.testing.assert_allclose(on_the_fly, sampler.velocity(merged, x, cond, 1), atol=1e-5)
    assert float(jnp.abs(on_the_fly - sampler.velocity(params, x, cond, 1)).max()) > 1e-3
