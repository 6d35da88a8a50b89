"""Prompt-embedding cache: encoding with tiny random text encoders through the diffusers
pipelines' own encode_prompt, the on-disk format, torch-free reading and its error messages.

No downloads: tokenizers are word-level vocabularies built here (a template or prompt word is
one token, so the Qwen-Image chat template's prefix is 34 tokens as with the real tokenizer; the
HunyuanVideo template's is 96 here, not 95, which only shifts what is cropped), and encoders are
tiny random transformers models. Qwen-Image's Qwen2.5-VL is replaced by a tiny text-only
Qwen2Model: the pipeline only reads `hidden_states[-1]` of the language model, which both
compute the same way for text input.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from digen_jax.data import embeddings
from digen_jax.data.embeddings import EmbeddingCache, write_cache

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("diffusers")

from digen_jax.data import encode  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = [
    "a photo of a red cat",
    " A pyramid made of falafel with a partial solar eclipse in the background. ",
    "two dogs",
    "a very long prompt: " + "the cat and the dog and the bird " * 4,
    "an unknownword",
]
_SPECIALS = ["<pad>", "<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|start_header_id|>",
             "<|end_header_id|>", "<|eot_id|>"]


def _tokenizer(template: str, post: str | None, max_length: int):
    """A word-level fast tokenizer covering `template`'s and PROMPTS' words; `post` is the
    special-token template around a text ('$A </s>' for T5, '<s> $A </s>' for CLIP)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors

    splitter = pre_tokenizers.Split(Regex(r"\w+|[^\w\s]|\n"), behavior="removed", invert=True)
    text = " ".join([template, *PROMPTS]).replace("unknownword", "")
    for special in _SPECIALS:
        text = text.replace(special, " ")
    words = sorted({piece for piece, _ in splitter.pre_tokenize_str(text)})
    vocab = {word: i for i, word in enumerate(_SPECIALS + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = splitter
    if post:
        tok.post_processor = processors.TemplateProcessing(
            single=post, special_tokens=[(t, vocab[t]) for t in ("<s>", "</s>") if t in post])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>", eos_token="</s>",
        additional_special_tokens=_SPECIALS[4:], model_max_length=max_length)


def _clip(tokenizer, cls=None, hidden_size=16):
    torch.manual_seed(0)
    return (cls or transformers.CLIPTextModel)(transformers.CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=77, projection_dim=16,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)).eval()


def _t5_config(tokenizer):
    return dict(vocab_size=len(tokenizer), d_model=24, d_kv=8, d_ff=32, num_layers=2, num_heads=3,
                relative_attention_num_buckets=8, pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id)


def _components(family: str) -> dict:
    """Tiny random text encoders and tokenizers of `family`'s pipeline."""
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

    torch.manual_seed(1)
    if family == "flux":
        clip_tok, t5_tok = _tokenizer("", "<s> $A </s>", 77), _tokenizer("", "$A </s>", 512)
        t5 = transformers.T5EncoderModel(transformers.T5Config(**_t5_config(t5_tok))).eval()
        return {"text_encoder": _clip(clip_tok), "tokenizer": clip_tok, "text_encoder_2": t5, "tokenizer_2": t5_tok}
    if family == "qwenimage":
        tok = _tokenizer(encode.text_pipeline("qwenimage", text_encoder=None, tokenizer=None).prompt_template_encode,
                         None, 2048)
        model = transformers.Qwen2Model(transformers.Qwen2Config(
            vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=2048, pad_token_id=tok.pad_token_id)).eval()
        return {"text_encoder": model, "tokenizer": tok}
    if family in ("wan", "wan22"):
        tok = _tokenizer("", "$A </s>", 512)
        return {"text_encoder": transformers.UMT5EncoderModel(transformers.UMT5Config(**_t5_config(tok))).eval(),
                "tokenizer": tok}
    if family == "hunyuan_video":
        tok = _tokenizer(DEFAULT_PROMPT_TEMPLATE["template"], "<s> $A", 1024)
        clip_tok = _tokenizer("", "<s> $A </s>", 77)
        llama = transformers.LlamaModel(transformers.LlamaConfig(
            vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=512, pad_token_id=tok.pad_token_id)).eval()
        return {"text_encoder": llama, "tokenizer": tok, "text_encoder_2": _clip(clip_tok), "tokenizer_2": clip_tok}
    if family == "sd3":
        # CLIP-L and CLIP-G (hidden 16 + 24, zero-padded to T5's 48) with projections, and T5.
        clip_tok, t5_tok = _tokenizer("", "<s> $A </s>", 77), _tokenizer("", "$A </s>", 512)
        with_projection = transformers.CLIPTextModelWithProjection
        t5 = transformers.T5EncoderModel(transformers.T5Config(**{**_t5_config(t5_tok), "d_model": 48})).eval()
        return {"text_encoder": _clip(clip_tok, with_projection), "tokenizer": clip_tok,
                "text_encoder_2": _clip(clip_tok, with_projection, hidden_size=24), "tokenizer_2": clip_tok,
                "text_encoder_3": t5, "tokenizer_3": t5_tok}
    raise ValueError(family)


@pytest.fixture(scope="module", params=sorted(embeddings.EMBEDDING_LAYOUTS))
def encoded(request, tmp_path_factory):
    """(family, pipeline, cache) for PROMPTS encoded in batches of 2 (the last one short)."""
    family = request.param
    pipe = encode.text_pipeline(family, **_components(family))
    out = str(tmp_path_factory.mktemp(family) / "cache")
    encode.encode_to_cache(pipe, family, PROMPTS, out, prompt_ids=[3, 4, 7, 8, 9], batch_size=2,
                           info={"source": "test"})
    return family, pipe, EmbeddingCache.open(out, expect_family=family)


def _reference(pipe, family, prompts):
    """encode_prompt called as each pipeline's __call__ calls it, on all prompts at once."""
    with torch.inference_mode():
        if family == "flux":
            text, pooled, text_ids = pipe.encode_prompt(prompts, prompt_2=None, max_sequence_length=512)
            assert not text_ids.any()
            return {"text": text, "pooled": pooled}
        if family == "qwenimage":
            text, mask = pipe.encode_prompt(prompts, max_sequence_length=512)
            return {"text": text, "mask": mask}
        if family in ("wan", "wan22"):
            return {"text": pipe.encode_prompt(prompts, do_classifier_free_guidance=False, max_sequence_length=512)[0]}
        if family == "sd3":
            text, _, pooled, _ = pipe.encode_prompt(prompts, None, None, do_classifier_free_guidance=False,
                                                    max_sequence_length=256)
            return {"text": text, "pooled": pooled}
        text, pooled, mask = pipe.encode_prompt(prompts, max_sequence_length=256)
        return {"text": text, "pooled": pooled, "mask": mask}


def test_cache_equals_pipeline_encode_prompt(encoded):
    family, pipe, cache = encoded
    ref = _reference(pipe, family, PROMPTS)
    got = cache.batch(np.arange(len(PROMPTS)))
    n = len(PROMPTS)
    # SD3: CLIP's 77 positions, then T5's 256.
    expected_len = {"flux": 512, "wan": 512, "wan22": 512, "hunyuan_video": 256, "sd3": 77 + 256}.get(
        family, ref["text"].shape[1])
    assert len(cache) == n and cache.text_len == expected_len and cache.dtype == "float32"
    assert cache.prompts == PROMPTS and got["prompt_ids"].tolist() == [3, 4, 7, 8, 9]
    width = {"flux": lambda: pipe.text_encoder_2.config.d_model, "sd3": lambda: pipe.text_encoder_3.config.d_model}.get(
        family, lambda: pipe.text_encoder.config.hidden_size)()
    assert got["text"].shape == (n, expected_len, width)
    # Batches of 2 vs one batch of 5: same values up to matmul-blocking rounding.
    np.testing.assert_allclose(got["text"], ref["text"].numpy(), rtol=1e-5, atol=1e-5)
    assert set(got) == {"text", "prompt_ids"} | {k for k in ("pooled", "mask", "lengths")
                                                  if embeddings.EMBEDDING_LAYOUTS[family][k]}
    if "pooled" in got:
        assert got["pooled"].shape == (n, 32 if family == "sd3" else 16)  # SD3: two projected CLIPs
        np.testing.assert_allclose(got["pooled"], ref["pooled"].numpy(), rtol=1e-5, atol=1e-5)
    if "mask" in got:
        np.testing.assert_array_equal(got["mask"], ref["mask"].numpy().astype(bool))
        np.testing.assert_array_equal(got["lengths"], ref["mask"].numpy().sum(1))
        # Right-padded, and zeros are in the padding only where diffusers zero-pads (Qwen-Image).
        assert all(got["mask"][i, :length].all() and not got["mask"][i, length:].any()
                   for i, length in enumerate(got["lengths"].tolist()))
    if family in ("wan", "wan22"):
        lengths = got["lengths"].tolist()
        assert all(not np.asarray(got["text"][i, length:]).any() and np.asarray(got["text"][i, length - 1]).any()
                   for i, length in enumerate(lengths))
    negative = embeddings.EMBEDDING_LAYOUTS[family]["negative"]
    assert cache.has_negative == (negative is not None)
    if negative is not None:
        ref_negative = _reference(pipe, family, [negative])["text"].numpy()
        got_negative = cache.negative()
        width = ref_negative.shape[1]
        np.testing.assert_allclose(got_negative["text"][:, :width], ref_negative, rtol=1e-5, atol=1e-5)
        assert not np.asarray(got_negative["text"][:, width:]).any()
        if "pooled" in got:  # SD3's CFG needs the negative prompt's pooled vector too
            np.testing.assert_allclose(got_negative["pooled"], _reference(pipe, family, [negative])["pooled"].numpy(),
                                       rtol=1e-5, atol=1e-5)
    else:
        with pytest.raises(ValueError, match="no negative prompt"):
            cache.negative()


def test_qwenimage_drops_template_prefix_and_caps(tmp_path):
    pipe = encode.text_pipeline("qwenimage", **_components("qwenimage"))
    prompt = PROMPTS[0]
    tokens = pipe.tokenizer(pipe.prompt_template_encode.format(prompt), return_tensors="pt")
    assert pipe.prompt_template_encode_start_idx == 34
    # The template's 34-token prefix ends just before the prompt's first word.
    assert pipe.tokenizer.convert_ids_to_tokens(tokens.input_ids[0, 33:35].tolist()) == ["\n", "a"]
    with torch.inference_mode():
        hidden = pipe.text_encoder(**tokens, output_hidden_states=True).hidden_states[-1][0, 34:].numpy()
    encode.encode_to_cache(pipe, "qwenimage", [prompt, "two dogs"], str(tmp_path / "full"), batch_size=1)
    full = EmbeddingCache.open(str(tmp_path / "full")).batch([0, 1])
    assert full["lengths"].tolist() == [len(hidden), len(hidden) - 4]
    np.testing.assert_allclose(full["text"][0], hidden, rtol=1e-5, atol=1e-5)
    encode.encode_to_cache(pipe, "qwenimage", [prompt, "two dogs"], str(tmp_path / "capped"), batch_size=1,
                           max_sequence_length=8, negative_prompt=None)
    capped = EmbeddingCache.open(str(tmp_path / "capped"))
    assert capped.text_len == 8 and not capped.has_negative
    # 11 and 7 positions (prompt words + the template's 5-token tail), capped at 8.
    assert capped.batch([0, 1])["lengths"].tolist() == [8, 7]
    np.testing.assert_allclose(capped.batch([0])["text"][0], hidden[:8], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="at most 1024"):
        encode.encode_to_cache(pipe, "qwenimage", [prompt], str(tmp_path / "x"), max_sequence_length=1025)


def test_hunyuan_video_crops_template_prefix(tmp_path):
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

    pipe = encode.text_pipeline("hunyuan_video", **_components("hunyuan_video"))
    tokens = pipe.tokenizer(DEFAULT_PROMPT_TEMPLATE["template"].format(PROMPTS[0]), return_tensors="pt")
    crop = DEFAULT_PROMPT_TEMPLATE["crop_start"]
    assert crop == 95
    with torch.inference_mode():
        # hidden_states[-3]: the last two layers are skipped.
        hidden = pipe.text_encoder(**tokens, output_hidden_states=True).hidden_states[-3][0, crop:].numpy()
    encode.encode_to_cache(pipe, "hunyuan_video", PROMPTS[:1], str(tmp_path / "c"))
    got = EmbeddingCache.open(str(tmp_path / "c")).batch([0])
    assert got["text"].shape == (1, 256, 16) and got["lengths"].tolist() == [len(hidden)]
    np.testing.assert_allclose(got["text"][0, :len(hidden)], hidden, rtol=1e-5, atol=1e-5)


def _write_tiny(path, family="flux", dtype="float32", **overrides):
    rng = np.random.default_rng(0)
    arrays = {"text": rng.standard_normal((3, 4, 2)).astype(np.float32)}
    if embeddings.EMBEDDING_LAYOUTS[family]["pooled"]:
        arrays["pooled"] = rng.standard_normal((3, 5)).astype(np.float32)
    if embeddings.EMBEDDING_LAYOUTS[family]["lengths"]:
        arrays["lengths"] = np.array([4, 2, 1], np.int32)
    if embeddings.EMBEDDING_LAYOUTS[family]["mask"]:
        arrays["mask"] = np.arange(4) < arrays["lengths"][:, None]
    arrays.update(overrides)
    write_cache(str(path), family, prompts=["a", "b", "c"], dtype=dtype, **arrays)
    return arrays


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_storage(tmp_path, dtype):
    import ml_dtypes

    arrays = _write_tiny(tmp_path / "c", dtype=dtype)
    cache = EmbeddingCache.open(str(tmp_path / "c"))
    stored = np.load(tmp_path / "c" / "text.npy", mmap_mode="r")
    assert stored.dtype == (np.uint16 if dtype == "bfloat16" else np.float16)
    got = cache.batch([2, 0])
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
    assert got["text"].dtype == np_dtype and got["pooled"].dtype == np_dtype
    np.testing.assert_array_equal(np.asarray(got["text"]), arrays["text"][[2, 0]].astype(np_dtype))


def test_reading_imports_no_torch(tmp_path):
    _write_tiny(tmp_path / "c", family="hunyuan_video", dtype="bfloat16")
    code = ("import sys; from digen_jax.data.embeddings import EmbeddingCache; "
            f"b = EmbeddingCache.open({str(tmp_path / 'c')!r}, expect_family='hunyuan_video').batch([1, 0]); "
            "assert b['text'].shape == (2, 4, 2) and b['mask'].shape == (2, 4); "
            "assert not {'torch', 'transformers', 'diffusers'} & set(sys.modules), 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu"},
                   timeout=60)


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="encode_prompts.py"):
        EmbeddingCache.open(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no meta.json.*encode_prompts.py"):
        EmbeddingCache.open(str(tmp_path / "empty"))
    _write_tiny(tmp_path / "flux")
    with pytest.raises(ValueError, match="'flux' prompt embeddings but the model is 'wan'"):
        EmbeddingCache.open(str(tmp_path / "flux"), expect_family="wan")
    with pytest.raises(FileExistsError, match="already holds"):
        _write_tiny(tmp_path / "flux")
    np.save(tmp_path / "flux" / "pooled.npy", np.zeros((3, 4), np.float32))
    with pytest.raises(ValueError, match=r"pooled.npy has shape \(3, 4\)"):
        EmbeddingCache.open(str(tmp_path / "flux"))
    (tmp_path / "flux" / "pooled.npy").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="cannot read pooled.npy"):
        EmbeddingCache.open(str(tmp_path / "flux"))
    _write_tiny(tmp_path / "hy", family="hunyuan_video", mask=np.ones((3, 4), bool))
    with pytest.raises(ValueError, match="mask.npy disagrees with lengths.npy"):
        EmbeddingCache.open(str(tmp_path / "hy"))
    with pytest.raises(ValueError, match=r"block needs keys \['lengths', 'text'\]"):
        _write_tiny(tmp_path / "wan", family="wan", lengths=None)
    with pytest.raises(ValueError, match="no true CFG"):
        write_cache(str(tmp_path / "neg"), "flux", prompts=["a"], text=np.zeros((1, 2, 2)), pooled=np.zeros((1, 2)),
                    negative_prompt="", negative={"text": np.zeros((1, 2, 2))})
    with pytest.raises(ValueError, match="unknown model family 'sdxl'"):
        EmbeddingCache.open(str(tmp_path / "flux"), expect_family="sdxl")
    (tmp_path / "flux" / "meta.json").write_text("{", encoding="utf-8")
    with pytest.raises(ValueError, match="cannot read meta.json"):
        EmbeddingCache.open(str(tmp_path / "flux"))
    writer = embeddings.CacheWriter(str(tmp_path / "partial"), "flux", ["a", "b"], text_len=4, text_dim=2, pooled_dim=5)
    with pytest.raises(ValueError, match=r"pooled block of shape \(2, 4\) at row 0 does not fit \(2, 5\)"):
        writer.write(0, {"text": np.zeros((2, 4, 2)), "pooled": np.zeros((2, 4))})
    with pytest.raises(ValueError, match="only 0 of 2 rows"):
        writer.finish()
    cache_dir = tmp_path / "wan_ok"
    _write_tiny(cache_dir, family="wan")
    with pytest.raises(IndexError):
        EmbeddingCache.open(str(cache_dir)).batch([3])


def test_read_prompts(tmp_path):
    (tmp_path / "p.txt").write_text("first \n\n  \nthird line\r\n", encoding="utf-8")
    assert encode.read_prompts(str(tmp_path / "p.txt")) == ([0, 3], ["first ", "third line"])
    lines = [json.dumps({"tag": "x", "prompt": "a photo of a cat"}), "", json.dumps({"prompt": "two dogs"})]
    (tmp_path / "p.jsonl").write_text("\n".join(lines), encoding="utf-8")
    assert encode.read_prompts(str(tmp_path / "p.jsonl")) == ([0, 2], ["a photo of a cat", "two dogs"])
    (tmp_path / "bad.jsonl").write_text('{"text": "no prompt key"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        encode.read_prompts(str(tmp_path / "bad.jsonl"))


@pytest.mark.parametrize("family", ["flux", "sd3"])  # SD3: three encoders, two of them CLIP with projections
def test_cli_loads_pipeline_folder(tmp_path, family):
    """convert/encode_prompts.py on a saved diffusers-layout folder gives the in-memory result."""
    components = _components(family)
    for name, component in components.items():
        component.save_pretrained(str(tmp_path / "pipe" / name))
    (tmp_path / "prompts.txt").write_text("\n".join(PROMPTS[:3]) + "\n", encoding="utf-8")
    out = tmp_path / "cache"
    subprocess.run([sys.executable, os.path.join(REPO, "convert", "encode_prompts.py"), f"--family={family}",
                    f"--prompts={tmp_path / 'prompts.txt'}", f"--out={out}", f"--encoder_dir={tmp_path / 'pipe'}",
                    "--batch_size=2", "--device=cpu", "--dtype=float32"],
                   check=True, cwd=REPO, timeout=120, capture_output=True)
    cache = EmbeddingCache.open(str(out), expect_family=family)
    assert cache.prompts == PROMPTS[:3] and cache.meta["source"] == str(tmp_path / "prompts.txt")
    ref = _reference(encode.text_pipeline(family, **components), family, PROMPTS[:3])
    got = cache.batch([0, 1, 2])
    np.testing.assert_allclose(got["text"], ref["text"].numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["pooled"], ref["pooled"].numpy(), rtol=1e-5, atol=1e-5)
