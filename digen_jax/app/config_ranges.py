"""Numeric ranges and named choices of config keys, checked before any compute.

One table says, for every numeric key whose valid values are an interval, the interval and
the type; another, for every key whose value is one of a fixed set of names, the names.
`check_ranges(config)` rejects a value outside them (NaN and inf included) with a
`ConfigError` naming the key. Keys that a config does not have (the shapes task's `task`,
`pretrain` and `model.arch` sections, the model zoo's `data`) are not checked. Rules that tie
several keys together (divisibility, step windows, the runtime split) live with the code they
protect.
"""
from __future__ import annotations

import math
import typing
from typing import NamedTuple

import ml_collections

from digen_jax.app.errors import ConfigError
from digen_jax.models import attention, stacking

INF = math.inf


class Range(NamedTuple):
    key: str  # dotted config path
    low: float
    high: float
    closed_low: bool = True
    closed_high: bool = False
    integer: bool = False
    optional: bool = False  # None allowed (a placeholder meaning "off" or "the default schedule")
    why: str = ""  # what the bounds or special values mean; optional keys say what None does

    def text(self) -> str:
        return f"{'[' if self.closed_low else '('}{self.low:g}, {self.high:g}{']' if self.closed_high else ')'}"

    def holds(self, value) -> bool:
        above = value >= self.low if self.closed_low else value > self.low
        below = value <= self.high if self.closed_high else value < self.high
        return above and below  # False for NaN


def _ints(key: str, low: int, why: str = "") -> Range:
    return Range(key, low, INF, integer=True, why=why)


def _positive(key: str, why: str = "", **kw) -> Range:
    return Range(key, 0.0, INF, closed_low=False, why=why, **kw)


def _non_negative(key: str, why: str = "") -> Range:
    return Range(key, 0.0, INF, why=why)


RANGES: tuple[Range, ...] = (
    _positive("rl.learning_rate"),
    _non_negative("rl.weight_decay"),
    _positive("rl.max_grad_norm", optional=True, why="None: no clipping"),
    _positive("rl.clip_range", why="the PPO ratio clip 1 +- clip_range"),
    Range("rl.adv_clip", 0.0, INF, closed_low=False, closed_high=True, why="inf: no clip"),
    _non_negative("rl.kl_beta", why="0: no KL term"),
    _positive("rl.is_cap", optional=True, why="None: untruncated importance weights"),
    _non_negative("rl.std_eps"),
    _ints("rl.std_ddof", 0),
    _non_negative("rl.lora_alpha", why="0: 2 * lora_rank"),
    Range("rl.ema_decay", 0.0, 1.0, optional=True, why="None: the Flow-GRPO warm-up schedule"),
    _ints("rl.ema_every", 1),
    _ints("rl.max_nonfinite_in_row", 1, why="the run stops after this many skipped updates in a row"),
    _positive("rl.nft_beta", why="DiffusionNFT's implicit-policy mixing strength (1 in the reference)"),
    _ints("rl.nft_timesteps", 0, why="0: int(sampling.num_steps * rl.timestep_fraction), the reference's rule"),
    Range("rl.max_update_ratio", 0.0, INF, closed_low=False, closed_high=True,
          why="an update larger than this times the parameters' norm is skipped; inf: no bound"),
    Range("rl.timestep_fraction", 0.0, 1.0, closed_low=False, closed_high=True,
          why="the share of sampling.num_steps trained per sample"),
    _ints("sampling.num_steps", 2, why="the last step is never trained"),
    _positive("sampling.noise_level", why="0 samples the ODE, whose steps have no log-probability to train"),
    _non_negative("sampling.guidance"),
    _ints("train.iterations", 1, why="the total number of iterations, resumed ones included"),
    _ints("train.checkpoint_every", 0, why="0: one checkpoint at the end"),
    _ints("train.eval_every", 0, why="0: never"),
    _ints("train.image_every", 0, why="0: never"),
    _ints("train.eval_prompts", 1),
    _ints("train.keep_checkpoints", 1),
    _ints("pretrain.steps", 0),
    _ints("pretrain.batch_size", 1),
    _positive("pretrain.learning_rate"),
    Range("task.label_noise", 0.0, 1.0, closed_high=True),
    _ints("task.text_len", 1),
    # The shapes task's transformer (model.arch: digen_jax.models.flux.FluxConfig's fields).
    _ints("model.arch.in_channels", 1),
    _ints("model.arch.num_layers", 1),
    _ints("model.arch.num_single_layers", 1),
    _ints("model.arch.attention_head_dim", 1),
    _ints("model.arch.num_attention_heads", 1),
    _ints("model.arch.joint_attention_dim", 1),
    _ints("model.arch.pooled_projection_dim", 1),
    _ints("runtime.reward_workers", 1),
    _ints("runtime.seq_parallel", 1, why="devices per sequence group; 1: each sample's tokens on one device"),
    Range("runtime.tag_microbatches", -1.0, INF, why="-1: chosen every iteration from measured costs; a fraction splits a micro-batch"),
    _ints("runtime.prefetch_microbatches", -1, why="-1: chosen every iteration from measured costs"),
    _ints("runtime.auto_rerank_after", 0, why="the iteration by which runtime.mode='auto' re-ranks from measured costs; "
                                              "0: never"),
    _non_negative("runtime.auto_switch_margin", why="a fraction: 0.03 switches to a mode predicted over 3% faster"),
    _positive("runtime.peer_timeout_s", why="seconds until a silent process stops a multi-process run"),
)


class Choice(NamedTuple):
    key: str  # dotted config path
    names: tuple[str, ...]
    why: str = ""


FLOAT_DTYPES = ("float32", "bfloat16", "float16")

CHOICES: tuple[Choice, ...] = (
    Choice("model.dtype", FLOAT_DTYPES, "the compute dtype of matmuls and activations"),
    Choice("model.param_dtype", FLOAT_DTYPES, "the dtype the weights are stored and trained in"),
    Choice("model.attention_impl", typing.get_args(attention.AttentionImpl)),
    Choice("model.remat_policy", tuple(stacking.REMAT_POLICIES), "what the backward pass keeps of each block"),
)


def _lookup(config: ml_collections.ConfigDict, key: str):
    """(True, value) of a dotted key, or (False, None) where the config lacks it."""
    node = config
    for part in key.split("."):
        if not hasattr(node, "keys") or part not in node:
            return False, None
        node = node[part]
    return True, node


def check_ranges(config: ml_collections.ConfigDict) -> None:
    """Raise ConfigError naming the first key of `RANGES` whose value lies outside its range, or
    of `CHOICES` whose value is not one of its names."""
    for c in CHOICES:
        present, value = _lookup(config, c.key)
        if present and value not in c.names:
            raise ConfigError(f"{c.key}={value!r} is not one of {', '.join(map(repr, c.names))}"
                              + (f" ({c.why})" if c.why else ""))
    for r in RANGES:
        present, value = _lookup(config, r.key)
        if not present or (value is None and r.optional):
            continue
        kind = "an integer" if r.integer else "a number"
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or (r.integer and not isinstance(value, int)) or not r.holds(value):
            raise ConfigError(f"{r.key} must be {kind} in {r.text()}, got {value!r}" + (f" ({r.why})" if r.why else ""))
