"""What every benchmark result records about where it ran: time, command, commit, code digest,
package versions, XLA settings and devices."""
from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import os
import platform
import subprocess
import sys
from typing import Any

# The repository root (digen_jax/app/bench/ is three levels below it).
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def versions() -> dict[str, str | None]:
    """Python's and the installed packages' versions (None: not installed)."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for pkg in ("jax", "jaxlib", "flax", "torch", "diffusers", "peft", "numpy"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def git_commit() -> dict[str, Any]:
    """The checkout's commit and whether it has uncommitted changes (None where git cannot say)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        status = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return {"commit": None, "dirty": None}
    if commit.returncode:
        return {"commit": None, "dirty": None}
    return {"commit": commit.stdout.strip(), "dirty": bool(status.stdout.strip())}


def source_digest(root: str | None = None) -> str:
    """SHA-256 over the code (path and bytes of every .py under digen_jax/, launch/, configs/).

    It names the code that ran where git cannot: a copy of the tree with stale or no git
    metadata (a device machine's). `git ls-files` + this function on a checkout tell which
    commit it was.
    """
    root = root or ROOT
    digest = hashlib.sha256()
    for top in ("digen_jax", "launch", "configs"):
        for folder, dirs, files in sorted(os.walk(os.path.join(root, top))):
            dirs.sort()
            for name in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(folder, name)
                digest.update(os.path.relpath(path, root).encode() + b"\0")
                with open(path, "rb") as f:
                    digest.update(f.read() + b"\0")
    return digest.hexdigest()


def run_record(mode: str, used: int) -> dict[str, Any]:
    """The fields every result JSON starts with: mode, time, command, commit, versions, devices."""
    import jax

    device = jax.devices()[0]
    return {
        "mode": mode,
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv,
        "git": git_commit(),
        "source_sha256": source_digest(),
        "versions": versions(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
        "device": {"kind": device.device_kind, "platform": device.platform, "count": jax.device_count(),
                   "used": used, "all_kinds": sorted({d.device_kind for d in jax.devices()})},
    }
