"""What a run trains on: a prompt task, the model that denoises it, and how samples are scored.

Two workloads, picked by the config's sections:

* :class:`ShapesWorkload` (a `task` section, configs/tiny.py): the synthetic shapes task in
  pixel space, with a tiny FLUX-family model pretrained on it.
* :class:`ModelZooWorkload` (a `data` section, configs/{flux,qwenimage,wan21,hunyuanvideo}.py):
  one of the four model families, from a converted checkpoint or randomly initialised at any
  variant's size, conditioned on an embedding cache or on random embeddings, scored on frames
  its VAE decodes.

Each provides `task` (prompt sampling, encoding and text), `base_params`, `sampler`,
`latent_shape`, `prompt_batch(k)`, `eval_batch(n)`, `score(latents, prompt_ids)` and
`images(latents)`; both score with `make_reward_fn(config)`: the rewards of `reward.weights`,
each built with its `reward.options` entry. `validate_config(config)` checks a config against
its workload without touching a device, so bad input fails before any compute; `ConfigError`
names the key.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from digen_jax import diffusion
from digen_jax.data.embeddings import FAMILIES as EMBEDDING_FAMILIES
from digen_jax.data.embeddings import EmbeddingCache
from digen_jax.data.encode import PIPELINES
from digen_jax.data.prompts import CachedPrompts, RandomPrompts
from digen_jax.data.shapes import ShapesTask
from digen_jax.models import FAMILIES, load_checkpoint, vae_flux, vae_hunyuan_video, vae_wan
from digen_jax.models.checkpoints import MODEL_JSON, PARAMS_DIR
from digen_jax.rewards import registry
from digen_jax.app.pretrain import cache_key, pretrained_params
from digen_jax.rl.rollout import Conditioning, Sampler, SamplerSpec, make_denoiser

# fold_in tags of one iteration's randomness
PROMPTS, SAMPLES, EVAL = 0, 1, 2


class ConfigError(ValueError):
    """A config that cannot run; the message names the config key and what to do."""


@dataclasses.dataclass(frozen=True)
class ZooFamily:
    """How the loop drives one transformer family.

    full_variant / full_vae_variant: the released model's entries in the transformer and VAE
    families' `variants` ('tiny' pairs with 'tiny'). vae_families: the converted-VAE families
    accepted for it. text_dim / pooled_dim: the config fields the conditioning must match.
    video: latents (C, T', H/8, W/8) and 4k+1 frames; else packed 2x2 tokens.
    """

    name: str
    title: str  # as the released pipeline folder is usually called
    full_variant: str
    full_vae_variant: str
    vae_families: tuple[str, ...]
    text_dim: str
    pooled_dim: str | None
    video: bool

    @property
    def text_cap(self) -> int:
        """Longest text the model takes: the pipeline's hard cap of max_sequence_length where it
        has one, else the fixed length its text encoder pads to (the length it was trained with)."""
        _, _, _, default_len, hard_cap = PIPELINES[self.name]
        return hard_cap or default_len


ZOO = {
    f.name: f
    for f in (
        ZooFamily("flux", "FLUX.1-dev", "dev", "flux1", ("vae_flux",), "joint_attention_dim",
                  "pooled_projection_dim", False),
        ZooFamily("qwenimage", "Qwen-Image", "qwen-image", "wan2.1", ("vae_qwenimage", "vae_wan"),
                  "joint_attention_dim", None, False),
        ZooFamily("wan", "Wan2.1-T2V-14B", "t2v-14b", "wan2.1", ("vae_wan",), "text_dim", None, True),
        ZooFamily("hunyuan_video", "HunyuanVideo", "t2v", "hunyuan_video", ("vae_hunyuan_video",),
                  "text_embed_dim", "pooled_projection_dim", True),
    )
}
# Config keys that shorten a random-weight transformer (block stacks by their config field names).
DEPTH_KEYS = ("num_layers", "num_single_layers")
_VAE_FAMILY = {"flux": "vae_flux", "qwenimage": "vae_qwenimage", "wan": "vae_wan", "hunyuan_video": "vae_hunyuan_video"}
# The VAEs' 8x downsampling, then 2x2 packing or patches: sides are multiples of 16.
_SIDE_MULTIPLE = 2 * diffusion.VAE_SCALE_FACTOR
_TEMPORAL = 4  # both video VAEs: 4k + 1 frames <-> k + 1 latent frames


def is_shapes(config: ml_collections.ConfigDict) -> bool:
    """Whether `config` is the shapes task's (a `task` section) rather than a model-zoo one (`data`)."""
    return "task" in config


# ---------------------------------------------------------------------------------------- rewards


def reward_options(config: ml_collections.ConfigDict) -> dict[str, dict]:
    """`reward.options` as plain dicts: {reward name: its factory's keyword arguments} (may be absent)."""
    options = config.reward.get("options") or {}
    if isinstance(options, ml_collections.ConfigDict):
        options = options.to_dict()
    return {name: dict(kwargs) for name, kwargs in options.items()}


def _validate_reward_options(config: ml_collections.ConfigDict) -> None:
    options = config.reward.get("options") or {}
    for name, kwargs in options.items():
        if name not in config.reward.weights:
            raise ConfigError(f"reward.options names {name!r}, which is not in reward.weights "
                              f"{sorted(dict(config.reward.weights))}: options belong to a weighted reward")
        if not isinstance(kwargs, (dict, ml_collections.ConfigDict)):
            raise ConfigError(f"reward.options[{name!r}] must map option names to values, got {kwargs!r}")


def make_reward_fn(config: ml_collections.ConfigDict) -> registry.CombinedRewardFn:
    """The combined reward of `reward.weights`, each reward built with its `reward.options` entry."""
    return registry.weighted_reward(dict(config.reward.weights), reward_options(config))


# ---------------------------------------------------------------------------------------- shapes


def _pretrain_recipe(config: ml_collections.ConfigDict) -> tuple[Any, ShapesTask, dict]:
    """The shapes task's base model as pretrained: (model config, task, pretraining arguments)."""
    c, p = config.model, config.pretrain
    model_cfg = FAMILIES[c.family].config_cls(**c.arch.to_dict(), **_policy(config))
    args = dict(steps=p.steps, batch_size=p.batch_size, learning_rate=p.learning_rate, seed=config.seed,
                guidance=config.sampling.guidance)
    return model_cfg, shapes_task(config), args


def base_model_id(config: ml_collections.ConfigDict) -> dict[str, str]:
    """The run's base transformer, named without reading its weights: `id` changes whenever the
    weights do (a converted checkpoint's model.json and orbax metadata, which orbax stamps at
    each write; the pretraining recipe's cache key; random weights' variant and seed), `where`
    says in words where they come from."""
    c = config.model
    if c.get("checkpoint"):
        path = os.path.abspath(c.checkpoint)
        digest = hashlib.sha256()
        for name in (MODEL_JSON, os.path.join(PARAMS_DIR, "_CHECKPOINT_METADATA"), os.path.join(PARAMS_DIR, "_METADATA")):
            if os.path.exists(os.path.join(path, name)):
                with open(os.path.join(path, name), "rb") as f:
                    digest.update(f.read())
        return {"id": f"checkpoint {digest.hexdigest()[:16]}", "where": path}
    if c.get("random_init"):
        return {"id": f"random {c.variant} seed {config.seed}", "where": f"random {c.variant} weights (seed {config.seed})"}
    model_cfg, task, args = _pretrain_recipe(config)
    key = cache_key(model_cfg, task, **args)
    return {"id": f"pretrained {key}", "where": os.path.join(os.path.abspath(os.path.expanduser(config.pretrain.cache_dir)), key)}


def shapes_task(config: ml_collections.ConfigDict) -> ShapesTask:
    return ShapesTask(
        resolution=config.task.resolution,
        text_len=config.task.text_len,
        embed_dim=config.model.arch.joint_attention_dim,
        pooled_dim=config.model.arch.pooled_projection_dim,
        label_noise=config.task.label_noise,
    )


def _validate_shapes(config) -> None:
    if config.model.family not in FAMILIES:
        raise ConfigError(f"model.family={config.model.family!r} is unknown; known: {sorted(FAMILIES)}")
    if config.task.name != "shapes":
        raise ConfigError(f"task.name={config.task.name!r} is unknown; known: ['shapes']")
    if config.sampling.cfg_scale != 1.0:
        raise ConfigError("sampling.cfg_scale: the shapes task has no negative prompt; use 1 (embedded guidance)")
    try:
        shapes_task(config)
    except ValueError as e:
        raise ConfigError(f"task: {e}") from None
    if config.model.checkpoint:
        _validate_shapes_checkpoint(config)


# What ties a transformer to the shapes task: packed pixel tokens in and out, the text encoder's widths.
_SHAPES_INTERFACE = ("in_channels", "out_dim", "joint_attention_dim", "pooled_projection_dim")


def _validate_shapes_checkpoint(config) -> None:
    """`model.checkpoint` of the shapes task: a converted model of `model.family` whose inputs and
    outputs are the task's (the architecture of `model.arch` there; its depth and width are free)."""
    c = config.model
    key = f"model.checkpoint={c.checkpoint!r}"
    if not os.path.exists(os.path.join(c.checkpoint, MODEL_JSON)):
        raise ConfigError(f"{key} holds no converted model ({MODEL_JSON} missing): give a directory written by "
                          "convert/diffusers_to_orbax.py, or leave it empty to pretrain on the task")
    meta = _read_model_json(c.checkpoint)
    if meta.get("family") != c.family:
        raise ConfigError(f"{key} holds a {meta.get('family')!r} model; the shapes task trains "
                          f"model.family={c.family!r}")
    family = FAMILIES[c.family]
    try:
        found = family.config_from_diffusers(meta["config"])
        wanted = family.config_cls(**c.arch.to_dict())
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{key}: {e}") from None
    differ = [f"{name}={getattr(found, name)} (the task needs {getattr(wanted, name)})"
              for name in _SHAPES_INTERFACE if getattr(found, name) != getattr(wanted, name)]
    if differ:
        raise ConfigError(f"{key} does not fit the shapes task: {', '.join(differ)}; the task packs "
                          "pixels 2x2 into 12 channels and encodes prompts at model.arch's widths")


class _Workload:
    """Prompt batches, eval prompts and scoring shared by both workloads."""

    task: Any
    reward_fn: Any

    def __init__(self, config: ml_collections.ConfigDict):
        self.config = config
        self._prompt_key = jax.random.key(config.seed)

    def prompt_batch(self, k: int) -> tuple[jax.Array, Conditioning]:
        """The prompt ids and conditioning (one row per prompt) of iteration k."""
        key = jax.random.fold_in(jax.random.fold_in(self._prompt_key, k), PROMPTS)
        ids = self.task.sample_prompts(key, self.config.rl.prompts_per_iteration)
        return ids, Conditioning(*self.task.encode(ids))

    def eval_batch(self, n: int) -> tuple[jax.Array, Conditioning]:
        """n fixed evaluation prompts (the same for every iteration and resume)."""
        ids = self.task.sample_prompts(jax.random.fold_in(jax.random.key(self.config.seed + 7), EVAL), n)
        return ids, Conditioning(*self.task.encode(ids))


class ShapesWorkload(_Workload):
    """The shapes task in pixel space: (3, H, W) images packed 2x2 into (H/2 * W/2, 12) tokens."""

    def __init__(self, config: ml_collections.ConfigDict):
        super().__init__(config)
        s = config.sampling
        self.task = shapes_task(config)
        self.reward_fn = make_reward_fn(config)
        self.family, self.model_cfg, self.base_params = self._base_model()
        res = config.task.resolution
        self.latent_shape = ((res // 2) ** 2, 12)
        sigmas = diffusion.sigma_ladder(s.ladder, s.num_steps, image_seq_len=self.latent_shape[0]).sigmas
        module = self.family.module_cls(self.model_cfg)
        denoiser = make_denoiser(config.model.family, module, guidance=s.guidance, image_grid=(res // 2, res // 2))
        self.sampler = Sampler(denoiser, SamplerSpec(s.sde_type, s.cfg_scale, s.cfg_rescale), sigmas)

    def _base_model(self):
        c = self.config.model
        if c.checkpoint:
            return load_checkpoint(c.checkpoint, **_policy(self.config))
        model_cfg, task, args = _pretrain_recipe(self.config)
        params = pretrained_params(model_cfg, task, **args, cache_dir=os.path.expanduser(self.config.pretrain.cache_dir))
        return FAMILIES[c.family], model_cfg, params

    decoder_params = None  # pixel space: nothing to decode with

    def decode(self, latents: jax.Array, decoder_params=None) -> jax.Array:
        """(B, H, W, 3) float32 in [0, 1] on the latents' devices (device work: dispatch it from
        the thread that dispatches the other device work)."""
        res = self.config.task.resolution
        pixels = diffusion.unpack_latents(latents, res, res)
        return jnp.clip((pixels + 1) / 2, 0, 1).transpose(0, 2, 3, 1)

    def images(self, latents: jax.Array) -> np.ndarray:
        """(B, H, W, 3) float32 in [0, 1] from packed pixel latents."""
        return np.asarray(self.decode(latents))

    def reward(self, decoded: np.ndarray, ids: jax.Array) -> tuple[np.ndarray, dict]:
        """Rewards of decoded images (host work)."""
        return self.reward_fn(decoded, self.task.prompt_text(ids), self.task.prompt_metadata(ids))

    def score(self, latents: jax.Array, ids: jax.Array) -> tuple[np.ndarray, dict]:
        return self.reward(self.images(latents), ids)


# ---------------------------------------------------------------------------------------- model zoo


def shards_weights(rules) -> bool:
    """Whether logical-axis `rules` split a weight axis over the mesh (FSDP), not only activations."""
    return any(mesh_axis and not logical.startswith("activation_") for logical, mesh_axis in rules)


def attention_impl(config: ml_collections.ConfigDict) -> str:
    """`model.attention_impl`, where `auto` also steers clear of cuDNN attention in FSDP programs
    on several GPUs.

    On the lent H100s (jax 0.11.2, NCCL 2.28.9) a program that all-gathers or all-reduces
    sharded weights per layer and runs cuDNN's fused attention deadlocked at its first run: one
    device's thread never joined the collective's rendezvous. The same programs with XLA's
    attention ran every mode, as did cuDNN attention with replicated weights and a plain FSDP
    scan without attention (README "Training shards"). An explicit 'cudnn' is kept as asked.
    """
    impl = config.model.attention_impl
    sharding = config.get("sharding")
    if (impl == "auto" and sharding is not None and shards_weights(sharding.train_rules)
            and jax.default_backend() == "gpu" and jax.device_count() > 1):
        return "xla"
    return impl


def _policy(config: ml_collections.ConfigDict) -> dict:
    c = config.model
    return dict(dtype=c.dtype, param_dtype=c.param_dtype, attention_impl=attention_impl(config),
                remat_policy=c.remat_policy, scan_layers=c.scan_layers)


def _read_model_json(path: str) -> dict:
    with open(os.path.join(path, MODEL_JSON)) as f:
        return json.load(f)


def model_config(config: ml_collections.ConfigDict):
    """The transformer's config (architecture + policy) without reading any weights."""
    c = config.model
    family = FAMILIES[c.family]
    if c.random_init:
        return dataclasses.replace(family.variants[c.variant], **_policy(config), **_depth_overrides(c))
    return family.config_from_diffusers(_read_model_json(c.checkpoint)["config"], **_policy(config))


def _depth_overrides(model: ml_collections.ConfigDict) -> dict[str, int]:
    """`model.num_layers` / `model.num_single_layers` when > 0: a shallower stack of the variant's
    blocks (random weights only), for throughput runs that must fit a short device budget."""
    return {key: model[key] for key in DEPTH_KEYS if model.get(key, 0) > 0}


def vae_config(config: ml_collections.ConfigDict):
    """The VAE decoder's config without reading any weights."""
    c, zoo = config.model, ZOO[config.model.family]
    if c.random_init:
        family = FAMILIES[_VAE_FAMILY[c.family]]
        return family.variants["tiny" if c.variant == "tiny" else zoo.full_vae_variant]
    meta = _read_model_json(c.vae_checkpoint)
    return FAMILIES[meta["family"]].config_from_diffusers(meta["config"])


def latent_shape(config: ml_collections.ConfigDict, vae_cfg) -> tuple[int, ...]:
    """Per-sample latent shape: (H/16 * W/16, 4C) packed tokens, or (C, (F - 1)/4 + 1, H/8, W/8) video."""
    s, zoo = config.sampling, ZOO[config.model.family]
    channels = vae_cfg.z_dim if isinstance(vae_cfg, vae_wan.WanVAEConfig) else vae_cfg.latent_channels
    if zoo.video:
        return (channels, (s.num_frames - 1) // _TEMPORAL + 1, *diffusion.latent_size(s.height, s.width))
    return (diffusion.packed_seq_len(s.height, s.width), 4 * channels)


def _missing_inputs_message(config, missing: list[str]) -> str:
    zoo = ZOO[config.model.family]
    pipeline = f"<{zoo.title} diffusers folder>"
    how = {
        "model.checkpoint": (
            "the converted transformer",
            f"python convert/diffusers_to_orbax.py --model_dir={pipeline}/transformer --out=<DIR> --dtype=bfloat16"),
        "model.vae_checkpoint": (
            "the converted VAE",
            f"python convert/diffusers_to_orbax.py --model_dir={pipeline}/vae --out=<DIR>"),
        "data.embedding_cache": (
            "the prompt-embedding cache",
            f"python convert/encode_prompts.py --family={zoo.name} --prompts=<prompts.txt> "
            f"--encoder_dir={pipeline} --out=<DIR> --device=cuda"),
    }
    lines = [f"model.family={zoo.name!r} needs inputs that are not there:"]
    for key in missing:
        what, command = how[key]
        value = config[key.split(".")[0]][key.split(".")[1]]
        if not value:
            state = " is not set"
        elif os.path.isdir(value):
            state = f"={value!r} holds no {MODEL_JSON} (not a converted checkpoint)"
        else:
            state = f"={value!r} does not exist"
        lines += [f"  {key}{state}: {what}. Make it with", f"      {command}",
                  f"    then pass --config.{key}=<DIR>"]
    lines.append("Or, for a throughput run without weights or text encoders: "
                 "--config.model.random_init=True --config.data.random_embeddings=True")
    return "\n".join(lines)


def _validate_zoo(config) -> None:
    c, s, d = config.model, config.sampling, config.data
    if c.family not in ZOO:
        raise ConfigError(f"model.family={c.family!r} is unknown; known: {sorted(ZOO)}")
    zoo = ZOO[c.family]
    if c.random_init and c.variant not in FAMILIES[c.family].variants:
        raise ConfigError(f"model.variant={c.variant!r} is unknown for {c.family}; "
                          f"known: {sorted(FAMILIES[c.family].variants)}")
    for key in DEPTH_KEYS:
        depth = c.get(key, 0)
        if depth and not c.random_init:
            raise ConfigError(f"model.{key}={depth} shortens random-weight models only (model.random_init=True); "
                              "a converted checkpoint has its own depth")
        if depth and not hasattr(FAMILIES[c.family].variants[c.variant], key):
            raise ConfigError(f"model.{key}={depth}: {c.family} has no {key}")
        if not isinstance(depth, int) or depth < 0:
            raise ConfigError(f"model.{key} must be an integer >= 0 (0: the variant's depth), got {depth!r}")
    for key in ("height", "width"):
        value = s[key]
        if not isinstance(value, int) or value <= 0 or value % _SIDE_MULTIPLE:
            raise ConfigError(f"sampling.{key}={value!r} must be a positive multiple of {_SIDE_MULTIPLE} "
                              f"(the VAE's 8x downsampling, then 2x2 packing or patches)")
    if zoo.video and (not isinstance(s.num_frames, int) or s.num_frames < 1 or (s.num_frames - 1) % _TEMPORAL):
        raise ConfigError(f"sampling.num_frames={s.num_frames!r} must be 4k+1 (1, 5, ..., 33, ..., 81): "
                          "the causal video VAE decodes k+1 latent frames into 4k+1")
    if s.cfg_scale != 1.0 and EMBEDDING_FAMILIES[c.family]["negative"] is None:
        raise ConfigError(f"sampling.cfg_scale={s.cfg_scale}: {c.family} uses embedded guidance (sampling.guidance), "
                          "not true CFG; set sampling.cfg_scale=1")
    positive = (("reward.frame_stride", config.reward.frame_stride), ("model.vae_decode_batch", c.vae_decode_batch))
    for key, value in positive:
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{key} must be a positive integer, got {value!r}")
    try:
        diffusion.sigma_ladder(s.ladder, s.num_steps, image_seq_len=256, **s.ladder_options.to_dict())
    except ValueError as e:
        raise ConfigError(f"sampling.ladder / sampling.ladder_options / sampling.num_steps: {e}") from None

    missing = []
    if not c.random_init:
        for key, path in (("model.checkpoint", c.checkpoint), ("model.vae_checkpoint", c.vae_checkpoint)):
            if not path or not os.path.exists(os.path.join(path, MODEL_JSON)):
                missing.append(key)
    if not d.random_embeddings and (not d.embedding_cache or not os.path.isdir(d.embedding_cache)):
        missing.append("data.embedding_cache")
    if missing:
        raise ConfigError(_missing_inputs_message(config, missing))

    if not c.random_init:
        for key, path, accepted in (("model.checkpoint", c.checkpoint, (c.family,)),
                                    ("model.vae_checkpoint", c.vae_checkpoint, zoo.vae_families)):
            found = _read_model_json(path).get("family")
            if found not in accepted:
                raise ConfigError(f"{key}={path!r} holds a {found!r} model; model.family={c.family!r} needs "
                                  f"{' or '.join(map(repr, accepted))}")
    try:
        model_cfg, vae_cfg = model_config(config), vae_config(config)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"model: {e}") from None
    shape = latent_shape(config, vae_cfg)
    model_in = model_cfg.in_channels
    if model_in != (shape[1] if not zoo.video else shape[0]):
        raise ConfigError(f"the transformer (model.checkpoint / model.variant) takes {model_in} latent channels but "
                          f"the VAE (model.vae_checkpoint) gives latents of shape {shape}: they are not one model's")

    text_dim = getattr(model_cfg, zoo.text_dim)
    pooled_dim = getattr(model_cfg, zoo.pooled_dim) if zoo.pooled_dim else None
    if d.random_embeddings:
        text_len, key = d.text_len, "data.text_len"
        if d.num_prompts < 1:
            raise ConfigError(f"data.num_prompts must be >= 1, got {d.num_prompts}")
    else:
        cache = open_cache(config)
        made_by = [str(cache.meta[k]) for k in ("encoders", "encoder_dir") if k in cache.meta]
        source = f" (encoded by {', '.join(made_by)})" if made_by else ""
        if (cache.text_dim, cache.pooled_dim) != (text_dim, pooled_dim):
            raise ConfigError(
                f"data.embedding_cache={d.embedding_cache!r} was made for another model{source}: text dim "
                f"{cache.text_dim}, pooled dim {cache.pooled_dim}; this {c.family} model takes {text_dim} and "
                f"{pooled_dim}. Encode the prompts with this model's text encoders")
        if s.cfg_scale != 1.0 and not cache.has_negative:
            raise ConfigError(f"data.embedding_cache={d.embedding_cache!r} stores no negative prompt, which "
                              f"sampling.cfg_scale={s.cfg_scale} (true CFG) needs; re-encode without --no_negative")
        text_len, key = cache.text_len, f"data.embedding_cache={d.embedding_cache!r}: its text length"
    if not 1 <= text_len <= zoo.text_cap:
        raise ConfigError(f"{key} {text_len} is over the {c.family} text cap of {zoo.text_cap} tokens "
                          "(or below 1)")


def open_cache(config) -> EmbeddingCache:
    """The config's embedding cache, checked to be of the model's family (ConfigError otherwise)."""
    path = config.data.embedding_cache
    try:
        return EmbeddingCache.open(path, expect_family=config.model.family)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(f"data.embedding_cache={path!r}: {e}") from None


# Up to this many parameters, random weights are drawn on the host: compiling an RNG program
# costs far more than the draw at tiny sizes; at full size the host would be the slow side.
_HOST_DRAW_LIMIT = 10**8


def _random_params(family, cfg, seed: int) -> dict:
    """Random weights of the shapes `family` has at `cfg`, for throughput runs and tests.

    Built from the abstract parameters (a trace, no compiled init): kernels normal with
    variance 1 / fan-in (the input axis and any kernel-window axes before it, not a
    stacked-layers axis), norm scales one, biases and modulation tables small normal. Drawn in
    the stored (stacked) layout, then split per block if `cfg` unrolls them.
    """
    stored = family.stored_config(cfg)
    if stored is not cfg:
        return family.to_layout(_random_params(family, stored, seed), cfg, consume=True)
    abstract = nn.unbox(family.abstract_params(cfg))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)

    def value(path, leaf, normal):
        name, shape = str(path[-1].key), leaf.shape
        if name == "gamma" or name.endswith("scale"):
            return np.ones(shape, np.float32)
        if name == "kernel":
            fan_in = shape[-2] if len(shape) == 3 else int(np.prod(shape[:-1]))  # 3-D: (layers, in, out)
            return normal(shape) / np.float32(np.sqrt(fan_in))
        return np.float32(0.02) * normal(shape)

    if sum(int(np.prod(leaf.shape)) for _, leaf in leaves) <= _HOST_DRAW_LIMIT:
        rng = np.random.default_rng(seed)
        host_normal = lambda shape: rng.standard_normal(shape, np.float32)  # noqa: E731
        drawn = [jax.device_put(value(path, leaf, host_normal).astype(leaf.dtype)) for path, leaf in leaves]
        return jax.tree_util.tree_unflatten(treedef, drawn)

    def draw(key):
        drawn = []
        for i, (path, leaf) in enumerate(leaves):
            device_normal = lambda shape, i=i: jax.random.normal(jax.random.fold_in(key, i), shape)  # noqa: E731
            drawn.append(jnp.asarray(value(path, leaf, device_normal), leaf.dtype))
        return jax.tree_util.tree_unflatten(treedef, drawn)

    return jax.jit(draw)(jax.random.key(seed))


def _decoder(family: str, vae_cfg, height: int, width: int):
    """`decode(params, latents) -> (B, 3, F, H, W)` in nominal [-1, 1], as the family's pipeline decodes."""
    unpack = lambda x: diffusion.unpack_latents(x, *diffusion.latent_size(height, width))  # noqa: E731
    if family == "flux":
        return lambda p, x: vae_flux.decode_latents(vae_cfg, p, unpack(x))[:, :, None]
    if family == "qwenimage":
        return lambda p, x: vae_wan.decode_latents(p, vae_cfg, unpack(x)[:, :, None])
    if family == "wan":
        return lambda p, x: vae_wan.decode_latents(p, vae_cfg, x)
    return lambda p, x: vae_hunyuan_video.decode_latents(p, vae_cfg, x)


class ModelZooWorkload(_Workload):
    """One of the four released model families on prompts from an embedding cache (or random ones).

    Rewards see decoded frames as uint8 (B, H, W, 3) images. A video is scored on every
    `reward.frame_stride`-th frame (the first and, for 4k+1 frames and a stride dividing 4k,
    the last included) and its reward is the mean over those frames, as Flow-GRPO's video OCR
    reward scores every 4th frame; stride 1 scores every frame.
    """

    def __init__(self, config: ml_collections.ConfigDict):
        super().__init__(config)
        c, s, d = config.model, config.sampling, config.data
        self.zoo = ZOO[c.family]
        self.reward_fn = make_reward_fn(config)
        if d.random_embeddings:
            model_cfg = model_config(config)
            pooled = getattr(model_cfg, self.zoo.pooled_dim) if self.zoo.pooled_dim else None
            self.task = RandomPrompts(c.family, num_prompts=d.num_prompts, text_len=d.text_len,
                                      text_dim=getattr(model_cfg, self.zoo.text_dim), pooled_dim=pooled,
                                      seed=config.seed + 3)
        else:
            self.task = CachedPrompts(open_cache(config))
        self.family, self.model_cfg, self.base_params = self._transformer()
        self.vae_cfg, self.vae_params = self._vae()
        self.latent_shape = latent_shape(config, self.vae_cfg)
        image_grid = None if self.zoo.video else (s.height // _SIDE_MULTIPLE, s.width // _SIDE_MULTIPLE)
        seq_len = None if self.zoo.video else self.latent_shape[0]
        ladder = diffusion.sigma_ladder(s.ladder, s.num_steps, image_seq_len=seq_len, **s.ladder_options.to_dict())
        denoiser = make_denoiser(c.family, self.family.module_cls(self.model_cfg), guidance=s.guidance,
                                 image_grid=image_grid)
        negative = self.task.negative() if s.cfg_scale != 1.0 else None
        self.sampler = Sampler(denoiser, SamplerSpec(s.sde_type, s.cfg_scale, s.cfg_rescale), ladder.sigmas,
                               None if negative is None else Conditioning(*negative))
        decode = _decoder(c.family, self.vae_cfg, s.height, s.width)
        self._frames_uint8 = jax.jit(
            lambda p, x, frames: _to_uint8_frames(decode(p, x)[:, :, list(frames)]), static_argnums=2)

    def _transformer(self):
        c = self.config.model
        if c.random_init:
            family, cfg = FAMILIES[c.family], model_config(self.config)
            return family, cfg, _random_params(family, cfg, self.config.seed + 4)
        return load_checkpoint(c.checkpoint, **_policy(self.config))

    def _vae(self):
        c = self.config.model
        if c.random_init:
            family, cfg = FAMILIES[_VAE_FAMILY[c.family]], vae_config(self.config)
            return cfg, _random_params(family, cfg, self.config.seed + 5)
        _, cfg, params = load_checkpoint(c.vae_checkpoint)
        return cfg, params

    @property
    def num_frames(self) -> int:
        return self.config.sampling.num_frames if self.zoo.video else 1

    @property
    def decoder_params(self):
        return self.vae_params

    def _decode_frames(self, latents: jax.Array, frames: tuple[int, ...], vae_params=None) -> jax.Array:
        """Decoded frames `frames` of each sample, (B, len(frames), H, W, 3) uint8 on the latents'
        devices; `model.vae_decode_batch` samples per VAE call bound the decoder's memory."""
        params = self.vae_params if vae_params is None else vae_params
        step = self.config.model.vae_decode_batch
        chunks = [self._frames_uint8(params, latents[i:i + step], tuple(frames))
                  for i in range(0, latents.shape[0], step)]
        return chunks[0] if len(chunks) == 1 else jnp.concatenate(chunks)

    def frames(self, latents: jax.Array, frames: tuple[int, ...]) -> np.ndarray:
        """Decoded frames `frames` of each sample, (B, len(frames), H, W, 3) uint8 on the host."""
        return np.asarray(self._decode_frames(latents, frames))

    def images(self, latents: jax.Array) -> np.ndarray:
        """(B, H, W, 3) float32 in [0, 1]: each sample's image, or its video's middle frame."""
        return self.frames(latents, (self.num_frames // 2,))[:, 0].astype(np.float32) / 255.0

    def decode(self, latents: jax.Array, decoder_params=None) -> jax.Array:
        """The frames rewards score (every `reward.frame_stride`-th), decoded on the latents'
        devices (device work: dispatch it from the thread that dispatches the other device work)."""
        scored = tuple(range(0, self.num_frames, self.config.reward.frame_stride))
        return self._decode_frames(latents, scored, decoder_params)

    def reward(self, frames: np.ndarray, ids: jax.Array) -> tuple[np.ndarray, dict]:
        """Rewards of decoded (B, F, H, W, 3) uint8 frames: per frame, averaged per sample (host work)."""
        batch, per_sample = frames.shape[:2]
        repeat = lambda items: [x for x in items for _ in range(per_sample)]  # noqa: E731
        total, per_reward = self.reward_fn(frames.reshape(batch * per_sample, *frames.shape[2:]),
                                           repeat(self.task.prompt_text(ids)), repeat(self.task.prompt_metadata(ids)))
        mean = lambda r: r.reshape(batch, per_sample).mean(axis=1)  # noqa: E731
        return mean(total), {name: mean(r) for name, r in per_reward.items()}

    def score(self, latents: jax.Array, ids: jax.Array) -> tuple[np.ndarray, dict]:
        return self.reward(np.asarray(self.decode(latents)), ids)


def _to_uint8_frames(video: jax.Array) -> jax.Array:
    """(B, 3, F, H, W) in nominal [-1, 1] -> (B, F, H, W, 3) uint8, rounded as rewards expect."""
    unit = jnp.clip((video.astype(jnp.float32) + 1) / 2, 0, 1)
    return jnp.round(unit * 255).astype(jnp.uint8).transpose(0, 2, 3, 4, 1)


# ---------------------------------------------------------------------------------------- entry points


def validate_config(config: ml_collections.ConfigDict) -> None:
    """The workload part of config validation: files, shapes, families and reward options, no device work."""
    (_validate_shapes if is_shapes(config) else _validate_zoo)(config)
    _validate_reward_options(config)


def make_workload(config: ml_collections.ConfigDict) -> ShapesWorkload | ModelZooWorkload:
    return (ShapesWorkload if is_shapes(config) else ModelZooWorkload)(config)
