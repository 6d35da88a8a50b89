"""rl/ and runtime/ are handed typed settings, never a config: neither imports ml_collections
nor reads a config section, and the settings the application layer builds carry every key
they are read from, with the config's values."""
import ast
import dataclasses
import os
import typing

import pytest

from configs import flux, schema, tiny
from digen_jax.app import settings as settings_lib
from digen_jax.runtime.settings import RunSettings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTIONS = {"rl", "sampling", "runtime", "model", "train", "reward", "data", "sharding", "task", "pretrain"}
# Sections looked up by name (`x.get("runtime")`, `x["runtime"]`): not those that are also role or
# attribute names ('train', 'reward', 'sharding'), nor 'rl' (the simulator reads bench results'
# recorded config, a JSON record).
LOOKED_UP = SECTIONS - {"train", "reward", "sharding", "rl"}


def _modules():
    for package in ("rl", "runtime"):
        folder = os.path.join(ROOT, "digen_jax", package)
        for name in sorted(os.listdir(folder)):
            if name.endswith(".py"):
                with open(os.path.join(folder, name)) as f:
                    yield f"digen_jax/{package}/{name}", ast.parse(f.read())


def test_rl_and_runtime_neither_import_ml_collections_nor_read_config_sections():
    found = []
    for path, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "ml_collections" for a in node.names):
                found.append(f"{path}:{node.lineno} imports ml_collections")
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ml_collections":
                found.append(f"{path}:{node.lineno} imports ml_collections")
            if (isinstance(node, ast.Attribute) and node.attr in SECTIONS and isinstance(node.value, ast.Name)
                    and node.value.id == "config"):
                found.append(f"{path}:{node.lineno} reads config.{node.attr}")
            keys = []
            if isinstance(node, ast.Call) and (getattr(node.func, "attr", None) or getattr(node.func, "id", None)) in (
                    "get", "_get", "getattr"):
                keys = [a.value for a in node.args if isinstance(a, ast.Constant)]
            elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
                keys = [node.slice.value]
            found += [f"{path}:{node.lineno} looks up section {key!r}" for key in keys if key in LOOKED_UP]
    assert not found, found


def _nested(cls) -> dict[str, type]:
    """The fields of `cls` that are settings of their own, and their classes."""
    return {name: t for name, t in typing.get_type_hints(cls).items() if dataclasses.is_dataclass(t)}


def _settings_classes():
    seen, todo = [], [RunSettings]
    while todo:
        cls = todo.pop()
        seen.append(cls)
        todo += list(_nested(cls).values())
    return seen


def test_every_settings_field_names_a_schema_key():
    """Each field of the settings (nested ones aside) is read from a key configs/schema.py states."""
    for cls in _settings_classes():
        fields = {f.name for f in dataclasses.fields(cls)} - set(_nested(cls))
        assert set(settings_lib.KEYS[cls]) == fields, cls.__name__
        for key in settings_lib.KEYS[cls].values():
            assert key in schema.KEYS, f"{cls.__name__}: {key}"


def _value(config, key):
    node = config
    for part in key.split("."):
        node = node[part]
    return node


@pytest.mark.parametrize("config", [tiny.get_config(), flux.get_config("tiny")], ids=["tiny", "flux"])
def test_settings_carry_the_config_values(config):
    built = settings_lib.run_settings(config)
    parts = {RunSettings: built}
    parts.update({cls: getattr(built, name) for name, cls in _nested(RunSettings).items()})
    assert set(parts) == set(_settings_classes())
    for cls, value in parts.items():
        for name, key in settings_lib.KEYS[cls].items():
            got, want = getattr(value, name), _value(config, key)
            if key == "reward.weights":  # the rewards in name order, and their weights
                want = tuple(sorted(want)) if name == "names" else tuple(want[n] for n in sorted(want))
            elif isinstance(want, (list, tuple)):
                want = tuple(tuple(x) if isinstance(x, (list, tuple)) else x for x in want)
            assert got == want, (cls.__name__, name, got, want)
    assert built.batch == config.rl.prompts_per_iteration * config.rl.group_size
