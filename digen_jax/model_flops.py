"""Exact FLOP counts of the diffusion transformers: every matmul and every attention product.

The count follows docs/models.md section 7: a dense layer applying an (in, out) kernel to n rows
costs 2 n in out; an attention with B x N heads, T queries, S keys and head dim H costs
4 B N T S H (QK^T and PV). Norms, RoPE, softmax and other elementwise work are not counted.
The AdaLN modulation layers act on one vector per sample and the two streams of a
double-stream block pass through their own weights; counting per layer and per stream is what
makes these numbers smaller than the naive 2 P S.

A model at a given input shape is a list of `Matmul` and `Attention` terms (`model_terms`),
built by its family's `Formula` in `FORMULAS` (keyed by the model-family names, built from the
family specs, which import no model code, so the simulator can count FLOPs without the model
zoo). From it:

* `forward`: one forward pass.
* `lora_forward`: the forward with LoRA adapters applied factored, 2 n r (in + out) each.
* `lora_fwd_bwd`: forward and backward w.r.t. the adapters over a frozen base. The backward
  computes input gradients of the base matmuls whose input depends on the adapters (every
  layer of a scanned stack from the first adapted stack on, whatever reads the stack's carried
  activations), the attention backward (dP and dQ, plus dK and dV where keys and values depend
  on the adapters), and the adapter gradients: dB, d(xA), dA and, where the layer's input
  needs a gradient, dx through A. Kernel-sized weight gradients are not computed.
* `full_fwd_bwd`: forward and backward w.r.t. every parameter: a weight gradient for every
  matmul, an input gradient for every matmul except those reading the model's inputs, and the
  full attention backward; about 3x the forward.

These are the FLOPs the program must do (model FLOPs); activation recomputation (remat) adds
executed FLOPs on top, which `jaxpr_matmul_flops` counts from a traced function.
`rl_sample_flops` combines them into the cost of one RL sample (rollout steps with CFG as a
doubled batch, and training units: the trained weights' forward+backward plus the forwards of
the old policy and the frozen reference where the algorithm runs them).
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, Sequence

import jax
import jax.extend

from digen_jax.models.specs import SPECS

# What a matmul's input depends on, which decides whether the backward needs its gradient:
# 'input' a model input (never), 'cond' conditioning derived from parameters outside the
# scanned blocks (full fine-tuning only), 'trunk' the activations a block stack carries.
READS = ("input", "cond", "trunk")
# Pixels per latent position (the VAEs' spatial factor times the 2x2 patch) and frames per
# latent frame of the video VAEs (causal: 4k + 1 frames -> k + 1 latent frames).
PIXELS_PER_TOKEN = 16
FRAMES_PER_LATENT = 4


@dataclasses.dataclass(frozen=True)
class Matmul:
    """`layers` dense layers, each applying a (fan_in, fan_out) kernel to `rows` rows.

    `path` is the module path in the params tree ('/'-joined); LoRA target patterns are
    searched in `path + '/kernel'`, as `rl.lora.match_lora_targets` does. `stack` names the
    scanned stack the layer belongs to ('out' for the output projection, None outside).
    """

    path: str
    rows: int
    fan_in: int
    fan_out: int
    reads: str
    stack: str | None = None
    layers: int = 1

    @property
    def flops(self) -> int:
        return 2 * self.layers * self.rows * self.fan_in * self.fan_out


@dataclasses.dataclass(frozen=True)
class Attention:
    """`layers` attentions of `batch` x `heads` heads, `q_len` queries over `kv_len` keys.

    `kv_paths`: for cross-attention, the paths of the key and value projections (their input
    is the text, so keys and values depend on LoRA adapters only through those layers); None
    for self-attention, where queries, keys and values come from the same activations.
    """

    name: str
    batch: int
    heads: int
    q_len: int
    kv_len: int
    head_dim: int
    stack: str
    layers: int = 1
    kv_paths: tuple[str, str] | None = None

    @property
    def flops(self) -> int:
        return 4 * self.layers * self.batch * self.heads * self.q_len * self.kv_len * self.head_dim


@dataclasses.dataclass(frozen=True)
class Flops:
    """A FLOP count split into base-model matmuls, attention products and LoRA adapters."""

    linear: int
    attention: int
    adapter: int = 0

    @property
    def total(self) -> int:
        return self.linear + self.attention + self.adapter

    def as_dict(self) -> dict[str, int]:
        return {"linear": self.linear, "attention": self.attention, "adapter": self.adapter, "total": self.total}


@dataclasses.dataclass(frozen=True)
class ModelTerms:
    """Every matmul and attention of one forward; `stacks` in data-flow order."""

    matmuls: tuple[Matmul, ...]
    attentions: tuple[Attention, ...]
    stacks: tuple[str, ...]

    # ------------------------------------------------------------------ counts
    def forward(self) -> Flops:
        """One forward pass."""
        return Flops(sum(m.flops for m in self.matmuls), sum(a.flops for a in self.attentions))

    def lora_forward(self, rank: int, targets: Sequence[str]) -> Flops:
        """The forward with rank-`rank` adapters on the matmuls `targets` match, applied factored."""
        adapted = self.adapted(targets)
        return dataclasses.replace(self.forward(), adapter=sum(_adapter_fwd(m, rank) for m in adapted))

    def lora_fwd_bwd(self, rank: int, targets: Sequence[str]) -> Flops:
        """Forward and backward w.r.t. the adapters only (frozen base; see the module docstring)."""
        adapted = self.adapted(targets)
        active = self._active_stacks(adapted)
        fwd = self.forward()
        linear = fwd.linear + sum(m.flops for m in self.matmuls if _needs_dx(m, active))
        attention = fwd.attention + sum(_attention_bwd(a, adapted, active) for a in self.attentions)
        adapter = 0
        for m in adapted:
            # dB = (xA)^T dy, d(xA) = dy B^T, dA = x^T d(xA), and dx = d(xA) A^T where needed.
            per_layer = 2 * m.rows * rank * (2 * m.fan_out + m.fan_in + (m.fan_in if _needs_dx(m, active) else 0))
            adapter += _adapter_fwd(m, rank) + m.layers * per_layer
        return Flops(linear, attention, adapter)

    def full_fwd_bwd(self) -> Flops:
        """Forward and backward w.r.t. every weight."""
        fwd = self.forward()
        weight_grads = sum(m.flops for m in self.matmuls)
        input_grads = sum(m.flops for m in self.matmuls if m.reads != "input")
        return Flops(fwd.linear + weight_grads + input_grads, 3 * fwd.attention)

    # ------------------------------------------------------------------ helpers
    def adapted(self, targets: Sequence[str]) -> list[Matmul]:
        """The matmuls LoRA `targets` (regexes searched in `path + '/kernel'`) adapt."""
        if isinstance(targets, str) or not targets:
            raise ValueError(f"LoRA targets must be a non-empty list of regexes, got {targets!r}")
        adapted = [m for m in self.matmuls if any(re.search(p, f"{m.path}/kernel") for p in targets)]
        for pattern in targets:
            if not any(re.search(pattern, f"{m.path}/kernel") for m in self.matmuls):
                raise ValueError(f"LoRA target pattern {pattern!r} matches no matmul of this model")
        outside = [m.path for m in adapted if m.stack is None]
        if outside:
            # Their adapters would make conditioning inputs depend on the adapters, which
            # the input-gradient accounting below does not model.
            raise ValueError(f"LoRA FLOPs are counted for adapters in the blocks and proj_out; targets also match {outside}")
        return adapted

    def _active_stacks(self, adapted: Sequence[Matmul]) -> set[str]:
        """Stacks whose carried activations depend on the adapters: from the first adapted on."""
        first = min((self.stacks.index(m.stack) for m in adapted), default=len(self.stacks))
        return set(self.stacks[first:])


def _adapter_fwd(m: Matmul, rank: int) -> int:
    return 2 * m.layers * m.rows * rank * (m.fan_in + m.fan_out)


def _needs_dx(m: Matmul, active: set[str]) -> bool:
    return m.reads == "trunk" and m.stack in active


def _attention_bwd(a: Attention, adapted: Sequence[Matmul], active: set[str]) -> int:
    if a.stack not in active:
        return 0
    if a.kv_paths is None:
        return 2 * a.flops  # dP, dQ, dK, dV
    adapted_paths = {m.path for m in adapted}
    kv = sum(p in adapted_paths for p in a.kv_paths)  # dK, dV only where K, V carry adapters
    return a.flops * (2 + kv) // 2


# ---------------------------------------------------------------------- shapes
def latent_grid(family: str, cfg: Any, *, height: int, width: int, frames: int = 1) -> tuple[int, int, int]:
    """The post-patch token grid (frames, rows, cols) of a `height` x `width` image or video.

    Images (flux, qwenimage): (1, H/16, W/16) packed 2x2 latent tokens. Videos (wan,
    hunyuan_video): ((frames - 1)/4 + 1, H/16, W/16) with the (1, 2, 2) patch.
    """
    formula = _formula(family)
    side = formula.pixels_per_token(cfg) if formula.pixels_per_token else PIXELS_PER_TOKEN
    if height <= 0 or width <= 0 or height % side or width % side:
        raise ValueError(f"height and width must be positive multiples of {side}, got {height}x{width}")
    rows, cols = height // side, width // side
    if formula.temporal_patch is None:
        if frames != 1:
            raise ValueError(f"{family} generates images: frames must be 1, got {frames}")
        return (1, rows, cols)
    if frames < 1 or (frames - 1) % FRAMES_PER_LATENT:
        raise ValueError(f"frames must be 4k + 1 for {family} (the causal video VAE), got {frames}")
    patch_t = formula.temporal_patch(cfg)
    latent_frames = (frames - 1) // FRAMES_PER_LATENT + 1
    if latent_frames % patch_t:
        raise ValueError(f"{latent_frames} latent frames do not divide by the temporal patch {patch_t}")
    return (latent_frames // patch_t, rows, cols)


def model_terms(family: str, cfg: Any, *, batch: int, height: int, width: int, frames: int = 1, text_len: int) -> ModelTerms:
    """The matmul and attention terms of one forward of `family` with config `cfg`.

    `text_len` is the text-encoder sequence length the model is fed (padded length: the
    model computes over padding too). Batch scales every term, including the per-sample
    conditioning matmuls.
    """
    formula = _formula(family)
    if batch < 1 or text_len < 1:
        raise ValueError(f"batch and text_len must be >= 1, got batch={batch}, text_len={text_len}")
    grid = latent_grid(family, cfg, height=height, width=width, frames=frames)
    return formula.terms(cfg, batch, math.prod(grid), text_len)


def _formula(family: str) -> Formula:
    if family not in FORMULAS:
        raise ValueError(f"model family must be one of {tuple(FORMULAS)}, got {family!r}")
    return FORMULAS[family]


def _embedder(path: str, batch: int, fan_in: int, dim: int) -> list[Matmul]:
    """An MLPEmbedder: linear_1 reads a model input (sinusoid or pooled text), linear_2 its output."""
    return [
        Matmul(f"{path}/linear_1", batch, fan_in, dim, "input"),
        Matmul(f"{path}/linear_2", batch, dim, dim, "cond"),
    ]


def _mmdit_double(stack: str, layers: int, batch: int, img: int, txt: int, dim: int, mlp: int,
                  names: dict[str, str]) -> list[Matmul]:
    """A double-stream block stack: each stream through its own attention and MLP weights."""
    out = [Matmul(f"{stack}/{names[m]}/linear", batch, dim, 6 * dim, "cond", stack, layers) for m in ("img_mod", "txt_mod")]
    for rows, prefix, proj_out, ff in ((img, "to_", "to_out", names["img_ff"]), (txt, "add_", "to_add_out", names["txt_ff"])):
        out += [Matmul(f"{stack}/attn/{prefix}{n}", batch * rows, dim, dim, "trunk", stack, layers) for n in "qkv"]
        out.append(Matmul(f"{stack}/attn/{proj_out}", batch * rows, dim, dim, "trunk", stack, layers))
        out.append(Matmul(f"{stack}/{ff}/proj_in", batch * rows, dim, mlp, "trunk", stack, layers))
        out.append(Matmul(f"{stack}/{ff}/proj_out", batch * rows, mlp, dim, "trunk", stack, layers))
    return out


def _single_stream(stack: str, layers: int, batch: int, seq: int, dim: int, mlp: int) -> list[Matmul]:
    """A single-stream block stack: attention and MLP in parallel, one output projection."""
    rows = batch * seq
    return [
        Matmul(f"{stack}/norm/linear", batch, dim, 3 * dim, "cond", stack, layers),
        *(Matmul(f"{stack}/attn/to_{n}", rows, dim, dim, "trunk", stack, layers) for n in "qkv"),
        Matmul(f"{stack}/proj_mlp", rows, dim, mlp, "trunk", stack, layers),
        Matmul(f"{stack}/proj_out", rows, dim + mlp, dim, "trunk", stack, layers),
    ]


_FLUX_NAMES = {"img_mod": "norm1", "txt_mod": "norm1_context", "img_ff": "ff", "txt_ff": "ff_context"}


def _flux(cfg, batch: int, img: int, txt: int) -> ModelTerms:
    dim, heads, hd = cfg.inner_dim, cfg.num_attention_heads, cfg.attention_head_dim
    m = [
        Matmul("x_embedder", batch * img, cfg.in_channels, dim, "input"),
        Matmul("context_embedder", batch * txt, cfg.joint_attention_dim, dim, "input"),
        *_embedder("time_text_embed/timestep_embedder", batch, 256, dim),
        *(_embedder("time_text_embed/guidance_embedder", batch, 256, dim) if cfg.guidance_embeds else []),
        *_embedder("time_text_embed/text_embedder", batch, cfg.pooled_projection_dim, dim),
        Matmul("norm_out/linear", batch, dim, 2 * dim, "cond"),
        Matmul("proj_out", batch * img, dim, cfg.out_dim, "trunk", "out"),
    ]
    att = []
    if cfg.num_layers:
        m += _mmdit_double("double_blocks", cfg.num_layers, batch, img, txt, dim, cfg.mlp_dim, _FLUX_NAMES)
        att.append(Attention("double_blocks/attn", batch, heads, img + txt, img + txt, hd, "double_blocks", cfg.num_layers))
    if cfg.num_single_layers:
        m += _single_stream("single_blocks", cfg.num_single_layers, batch, img + txt, dim, cfg.mlp_dim)
        seq = img + txt
        att.append(Attention("single_blocks/attn", batch, heads, seq, seq, hd, "single_blocks", cfg.num_single_layers))
    return ModelTerms(tuple(m), tuple(att), ("double_blocks", "single_blocks", "out"))


def _qwenimage(cfg, batch: int, img: int, txt: int) -> ModelTerms:
    dim = cfg.inner_dim
    names = {"img_mod": "img_mod", "txt_mod": "txt_mod", "img_ff": "img_mlp", "txt_ff": "txt_mlp"}
    m = [
        Matmul("img_in", batch * img, cfg.in_channels, dim, "input"),
        # txt_in reads the text after txt_norm, whose scale is a parameter.
        Matmul("txt_in", batch * txt, cfg.joint_attention_dim, dim, "cond"),
        *_embedder("time_text_embed/timestep_embedder", batch, 256, dim),
        Matmul("norm_out/linear", batch, dim, 2 * dim, "cond"),
        Matmul("proj_out", batch * img, dim, cfg.out_dim, "trunk", "out"),
    ]
    att = []
    if cfg.num_layers:
        m += _mmdit_double("transformer_blocks", cfg.num_layers, batch, img, txt, dim, cfg.mlp_dim, names)
        att.append(Attention("transformer_blocks/attn", batch, cfg.num_attention_heads, img + txt, img + txt,
                             cfg.attention_head_dim, "transformer_blocks", cfg.num_layers))
    return ModelTerms(tuple(m), tuple(att), ("transformer_blocks", "out"))


def _wan(cfg, batch: int, vid: int, txt: int) -> ModelTerms:
    dim, layers, s = cfg.inner_dim, cfg.num_layers, "blocks"
    m = [
        Matmul("patch_embedding", batch * vid, math.prod(cfg.patch_size) * cfg.in_channels, dim, "input"),
        *_embedder("condition_embedder/time_embedder", batch, cfg.freq_dim, dim),
        Matmul("condition_embedder/time_proj", batch, dim, 6 * dim, "cond"),
        Matmul("condition_embedder/text_linear_1", batch * txt, cfg.text_dim, dim, "input"),
        Matmul("condition_embedder/text_linear_2", batch * txt, dim, dim, "cond"),
        Matmul("proj_out", batch * vid, dim, cfg.out_dim, "trunk", "out"),
    ]
    att = []
    if layers:
        m += [Matmul(f"{s}/attn1/to_{n}", batch * vid, dim, dim, "trunk", s, layers) for n in ("q", "k", "v", "out")]
        m += [Matmul(f"{s}/attn2/to_{n}", batch * vid, dim, dim, "trunk", s, layers) for n in ("q", "out")]
        m += [Matmul(f"{s}/attn2/to_{n}", batch * txt, dim, dim, "cond", s, layers) for n in ("k", "v")]
        m += [
            Matmul(f"{s}/ffn/proj_in", batch * vid, dim, cfg.ffn_dim, "trunk", s, layers),
            Matmul(f"{s}/ffn/proj_out", batch * vid, cfg.ffn_dim, dim, "trunk", s, layers),
        ]
        heads, hd = cfg.num_attention_heads, cfg.attention_head_dim
        att += [
            Attention(f"{s}/attn1", batch, heads, vid, vid, hd, s, layers),
            Attention(f"{s}/attn2", batch, heads, vid, txt, hd, s, layers, (f"{s}/attn2/to_k", f"{s}/attn2/to_v")),
        ]
    return ModelTerms(tuple(m), tuple(att), (s, "out"))


def _hunyuan_video(cfg, batch: int, vid: int, txt: int) -> ModelTerms:
    dim, heads, hd = cfg.inner_dim, cfg.num_attention_heads, cfg.attention_head_dim
    c, r = "context_embedder", "context_embedder/refiner_blocks"
    m = [
        Matmul("x_embedder", batch * vid, math.prod(cfg.patch) * cfg.in_channels, dim, "input"),
        *_embedder("time_text_embed/timestep_embedder", batch, 256, dim),
        *(_embedder("time_text_embed/guidance_embedder", batch, 256, dim) if cfg.guidance_embeds else []),
        *_embedder("time_text_embed/text_embedder", batch, cfg.pooled_projection_dim, dim),
        *_embedder(f"{c}/timestep_embedder", batch, 256, dim),
        *_embedder(f"{c}/text_embedder", batch, cfg.text_embed_dim, dim),
        Matmul(f"{c}/proj_in", batch * txt, cfg.text_embed_dim, dim, "input"),
        Matmul("norm_out/linear", batch, dim, 2 * dim, "cond"),
        Matmul("proj_out", batch * vid, dim, cfg.out_dim, "trunk", "out"),
    ]
    att = []
    if cfg.num_refiner_layers:
        n = cfg.num_refiner_layers
        m += [Matmul(f"{r}/to_{x}", batch * txt, dim, dim, "trunk", r, n) for x in ("q", "k", "v", "out")]
        m += [
            Matmul(f"{r}/norm_out/linear", batch, dim, 2 * dim, "cond", r, n),
            Matmul(f"{r}/ff/proj_in", batch * txt, dim, cfg.refiner_mlp_dim, "trunk", r, n),
            Matmul(f"{r}/ff/proj_out", batch * txt, cfg.refiner_mlp_dim, dim, "trunk", r, n),
        ]
        att.append(Attention(f"{r}/attn", batch, heads, txt, txt, hd, r, n))
    if cfg.num_layers:
        m += _mmdit_double("double_blocks", cfg.num_layers, batch, vid, txt, dim, cfg.mlp_dim, _FLUX_NAMES)
        att.append(Attention("double_blocks/attn", batch, heads, vid + txt, vid + txt, hd, "double_blocks", cfg.num_layers))
    if cfg.num_single_layers:
        m += _single_stream("single_blocks", cfg.num_single_layers, batch, vid + txt, dim, cfg.mlp_dim)
        seq = vid + txt
        att.append(Attention("single_blocks/attn", batch, heads, seq, seq, hd, "single_blocks", cfg.num_single_layers))
    return ModelTerms(tuple(m), tuple(att), (r, "double_blocks", "single_blocks", "out"))


def _sd3(cfg, batch: int, img: int, txt: int) -> ModelTerms:
    dim, heads, hd = cfg.inner_dim, cfg.num_attention_heads, cfg.attention_head_dim
    m = [
        Matmul("pos_embed", batch * img, cfg.patch_dim, dim, "input"),
        Matmul("context_embedder", batch * txt, cfg.joint_attention_dim, dim, "input"),
        *_embedder("time_text_embed/timestep_embedder", batch, 256, dim),
        *_embedder("time_text_embed/text_embedder", batch, cfg.pooled_projection_dim, dim),
        Matmul("norm_out/linear", batch, dim, 2 * dim, "cond"),
        Matmul("proj_out", batch * img, dim, cfg.out_dim, "trunk", "out"),
    ]
    att = []
    for s, _, n, dual in cfg.stacks:
        # The last block's text only feeds the joint attention: AdaLN-Continuous (scale, shift),
        # no text output projection or MLP; its text queries are still computed and attend.
        last = s == "final_block"
        m += [Matmul(f"{s}/norm1/linear", batch, dim, (9 if dual else 6) * dim, "cond", s, n),
              Matmul(f"{s}/norm1_context/linear", batch, dim, (2 if last else 6) * dim, "cond", s, n)]
        streams = [(img, ("to_q", "to_k", "to_v", "to_out"), "ff")]
        streams.append((txt, ("add_q_proj", "add_k_proj", "add_v_proj") + (() if last else ("to_add_out",)),
                        None if last else "ff_context"))
        for rows, projections, ff in streams:
            m += [Matmul(f"{s}/attn/{p}", batch * rows, dim, dim, "trunk", s, n) for p in projections]
            if ff:
                m += [Matmul(f"{s}/{ff}/proj_in", batch * rows, dim, cfg.mlp_dim, "trunk", s, n),
                      Matmul(f"{s}/{ff}/proj_out", batch * rows, cfg.mlp_dim, dim, "trunk", s, n)]
        att.append(Attention(f"{s}/attn", batch, heads, img + txt, img + txt, hd, s, n))
        if dual:  # MMDiT-X: a second self-attention over the image tokens
            m += [Matmul(f"{s}/attn2/{p}", batch * img, dim, dim, "trunk", s, n) for p in ("to_q", "to_k", "to_v", "to_out")]
            att.append(Attention(f"{s}/attn2", batch, heads, img, img, hd, s, n))
    return ModelTerms(tuple(m), tuple(att), tuple(s for s, *_ in cfg.stacks) + ("out",))


@dataclasses.dataclass(frozen=True)
class Formula:
    """One model family's FLOP formula.

    terms(cfg, batch, tokens, text_len): every matmul and attention of one forward of `batch`
    samples of `tokens` post-patch latent tokens and `text_len` text positions each.
    temporal_patch(cfg): for video families, the latent frames one token spans (the config's
    temporal patch); None for image families (one frame of packed 2x2 tokens).
    pixels_per_token(cfg): the side of the pixel square one token spans; None: PIXELS_PER_TOKEN.
    """

    terms: Callable[[Any, int, int, int], ModelTerms]
    temporal_patch: Callable[[Any], int] | None = None
    pixels_per_token: Callable[[Any], int] | None = None


# The term builders, by architecture (a family spec's `flop_terms`).
TERMS: dict[str, Callable[[Any, int, int, int], ModelTerms]] = {
    "flux": _flux, "qwenimage": _qwenimage, "wan": _wan, "hunyuan_video": _hunyuan_video, "sd3": _sd3,
}
# The FLOP formula of each transformer family, by the family's name, from its spec.
FORMULAS: dict[str, Formula] = {
    name: Formula(TERMS[s.flop_terms], s.temporal_patch, s.pixels_per_token) for name, s in SPECS.items()
}


# ---------------------------------------------------------------------- RL costs
def rl_sample_flops(
    family: str,
    cfg: Any,
    *,
    height: int,
    width: int,
    frames: int = 1,
    text_len: int,
    num_steps: int,
    trained_steps: int,
    cfg_forwards: int = 1,
    lora_rank: int = 0,
    lora_targets: Sequence[str] = (),
    old_policy_forward: bool = False,
    reference_forward: bool = False,
) -> dict[str, int]:
    """FLOPs of one RL sample: `num_steps` rollout steps and `trained_steps` training units.

    A rollout step is one model evaluation: the SDE step, and either ODE solver (Euler; the
    multistep DPM2, whose second-order term reuses the previous step's data prediction). `cfg_forwards` is 2 for true CFG
    (the negative and positive branch, run as one forward at twice the batch: the same FLOPs)
    and 1 otherwise; the trainer recomputes the guided velocity, so training units carry the
    same factor. Training is LoRA (`lora_rank` > 0, over `lora_targets`) or full fine-tuning.

    A training unit is the trained weights' forward and backward, plus forwards without a
    backward: the old policy's with its own adapters or weights (`old_policy_forward`,
    DiffusionNFT) and the frozen reference model's (`reference_forward`: a KL or
    reference-velocity penalty, rl.kl_beta > 0; the base model, no adapters).

    Returns rollout, train and total FLOPs, plus `train_full_convention`: the training FLOPs at 3x the
    forward for the trained pass and 1x for each extra forward, whatever the adapter (the
    usual rule of thumb, which overstates LoRA training).
    """
    if cfg_forwards not in (1, 2):
        raise ValueError(f"cfg_forwards must be 1 (no CFG) or 2 (true CFG), got {cfg_forwards}")
    terms = model_terms(family, cfg, batch=cfg_forwards, height=height, width=width, frames=frames, text_len=text_len)
    step = terms.forward().total
    unit = (terms.lora_fwd_bwd(lora_rank, lora_targets) if lora_rank else terms.full_fwd_bwd()).total
    if old_policy_forward:
        unit += (terms.lora_forward(lora_rank, lora_targets) if lora_rank else terms.forward()).total
    if reference_forward:
        unit += step
    extra = int(old_policy_forward) + int(reference_forward)
    rollout, train = num_steps * step, trained_steps * unit
    return {
        "rollout": rollout,
        "train": train,
        "total": rollout + train,
        "train_full_convention": trained_steps * (3 + extra) * step,
    }


# ---------------------------------------------------------------------- jaxpr count
def jaxpr_matmul_flops(fn: Callable, *args, **kwargs) -> int:
    """FLOPs of every `dot_general` in the traced program of `fn(*args, **kwargs)`.

    An independent count of what a function executes: it walks the jaxpr (no compilation,
    no device work; arguments may be `jax.ShapeDtypeStruct`s), entering nested jaxprs (jit,
    remat, custom derivatives) and multiplying scan bodies by their length. Every branch of a
    `cond` counts; loops of unknown trip count are an error. Attention counts only where it is written as dot_generals (the
    XLA implementation), not inside a fused kernel's custom call.
    """
    total = 0
    for eqn, times in dot_generals(fn, *args, **kwargs):
        (lhs_contract, _), _ = eqn.params["dimension_numbers"]
        lhs_shape = eqn.invars[0].aval.shape
        contracted = math.prod(lhs_shape[d] for d in lhs_contract)
        total += times * 2 * math.prod(eqn.outvars[0].aval.shape) * contracted
    return total


def dot_generals(fn: Callable, *args, **kwargs) -> list[tuple[Any, int]]:
    """Every `dot_general` equation of the traced `fn(*args, **kwargs)`, with how many times it
    runs (scan lengths multiplied in; for `cond`, every branch is listed, each once)."""
    found: list[tuple[Any, int]] = []
    _collect_dots(jax.make_jaxpr(fn)(*args, **kwargs).jaxpr, 1, found)
    return found


def _collect_dots(jaxpr, times: int, found: list) -> None:
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            found.append((eqn, times))
        elif name == "while":
            raise ValueError("cannot count the matmuls of a while loop (unknown trip count)")
        else:
            inner = times * eqn.params["length"] if name == "scan" else times
            for sub in _sub_jaxprs(eqn.params):
                _collect_dots(sub, inner, found)


def _sub_jaxprs(params: dict) -> list:
    out = []
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, jax.extend.core.ClosedJaxpr):
                out.append(item.jaxpr)
            elif isinstance(item, jax.extend.core.Jaxpr):
                out.append(item)
    return out
