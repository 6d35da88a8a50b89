"""`train.init_from`: a new run that starts from the trainable weights of another run's latest
checkpoint, with a fresh optimizer state and EMA. The checkpoint is checked before any compute
(`machine_checks.check_init_from`: the keys that shape the trainable weights must match); the
other fingerprint keys that differ are named when it loads.
"""
from __future__ import annotations

from typing import Callable

import ml_collections
import orbax.checkpoint as ocp

from digen_jax.app.errors import RunStopped
from digen_jax.app.fingerprint import WEIGHT_KEYS, differences, fingerprint
from digen_jax.app.run_checkpoints import abstract, read_item
from digen_jax.app.workdir import short_reason


def load_init_from(manager: ocp.CheckpointManager, step: int, meta: dict, trainable,
                   config: ml_collections.ConfigDict, log: Callable[[str], None]):
    """The trainable weights of `train.init_from`'s checkpoint `step`, in `trainable`'s shapes and
    placement (RunStopped when a leaf does not fit); logs what was loaded."""
    target = abstract(trainable)
    try:
        restored = read_item(manager, step, "state", {"trainable": target}, partial=True)
    except Exception as e:  # noqa: BLE001 (a source written before fingerprints: its shapes are the check)
        raise RunStopped(f"train.init_from={config.train.init_from!r}: the trainable weights of checkpoint {step} "
                         f"do not load into this run's: {short_reason(e)}") from e
    saved = meta.get("fingerprint") or {}
    notes = differences(saved, fingerprint(config), carried=False,
                        keys=tuple(k for k in saved if k not in WEIGHT_KEYS)) if saved else []
    log(f"train.init_from: loaded the trainable weights ({saved.get('trainable', 'trainable tree')}) of "
        f"{manager.directory}/{step}; fresh optimizer state and EMA, starting at iteration 0"
        + ("; that run differed in:\n  " + "\n  ".join(notes) if notes else ""))
    return restored["trainable"]
