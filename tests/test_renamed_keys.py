"""A renamed config key keeps working under its old name (`rl.micro_batch_size`, now
`rl.grad_chunk_size`): the same settings and one warning line naming both keys; both names given
different values on the command line: one error line."""
import importlib
import os
import subprocess
import sys

import pytest

from configs import tiny
from digen_jax.app import renamed_keys, resume_keys
from digen_jax.app.errors import ConfigError
from digen_jax.app.settings import run_settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "launch", "train.py")
ZOO = ("flux", "flux_nft", "qwenimage", "qwenimage_full", "sd35", "wan21", "wan22", "hunyuanvideo")


def test_old_key_gives_the_same_settings_and_one_warning(capsys):
    new, old = tiny.get_config(), tiny.get_config()
    new.rl.grad_chunk_size = 56
    with old.rl.unlocked():
        old.rl.micro_batch_size = 56  # a config derived from tiny's (which sets the new key to 112)
    assert run_settings(old) == run_settings(new)
    assert run_settings(old).grad_chunk_size == 56 and "micro_batch_size" not in old.rl
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines  # the second build found the key moved already
    assert all(text in lines[0] for text in ("rl.micro_batch_size", "rl.grad_chunk_size", "will be removed",
                                             "replaces rl.grad_chunk_size=112")), lines[0]


def test_command_line_overrides_are_renamed():
    argv = ["train.py", "--config=c.py", "--config.rl.micro_batch_size=8", "--config.rl.micro_batch_size", "8",
            "--config.rl.grad_chunk_size=8", "--workdir=w"]
    assert renamed_keys.rename_overrides(argv) == [("rl.micro_batch_size", "rl.grad_chunk_size")]
    assert argv == ["train.py", "--config=c.py", "--config.rl.grad_chunk_size=8", "--config.rl.grad_chunk_size", "8",
                    "--config.rl.grad_chunk_size=8", "--workdir=w"]
    with pytest.raises(ConfigError, match="micro_batch_size=8 and --config.rl.grad_chunk_size=4 both given"):
        renamed_keys.rename_overrides(["--config.rl.micro_batch_size=8", "--config.rl.grad_chunk_size=4"])


def test_a_command_line_override_wins_over_the_files_old_key(capsys):
    config = tiny.get_config()
    config.rl.grad_chunk_size = 28  # as the override set it
    with config.rl.unlocked():
        config.rl.micro_batch_size = 56
    renamed_keys.resolve(config, command_line=["rl.grad_chunk_size"])
    assert config.rl.grad_chunk_size == 28 and "micro_batch_size" not in config.rl
    assert "rl.micro_batch_size is now rl.grad_chunk_size" in capsys.readouterr().err


def test_a_checkpoint_recording_the_old_name_resumes_without_a_change():
    config = tiny.get_config()
    saved = resume_keys.settings(config)
    saved["rl.micro_batch_size"] = saved.pop("rl.grad_chunk_size")
    assert resume_keys.changes(saved, config) == {}
    saved["rl.micro_batch_size"] += 1
    assert list(resume_keys.changes(saved, config)) == ["rl.grad_chunk_size"]


@pytest.mark.parametrize("name", ZOO)
def test_zoo_configs_hold_the_new_key_only(name):
    rl = importlib.import_module(f"configs.{name}").get_config().rl
    assert "grad_chunk_size" in rl and "micro_batch_size" not in rl


def test_launcher_old_key_and_both_keys():
    """--print_config with the old key: its value under the new key, one warning line; with both
    names at different values: one error line, status 2, nothing printed."""
    env = os.environ | {"JAX_PLATFORMS": "cpu"}
    commands = {"old": ["--config.rl.micro_batch_size=56"],
                "both": ["--config.rl.micro_batch_size=56", "--config.rl.grad_chunk_size=28"]}
    procs = {name: subprocess.Popen([sys.executable, TRAIN, "--print_config", *args], cwd=ROOT, env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE) for name, args in commands.items()}
    done = {name: (proc.communicate(timeout=300), proc.returncode) for name, proc in procs.items()}
    (out, err), code = done["old"]
    assert code == 0 and "rl.grad_chunk_size = 56" in out.splitlines() and "micro_batch_size" not in out, err
    assert [line for line in err.splitlines() if "micro_batch_size" in line] == [
        renamed_keys.warning("rl.micro_batch_size", "rl.grad_chunk_size")], err
    (out, err), code = done["both"]
    assert code == 2 and not out and "Traceback" not in err, err
    assert err.strip().splitlines() == [
        "error: --config.rl.micro_batch_size=56 and --config.rl.grad_chunk_size=28 both given: rl.micro_batch_size "
        "is the old name of rl.grad_chunk_size; give only --config.rl.grad_chunk_size"], err
