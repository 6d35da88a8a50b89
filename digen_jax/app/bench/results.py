"""Where a benchmark result goes: its default file name under benchmarks/results/, the JSON and
(system mode) the traces beside it."""
from __future__ import annotations

import json
import os
import shutil
from typing import Any

from digen_jax.app.bench.provenance import ROOT
from digen_jax.models.specs import SPECS

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
