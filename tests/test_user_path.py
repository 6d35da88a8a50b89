"""The path a user with released weights takes, on CPU: each family's tiny diffusers transformer
and VAE (random weights) saved as diffusers folders, converted by `convert/diffusers_to_orbax.py`,
an embedding cache of the family's arrays, then `configs/<family>.py:tiny` trained from them
through `launch/train.py`'s entry (validation, the executor, one iteration, a checkpoint)."""
import dataclasses
import inspect
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from digen_jax.data import write_cache
from digen_jax.data.embeddings import EMBEDDING_LAYOUTS
from digen_jax.models import FAMILIES, load_checkpoint
from digen_jax.models.conversion import POLICY_FIELDS
from digen_jax.app import loop, workload
from digen_jax.app import families, random_init

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_configs import assert_one_on_policy_lora_iteration, get_config as zoo_config  # noqa: E402

diffusers = pytest.importorskip("diffusers")
torch = pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {"flux": "flux", "qwenimage": "qwenimage", "wan": "wan21", "hunyuan_video": "hunyuanvideo", "sd3": "sd35"}
PROMPTS = ("a cat", "a dog", "a red car", "two birds", "a house", "a tree")
# One interpreter converts every folder through the CLI's own flags and main (a process per
# folder would start JAX eight times).
_CONVERT_ALL = """
import runpy
import sys
from absl import flags
cli = runpy.run_path("convert/diffusers_to_orbax.py")
for model_dir, out in zip(sys.argv[1::2], sys.argv[2::2]):
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["diffusers_to_orbax.py", f"--model_dir={model_dir}", f"--out={out}"])
    cli["main"]([])
"""


def get_config(family: str):
    return zoo_config(family, "tiny")


def diffusers_model(name: str, seed: int):
    """The diffusers module of FAMILIES[name]'s tiny variant (fields the class does not take, or
    left unset, keep the class's defaults), every weight perturbed so none is a default value."""
    family = FAMILIES[name]
    cls = getattr(diffusers, family.diffusers_class)
    accepted = inspect.signature(cls.__init__).parameters
    variant = family.variants["tiny"]
    kwargs = {f.name: getattr(variant, f.name) for f in dataclasses.fields(variant)
              if f.name not in POLICY_FIELDS and f.name in accepted and getattr(variant, f.name) is not None}
    torch.manual_seed(seed)
    model = cls(**{k: list(v) if isinstance(v, tuple) else v for k, v in kwargs.items()}).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def random_cache(path: str, family: str, text_dim: int, pooled_dim: int | None, text_len: int = 8) -> str:
    """A cache holding what `family`'s encoders store, random values, as the library writes it."""
    spec, rng = EMBEDDING_LAYOUTS[family], np.random.default_rng(3)
    n = len(PROMPTS)
    lengths = rng.integers(1, text_len + 1, n).astype(np.int32)
    mask = np.arange(text_len)[None] < lengths[:, None]
    text = rng.standard_normal((n, text_len, text_dim)).astype(np.float32)
    arrays = {"text": text if spec["mask"] else text * mask[..., None]}
    if spec["pooled"]:
        arrays["pooled"] = rng.standard_normal((n, pooled_dim)).astype(np.float32)
    if spec["mask"]:
        arrays["mask"] = mask
    if spec["lengths"]:
        arrays["lengths"] = lengths
    negative = None
    if spec["negative"] is not None:
        negative = {"text": rng.standard_normal((1, 3, text_dim)).astype(np.float32)}
        if spec["lengths"]:
            negative["lengths"] = np.array([3], np.int32)
        if spec["pooled"]:  # SD3: CFG's negative has a pooled vector too
            negative["pooled"] = rng.standard_normal((1, pooled_dim)).astype(np.float32)
        if spec["mask"]:
            negative["mask"] = np.ones((1, 3), bool)
    return write_cache(path, family, prompts=PROMPTS, **arrays,
                       negative_prompt=spec["negative"] if negative is not None else None, negative=negative)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """{family: (converted transformer dir, converted VAE dir, embedding cache dir)}."""
    root = tmp_path_factory.mktemp("user_path")
    pairs, out = [], {}
    for i, family in enumerate(sorted(CONFIGS)):
        for kind, name in (("transformer", family), ("vae", families.ZOO[family].vae_family)):
            diffusers_model(name, seed=10 + i).save_pretrained(root / family / kind)
            pairs += [str(root / family / kind), str(root / family / f"{kind}-jax")]
        cfg = FAMILIES[family].variants["tiny"]
        zoo = families.ZOO[family]
        cache = random_cache(str(root / family / "cache"), family, getattr(cfg, zoo.text_dim),
                             getattr(cfg, zoo.pooled_dim) if zoo.pooled_dim else None)
        out[family] = (str(root / family / "transformer-jax"), str(root / family / "vae-jax"), cache)
    result = subprocess.run([sys.executable, "-c", _CONVERT_ALL, *pairs], cwd=ROOT, capture_output=True, text=True,
                            env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("wrote ") == len(pairs) // 2
    return out


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_converted_weights_and_cache_train_through_the_executor(converted, family, tmp_path):
    """README's real-user settings on the `:tiny` config, through what launch/train.py calls:
    validation, then `loop.train` (the executor, colocated on every device: one rollout, VAE
    decode, reward, advantages and LoRA update, a checkpoint), from the converted weights and
    embedding cache, with splash attention (Pallas' TPU kernel, interpreted on the CPU):
    exactly on-policy (`test_configs.assert_one_on_policy_lora_iteration`)."""
    transformer, vae, cache = converted[family]
    c = get_config(family)
    c.model.random_init, c.data.random_embeddings = False, False
    c.model.checkpoint, c.model.vae_checkpoint, c.data.embedding_cache = transformer, vae, cache
    c.model.attention_impl = "splash"
    c.train.checkpoint_every = 1
    assert c.runtime.mode == "colocated"
    loop.validate_config(c)
    state = loop.train(c, str(tmp_path), log=lambda _: None)
    assert_one_on_policy_lora_iteration(tmp_path, state)
    assert os.path.isdir(tmp_path / "checkpoints" / "1")


def test_loaded_checkpoint_leaves_are_device_arrays(converted):
    """Conversion writes host arrays; loading them must give device arrays (the executor places
    weights by their sharding), for the transformer and the VAE alike."""
    for path in converted["flux"][:2]:
        _, _, params = load_checkpoint(path)
        leaves = jax.tree.leaves(params)
        assert leaves and all(isinstance(x, jax.Array) for x in leaves), {type(x) for x in leaves}


def _shapes_config(checkpoint: str):
    from configs import tiny

    c = tiny.get_config()
    c.model.checkpoint = checkpoint
    return c


def test_shapes_task_rejects_a_checkpoint_that_does_not_fit(converted, monkeypatch):
    """configs/tiny.py with a converted model of another family, or a FLUX of other channels: a
    message naming model.checkpoint, before any weight is read."""
    monkeypatch.setattr(workload, "load_checkpoint", lambda *a, **k: pytest.fail("weights read before validation"))
    wan, flux = converted["wan"][0], converted["flux"][0]
    with pytest.raises(workload.ConfigError, match=r"model.checkpoint='.*' holds a 'wan' model; the shapes task trains "
                                                   r"model.family='flux'"):
        loop.validate_config(_shapes_config(wan))
    with pytest.raises(workload.ConfigError, match=r"does not fit the shapes task: in_channels=16 \(the task needs 12\), "
                                                   r"out_dim=16 \(the task needs 12\)"):
        loop.validate_config(_shapes_config(flux))
    with pytest.raises(workload.ConfigError, match=r"model.checkpoint='/no/such' holds no converted model"):
        loop.validate_config(_shapes_config("/no/such"))


def test_shapes_task_trains_from_a_checkpoint_that_fits(tmp_path):
    """A FLUX checkpoint with the task's channels and text widths (any depth) is the base model."""
    from digen_jax.models import save_checkpoint

    c = _shapes_config(str(tmp_path / "ckpt"))
    family = FAMILIES["flux"]
    cfg = family.config_cls(**{**c.model.arch.to_dict(), "num_single_layers": 1})
    params = random_init.random_params(family, cfg, seed=5)
    save_checkpoint(c.model.checkpoint, family, cfg, params)
    loop.validate_config(c)
    work = workload.make_workload(c)
    assert work.model_cfg.num_single_layers == 1
    jax.tree.map(np.testing.assert_array_equal, work.base_params, params)
