"""ImageReward in JAX against the `image-reward` package's own modules at a tiny random size.

The package (THUDM/ImageReward 1.5, installed with --no-deps: README) cannot be imported whole
here: its ViT imports timm, which needs torchvision, and its BERT was written for transformers
4.x. So the reference is built from its source files as they are: `models/BLIP/vit.py`
(`VisionTransformer`), `models/BLIP/med.py` (`BertModel`) and `ImageReward.py` (`MLP` and the
scoring method `ImageReward.score_gard`, normalisation included), imported with placeholders
for what their imports name but the score never runs (timm's initialisers and registry,
fairscale's checkpointing, torchvision's transforms, BLIP_Pretrain's tokenizer download), a
copy of timm's `PatchEmbed` (a strided convolution), and the transformers 4.x base-class
methods `BertModel` calls (`init_weights`, `get_head_mask`, `invert_attention_mask`).
"""
import dataclasses
import importlib.util
import os
import re
import sys
import types

import flax.linen as nn
import jax
import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from digen_jax.models import FAMILIES, image_reward as model_lib, load_checkpoint
from digen_jax.models.conversion import ConversionError, convert_weights, torch_state_dict_arrays
from digen_jax.rewards import clip_scores, get_reward, image_reward

CFG = model_lib.VARIANTS["tiny"]


class PatchEmbed(torch.nn.Module):
    """timm's PatchEmbed as BLIP's ViT uses it: a patch-strided conv, flattened to tokens."""

    def __init__(self, img_size=224, patch_size=16, in_chans=3, embed_dim=768):
        super().__init__()
        self.num_patches = (img_size // patch_size) ** 2
        self.proj = torch.nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class DropPath(torch.nn.Identity):  # stochastic depth: the identity at inference
    def __init__(self, *args, **kwargs):
        super().__init__()


def _placeholder_modules():
    def module(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        return m

    unused = lambda *a, **k: None  # noqa: E731
    identity = lambda f, *a, **k: f  # noqa: E731
    return {
        "timm": module("timm"), "timm.models": module("timm.models"),
        "timm.models.vision_transformer": module("timm.models.vision_transformer", PatchEmbed=PatchEmbed, _cfg=unused),
        "timm.models.registry": module("timm.models.registry", register_model=identity),
        "timm.models.layers": module("timm.models.layers", trunc_normal_=torch.nn.init.trunc_normal_, DropPath=DropPath),
        "timm.models.helpers": module("timm.models.helpers", named_apply=unused, adapt_input_conv=unused),
        "fairscale": module("fairscale"), "fairscale.nn": module("fairscale.nn"),
        "fairscale.nn.checkpoint": module("fairscale.nn.checkpoint"),
        "fairscale.nn.checkpoint.checkpoint_activations": module(
            "fairscale.nn.checkpoint.checkpoint_activations", checkpoint_wrapper=identity),
        "torchvision": module("torchvision"),
        "torchvision.transforms": module("torchvision.transforms", Compose=unused, Resize=unused,
                                         CenterCrop=unused, ToTensor=unused, Normalize=unused),
        "ir_ref": module("ir_ref", __path__=[]), "ir_ref.models": module("ir_ref.models", __path__=[]),
        "ir_ref.models.BLIP": module("ir_ref.models.BLIP", __path__=[]),
        "ir_ref.models.BLIP.blip_pretrain": module("ir_ref.models.BLIP.blip_pretrain", BLIP_Pretrain=None),
    }


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def reference_source():
    """(vit, med, ImageReward) modules from the installed package's source files."""
    return package_modules()


def package_modules():
    """(vit, med, ImageReward modules, ImageReward.py's text) of the installed package (module
    docstring: imported with placeholders for what the score never runs)."""
    spec = importlib.util.find_spec("ImageReward")
    if spec is None:
        pytest.fail("image-reward is not installed: python3 -m pip install --no-deps image-reward==1.5 (README)")
    root = spec.submodule_search_locations[0]
    from transformers import modeling_utils, pytorch_utils

    placeholders = _placeholder_modules()
    saved = {n: sys.modules.get(n) for n in placeholders}
    helpers = dict(apply_chunking_to_forward=pytorch_utils.apply_chunking_to_forward,
                   prune_linear_layer=pytorch_utils.prune_linear_layer,
                   find_pruneable_heads_and_indices=lambda *a: None)  # head pruning: never called
    added = [n for n in helpers if not hasattr(modeling_utils, n)]
    for name in added:
        setattr(modeling_utils, name, helpers[name])
    sys.modules.update(placeholders)
    try:
        vit = _load("ir_ref.models.BLIP.vit", os.path.join(root, "models", "BLIP", "vit.py"))
        med = _load("ir_ref.models.BLIP.med", os.path.join(root, "models", "BLIP", "med.py"))
        scoring = _load("ir_ref.ImageReward", os.path.join(root, "ImageReward.py"))
    finally:
        for name in added:
            delattr(modeling_utils, name)
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    return vit, med, scoring, open(os.path.join(root, "ImageReward.py")).read()


def _bert(med, cfg):
    config = transformers.BertConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.text_width,
                                     num_hidden_layers=cfg.text_layers, num_attention_heads=cfg.text_heads,
                                     intermediate_size=cfg.text_intermediate, max_position_embeddings=cfg.max_positions,
                                     hidden_act="gelu", layer_norm_eps=cfg.text_eps, pad_token_id=0)
    config.add_cross_attention, config.encoder_width = True, cfg.vision_width  # BLIP's med_config.json

    class BertModel(med.BertModel):
        # transformers 4.x base-class methods that med's BertModel calls (changed or removed in 5.x).
        def init_weights(self):
            self.apply(self._init_weights)

        def get_head_mask(self, head_mask, num_layers):
            return [None] * num_layers

        def invert_attention_mask(self, mask):
            mask = mask[:, None, None, :].to(self.dtype)
            return (1.0 - mask) * torch.finfo(self.dtype).min

    return BertModel(config, add_pooling_layer=False)


@pytest.fixture(scope="module")
def reference(reference_source):
    """The package's `ImageReward` scorer on the tiny config, every weight random."""
    return package_model(reference_source, CFG, seed=0)


_NORMS = ("norm.weight", "norm1.weight", "norm2.weight", "LayerNorm.weight")


def package_model(modules, cfg, *, seed: int, deep: bool = False, device: str = "cpu"):
    """The package's `ImageReward` scorer (eval mode) of `cfg`'s sizes, every weight random.

    Tiny (default): weights N(0, 0.1), vectors N(0, 0.2), norm scales about 1, so that two blocks
    move the features well away from their input. `deep` (the 24- and 12-block full size): every
    backbone weight N(0, 0.02) (BERT's and BLIP's initialiser scale, which keeps the activations
    of deep residual stacks finite), norm scales 1 + N(0, 0.02), and the MLP head's matrices
    N(0, 1/fan_in), so that its output stays of order one across its five layers."""
    vit, med, scoring, source = modules
    torch.manual_seed(seed)
    with torch.device(device):
        model = scoring.ImageReward.__new__(scoring.ImageReward)
        torch.nn.Module.__init__(model)
        model.device = device
        model.blip = torch.nn.Module()
        model.blip.visual_encoder = vit.VisionTransformer(
            img_size=cfg.image_size, patch_size=cfg.patch_size, embed_dim=cfg.vision_width, depth=cfg.vision_layers,
            num_heads=cfg.vision_heads, drop_path_rate=0.1)  # as create_vit('large'); inactive in eval
        model.blip.text_encoder = _bert(med, cfg)
        model.mlp = scoring.MLP(cfg.text_width)
    # The package's normalisation constants, read from its __init__ (not run: it builds ViT-L).
    model.mean = float(re.search(r"self\.mean = ([0-9.]+)", source).group(1))
    model.std = float(re.search(r"self\.std = ([0-9.]+)", source).group(1))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not deep:
                p.normal_(0.0, 0.2 if p.ndim == 1 else 0.1)
            elif name.startswith("mlp.") and p.ndim == 2:
                p.normal_(0.0, p.shape[1] ** -0.5)
            else:
                p.normal_(0.0, 0.02)
            if name.endswith(_NORMS):
                p.add_(1.0)
    return model.eval()


def _convert(model, cfg=CFG):
    state = {f"{k}": v for k, v in torch_state_dict_arrays(model)}
    backbone = {k: v for k, v in state.items() if not k.startswith("mlp.")}
    params = convert_weights(model_lib.FAMILY, cfg, backbone.items())
    head = clip_scores.aesthetic_head_params(
        [(k.removeprefix("mlp."), v) for k, v in state.items() if k.startswith("mlp.")], cfg.text_width)
    return {"model": params, "head": head}


def _images():
    rng = np.random.default_rng(1)
    y, x = np.mgrid[0:40, 0:56]
    base = np.stack([x / 56, y / 40, (x + y) / 96], -1) * 200
    return np.stack([np.clip(base + rng.normal(0, 30, base.shape), 0, 255).astype(np.uint8) for _ in range(3)])


def _tokens():
    rng = np.random.default_rng(2)
    ids = rng.integers(1, CFG.vocab_size, size=(3, CFG.context_length))
    for row, length in enumerate((4, CFG.context_length, 7)):
        ids[row, length:] = 0  # [PAD]
    return ids.astype(np.int32)


def _pil_pixels(images, size):
    """torchvision Resize(size, BICUBIC) + CenterCrop(size) + Normalize on PIL images, NCHW."""
    out = []
    for image in images:
        pil = Image.fromarray(image)
        w, h = pil.size
        new_w, new_h = (int(size * w / h), size) if h <= w else (size, int(size * h / w))
        arr = np.asarray(pil.resize((new_w, new_h), Image.BICUBIC), np.float64) / 255
        top, left = int(round((new_h - size) / 2)), int(round((new_w - size) / 2))
        arr = arr[top:top + size, left:left + size]
        out.append((arr - np.asarray(image_reward.PREPROCESS.mean)) / np.asarray(image_reward.PREPROCESS.std))
    return torch.tensor(np.stack(out).transpose(0, 3, 1, 2), dtype=torch.float32)


def _rel(a, b):
    return float(np.max(np.abs(np.asarray(a) - b)) / np.max(np.abs(b)))


def test_score_matches_the_package(reference):
    images, ids = _images(), _tokens()
    mask = (ids != 0).astype(np.int32)
    with torch.no_grad():
        want = reference.score_gard(torch.tensor(ids, dtype=torch.long), torch.tensor(mask),
                                    _pil_pixels(images, CFG.image_size))[:, 0].numpy()
    params = _convert(reference)
    got = np.asarray(image_reward.jitted_score_fn(CFG)(params, images, ids, mask))
    assert got.shape == (3,) and _rel(got, want) <= 1e-4, (got, want, _rel(got, want))
    assert np.std(want) > 1e-3  # the images and prompts are told apart
    # Padding is masked: changing a padded id changes nothing, changing a real one does.
    padded, real = ids.copy(), ids.copy()
    padded[0, -1], real[0, 1] = 5, (ids[0, 1] % 90) + 1
    score = image_reward.jitted_score_fn(CFG)
    assert np.asarray(score(params, images, padded, mask))[0] == pytest.approx(got[0], abs=1e-6)
    assert abs(np.asarray(score(params, images, real, mask))[0] - got[0]) > 1e-4


def test_conversion_cli_and_registered_reward(reference, tmp_path):
    spec = importlib.util.spec_from_file_location("image_reward_to_orbax", os.path.join(
        os.path.dirname(__file__), "..", "convert", "image_reward_to_orbax.py"))
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    state = reference.state_dict()
    state["blip.text_proj.weight"] = torch.zeros(4, CFG.text_width)  # BLIP's unused projections are ignored
    torch.save(state, tmp_path / "ImageReward.pt")
    cli.main([f"--checkpoint={tmp_path / 'ImageReward.pt'}", "--variant=tiny", f"--out={tmp_path / 'ckpt'}"])
    family, cfg, loaded = load_checkpoint(str(tmp_path / "ckpt"))
    assert family is FAMILIES["image_reward"] and cfg == CFG
    jax.tree.map(np.testing.assert_array_equal, loaded, _convert(reference)["model"])

    images, ids = _images(), _tokens()
    reward = get_reward("image_reward", checkpoint_dir=str(tmp_path / "ckpt"))
    got = reward(images, ["a", "b", "c"], [{"prompt_tokens": row} for row in ids])
    want = image_reward.jitted_score_fn(CFG)(_convert(reference), images, ids, (ids != 0).astype(np.int32))
    np.testing.assert_allclose(got, np.asarray(want), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="tokenizer_dir"):
        reward(images, ["a", "b", "c"], [{}] * 3)

    del state["mlp.layers.7.bias"]
    torch.save(state, tmp_path / "broken.pt")
    with pytest.raises(ConversionError, match="layers.7.bias"):
        cli.convert(cli.parser().parse_args([f"--checkpoint={tmp_path / 'broken.pt'}", "--variant=tiny",
                                             f"--out={tmp_path / 'broken'}"]), log=lambda _: None)
    with pytest.raises(ValueError, match=r"checkpoint_dir.*convert/image_reward_to_orbax.py"):
        get_reward("image_reward")


def test_full_size_matches_the_package_parameter_count(reference_source):
    """ImageReward-v1.0 (ViT-L/16 at 224, BERT-base with cross-attention) has the reference's
    parameters: counted on one- and two-block references of full width (the count is affine
    in the depth), so nothing of full size is built; its score traces at full size (no FLOPs)."""
    vit, med, _, _ = reference_source
    cfg = model_lib.VARIANTS["ImageReward-v1.0"]

    def count(depth):
        vision = vit.VisionTransformer(img_size=224, patch_size=16, embed_dim=1024, depth=depth, num_heads=16)
        text = _bert(med, dataclasses.replace(cfg, text_layers=depth))
        return (sum(p.numel() for p in vision.parameters()), sum(p.numel() for p in text.parameters()))

    (v1, t1), (v2, t2) = count(1), count(2)
    torch_count = v1 + (cfg.vision_layers - 1) * (v2 - v1) + t1 + (cfg.text_layers - 1) * (t2 - t1)
    abstract = nn.unbox(model_lib.FAMILY.abstract_params(cfg))
    assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract)) == torch_count
    head = jax.eval_shape(lambda: clip_scores.AestheticHead().init(
        jax.random.key(0), np.zeros((1, cfg.text_width), np.float32)))["params"]
    out = jax.eval_shape(image_reward.make_score_fn(cfg), {"model": abstract, "head": head},
                         jax.ShapeDtypeStruct((2, 512, 512, 3), np.uint8), jax.ShapeDtypeStruct((2, 35), np.int32),
                         jax.ShapeDtypeStruct((2, 35), np.int32))
    assert out.shape == (2,) and out.dtype == np.float32


def _photos(h, w, count=3):
    """Smooth gradients (each rotated differently) plus noise: distinct images of a real size."""
    rng = np.random.default_rng(4)
    y, x = np.mgrid[0:h, 0:w]
    out = []
    for k in range(count):
        base = np.stack([x / w, y / h, (x + y) / (h + w)], -1)[..., np.roll(np.arange(3), k)] * 200
        out.append(np.clip(base + rng.normal(0, 25, base.shape), 0, 255).astype(np.uint8))
    return np.stack(out)


@pytest.mark.gpu
def test_full_size_score_matches_the_package_on_gpu(reference_source):
    """ImageReward-v1.0 at full size (ViT-L/16 at 224, BERT-base with cross-attention; random
    weights, `package_model(deep=True)`) in float32, the package's modules on the same card with
    TF32 off and JAX at the highest matmul precision: the BLIP feature on the same pixels, and the
    score from uint8 images (our on-device preprocessing against PIL's) to 1e-4 relative.
    CPU counterpart: test_score_matches_the_package (the tiny config)."""
    errors, want_raw = full_size_errors(reference_source, "cuda")
    print(f"ImageReward-v1.0 fp32, JAX vs the package on {jax.devices()[0].device_kind}: "
          + ", ".join(f"{k} rel err {v:.2e}" for k, v in errors.items()))
    assert np.std(want_raw) > 1e-2 and np.abs(want_raw).max() > 0.1  # rows told apart, the head not negligible
    assert max(errors.values()) <= 1e-4, errors


def full_size_errors(modules, device):
    """({'feature', 'score', 'head output'}: relative error of JAX against the package at full
    size, the package's head outputs) with the reference on the torch `device`."""
    cfg = model_lib.VARIANTS["ImageReward-v1.0"]
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    model = package_model(modules, cfg, seed=0, deep=True, device=device)
    images = _photos(384, 512)
    rng = np.random.default_rng(5)
    ids = rng.integers(1000, cfg.vocab_size, size=(3, cfg.context_length))
    ids[:, 0] = 101  # [CLS]
    for row, length in enumerate((6, cfg.context_length, 17)):
        ids[row, length:] = 0  # [PAD]
    ids, mask = ids.astype(np.int32), (ids != 0).astype(np.int32)
    pixels = _pil_pixels(images, cfg.image_size)
    with torch.no_grad():
        t_ids, t_mask, t_pixels = (torch.as_tensor(a).to(device) for a in (ids.astype(np.int64), mask, pixels))
        image_embeds = model.blip.visual_encoder(t_pixels)
        feature = model.blip.text_encoder(
            t_ids, attention_mask=t_mask, encoder_hidden_states=image_embeds,
            encoder_attention_mask=torch.ones(image_embeds.shape[:-1], dtype=torch.long, device=device),
            return_dict=True).last_hidden_state[:, 0, :]
        want_feature = feature.cpu().numpy()
        want_raw = model.mlp(feature)[:, 0].cpu().numpy()
        want = model.score_gard(t_ids, t_mask, t_pixels)[:, 0].cpu().numpy()
    params = _convert(model.cpu(), cfg)
    del model, image_embeds, feature
    if device == "cuda":
        torch.cuda.empty_cache()
    with jax.default_matmul_precision("highest"):
        got_feature = jax.jit(model_lib.ImageRewardModel(cfg).apply)(
            {"params": params["model"]}, pixels.numpy().transpose(0, 2, 3, 1), ids, mask)
        got = np.asarray(image_reward.jitted_score_fn(cfg)(params, images, ids, mask))
    got_raw = got * image_reward.SCORE_STD + image_reward.SCORE_MEAN
    errors = {"feature": _rel(got_feature, want_feature), "score": _rel(got, want), "head output": _rel(got_raw, want_raw)}
    return errors, want_raw
