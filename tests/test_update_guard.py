"""The divergence guard of an optimizer update, and the numeric ranges of config keys."""
import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import tiny
from digen_jax.rl import make_optimizer
from digen_jax.app.config_ranges import CHOICES, RANGES, check_ranges
from digen_jax.rl.nft_trainer import NftConfig, NftTrainer
from digen_jax.rl.trainer import LossConfig, Trainer, is_unbuilt
from digen_jax.app.errors import ConfigError


def _trainer(learning_rate: float, **cfg) -> tuple[Trainer, object]:
    """A trainer whose update runs on a small tree (the update needs no sampler), its state."""
    trainer = Trainer(None, None, make_optimizer(learning_rate), LossConfig(**cfg))
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(0, 0.05, (16, 8)), jnp.float32), "b": jnp.zeros((8,), jnp.float32)}
    return trainer, trainer.init_state(params)


def _grads(state):
    return jax.tree.map(lambda p: jnp.full_like(p, 0.3), state.trainable)


@pytest.mark.parametrize("learning_rate", [math.nan, 1e6])
def test_nonfinite_or_exploding_updates_are_skipped(learning_rate):
    """Finite rewards, loss and gradients, but an update of NaN (lr nan) or of 1e6 per weight:
    the old guard (rewards, loss and gradient norm only) applied both."""
    trainer, state = _trainer(learning_rate)
    before = jax.tree.map(np.asarray, (state.trainable, state.opt_state, state.ema))
    for streak in (1, 2):
        state, metrics = trainer.apply_update(state, _grads(state), jnp.float32(1), jnp.bool_(True), True)
        assert int(metrics["skipped"]) == 1 and int(metrics["nonfinite_streak"]) == streak
    assert int(state.version) == 0
    for got, want in zip(jax.tree.leaves((state.trainable, state.opt_state, state.ema)), jax.tree.leaves(before)):
        np.testing.assert_array_equal(np.asarray(got), want)  # weights, optimizer state, EMA: all kept


def test_healthy_update_is_applied_and_the_bound_can_be_lifted():
    trainer, state = _trainer(1e-3)
    new, metrics = trainer.apply_update(state, _grads(state), jnp.float32(1), jnp.bool_(True), True)
    assert int(metrics["skipped"]) == 0 and int(new.version) == 1
    assert 0 < float(metrics["update_ratio"]) < 0.1  # about lr / rms(weights) = 1e-3 / 0.05
    # A step as large as the weights: over the default bound, applied without one.
    trainer, state = _trainer(0.2)
    assert int(trainer.apply_update(state, _grads(state), jnp.float32(1), jnp.bool_(True), True)[1]["skipped"]) == 1
    trainer, state = _trainer(0.2, max_update_ratio=math.inf)
    new, metrics = trainer.apply_update(state, _grads(state), jnp.float32(1), jnp.bool_(True), True)
    assert int(metrics["skipped"]) == 0 and int(new.version) == 1 and float(metrics["update_ratio"]) > 1


def test_bfloat16_state_keeps_its_dtypes_and_is_updated_in_place():
    """Full fine-tuning keeps bfloat16 weights and moments (`rl.optimizer_state_dtype='param'`):
    an update returns every leaf in its own dtype (the gradients are averaged in float32, which
    made optax's first moment float32) and writes the whole donated state in place."""
    trainer = Trainer(None, None, make_optimizer(1e-3), LossConfig())
    params = {"w": jnp.full((64, 32), 0.1, jnp.bfloat16), "b": jnp.zeros((32,), jnp.bfloat16)}
    state = trainer.init_state(params)
    dtypes = jax.tree.map(lambda x: x.dtype, state)
    args = (state, _grads(state), np.float32(2), jnp.bool_(True), np.bool_(True))
    analysis = trainer._commit_update.lower(*args).compile().memory_analysis()
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    assert analysis.alias_size_in_bytes >= state_bytes - 64  # scalars (version, counters) aside
    new, metrics = trainer.apply_update(*args)
    assert int(metrics["skipped"]) == 0 and int(new.version) == 1
    assert jax.tree.map(lambda x: x.dtype, new) == dtypes


def test_an_update_pinned_to_shardings_seen_before_compiles_nothing_new():
    """Every executor pins the trainer's update to its state sharding: a later executor of the
    run on equal shardings (its own mesh object) runs the commit program the first compiled,
    and one on other shardings gets its own, whose output has those shardings."""
    trainer, state = _trainer(1e-3)
    state = jax.device_get(state)  # host copies: each placement makes buffers of its own to donate

    def sharding(devices: int):
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("data",))
        return jax.tree.map(lambda _: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()), state)

    compiled = []

    def listen(event, secs, fun_name="", **kwargs):
        if event == "/jax/core/compile/backend_compile_duration" and "_commit" in fun_name:
            compiled.append(fun_name)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        commits = []
        for devices in (4, 4, 2):
            trainer.pin_state_sharding(sharding(devices))
            placed = jax.device_put(state, sharding(devices))
            before = len(compiled)
            new, metrics = trainer.apply_update(placed, _grads(placed), np.float32(1), np.bool_(True), np.bool_(True))
            assert int(metrics["skipped"]) == 0 and new.trainable["w"].sharding == sharding(devices).trainable["w"]
            commits.append(len(compiled) - before)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert commits == [1, 0, 1]


@pytest.mark.parametrize("name", ["tiny", "flux", "qwenimage", "wan21", "hunyuanvideo"])
def test_shipped_configs_are_in_range(name):
    check_ranges(importlib.import_module(f"configs.{name}").get_config())


def test_every_range_and_choice_names_a_key_of_some_config():
    configs = [importlib.import_module(f"configs.{name}").get_config() for name in ("tiny", "flux")]

    def present(config, key):
        for part in key.split("."):
            if not hasattr(config, "keys") or part not in config:
                return False
            config = config[part]
        return True

    keys = [r.key for r in RANGES] + [c.key for c in CHOICES]
    assert [key for key in keys if not any(present(config, key) for config in configs)] == []


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("rl.learning_rate", math.nan, r"rl\.learning_rate must be a number in \(0, inf\), got nan"),
        ("rl.learning_rate", -3e-4, r"rl\.learning_rate must be a number in \(0, inf\)"),
        ("rl.learning_rate", math.inf, r"rl\.learning_rate"),
        ("rl.clip_range", -1.0, r"rl\.clip_range must be a number in \(0, inf\)"),
        ("rl.adv_clip", 0.0, r"rl\.adv_clip"),
        ("rl.kl_beta", -0.1, r"rl\.kl_beta"),
        ("rl.is_cap", 0.0, r"rl\.is_cap"),
        ("rl.ema_decay", 1.0, r"rl\.ema_decay must be a number in \[0, 1\)"),
        ("rl.max_nonfinite_in_row", 0, r"rl\.max_nonfinite_in_row must be an integer in \[1, inf\)"),
        ("rl.max_update_ratio", 0.0, r"rl\.max_update_ratio"),
        ("sampling.num_steps", 1, r"sampling\.num_steps"),
        ("sampling.noise_level", -0.7, r"sampling\.noise_level"),
        ("train.iterations", -5, r"train\.iterations must be an integer in \[1, inf\)"),
        ("train.iterations", 0, r"train\.iterations"),
        ("train.checkpoint_every", -1, r"train\.checkpoint_every must be an integer in \[0, inf\), got -1 \(0: one checkpoint"),
        ("runtime.tag_microbatches", -2, r"runtime\.tag_microbatches"),
    ],
)
def test_out_of_range_values_name_the_key(key, value, message):
    config = tiny.get_config()
    section, name = key.split(".")
    config[section][name] = value
    with pytest.raises(ConfigError, match=message):
        check_ranges(config)


def test_optional_keys_accept_none_and_boundaries():
    config = tiny.get_config()
    config.rl.is_cap, config.rl.max_grad_norm = None, None
    config.rl.ema_decay = 0.0
    config.rl.adv_clip = math.inf
    config.rl.max_update_ratio = math.inf
    config.train.checkpoint_every = 0
    check_ranges(config)


@pytest.mark.parametrize("state_dtype", ["param", "float32"])
def test_an_unbuilt_initial_state_is_built_where_it_is_placed_equal_to_init_state(state_dtype):
    """`Trainer.unbuilt_state` holds only the weights; `build_state` makes the moments, EMA and
    (DiffusionNFT) old policy on the given shardings, leaf for leaf equal to `init_state`."""
    params = {"w": jnp.full((16, 8), 0.25, jnp.bfloat16), "b": jnp.full((8,), -0.5, jnp.bfloat16)}
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
    row = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    for trainer in (Trainer(None, None, make_optimizer(1e-3, state_dtype=state_dtype), LossConfig(use_ema=True)),
                    NftTrainer(None, None, make_optimizer(1e-3, state_dtype=state_dtype), LossConfig(), NftConfig())):
        want = trainer.init_state(params)
        unbuilt = trainer.unbuilt_state(params)
        assert is_unbuilt(unbuilt) and not is_unbuilt(want)
        assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(unbuilt.opt_state))
        sharding = jax.tree.map(lambda a: row if a.ndim else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()),
                                want)
        placed = jax.device_put(params, sharding.trainable)
        got = trainer.build_state(placed, sharding)
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for g, w, s in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(sharding)):
            assert g.dtype == w.dtype and g.sharding == s
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
