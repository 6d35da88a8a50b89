"""One transformer linear layer in the forms the FP8 rollout path could take, timed on one GPU.

    python3 benchmarks/fp8_linear.py --out=fp8_linear.json   # XLA_FLAGS as launch/bench.py sets them

The shape is a Qwen-Image MLP up-projection at the rollout batch (8 images x CFG 2 = 16 samples
of 1152 tokens at 512x512: 18432 x 3072 -> 12288), followed by its bias and tanh-GELU. Each form
is compiled once; the custom calls of its compiled HLO show whether XLA made a cuBLASLt FP8
GEMM of it (`__cublas$lt$matmul$f8`). Also timed: the per-token activation quantisation alone,
as models/fp8.py writes it and as it was first written (float32 upcast, division, clip).
"""
from __future__ import annotations

import argparse
import json
import re
import time

from digen_jax import xla_flags

xla_flags.set_defaults()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from digen_jax.models import fp8  # noqa: E402

F32, BF16 = jnp.float32, jnp.bfloat16
IN_OUT = (((1,), (0,)), ((), ()))
IN_IN = (((1,), (1,)), ((), ()))  # a kernel stored (out, in)


def _epilogue(y, b):
    return jax.nn.gelu(y.astype(F32) + b, approximate=True).astype(BF16)


def _first_quantisation(x):
    x32 = x.astype(F32)
    scale = jnp.maximum(jnp.max(jnp.abs(x32), axis=-1, keepdims=True), fp8.AMAX_FLOOR) / fp8.E4M3_MAX
    return jnp.clip(x32 / scale, -fp8.E4M3_MAX, fp8.E4M3_MAX).astype(fp8.E4M3), scale


def _token_scaled(quantize, product_dtype, kernel_transposed=False):
    def form(a):
        x_q, x_scale = quantize(a["x"])
        w, dims = (a["w_q_t"], IN_IN) if kernel_transposed else (a["w_q"], IN_OUT)
        acc = jax.lax.dot_general(x_q.astype(BF16), w.astype(BF16), dims, preferred_element_type=product_dtype)
        return _epilogue(acc.astype(F32) * x_scale * a["w_scale"], a["b"])
    return form


def _tensor_scaled(a):
    x32 = a["x"].astype(F32)
    s_x = jnp.maximum(jnp.max(jnp.abs(x32)), fp8.AMAX_FLOOR) / fp8.E4M3_MAX
    x_q = jnp.clip(x32 / s_x, -fp8.E4M3_MAX, fp8.E4M3_MAX).astype(fp8.E4M3)
    y = jax.lax.dot_general(x_q.astype(BF16) * s_x.astype(BF16), a["w_q_tensor"].astype(BF16) * a["s_w_tensor"].astype(BF16),
                            IN_OUT, preferred_element_type=BF16)
    return _epilogue(y, a["b"])


FORMS = {
    "bf16": lambda a: _epilogue(jax.lax.dot_general(a["x"], a["w"], IN_OUT, preferred_element_type=BF16), a["b"]),
    "token_first_form_f32_product": _token_scaled(_first_quantisation, F32),
    "token_f32_product": _token_scaled(fp8.quantize_activation, F32),
    "token_bf16_product": _token_scaled(fp8.quantize_activation, BF16),
    "token_bf16_product_kernel_out_in": _token_scaled(fp8.quantize_activation, BF16, kernel_transposed=True),
    "tensor_scaled": _tensor_scaled,
    "quantise_first_form": lambda a: _first_quantisation(a["x"]),
    "quantise": lambda a: fp8.quantize_activation(a["x"]),
}


def _inputs(m: int, k: int, n: int) -> dict:
    x = jax.random.normal(jax.random.key(0), (m, k), BF16)
    w = (jax.random.normal(jax.random.key(1), (k, n), F32) * 0.02).astype(BF16)
    w_q, w_scale = jax.jit(fp8.quantize_weight)(w)
    s_w_tensor = jnp.max(jnp.abs(w.astype(F32))) / fp8.E4M3_MAX
    w_q_tensor = jnp.clip(w.astype(F32) / s_w_tensor, -fp8.E4M3_MAX, fp8.E4M3_MAX).astype(fp8.E4M3)
    return dict(x=x, w=w, b=jax.random.normal(jax.random.key(2), (n,), F32) * 0.1, w_q=w_q, w_scale=w_scale,
                w_q_t=w_q.T.copy(), w_q_tensor=w_q_tensor, s_w_tensor=s_w_tensor)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="18432,3072,12288", help="tokens,in,out")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default="fp8_linear.json")
    args = parser.parse_args()
    m, k, n = (int(v) for v in args.shape.split(","))
    a = _inputs(m, k, n)
    reference = FORMS["bf16"](a).astype(F32)
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "shape": [m, k, n], "forms": {}}
    for name, form in FORMS.items():
        compiled = jax.jit(form).lower(a).compile()
        for _ in range(3):
            jax.block_until_ready(compiled(a))
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            out = jax.block_until_ready(compiled(a))
            times.append(time.perf_counter() - start)
        entry = {"median_ms": sorted(times)[len(times) // 2] * 1e3,
                 "custom_calls": sorted(set(re.findall(r'custom_call_target="([^"]+)"', compiled.as_text())))}
        if not name.startswith("quantise"):
            entry["rel_err_vs_bf16"] = float(jnp.linalg.norm(out.astype(F32) - reference) / jnp.linalg.norm(reference))
        result["forms"][name] = entry
        print(f"{name:34s} {entry['median_ms']:8.3f} ms  {entry['custom_calls']}", flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
