"""Optimizer and EMA of the trained parameters (full weights or a LoRA adapter tree).

The optimizer is the references' AdamW with gradient-norm clipping (docs/algorithms.md A4, A8);
the EMA follows Flow-GRPO's schedule (A6) or DanceGRPO's constant decay (A8). Both are pure
pytree functions that jit; the EMA's step may be traced.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

PyTree = Any

# `rl.optimizer_state_dtype`: the Adam moments in the trained weights' own dtype ('param': bf16 for
# bf16 weights, 2 x 2 bytes per weight) or in float32 (2 x 4 bytes), as the references' torch
# AdamW keeps them for float32 masters.
OPTIMIZER_STATE_DTYPES = ("param", "float32")


def make_optimizer(
    learning_rate: float | optax.Schedule,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-4,
    max_grad_norm: float | None = 1.0,
    state_dtype: str = "param",
) -> optax.GradientTransformation:
    """``clip_by_global_norm(max_grad_norm)`` then ``adamw(lr, b1, b2, eps, weight_decay)``.

    Clipping: ``g <- g * min(1, max_grad_norm / ||g||_2)`` over the whole tree; ``None`` skips
    it. AdamW: ``m = b1 m + (1-b1) g``, ``v = b2 v + (1-b2) g^2``, bias-corrected ``m_hat``,
    ``v_hat``, and ``p <- p - lr (m_hat / (sqrt(v_hat) + eps) + weight_decay * p)`` -- the
    decoupled decay of torch.optim.AdamW, which the references use (Flow-GRPO: lr 3e-4 on LoRA,
    DanceGRPO: 1e-5 full fine-tune, both 0.9/0.999, eps 1e-8, wd 1e-4). torch's clip divides by
    ``||g|| + 1e-6`` instead of ``||g||``: a relative difference below 1e-6 at the clip boundary.

    ``state_dtype`` (`OPTIMIZER_STATE_DTYPES`): 'param' keeps both moments in each weight's dtype;
    'float32' keeps them in float32 and runs the whole update (clip, moments, decay) in float32,
    casting only the final update to the weight's dtype.
    """
    if max_grad_norm is not None and max_grad_norm <= 0:
        raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm}")
    if state_dtype not in OPTIMIZER_STATE_DTYPES:
        raise ValueError(f"rl.optimizer_state_dtype must be one of {OPTIMIZER_STATE_DTYPES}, got {state_dtype!r}")
    adamw = optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    tx = adamw if max_grad_norm is None else optax.chain(optax.clip_by_global_norm(max_grad_norm), adamw)
    return tx if state_dtype == "param" else in_float32(tx)


def in_float32(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """`inner` run on float32 views of the gradients and weights: its state is float32 whatever
    the weights' dtype, and its updates are cast back to each weight's dtype."""
    up = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32), tree)  # noqa: E731

    def init(params):
        return inner.init(up(params))

    def update(grads, state, params=None):
        updates, state = inner.update(up(grads), state, None if params is None else up(params))
        return jax.tree.map(lambda u, g: u.astype(g.dtype), updates, grads), state

    return optax.GradientTransformation(init, update)


def ema_decay(step: jax.Array | int, *, max_decay: float = 0.9) -> jax.Array:
    """Flow-GRPO's warm-up EMA decay ``d(k) = min((1 + k) / (10 + k), max_decay)``, float32.

    ``k`` is the optimizer step; d(0) = 0.1, so the first updates mostly copy the weights, and
    Flow-GRPO caps it at 0.9 (reached at k = 80).
    """
    k = jnp.asarray(step, jnp.float32)
    return jnp.minimum((1.0 + k) / (10.0 + k), max_decay)


def ema_update(
    ema_params: PyTree,
    params: PyTree,
    step: jax.Array | int,
    *,
    update_every: int = 8,
    max_decay: float = 0.9,
    decay: float | None = None,
) -> PyTree:
    """EMA step ``ema <- ema + (1 - d) (params - ema)`` where ``(step + 1) % update_every == 0``.

    ``decay=None`` (Flow-GRPO): ``d = ema_decay(step, max_decay=max_decay)``, ``update_every=8``;
    Flow-GRPO calls this once per micro-batch with the optimizer step, so several updates can
    share one ``step``. ``decay=0.995, update_every=1`` is DanceGRPO's constant-decay FLUX EMA.
    On the other steps every leaf is returned unchanged (bit-exact). The arithmetic is float32 and
    each result keeps its EMA leaf's dtype. ``step`` may be a traced int and ``decay`` a traced
    float32 (a Python ``decay`` is checked to lie in [0, 1]).
    """
    if update_every < 1:
        raise ValueError(f"update_every must be >= 1, got {update_every}")
    if decay is not None and not isinstance(decay, jax.Array) and not 0.0 <= decay <= 1.0:
        raise ValueError(f"decay must be in [0, 1], got {decay}")
    step = jnp.asarray(step, jnp.int32)
    d = ema_decay(step, max_decay=max_decay) if decay is None else jnp.float32(decay)
    active = (step + 1) % update_every == 0

    def leaf(ema: jax.Array, p: jax.Array) -> jax.Array:
        e32 = ema.astype(jnp.float32)
        new = e32 + (1.0 - d) * (p.astype(jnp.float32) - e32)
        return jnp.where(active, new.astype(ema.dtype), ema)

    return jax.tree_util.tree_map(leaf, ema_params, params)
