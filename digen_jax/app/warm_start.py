"""`train.init_from`: a new run that starts from the trainable weights of another run's latest
checkpoint, checked before any compute (the keys that shape the trainable weights must match;
the other fingerprint keys that differ are named) with a fresh optimizer state and EMA.
"""
from __future__ import annotations

import os
from typing import Callable

import ml_collections
import orbax.checkpoint as ocp

from digen_jax.app.errors import RunStopped
from digen_jax.app.fingerprint import WEIGHT_KEYS, differences, fingerprint
from digen_jax.app.run_checkpoints import abstract, open_manager, read_item, read_meta
from digen_jax.app.workdir import short_reason


def check_init_from(config: ml_collections.ConfigDict) -> tuple[ocp.CheckpointManager, int, dict]:
    """`train.init_from`'s checkpoint, checked before any compute: (its manager, step, meta).
    RunStopped when there is none or its weights cannot fit this run's (naming the keys)."""
    source = os.path.abspath(os.path.expanduser(config.train.init_from))
    if not os.path.isdir(os.path.join(source, "checkpoints")):
        raise RunStopped(f"train.init_from={config.train.init_from!r}: {source}/checkpoints does not exist "
                         "(it names the workdir of the run to start from)")
    manager = open_manager(source, config, read_only=True)
    step = manager.latest_step()
    if step is None:
        raise RunStopped(f"train.init_from={config.train.init_from!r}: {source}/checkpoints holds no checkpoint "
                         "(it names the workdir of the run to start from)")
    try:
        meta = read_meta(manager, step)
    except Exception as e:  # noqa: BLE001 (reported as what it is: an unreadable source)
        raise RunStopped(f"train.init_from={config.train.init_from!r}: checkpoint {step} cannot be read "
                         f"({short_reason(e)})") from e
    saved = meta.get("fingerprint")
    if saved is not None:
        diff = differences(saved, fingerprint(config), carried=False, keys=WEIGHT_KEYS)
        if diff:
            raise RunStopped(f"train.init_from={config.train.init_from!r}: the trainable weights of its checkpoint "
                             f"{step} do not fit this run's:\n  " + "\n  ".join(diff))
    return manager, step, meta


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
