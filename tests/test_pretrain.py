"""Flow-matching pretraining on the shapes task: the loss falls, results are cached by their inputs."""
import dataclasses
import importlib.util
import os
import re

import jax
import numpy as np
import pytest

from digen_jax.data import ShapesTask
from digen_jax.models.flux import FluxConfig
from digen_jax.app.pretrain import cache_key, check_compatible, init_params, pretrained_params

HYPER = dict(steps=30, batch_size=8, learning_rate=3e-3, seed=0)


def _tiny_model() -> FluxConfig:
    """The architecture of configs/tiny.py, the CPU demo's model."""
    path = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "tiny.py")
    spec = importlib.util.spec_from_file_location("tiny_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.get_config().model
    return FluxConfig(**model.arch.to_dict(), dtype=model.dtype, param_dtype=model.param_dtype)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One short pretraining run through the cache: (cache dir, params, log lines)."""
    cache_dir = str(tmp_path_factory.mktemp("pretrain_cache"))
    lines = []
    params = pretrained_params(_tiny_model(), ShapesTask(), cache_dir=cache_dir, log_every=5, log=lines.append, **HYPER)
    return cache_dir, params, lines


def _logged_losses(lines):
    return [float(m.group(1)) for line in lines if (m := re.search(r"loss ([0-9.]+)", line))]


def test_loss_decreases(trained):
    _, params, lines = trained
    losses = _logged_losses(lines)
    assert len(losses) == HYPER["steps"] // 5  # one line per 5-step window
    assert losses[-1] < 0.5 * losses[0], losses
    init = init_params(_tiny_model(), jax.random.key(0))
    assert jax.tree.structure(params) == jax.tree.structure(init)
    assert all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(params))


def test_cache_hit_loads_identical_params(trained):
    cache_dir, params, first_lines = trained
    assert any("saved pretrained model" in line for line in first_lines)
    entries = os.listdir(cache_dir)
    assert entries == [cache_key(_tiny_model(), ShapesTask(), guidance=3.5, **HYPER)]
    lines = []
    again = pretrained_params(_tiny_model(), ShapesTask(), cache_dir=cache_dir, log=lines.append, **HYPER)
    assert not _logged_losses(lines)  # no training step ran
    assert len(lines) == 1 and lines[0].startswith("loaded pretrained model")
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, again)


def test_cache_key_covers_every_input():
    model, task = _tiny_model(), ShapesTask()
    base = cache_key(model, task, guidance=3.5, **HYPER)
    assert cache_key(_tiny_model(), ShapesTask(), guidance=3.5, **HYPER) == base
    changed = [
        cache_key(model, task, guidance=3.5, **{**HYPER, "steps": 31}),
        cache_key(model, task, guidance=3.5, **{**HYPER, "batch_size": 16}),
        cache_key(model, task, guidance=3.5, **{**HYPER, "learning_rate": 1e-3}),
        cache_key(model, task, guidance=3.5, **{**HYPER, "seed": 1}),
        cache_key(model, task, guidance=4.0, **HYPER),
        cache_key(model, ShapesTask(label_noise=0.5), guidance=3.5, **HYPER),
        cache_key(model, ShapesTask(embedding_seed=7), guidance=3.5, **HYPER),
        cache_key(dataclasses.replace(model, num_layers=3), task, guidance=3.5, **HYPER),
        cache_key(dataclasses.replace(model, dtype="bfloat16"), task, guidance=3.5, **HYPER),
    ]
    assert len(set(changed) | {base}) == len(changed) + 1


def test_rejects_a_model_that_does_not_fit_the_task():
    with pytest.raises(ValueError, match="in_channels"):
        check_compatible(dataclasses.replace(_tiny_model(), in_channels=16), ShapesTask())
    with pytest.raises(ValueError, match="joint_attention_dim"):
        check_compatible(_tiny_model(), ShapesTask(embed_dim=64))
