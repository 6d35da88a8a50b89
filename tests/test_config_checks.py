"""Config checks live at the application boundary and run once per run.

Every function that checks a config (a `validate_*` or `check_*` taking the config or one of
its sections) is defined in app/validation.py, app/config_ranges.py or app/machine_checks.py;
the pure layers keep only assertions on their own arguments. A run validates its config once:
neither the `Run` nor the runtime's executor checks it again."""
import ast
import os

import pytest

from digen_jax.app import loop, machine_checks, random_init, validation, workload
from digen_jax.app.bench import system
from digen_jax.models import FAMILIES
from digen_jax.runtime import executor as executor_lib
from test_train_loop import small_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECK_FILES = {os.path.join("digen_jax", "app", name)
               for name in ("validation.py", "config_ranges.py", "machine_checks.py")}
# Parameter names that hand a function a config or one of its sections.
CONFIG_PARAMS = {"config", "rl", "rt", "runtime", "sampling", "model", "train", "reward", "data", "sharding"}


def _python_files():
    for top in ("digen_jax", "launch", "configs", "convert"):
        for folder, _, names in os.walk(os.path.join(ROOT, top)):
            for name in names:
                if name.endswith(".py"):
                    yield os.path.relpath(os.path.join(folder, name), ROOT)


def test_config_checks_are_defined_in_at_most_three_app_files():
    where = {}
    for path in _python_files():
        with open(os.path.join(ROOT, path)) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name.startswith(("validate_", "check_")):
                params = {a.arg for a in node.args.args + node.args.kwonlyargs}
                if params & CONFIG_PARAMS:
                    where.setdefault(path, []).append(node.name)
    outside = {path: names for path, names in where.items() if path not in CHECK_FILES}
    assert not outside, f"config checks outside {sorted(CHECK_FILES)}: {outside}"
    assert len(where) <= 3


CHECKS = {validation: ("check_ranges", "validate_runtime_config", "validate_rollout_precision", "validate_group_size",
                        "validate_policy_loss", "validate_step_selection"),
          machine_checks: ("check_devices", "check_memory", "check_fits", "check_pretrain_cache")}


class Stop(Exception):
    pass


def _counted_checks(monkeypatch, pretrain_cache_dir, *entry_points) -> tuple:
    """A small config whose run stops at its first iteration (random weights for pretraining, one
    block), and the calls of every check (and of `entry_points`, (module, name) pairs) counted."""
    monkeypatch.setattr(workload, "pretrained_params",
                        lambda model_cfg, task, *, seed, **_: random_init.random_params(FAMILIES["flux"], model_cfg, seed))
    config = small_config(pretrain_cache_dir)
    config.model.arch.num_layers = config.model.arch.num_single_layers = 1
    calls = {}

    def counted(module, name):
        original = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    for module, name in entry_points:
        counted(module, name)
    for module, names in CHECKS.items():
        for name in names:
            counted(module, name)

    def first_iteration(self, k):
        raise Stop

    monkeypatch.setattr(executor_lib.Executor, "iteration", first_iteration)
    return config, calls


def test_a_run_checks_its_config_once(pretrain_cache_dir, tmp_path, monkeypatch):
    """`loop.train` up to its first iteration: every check ran exactly once."""
    config, calls = _counted_checks(monkeypatch, pretrain_cache_dir, (loop, "validate_config"))
    with pytest.raises(Stop):
        loop.train(config, str(tmp_path / "run"), log=lambda _: None)
    assert calls == {name: 1 for name in calls} and len(calls) == 11, calls


def test_the_system_bench_checks_its_config_once(pretrain_cache_dir, tmp_path, monkeypatch):
    """The system bench (`run_modes`) in the config's own mode, up to its first iteration: the
    config and that mode's runtime checked exactly once each."""
    config, calls = _counted_checks(monkeypatch, pretrain_cache_dir, (system, "validate_bench_arguments"),
                                    (validation, "validate_config"))
    with pytest.raises(Stop):
        system.run_modes(config, [config.runtime.mode], str(tmp_path / "bench"), warmups=0, iterations=1,
                         log=lambda _: None)
    assert calls == {name: 1 for name in calls} and len(calls) == 12, calls
