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
each built with its `reward.options` entry. `validation.validate_config` checks a config against
its workload before any of this is built.
"""
from __future__ import annotations

import hashlib
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from digen_jax import diffusion
from digen_jax.app import random_init
from digen_jax.app.errors import ConfigError
from digen_jax.app.families import SIDE_MULTIPLE, ZOO, latent_shape, model_config, policy, vae_config, decoder
from digen_jax.app.pretrain import cache_key, pretrained_params
from digen_jax.data.embeddings import EmbeddingCache
from digen_jax.data.first_frames import open_first_frames
from digen_jax.data.prompts import CachedPrompts, RandomPrompts
from digen_jax.data.shapes_task import ShapesTask
from digen_jax.models import FAMILIES, load_checkpoint
from digen_jax.models.checkpoints import MODEL_JSON, PARAMS_DIR
from digen_jax.models.wan import vae as vae_wan
from digen_jax.rewards import registry
from digen_jax.rl.rollout import Conditioning, Sampler, SamplerSpec, make_denoiser

# fold_in tags of one iteration's randomness
PROMPTS, SAMPLES, EVAL = 0, 1, 2


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


def make_reward_fn(config: ml_collections.ConfigDict) -> registry.CombinedRewardFn:
    """The combined reward of `reward.weights`, each reward built with its `reward.options` entry."""
    return registry.weighted_reward(dict(config.reward.weights), reward_options(config))


# ---------------------------------------------------------------------------------------- shapes


def pretrain_recipe(config: ml_collections.ConfigDict) -> tuple[Any, ShapesTask, dict]:
    """The shapes task's base model as pretrained: (model config, task, pretraining arguments)."""
    c, p = config.model, config.pretrain
    model_cfg = FAMILIES[c.family].config_cls(**c.arch.to_dict(), **policy(config))
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
    model_cfg, task, args = pretrain_recipe(config)
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
        return ids, self.conditioning(ids)

    def eval_batch(self, n: int) -> tuple[jax.Array, Conditioning]:
        """n fixed evaluation prompts (the same for every iteration and resume)."""
        ids = self.task.sample_prompts(jax.random.fold_in(jax.random.key(self.config.seed + 7), EVAL), n)
        return ids, self.conditioning(ids)

    def conditioning(self, ids: jax.Array) -> Conditioning:
        """The conditioning of prompts `ids`, one row per prompt."""
        return Conditioning(*self.task.encode(ids))


class ShapesWorkload(_Workload):
    """The shapes task in pixel space: (3, H, W) images packed 2x2 into (H/2 * W/2, 12) tokens."""

    def __init__(self, config: ml_collections.ConfigDict, log: Callable[[str], None] = print):
        super().__init__(config)
        s = config.sampling
        self.log = log  # pretraining's progress, or where the cached model came from
        self.task = shapes_task(config)
        self.reward_fn = make_reward_fn(config)
        self.family, self.model_cfg, self.base_params = self._base_model()
        res = config.task.resolution
        self.latent_shape = ((res // 2) ** 2, 12)
        sigmas = diffusion.sigma_ladder(s.ladder, s.num_steps, image_seq_len=self.latent_shape[0]).sigmas
        module = self.family.module_cls(self.model_cfg)
        denoiser = make_denoiser(self.family, module, guidance=s.guidance, image_grid=(res // 2, res // 2))
        self.sampler = Sampler(denoiser, SamplerSpec(s.sde_type, s.cfg_scale, s.cfg_rescale), sigmas)

    def _base_model(self):
        c = self.config.model
        if c.checkpoint:
            return load_checkpoint(c.checkpoint, **policy(self.config))
        model_cfg, task, args = pretrain_recipe(self.config)
        params = pretrained_params(model_cfg, task, **args, cache_dir=os.path.expanduser(self.config.pretrain.cache_dir),
                                   log=self.log)
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


def open_cache(config) -> EmbeddingCache:
    """The config's embedding cache, checked to be of the model's family (ConfigError otherwise)."""
    path = config.data.embedding_cache
    try:
        return EmbeddingCache.open(path, expect_family=config.model.family)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(f"data.embedding_cache={path!r}: {e}") from None


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
        self.first_frames = self._first_frames()
        self.latent_shape = latent_shape(config, self.vae_cfg)
        image_grid = None if self.zoo.video else (s.height // SIDE_MULTIPLE, s.width // SIDE_MULTIPLE)
        seq_len = None if self.zoo.video else self.latent_shape[0]
        ladder = diffusion.sigma_ladder(s.ladder, s.num_steps, image_seq_len=seq_len, **s.ladder_options.to_dict())
        denoiser = make_denoiser(self.family, self.family.module_cls(self.model_cfg), guidance=s.guidance,
                                 image_grid=image_grid)
        negative = self.task.negative() if s.cfg_scale != 1.0 else None
        spec = SamplerSpec(s.sde_type, s.cfg_scale, s.cfg_rescale, s.get("cfg_scale_2"),
                           getattr(self.model_cfg, "boundary_timestep", None))
        self.sampler = Sampler(denoiser, spec, ladder.sigmas, None if negative is None else Conditioning(*negative))
        decode = decoder(c.family, self.vae_cfg, s.height, s.width)
        self._frames_uint8 = jax.jit(
            lambda p, x, frames: _to_uint8_frames(decode(p, x)[:, :, list(frames)]), static_argnums=2)

    def _transformer(self):
        c = self.config.model
        if c.random_init:
            family, cfg = self.zoo.transformer, model_config(self.config)
            return family, cfg, random_init.random_params(family, cfg, self.config.seed + 4)
        return load_checkpoint(c.checkpoint, **policy(self.config))

    def _vae(self):
        c = self.config.model
        if c.random_init:
            family, cfg = self.zoo.vae, vae_config(self.config)
            return cfg, random_init.random_params(family, cfg, self.config.seed + 5)
        _, cfg, params = load_checkpoint(c.vae_checkpoint, dtype=c.dtype)  # decodes in model.dtype
        return cfg, params

    def _first_frames(self):
        """(the images of `data.first_frames`, the VAE encoder's config and weights), or None for
        text-to-video."""
        c, s = self.config.model, self.config.sampling
        source = self.config.data.get("first_frames")
        if not source:
            return None
        images = open_first_frames(source, s.height, s.width, self.config.seed + 6)
        if c.random_init:
            cfg = vae_config(self.config)
            return images, cfg, random_init.random_params(vae_wan.ENCODER_FAMILY, cfg, self.config.seed + 9)
        _, cfg, params = load_checkpoint(c.vae_encoder_checkpoint, dtype=c.dtype)  # encodes in model.dtype
        return images, cfg, params

    def conditioning(self, ids: jax.Array) -> Conditioning:
        """The prompts' text conditioning and, with `data.first_frames`, each prompt's image encoded
        once into the clean first latent frame its samples share."""
        cond = super().conditioning(ids)
        if self.first_frames is None:
            return cond
        images, cfg, params = self.first_frames
        pixels = images([m["prompt_id"] for m in self.task.prompt_metadata(ids)])
        return cond.replace(first_frame=vae_wan.encode_latents(params, cfg, pixels[:, :, None]))

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


def make_workload(config: ml_collections.ConfigDict, log: Callable[[str], None] = print) -> ShapesWorkload | ModelZooWorkload:
    """The workload of `config`; `log` gets the shapes task's pretraining progress."""
    return ShapesWorkload(config, log) if is_shapes(config) else ModelZooWorkload(config)
