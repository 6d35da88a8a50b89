"""Where a benchmark result goes: its default file name under benchmarks/results/, the JSON and
(system mode) the traces beside it, and the device-memory share the model bench runs with."""
from __future__ import annotations

import json
import os
import shutil
from typing import Any

from digen_jax.app.bench.provenance import ROOT
from digen_jax.models.specs import SPECS

# The device-memory share of the model bench (XLA_PYTHON_CLIENT_MEM_FRACTION) unless the user set
# one: JAX's default 0.75 of an 80 GB card is too little for the largest documented measurement
# (LoRA fwd+bwd of Qwen-Image-20B with unrolled blocks, about 72 GB).
MODEL_MEM_FRACTION = "0.95"


def set_memory_fraction(mode: str, environ=os.environ) -> str | None:
    """For `mode` 'model', XLA_PYTHON_CLIENT_MEM_FRACTION as MODEL_MEM_FRACTION unless already set
    (JAX reads it when it first uses the GPU); returns the value in effect (None: JAX's default)."""
    if mode == "model":
        environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", MODEL_MEM_FRACTION)
    return environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")


def default_out(result: dict[str, Any]) -> str:
    """benchmarks/results/<mode>_<model>_..._<UTC time>.json of a result."""
    stamp = result["created_utc"].replace(":", "").replace("-", "").split("+")[0]
    if result["mode"] == "system":
        config = result["config"]["model"]
        nft = "_nft" if result["config"].get("rl", {}).get("algorithm") == "nft" else ""  # GRPO names as before
        name = f"system_{config['family']}_{config.get('variant', 'custom')}{nft}_{result['device']['count']}dev_{stamp}.json"
    else:
        c = result["config"]
        frames = f"x{c['frames']}" if SPECS[c["family"]].video else ""
        name = f"{result['mode']}_{c['family']}_{c['variant']}_b{c['batch']}_{c['height']}x{c['width']}{frames}_{stamp}.json"
    return os.path.join(ROOT, "benchmarks", "results", name)


def write(result: dict[str, Any], path: str, workdir: str) -> None:
    """Write `result` as JSON to `path`; a system run's traces (under `workdir`) go next to it
    (they explain the bubbles)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    if result["mode"] == "system":
        traces = os.path.splitext(path)[0] + "_traces"
        os.makedirs(traces, exist_ok=True)
        for record in result.get("modes", {}).values():
            shutil.copy(os.path.join(workdir, record["trace"]), traces)
