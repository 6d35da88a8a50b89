"""Sigma ladders (noise schedules) for the flow-matching denoisers digen-jax trains.

A ladder for N sampling steps is a host-side ``np.float32`` array ``sigmas`` of length N + 1 that
runs from (about) 1 down to ``sigmas[N] == 0``, exactly like a diffusers scheduler's ``.sigmas``
after ``set_timesteps``. Step i moves the latent from ``sigmas[i]`` to ``sigmas[i + 1]``. Next to
it sits ``timesteps`` (length N), the value the denoiser is conditioned on at each step.

Each family reproduces its reference bit for bit: the diffusers 0.42.1 pipeline + scheduler for
FLUX, Qwen-Image, SD3, HunyuanVideo and Wan, and DanceGRPO's own torch code for ``dancegrpo``.
The shift helpers keep the dtype of their input, and each ladder feeds them float32 or float64
exactly where the reference does (diffusers rounds custom sigmas to float32 and then shifts them
in float32; its default static ladder is shifted in float64). The result is always cast to
float32, like the schedulers' torch ``.sigmas``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import numpy as np

# diffusers schedulers are configured with 1000 training timesteps; timestep = sigma * 1000.
NUM_TRAIN_TIMESTEPS = 1000


@dataclasses.dataclass(frozen=True, eq=False)
class SigmaLadder:
    """A sampling schedule for ``num_steps`` denoising steps.

    Attributes:
        sigmas: ``np.float32`` array, shape (N + 1,), decreasing, ``sigmas[-1] == 0``.
        timesteps: shape (N,), the denoiser's timestep input at each step. ``np.float32``
            (``sigma * 1000``) for FlowMatchEuler families; ``np.int64`` (truncated) for the Wan
            UniPC and DanceGRPO ladders, which feed integer timesteps.
        mu: the dynamic-shift exponent used (FLUX, Qwen-Image), else ``None``.
    """

    sigmas: np.ndarray
    timesteps: np.ndarray
    mu: float | None = None

    @property
    def num_steps(self) -> int:
        """N, the number of denoising transitions in the ladder."""
        return int(self.sigmas.shape[0]) - 1


def _check_num_steps(num_steps: int) -> None:
    if isinstance(num_steps, bool) or not isinstance(num_steps, (int, np.integer)):
        raise ValueError(f"num_steps must be an int >= 1, got {num_steps!r}")
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")


def _check_image_seq_len(image_seq_len: int | None, family: str) -> None:
    if image_seq_len is None:
        raise ValueError(
            f"the {family!r} ladder uses a resolution-dependent shift: pass image_seq_len "
            "(the packed token count, (height // 16) * (width // 16))"
        )
    if isinstance(image_seq_len, bool) or not isinstance(image_seq_len, (int, np.integer)):
        raise ValueError(f"image_seq_len must be a positive int, got {image_seq_len!r}")
    if image_seq_len <= 0:
        raise ValueError(f"image_seq_len must be > 0, got {image_seq_len}")


def _check_positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")


def _flow_match_timesteps(sigmas: np.ndarray) -> np.ndarray:
    # FlowMatchEulerDiscreteScheduler multiplies the float32 sigmas by 1000 in float32.
    return sigmas[:-1] * np.float32(NUM_TRAIN_TIMESTEPS)


def _append_zero(sigmas: np.ndarray) -> np.ndarray:
    return np.concatenate([sigmas.astype(np.float32), np.zeros(1, np.float32)])


def calculate_shift(
    image_seq_len: int,
    base_seq_len: int = 256,
    max_seq_len: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> float:
    """The pipelines' resolution-dependent shift exponent mu.

    mu is linear in the packed token count: ``m = (max_shift - base_shift) / (max_seq_len -
    base_seq_len)`` and ``mu = image_seq_len * m + (base_shift - m * base_seq_len)``, i.e.
    ``base_shift`` at ``base_seq_len`` tokens and ``max_shift`` at ``max_seq_len`` tokens (and
    extrapolated outside that range). The intercept form matches the diffusers pipelines to the
    last bit. Defaults are FLUX.1-dev's scheduler config.
    """
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    intercept = base_shift - slope * base_seq_len
    return image_seq_len * slope + intercept


# The three helpers below combine Python-float parameters with a numpy array, so (numpy >= 2
# promotion) the arithmetic runs in the array's dtype: float32 in, float32 math, as in diffusers.


def exponential_time_shift(mu: float, t: np.ndarray) -> np.ndarray:
    """Dynamic (resolution-dependent) shift ``e^mu / (e^mu + (1/t - 1))``, elementwise.

    Computed in the floating dtype of ``t`` (float32 stays float32).
    """
    t = np.asarray(t)
    return math.exp(mu) / (math.exp(mu) + (1 / t - 1))


def static_shift(shift: float, t: np.ndarray) -> np.ndarray:
    """Static (SD3-style) shift ``shift * t / (1 + (shift - 1) * t)``, elementwise.

    Computed in the floating dtype of ``t`` (float32 stays float32).
    """
    t = np.asarray(t)
    return shift * t / (1 + (shift - 1) * t)


def stretch_to_terminal(sigmas: np.ndarray, shift_terminal: float) -> np.ndarray:
    """Rescale ``1 - sigma`` so the last (pre-zero) sigma becomes ``shift_terminal``.

    ``sigma' = 1 - (1 - sigma) / ((1 - sigma[-1]) / (1 - shift_terminal))``, in the dtype of
    ``sigmas``; sigma = 1 stays 1. Undefined (0/0) when ``sigma[-1] == 1``, i.e. a one-step
    dynamic ladder, where diffusers silently returns NaN: this raises instead.
    """
    one_minus = 1 - np.asarray(sigmas)
    if one_minus[-1] == 0:
        raise ValueError(
            "shift_terminal needs a ladder whose last sigma is < 1, i.e. num_steps >= 2 "
            "(diffusers returns NaN sigmas here)"
        )
    return 1 - one_minus / (one_minus[-1] / (1 - shift_terminal))


def _dynamic_ladder(
    num_steps: int,
    image_seq_len: int | None,
    family: str,
    base_shift: float,
    max_shift: float,
    base_seq_len: int,
    max_seq_len: int,
    shift_terminal: float | None,
) -> SigmaLadder:
    _check_num_steps(num_steps)
    _check_image_seq_len(image_seq_len, family)
    mu = calculate_shift(image_seq_len, base_seq_len, max_seq_len, base_shift, max_shift)
    # The pipelines pass linspace(1, 1/N, N) as custom sigmas; the scheduler rounds them to
    # float32 before shifting, so do the same to land on the same values.
    base = np.linspace(1.0, 1.0 / num_steps, num_steps).astype(np.float32)
    sigmas = exponential_time_shift(mu, base)
    if shift_terminal:
        sigmas = stretch_to_terminal(sigmas, shift_terminal)
    sigmas = _append_zero(sigmas)
    return SigmaLadder(sigmas=sigmas, timesteps=_flow_match_timesteps(sigmas), mu=mu)


def flux_ladder(
    num_steps: int,
    image_seq_len: int | None,
    *,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
    base_seq_len: int = 256,
    max_seq_len: int = 4096,
) -> SigmaLadder:
    """FLUX.1-dev ladder (FluxPipeline + its FlowMatchEuler config, dynamic shifting).

    ``s = linspace(1, 1/N, N)``, ``mu = calculate_shift(image_seq_len, 256, 4096, 0.5, 1.15)``,
    ``sigma = exponential_time_shift(mu, s)``, then 0 appended. ``image_seq_len`` is the packed
    token count ``(H // 16) * (W // 16)`` (1024 at 512 px, mu = 0.63). Timesteps are
    ``sigma * 1000`` (the FLUX transformer is fed ``timestep / 1000``).
    """
    return _dynamic_ladder(
        num_steps, image_seq_len, "flux", base_shift, max_shift, base_seq_len, max_seq_len, None
    )


def qwen_image_ladder(
    num_steps: int,
    image_seq_len: int | None,
    *,
    base_shift: float = 0.5,
    max_shift: float = 0.9,
    base_seq_len: int = 256,
    max_seq_len: int = 8192,
    shift_terminal: float = 0.02,
) -> SigmaLadder:
    """Qwen-Image ladder (QwenImagePipeline + its FlowMatchEuler config).

    As :func:`flux_ladder` with ``mu = calculate_shift(image_seq_len, 256, 8192, 0.5, 0.9)``, then
    :func:`stretch_to_terminal` so the last nonzero sigma is 0.02, then 0 appended. Requires
    ``num_steps >= 2`` (with one step the stretch is 0/0; diffusers yields NaN).
    """
    return _dynamic_ladder(
        num_steps,
        image_seq_len,
        "qwen_image",
        base_shift,
        max_shift,
        base_seq_len,
        max_seq_len,
        shift_terminal,
    )


def sd3_ladder(num_steps: int, *, shift: float = 3.0) -> SigmaLadder:
    """Static-shift FlowMatchEuler ladder as ``FlowMatchEulerDiscreteScheduler(shift=shift)
    .set_timesteps(N)`` builds it (SD3 / SD3.5 pipelines, the Flow-GRPO check values).

    diffusers shifts twice: its constructor stores the shifted training sigmas, whose smallest
    value ``sigma_min = shifted(1/1000)`` (a float32) becomes the end of
    ``t = linspace(1, sigma_min, N)``, and ``set_timesteps`` shifts ``t`` again:
    ``sigma = static_shift(shift, t)``. Hence the last nonzero sigma is ``shifted(shifted(1e-3))``
    (0.0089 for shift 3), not ``shifted(1e-3)``. Then 0 is appended; timesteps ``sigma * 1000``.
    """
    _check_num_steps(num_steps)
    _check_positive("shift", shift)
    # The constructor shifts its float32 training sigmas in float32; mirror that rounding.
    t_min = np.asarray([1 / NUM_TRAIN_TIMESTEPS], np.float32)
    sigma_min = float(static_shift(shift, t_min)[0])
    # From here on diffusers works in float64 (np.linspace) until the final float32 cast.
    t = np.linspace(1.0 * NUM_TRAIN_TIMESTEPS, sigma_min * NUM_TRAIN_TIMESTEPS, num_steps)
    sigmas = _append_zero(static_shift(shift, t / NUM_TRAIN_TIMESTEPS))
    return SigmaLadder(sigmas=sigmas, timesteps=_flow_match_timesteps(sigmas))


def hunyuan_video_ladder(num_steps: int, *, shift: float = 7.0) -> SigmaLadder:
    """HunyuanVideo ladder (HunyuanVideoPipeline + FlowMatchEuler, static ``shift=7``).

    ``s = linspace(1, 0, N + 1)[:-1]`` (passed as custom sigmas, rounded to float32),
    ``sigma = static_shift(shift, s)``, then 0 appended; timesteps ``sigma * 1000`` (fed raw).
    """
    _check_num_steps(num_steps)
    _check_positive("shift", shift)
    base = np.linspace(1.0, 0.0, num_steps + 1)[:-1].astype(np.float32)
    sigmas = _append_zero(static_shift(shift, base))
    return SigmaLadder(sigmas=sigmas, timesteps=_flow_match_timesteps(sigmas))


def wan_unipc_ladder(num_steps: int, *, flow_shift: float = 3.0) -> SigmaLadder:
    """Wan2.1 ladder from ``UniPCMultistepScheduler(prediction_type="flow_prediction",
    use_flow_sigmas=True, flow_shift=3.0)`` (the Wan checkpoints' scheduler; Flow-GRPO's Wan
    pipeline reads its ``.sigmas``).

    ``s = linspace(1, 1/1000, N + 1)[:-1]``, ``sigma = static_shift(flow_shift, s)``; UniPC then
    lowers ``sigma[0]`` from 1 to ``1 - 1e-6`` (it takes ``log`` of ``1 - sigma``), so the ladder
    starts at 0.999999, not 1. Timesteps are ``int64(sigma * 1000)`` truncated in float64, so the
    first timestep is 999. Then 0 is appended (``final_sigmas_type="zero"``). For N = 20,
    ``sigmas[1] = 0.9828``.
    """
    _check_num_steps(num_steps)
    _check_positive("flow_shift", flow_shift)
    base = np.linspace(1.0, 1.0 / NUM_TRAIN_TIMESTEPS, num_steps + 1)[:-1]
    sigmas = static_shift(flow_shift, base)
    if abs(sigmas[0] - 1.0) < 1e-6:
        sigmas[0] -= 1e-6
    timesteps = (sigmas * NUM_TRAIN_TIMESTEPS).astype(np.int64)
    return SigmaLadder(sigmas=_append_zero(sigmas), timesteps=timesteps)


def _torch_linspace_f32(start: float, end: float, steps: int) -> np.ndarray:
    """``torch.linspace(start, end, steps)`` (float32, CPU) reproduced bit for bit, steps >= 2.

    torch fills the first half as ``start + step * i`` and the second as
    ``end - step * (steps - 1 - i)`` with a float32 ``step`` and one rounding per element (a fused
    multiply-add), which differs from numpy's float64 linspace rounded to float32 by up to one ulp.
    The float64 expressions below are exact before the final rounding, so they match the FMA.
    """
    step = float((np.float32(end) - np.float32(start)) / np.float32(steps - 1))
    index = np.arange(steps)
    head = start + step * index
    tail = end - step * (steps - 1 - index)
    return np.where(index < steps // 2, head, tail).astype(np.float32)


def dancegrpo_ladder(num_steps: int, *, shift: float = 3.0) -> SigmaLadder:
    """DanceGRPO's own ladder (every ``fastvideo/train_grpo_*.py``; docs/algorithms.md A7).

    ``sigma = static_shift(shift, torch.linspace(1, 0, N + 1))`` in float32 (the trailing 0 is
    part of the linspace). Timesteps are ``int(sigma * 1000)``, the float32 product truncated, as
    DanceGRPO feeds them (the caller divides by 1000 for FLUX/Qwen, feeds them raw to
    Hunyuan/Wan). Truncation makes the integers sensitive to single-ulp differences, so the
    linspace reproduces torch's float32 rounding rather than numpy's.
    """
    _check_num_steps(num_steps)
    _check_positive("shift", shift)
    sigmas = static_shift(shift, _torch_linspace_f32(1.0, 0.0, num_steps + 1))
    timesteps = (sigmas[:-1] * np.float32(NUM_TRAIN_TIMESTEPS)).astype(np.int64)
    return SigmaLadder(sigmas=sigmas.astype(np.float32), timesteps=timesteps)


_DYNAMIC_FAMILIES: dict[str, Callable[..., SigmaLadder]] = {
    "flux": flux_ladder,
    "qwen_image": qwen_image_ladder,
}
_STATIC_FAMILIES: dict[str, Callable[..., SigmaLadder]] = {
    "sd3": sd3_ladder,
    "hunyuan_video": hunyuan_video_ladder,
    "wan": wan_unipc_ladder,
    "dancegrpo": dancegrpo_ladder,
}
LADDER_FAMILIES: tuple[str, ...] = tuple(_DYNAMIC_FAMILIES) + tuple(_STATIC_FAMILIES)


def sigma_ladder(
    family: str, num_steps: int, image_seq_len: int | None = None, **overrides: Any
) -> SigmaLadder:
    """Build the ladder of ``family`` for ``num_steps`` steps.

    Families: ``"flux"``, ``"qwen_image"`` (need ``image_seq_len``, the packed token count),
    ``"sd3"``, ``"hunyuan_video"``, ``"wan"``, ``"dancegrpo"`` (static; ``image_seq_len`` is
    ignored). ``overrides`` are the keyword arguments of the family's function (e.g.
    ``shift=5.0`` for ``"hunyuan_video"``, ``max_shift=1.0`` for ``"flux"``).

    Raises:
        ValueError: unknown family, unknown override, or invalid ``num_steps`` /
            ``image_seq_len``.
    """
    if family in _DYNAMIC_FAMILIES:
        build = _DYNAMIC_FAMILIES[family]
        args: tuple[Any, ...] = (num_steps, image_seq_len)
    elif family in _STATIC_FAMILIES:
        build = _STATIC_FAMILIES[family]
        args = (num_steps,)
    else:
        raise ValueError(
            f"unknown sigma ladder family {family!r}; valid families: {', '.join(LADDER_FAMILIES)}"
        )
    valid = build.__kwdefaults__ or {}
    unknown = sorted(set(overrides) - set(valid))
    if unknown:
        raise ValueError(
            f"unknown override(s) {unknown} for family {family!r}; valid: {sorted(valid)}"
        )
    return build(*args, **overrides)
