"""CLIP towers, conversion, preprocessing and the CLIP-based rewards.

References: transformers `CLIPModel` and `CLIPImageProcessorPil`, open_clip `CLIP` (tiny random
models); PIL for open_clip's and HPSv2's PIL pipelines (torchvision's PIL path is
`PIL.Image.resize`); torch `interpolate(antialias=True)` for torchvision's tensor `Resize`.
Scorer formulas: docs/algorithms.md (c) (PickScore s*cos/26, HPSv2.1 cos, CLIPScore s*cos/30,
aesthetic MLP 768-1024-128-64-16-1 on the normalised image embedding).
"""
import dataclasses
import functools
import importlib
import importlib.util
import json
import os
import sys
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from digen_jax.models import FAMILIES, clip, load_checkpoint
from digen_jax.models.conversion import ConversionError, convert_weights, torch_state_dict_arrays
from digen_jax.rewards import clip_scores, get_reward

try:  # transformers >= 5 names the PIL processor apart from the torchvision one
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
except ImportError:  # older releases: CLIPImageProcessor is the PIL one
    from transformers import CLIPImageProcessor as CLIPImageProcessorPil

TINY = dict(image_size=32, patch_size=8, vision_width=32, vision_layers=2, vision_heads=4, vocab_size=99,
            context_length=16, text_width=32, text_layers=2, text_heads=4, projection_dim=24)
EOS = 98


def _open_clip_model_module():
    """open_clip's `model` module. Its package __init__ imports torchvision for the image
    transforms; where torchvision cannot load (a CPU-only torch without a matching
    torchvision), the model code is imported with a placeholder for the one torchvision
    name it imports (FrozenBatchNorm2d, used only by ResNet towers)."""
    if "open_clip.model" in sys.modules:  # imported before (the placeholder package has no spec to find)
        return sys.modules["open_clip.model"]
    if importlib.util.find_spec("open_clip") is None:
        pytest.fail("open_clip_torch is not installed: python3 -m pip install --no-deps open_clip_torch==3.3.0 (README)")
    try:
        import open_clip

        return open_clip.model
    except ModuleNotFoundError as e:
        if e.name != "torchvision":
            raise
    # Settle transformers' cached torchvision check before the placeholder exists.
    from transformers import AutoConfig, AutoModel, AutoTokenizer, PretrainedConfig, modeling_outputs  # noqa: F401

    transformers.utils.import_utils.is_torchvision_available()
    names = ("torchvision", "torchvision.ops", "torchvision.ops.misc")
    saved = {n: sys.modules.get(n) for n in names}
    package = types.ModuleType("open_clip")
    package.__path__ = list(importlib.util.find_spec("open_clip").submodule_search_locations)
    misc = types.ModuleType("torchvision.ops.misc")
    misc.FrozenBatchNorm2d = type("FrozenBatchNorm2d", (torch.nn.Module,), {})
    sys.modules.update({"open_clip": package, "torchvision": types.ModuleType("torchvision"),
                        "torchvision.ops": types.ModuleType("torchvision.ops"), "torchvision.ops.misc": misc})
    try:
        return importlib.import_module("open_clip.model")
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def _hf_config(act="quick_gelu", eos=EOS):
    text = dict(vocab_size=99, hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=16, eos_token_id=eos, bos_token_id=0, pad_token_id=1, hidden_act=act)
    vision = dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, hidden_act=act)
    return transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=24)


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(0)
    model = transformers.CLIPModel(_hf_config()).eval()
    with torch.no_grad():  # a logit scale away from its init, so the scaling is checked
        model.logit_scale.fill_(3.1)
    cfg = clip.config_from_transformers(model.config)
    return model, cfg, convert_weights(clip.TRANSFORMERS_FAMILY, cfg, torch_state_dict_arrays(model))


@pytest.fixture(scope="module")
def open_clip_model():
    ocm = _open_clip_model_module()
    torch.manual_seed(1)
    model = ocm.CLIP(
        embed_dim=24,
        vision_cfg=ocm.CLIPVisionCfg(layers=2, width=32, head_width=8, patch_size=8, image_size=32),
        text_cfg=ocm.CLIPTextCfg(context_length=16, vocab_size=99, width=32, heads=4, layers=2),
    ).eval()
    cfg = clip.CLIPConfig(**TINY, hidden_act="gelu")
    params = convert_weights(clip.OPEN_CLIP_FAMILY, cfg, clip.split_fused_qkv(torch_state_dict_arrays(model)))
    return model, cfg, params


def _tokens(batch=3, eos=EOS, pad=1):
    rng = np.random.default_rng(2)
    ids = rng.integers(2, 90, size=(batch, 16))
    for row, length in enumerate((5, 16, 9)[:batch]):
        ids[row, length - 1] = eos
        ids[row, length:] = pad
    return ids.astype(np.int32)


def _score_fn(name, cfg):
    """The jitted score function the rewards use (compiled once per scorer, config and shape)."""
    return clip_scores.jitted_score_fn(clip_scores.SCORERS[name], cfg)


@functools.lru_cache(maxsize=None)
def _towers(cfg):
    return jax.jit(clip.CLIPModel(cfg).apply)


def _rel(a, b):
    return float(np.max(np.abs(np.asarray(a) - b)) / np.max(np.abs(b)))


def test_transformers_towers_parity(hf_model):
    model, cfg, params = hf_model
    pixels = np.random.default_rng(3).normal(size=(2, 3, 32, 32)).astype(np.float32)
    ids = _tokens()
    with torch.no_grad():
        ref_image = model.get_image_features(pixel_values=torch.tensor(pixels))
        ref_text = model.get_text_features(input_ids=torch.tensor(ids), attention_mask=torch.tensor(ids != 1))
    ref_image, ref_text = (getattr(r, "pooler_output", r).numpy() for r in (ref_image, ref_text))
    image, text = _towers(cfg)({"params": params}, pixels.transpose(0, 2, 3, 1), ids)
    assert _rel(image, ref_image) <= 1e-5 and _rel(text, ref_text) <= 1e-5
    assert float(params["logit_scale"]) == pytest.approx(3.1)


def test_open_clip_towers_parity(open_clip_model):
    model, cfg, params = open_clip_model
    pixels = np.random.default_rng(4).normal(size=(2, 3, 32, 32)).astype(np.float32)
    ids = _tokens(pad=0)
    with torch.no_grad():
        ref_image = model.encode_image(torch.tensor(pixels)).numpy()
        ref_text = model.encode_text(torch.tensor(ids)).numpy()  # pools at argmax (EOS = 98 is the largest id)
    image, text = _towers(cfg)({"params": params}, pixels.transpose(0, 2, 3, 1), ids)
    assert _rel(image, ref_image) <= 1e-5 and _rel(text, ref_text) <= 1e-5


def test_conversion_rejects_wrong_weights(hf_model):
    model, cfg, _ = hf_model
    state = dict(torch_state_dict_arrays(model))
    state["text_projection.weight"] = state["text_projection.weight"][:, :16]
    with pytest.raises(ConversionError, match="text_projection.weight"):
        convert_weights(clip.TRANSFORMERS_FAMILY, cfg, state.items())
    with pytest.raises(ConversionError, match="first axis is not 3 x width"):
        list(clip.split_fused_qkv([("visual.transformer.resblocks.0.attn.in_proj_bias", np.zeros(31))]))


@pytest.mark.parametrize("name,hf_kwargs", [
    ("ViT-L-14", dict(projection_dim=768,
                      text_config=dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12,
                                       num_hidden_layers=12),
                      vision_config=dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=16,
                                         num_hidden_layers=24, patch_size=14))),
    ("ViT-H-14", dict(projection_dim=1024,
                      text_config=dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=16,
                                       num_hidden_layers=24, hidden_act="gelu"),
                      vision_config=dict(hidden_size=1280, intermediate_size=5120, num_attention_heads=16,
                                         num_hidden_layers=32, patch_size=14, hidden_act="gelu"))),
])
def test_full_size_parameter_counts(name, hf_kwargs):
    hf_config = transformers.CLIPConfig(**hf_kwargs)
    with torch.device("meta"):  # shapes only, nothing allocated
        hf_count = sum(p.numel() for p in transformers.CLIPModel(hf_config).parameters())
    cfg = clip.VARIANTS[name]
    assert dataclasses.replace(clip.config_from_transformers(hf_config), eos_token_id=None) == cfg
    abstract = clip.TRANSFORMERS_FAMILY.abstract_params(cfg)
    ours = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract))
    assert ours == hf_count
    assert hf_count == {"ViT-L-14": 427_616_513, "ViT-H-14": 986_109_441}[name]
    # A full-size scorer traces on real frame sizes (no FLOPs).
    scorer = clip_scores.SCORERS["clipscore" if name == "ViT-L-14" else "hpsv2"]
    out = jax.eval_shape(clip_scores.make_score_fn(scorer, cfg), {"clip": nn.unbox(abstract)},
                         jax.ShapeDtypeStruct((2, 480, 832, 3), jnp.uint8), jax.ShapeDtypeStruct((2, 77), jnp.int32))
    assert out.shape == (2,) and out.dtype == jnp.float32


# ------------------------------------------------------------------------------ preprocessing

SIZES = [(512, 512), (480, 832), (333, 517)]


def _photo(h, w, seed=0):
    """A smooth gradient plus noise: both flat regions and edges for the filters."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x / w, y / h, (x + y) / (h + w)], -1) * 200
    return np.clip(base + rng.normal(0, 25, (h, w, 3)), 0, 255).astype(np.uint8)


def _normalise(a):
    return (a - np.asarray(clip.OPENAI_MEAN)) / np.asarray(clip.OPENAI_STD)


def _pil_shortest_crop(image, size, rounding):
    pil = Image.fromarray(image)
    w, h = pil.size
    new_h, new_w = (size, int(size * w / h)) if h <= w else (int(size * h / w), size)
    arr = np.asarray(pil.resize((new_w, new_h), Image.BICUBIC), np.float64) / 255
    top, left = round((new_h - size) / 2), round((new_w - size) / 2)  # torchvision CenterCrop
    assert rounding == "half_even"
    return _normalise(arr[top : top + size, left : left + size])


def _pil_longest_pad(image, size):
    """HPSv2's ResizeMaxSize on a PIL image, then ToTensor + Normalize."""
    pil = Image.fromarray(image)
    w, h = pil.size
    scale = size / max(h, w)
    new_h, new_w = round(h * scale), round(w * scale)
    arr = np.asarray(pil.resize((new_w, new_h), Image.BICUBIC), np.float64) / 255
    pad_h, pad_w = size - new_h, size - new_w
    arr = np.pad(arr, ((pad_h // 2, pad_h - pad_h // 2), (pad_w // 2, pad_w - pad_w // 2), (0, 0)))
    return _normalise(arr)


def _tensor_resize(images, size):
    """torchvision Resize(size) + CenterCrop(size) + Normalize on a float tensor batch."""
    x = torch.tensor(images).permute(0, 3, 1, 2).float() / 255
    h, w = x.shape[-2:]
    new_h, new_w = (size, int(size * w / h)) if h <= w else (int(size * h / w), size)
    x = torch.nn.functional.interpolate(x, size=(new_h, new_w), mode="bilinear", antialias=True, align_corners=False)
    top, left = int(round((new_h - size) / 2)), int(round((new_w - size) / 2))
    return _normalise(x[:, :, top : top + size, left : left + size].permute(0, 2, 3, 1).numpy())


@pytest.mark.parametrize("h,w", SIZES)
def test_preprocessing_matches_references(h, w):
    images = np.stack([_photo(h, w, 0), _photo(h, w, 1)])
    ours = jax.jit(clip.preprocess_images, static_argnums=1)
    ref = CLIPImageProcessorPil()(images=list(images), return_tensors="np")["pixel_values"].transpose(0, 2, 3, 1)
    got = np.asarray(ours(images, clip.TRANSFORMERS_PROCESSOR))
    assert got.shape == (2, 224, 224, 3) and np.max(np.abs(got - ref)) <= 1e-3
    # float [0, 1] input is quantised to uint8 first, as PIL sees it.
    np.testing.assert_array_equal(np.asarray(ours(images.astype(np.float32) / 255, clip.TRANSFORMERS_PROCESSOR)), got)
    ref = np.stack([_pil_shortest_crop(im, 224, "half_even") for im in images])
    assert np.max(np.abs(np.asarray(ours(images, clip.OPEN_CLIP_VAL)) - ref)) <= 1e-3
    ref = np.stack([_pil_longest_pad(im, 224) for im in images])
    assert np.max(np.abs(np.asarray(ours(images, clip.HPS_VAL)) - ref)) <= 1e-3
    got = np.asarray(ours(images.astype(np.float32) / 255, clip.TENSOR_RESIZE))
    assert np.max(np.abs(got - _tensor_resize(images, 224))) <= 1e-3


def test_crop_rounding_follows_each_reference():
    # 7 extra columns: floor(3.5) = 3 (transformers), round(3.5) = 4 (torchvision, half to even).
    image = _photo(64, 71, 5)[None]
    spec = clip.ImagePreprocess(size=64, resample="pil_bicubic")
    floor = np.asarray(clip.preprocess_images(image, spec))
    half_even = np.asarray(clip.preprocess_images(image, dataclasses.replace(spec, crop_rounding="half_even")))
    ref = CLIPImageProcessorPil(size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64})(
        images=list(image), return_tensors="np")["pixel_values"].transpose(0, 2, 3, 1)
    assert np.max(np.abs(floor - ref)) <= 1e-3
    assert np.max(np.abs(half_even - _pil_shortest_crop(image[0], 64, "half_even")[None])) <= 1e-3
    assert np.max(np.abs(floor - half_even)) > 0.1
    with pytest.raises(ValueError, match="ImagePreprocess.mode"):
        clip.ImagePreprocess(mode="squash")


# ------------------------------------------------------------------------------ scorers


def _torch_normalised(x):
    return x / x.norm(dim=-1, keepdim=True)


class TorchAestheticMLP(torch.nn.Module):
    """The reference head: Linear/Dropout stack 768-1024-128-64-16-1, no activations."""

    def __init__(self, dim):
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(dim, 1024), torch.nn.Dropout(0.2), torch.nn.Linear(1024, 128), torch.nn.Dropout(0.2),
            torch.nn.Linear(128, 64), torch.nn.Dropout(0.1), torch.nn.Linear(64, 16), torch.nn.Linear(16, 1),
        )

    def forward(self, x):
        return self.layers(x)


def _scorer_images():
    return np.stack([_photo(40, 56, 7), _photo(40, 56, 8), _photo(40, 56, 9)])


def test_transformers_scorers_match_torch(hf_model):
    model, cfg, params = hf_model
    images, ids = _scorer_images(), _tokens()
    processor = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    pil_pixels = torch.tensor(processor(images=list(images), return_tensors="np")["pixel_values"])
    tensor_pixels = torch.tensor(_tensor_resize(images, 32)).permute(0, 3, 1, 2).float()
    torch.manual_seed(5)
    mlp = TorchAestheticMLP(24).eval()
    head = clip_scores.aesthetic_head_params(torch_state_dict_arrays(mlp), 24)
    with torch.no_grad():
        def cosine(pixels):
            image = _torch_normalised(getattr(o := model.get_image_features(pixel_values=pixels), "pooler_output", o))
            text = _torch_normalised(getattr(o := model.get_text_features(input_ids=torch.tensor(ids)), "pooler_output", o))
            return image, (image * text).sum(-1)

        scale = model.logit_scale.exp()
        image, cos = cosine(pil_pixels)
        want = {
            "pickscore": (scale * cos / 26).numpy(),
            "aesthetic": mlp(image)[:, 0].numpy(),
            "clipscore": (scale * cosine(tensor_pixels)[1] / 30).numpy(),
        }
    for name, ref in want.items():
        pixels = images.astype(np.float32) / 255 if name == "clipscore" else images
        got = _score_fn(name, cfg)({"clip": params, "head": head}, pixels, None if name == "aesthetic" else ids)
        np.testing.assert_allclose(np.asarray(got), ref, rtol=2e-5, atol=2e-6, err_msg=name)


def test_hpsv2_matches_open_clip(open_clip_model):
    model, cfg, params = open_clip_model
    images, ids = _scorer_images(), _tokens(pad=0)
    pixels = torch.tensor(np.stack([_pil_longest_pad(im, 32) for im in images])).permute(0, 3, 1, 2).float()
    with torch.no_grad():
        out = model(pixels, torch.tensor(ids))  # open_clip returns normalised features
        ref = (out[0] * out[1]).sum(-1).numpy()
    got = _score_fn("hpsv2", cfg)({"clip": params}, images, ids)
    np.testing.assert_allclose(np.asarray(got), ref, rtol=2e-5, atol=2e-6)


def test_hpsv2_architecture_is_open_clip_vit_h_14(open_clip_model):
    """HPS v2.1 is open_clip's ViT-H-14 fine-tuned: its model config (open_clip's
    model_configs/ViT-H-14.json, every key) gives our ViT-H-14 variant, and a copy of that
    config shrunk to tiny widths and depths (every other key kept) scores as HPSv2's
    img_score.py does (cosine of the normalised features) to 1e-4 relative in float32."""
    ocm = sys.modules[type(open_clip_model[0]).__module__]  # open_clip.model, as the fixture imported it
    with open(os.path.join(os.path.dirname(ocm.__file__), "model_configs", "ViT-H-14.json")) as f:
        full = json.load(f)
    vision, text = full["vision_cfg"], full["text_cfg"]
    assert clip.VARIANTS["ViT-H-14"] == dataclasses.replace(
        clip.VARIANTS["ViT-H-14"], image_size=vision["image_size"], patch_size=vision["patch_size"],
        vision_width=vision["width"], vision_layers=vision["layers"],
        vision_heads=vision["width"] // vision["head_width"], vocab_size=text["vocab_size"],
        context_length=text["context_length"], text_width=text["width"], text_layers=text["layers"],
        text_heads=text["heads"], projection_dim=full["embed_dim"],
        hidden_act="quick_gelu" if full.get("quick_gelu") else "gelu")
    tiny = json.loads(json.dumps(full))
    tiny["embed_dim"] = 24
    tiny["vision_cfg"].update(image_size=32, patch_size=8, width=32, layers=2, head_width=8)
    tiny["text_cfg"].update(context_length=16, vocab_size=99, width=32, heads=4, layers=2)
    torch.manual_seed(7)
    model = ocm.CLIP(**tiny).eval()
    cfg = clip.CLIPConfig(**TINY, hidden_act="gelu")
    params = convert_weights(clip.OPEN_CLIP_FAMILY, cfg, clip.split_fused_qkv(torch_state_dict_arrays(model)))
    images, ids = _scorer_images(), _tokens(pad=0)
    pixels = torch.tensor(np.stack([_pil_longest_pad(im, 32) for im in images])).permute(0, 3, 1, 2).float()
    with torch.no_grad():
        image = _torch_normalised(model.encode_image(pixels))
        text = _torch_normalised(model.encode_text(torch.tensor(ids)))
        ref = torch.diagonal(image @ text.T).numpy()  # img_score.py's logits_per_image diagonal
    got = np.asarray(_score_fn("hpsv2", cfg)({"clip": params}, images, ids))
    assert _rel(got, ref) <= 1e-4


def _tiny_tokenizer_dir(path):
    """A CLIP BPE tokenizer over a handful of words, written as vocab.json + merges.txt."""
    words = ["a", "cat", "dog", "on", "mat"]
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    merges = []
    for ch in sorted({c for w in words for c in w}):
        vocab.setdefault(ch, len(vocab))
        vocab.setdefault(ch + "</w>", len(vocab))
    for w in words:  # merge each word left to right
        piece = w[0]
        for i, ch in enumerate(w[1:], 1):
            nxt = ch + ("</w>" if i == len(w) - 1 else "")
            merges.append(f"{piece} {nxt}")
            piece += nxt
            vocab.setdefault(piece, len(vocab))
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "vocab.json"), "w") as f:
        json.dump(vocab, f)
    with open(os.path.join(path, "merges.txt"), "w") as f:
        f.write("#version: 0.2\n" + "\n".join(dict.fromkeys(merges)) + "\n")
    transformers.CLIPTokenizer(os.path.join(path, "vocab.json"), os.path.join(path, "merges.txt"),
                               pad_token="<|endoftext|>").save_pretrained(path)
    return vocab


def test_conversion_cli_round_trip_and_reward(hf_model, open_clip_model, tmp_path):
    spec = importlib.util.spec_from_file_location("clip_to_orbax", os.path.join(
        os.path.dirname(__file__), "..", "convert", "clip_to_orbax.py"))
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)

    # transformers folder + aesthetic head + tokenizer -> checkpoint -> registered rewards.
    model, cfg, params = hf_model
    model.save_pretrained(tmp_path / "hf")
    vocab = _tiny_tokenizer_dir(str(tmp_path / "tok"))
    torch.manual_seed(6)
    mlp = TorchAestheticMLP(24)
    torch.save(mlp.state_dict(), tmp_path / "head.pth")
    cli.main([f"--transformers_dir={tmp_path / 'hf'}", f"--tokenizer_dir={tmp_path / 'tok'}",
              f"--aesthetic_head={tmp_path / 'head.pth'}", f"--out={tmp_path / 'ckpt'}"])
    family, loaded_cfg, loaded = load_checkpoint(str(tmp_path / "ckpt"))
    assert family is FAMILIES["clip"] and loaded_cfg == cfg
    jax.tree.map(np.testing.assert_array_equal, loaded, params)

    images = _scorer_images()
    prompts = ["a cat on a mat", "a dog", "cat"]
    pickscore = get_reward("pickscore", checkpoint_dir=str(tmp_path / "ckpt"))  # tokenizer/ found in the checkpoint
    tokenizer = transformers.CLIPTokenizer.from_pretrained(str(tmp_path / "tok"))
    ids = np.asarray(tokenizer(prompts, padding="max_length", max_length=16, truncation=True)["input_ids"], np.int32)
    assert ids.max() < len(vocab) + 2 and (ids[:, 0] == 0).all()
    direct = _score_fn("pickscore", cfg)({"clip": params}, images, ids)
    np.testing.assert_allclose(pickscore(images, prompts, [{}] * 3), np.asarray(direct), rtol=1e-5)

    aesthetic = get_reward("aesthetic", checkpoint_dir=str(tmp_path / "ckpt"))
    with torch.no_grad():
        pixels = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})(
            images=list(images), return_tensors="pt")["pixel_values"]
        embed = getattr(o := model.get_image_features(pixel_values=pixels), "pooler_output", o)
        ref = mlp.eval()(_torch_normalised(embed))[:, 0].numpy()
    np.testing.assert_allclose(aesthetic(images, prompts, [{}] * 3), ref, rtol=2e-5, atol=2e-6)

    # open_clip state dict, wrapped and DDP-prefixed as HPS checkpoints are.
    oc_model, oc_cfg, oc_params = open_clip_model
    torch.save({"state_dict": {f"module.{k}": v for k, v in oc_model.state_dict().items()}}, tmp_path / "hps.pt")
    cli.main([f"--open_clip_checkpoint={tmp_path / 'hps.pt'}", "--variant=tiny",
              '--config_overrides={"hidden_act": "gelu"}', f"--out={tmp_path / 'hps'}"])
    family, loaded_cfg, loaded = load_checkpoint(str(tmp_path / "hps"))
    assert family is FAMILIES["open_clip"] and loaded_cfg == oc_cfg
    jax.tree.map(np.testing.assert_array_equal, loaded, oc_params)


def test_reward_errors_and_video_frames(hf_model):
    with pytest.raises(ValueError, match=r"checkpoint_dir.*convert/clip_to_orbax.py --transformers_dir"):
        get_reward("pickscore")
    with pytest.raises(FileNotFoundError, match="convert/clip_to_orbax.py --open_clip_checkpoint"):
        get_reward("hpsv2", checkpoint_dir="/nonexistent")

    _, cfg, params = hf_model
    reward = clip_scores.build_clip_reward(clip_scores.SCORERS["pickscore"], cfg, {"clip": params}, frame_stride=2)
    ids = _tokens()
    meta = [{"prompt_tokens": row} for row in ids]
    video = np.stack([np.stack([_photo(40, 56, 10 * b + t) for t in range(3)]) for b in range(3)])  # (3, 3, H, W, 3)
    per_frame = _score_fn("pickscore", cfg)
    want = np.mean([per_frame({"clip": params}, video[:, t], ids) for t in (0, 2)], axis=0)
    np.testing.assert_allclose(reward(video, [""] * 3, meta), want, rtol=1e-5)
    with pytest.raises(ValueError, match="tokenizer_dir"):
        reward(video, [""] * 3, [{}] * 3)
    with pytest.raises(ValueError, match="NaN or inf"):
        reward(np.full((3, 40, 56, 3), np.nan, np.float32), [""] * 3, meta)


def test_bfloat16_scores_track_float32(hf_model):
    _, cfg, params = hf_model
    images, ids = _scorer_images(), _tokens()
    f32 = _score_fn("pickscore", cfg)({"clip": params}, images, ids)
    bf16_cfg = dataclasses.replace(cfg, dtype="bfloat16", param_dtype="bfloat16")
    bf16_params = jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), params)
    bf16 = _score_fn("pickscore", bf16_cfg)({"clip": bf16_params}, images, ids)
    assert bf16.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(bf16), np.asarray(f32), atol=0.05)


def _photos(h, w, count=3):
    """Smooth gradients (each rotated differently) plus noise: distinct images of a real size."""
    return np.stack([_photo(h, w, seed)[..., np.roll(np.arange(3), seed)] for seed in range(count)])


@pytest.mark.gpu
def test_full_size_hpsv2_matches_open_clip_on_gpu(open_clip_model):
    """HPS v2.1's architecture at full size: open_clip's ViT-H-14 (its model_configs/ViT-H-14.json,
    open_clip's own random initialisation) in float32 on the same card, TF32 off and JAX at the
    highest matmul precision: both towers' projected features on the same pixels, and the score
    (cosine, as HPSv2's img_score.py) from uint8 images against PIL's ResizeMaxSize pipeline, to
    1e-4 relative. CPU counterparts: test_hpsv2_architecture_is_open_clip_vit_h_14 and
    test_open_clip_towers_parity (tiny sizes)."""
    errors, want = full_size_hpsv2_errors(sys.modules[type(open_clip_model[0]).__module__], "cuda")
    print(f"HPSv2.1 (open_clip ViT-H-14) fp32, JAX vs open_clip on {jax.devices()[0].device_kind}: "
          + ", ".join(f"{k} rel err {v:.2e}" for k, v in errors.items()))
    assert np.std(want) > 1e-3  # the rows are told apart
    assert max(errors.values()) <= 1e-4, errors


def full_size_hpsv2_errors(ocm, device):
    """({'image features', 'text features', 'score'}: relative error of JAX against open_clip's
    ViT-H-14 built by `ocm` (open_clip.model) on the torch `device`, the reference scores)."""
    with open(os.path.join(os.path.dirname(ocm.__file__), "model_configs", "ViT-H-14.json")) as f:
        full = json.load(f)
    cfg = clip.VARIANTS["ViT-H-14"]
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    with torch.device(device):
        model = ocm.CLIP(**full).eval()
    images = _photos(384, 512)
    rng = np.random.default_rng(6)
    eos = cfg.vocab_size - 1  # <|endoftext|>, the largest id: open_clip pools at the argmax
    ids = rng.integers(1, eos - 1, size=(3, cfg.context_length))
    ids[:, 0] = eos - 1  # <|startoftext|>
    for row, length in enumerate((6, cfg.context_length, 20)):
        ids[row, length - 1], ids[row, length:] = eos, 0
    ids = ids.astype(np.int32)
    pixels = np.stack([_pil_longest_pad(im, cfg.image_size) for im in images]).astype(np.float32)
    with torch.no_grad():
        image = model.encode_image(torch.as_tensor(pixels).permute(0, 3, 1, 2).to(device))
        text = model.encode_text(torch.as_tensor(ids, dtype=torch.long).to(device))
        want_image, want_text = image.cpu().numpy(), text.cpu().numpy()
        want = torch.diagonal(_torch_normalised(image) @ _torch_normalised(text).T).cpu().numpy()
    params = convert_weights(clip.OPEN_CLIP_FAMILY, cfg, clip.split_fused_qkv(torch_state_dict_arrays(model)))
    del model, image, text
    if device == "cuda":
        torch.cuda.empty_cache()
    with jax.default_matmul_precision("highest"):
        got_image, got_text = _towers(cfg)({"params": params}, pixels, ids)
        got = np.asarray(_score_fn("hpsv2", cfg)({"clip": params}, images, ids))
    errors = {"image features": _rel(got_image, want_image), "text features": _rel(got_text, want_text),
              "score": _rel(got, want)}
    return errors, want


def test_random_reference_checkpoints_convert_and_score(tmp_path):
    """benchmarks/random_reward_checkpoints.py (the inputs of the GPU benchmark's reward runs):
    its tiny ImageReward and HPS files convert with the converter CLIs, load as registered rewards
    through their tokenizer folders and score prompts as the random-embedding runs name them; its
    CLIP tokenizer made from open_clip's shipped vocabulary gives CLIP's ids."""
    spec = importlib.util.spec_from_file_location("random_reward_checkpoints", os.path.join(
        os.path.dirname(__file__), "..", "benchmarks", "random_reward_checkpoints.py"))
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    clis = {}
    for name in ("clip_to_orbax", "image_reward_to_orbax"):
        spec = importlib.util.spec_from_file_location(name, os.path.join(
            os.path.dirname(__file__), "..", "convert", f"{name}.py"))
        clis[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(clis[name])
    src = tmp_path / "src"
    maker.main([f"--out={src}", "--size=tiny"])
    clis["image_reward_to_orbax"].main([f"--checkpoint={src / 'ImageReward.pt'}", "--variant=tiny",
                                        f"--tokenizer_dir={src / 'bert_tokenizer'}", f"--out={tmp_path / 'ir'}"])
    clis["clip_to_orbax"].main([f"--open_clip_checkpoint={src / 'HPS_v2.1.pt'}", "--variant=tiny",
                                '--config_overrides={"hidden_act": "gelu"}', f"--tokenizer_dir={src / 'clip_tokenizer'}",
                                f"--out={tmp_path / 'hps'}"])
    images, prompts = _scorer_images(), ["<random prompt 3>", "<random prompt 11>", "a cat on a mat"]
    for name, ckpt in (("image_reward", "ir"), ("hpsv2", "hps")):
        scores = get_reward(name, checkpoint_dir=str(tmp_path / ckpt))(images, prompts, [{}] * 3)
        assert scores.shape == (3,) and np.isfinite(scores).all() and np.ptp(scores) > 0, (name, scores)

    assert maker.clip_tokenizer(str(tmp_path / "clip_tok")) == 49408
    ids = clip.load_tokenizer(str(tmp_path / "clip_tok"))(["a photo of a cat"], 77)
    assert ids[0, :8].tolist() == [49406, 320, 1125, 539, 320, 2368, 49407, 49407]
