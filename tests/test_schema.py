"""configs/schema.py: every key of every config stated once, config files setting only what
differs from it, and its allowed values equal to the library's own."""
import ast
import importlib
import os

import ml_collections
import pytest

from configs import schema
from digen_jax.models.stacking import REMAT_POLICIES
from digen_jax.rl import losses, optim, rollout, timesteps
from digen_jax.rl.trainer import ALGORITHMS, ONPOLICY_ANCHORS
from digen_jax.app import run_sizing
from digen_jax.runtime import memory_plan
from digen_jax.runtime.plan import MODES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_FILES = sorted(
    os.path.join(d, f) for d in ("configs", os.path.join("configs", "paper"))
    for f in os.listdir(os.path.join(ROOT, d)) if f.endswith(".py") and f not in ("__init__.py", "schema.py")
)


def _flat(c, prefix=""):
    out = {}
    for k, v in c.items():
        key = prefix + k
        if isinstance(v, ml_collections.ConfigDict) and key not in schema.KEYS:
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def _configs():
    for path in CONFIG_FILES:
        module = importlib.import_module(path[:-3].replace(os.sep, "."))
        if hasattr(module, "get_config"):
            if path.endswith("tpu.py"):
                sizes = ("qwenimage", "wan21/tiny")
            else:
                sizes = getattr(module, "SIZES", ("full", "tiny")) if module.get_config.__code__.co_argcount else (None,)
            for size in sizes:
                config = module.get_config() if size is None else module.get_config(size)
                if isinstance(config, ml_collections.ConfigDict) and "model" in config:  # not testbeds.py's pools
                    yield f"{path}:{size}", config


def test_every_key_of_every_config_is_in_the_schema_with_an_allowed_value():
    seen = 0
    for name, config in _configs():
        for key, value in _flat(config).items():
            assert key in schema.KEYS, f"{name}: {key} is not in configs/schema.py"
            choices = schema.KEYS[key].choices
            assert choices is None or value in choices, f"{name}: {key}={value!r} not in {choices}"
        seen += 1
    assert seen >= 20


def test_config_files_set_only_what_differs_from_the_schema():
    """In a config built from the schema (`schema.config(...)`), a literal assigned to a key
    (`c.rl.clip_range = 1e-4`) differs from its default: the default is stated once, in the schema."""
    restated, built = [], 0
    for path in CONFIG_FILES:
        source = open(os.path.join(ROOT, path)).read()
        if "schema.config(" not in source:
            continue  # recipes and configs derived from another config set what differs from it
        built += 1
        tree = ast.parse(source)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Assign):
                continue
            for target in node.targets:
                names, t = [], target
                while isinstance(t, ast.Attribute):
                    names.append(t.attr)
                    t = t.value
                if not (isinstance(t, ast.Name) and t.id == "c" and names):
                    continue
                key = ".".join(reversed(names))
                try:
                    value = ast.literal_eval(node.value)
                except ValueError:
                    continue
                if key in schema.KEYS and value == schema.KEYS[key].default:
                    restated.append(f"{path}:{node.lineno} {key} = {value!r}")
    assert built >= 5 and not restated, restated


def test_schema_choices_are_the_librarys():
    keys = schema.KEYS
    assert set(keys["runtime.mode"].choices) == set(MODES) | {run_sizing.AUTO_MODE}
    assert set(keys["runtime.tag_precision"].choices) == set(memory_plan.TAG_PRECISION)
    assert set(keys["runtime.colocated_sampling"].choices) == set(memory_plan.COLOCATED_SAMPLING)
    assert set(keys["rl.policy_loss"].choices) == set(losses.POLICY_LOSSES)
    assert set(keys["rl.optimizer_state_dtype"].choices) == set(optim.OPTIMIZER_STATE_DTYPES)
    assert set(keys["sampling.sde_type"].choices) == set(rollout.SDE_TYPES)
    assert set(keys["rl.step_selection"].choices) == set(timesteps.STEP_SELECTIONS)
    assert set(keys["rl.onpolicy_anchor"].choices) == set(ONPOLICY_ANCHORS)
    assert set(keys["rl.algorithm"].choices) == set(ALGORITHMS)
    assert keys["model.remat_policy"].default in REMAT_POLICIES


def test_groups_build_the_keys_a_config_holds():
    """`schema.config(*groups)` holds the base keys and its groups' only; every key has a meaning."""
    for group in schema.GROUPS:
        keys = set(_flat(schema.config(group)))
        expected = {k for k, spec in schema.KEYS.items() if spec.group in ("base", group)}
        assert keys == expected, group
    assert all(spec.meaning and spec.group in schema.GROUPS for spec in schema.KEYS.values())
    with pytest.raises(ValueError, match="unknown key groups"):
        schema.config("videos")
