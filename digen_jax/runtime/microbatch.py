"""A micro-batch of an iteration, and the pieces it may be rolled out in.

Micro-batches are whole groups: iteration k's P prompts are cut into M contiguous slices,
each carrying its prompts' G samples. Advantages are normalised per micro-batch (the grain
that flows from reward to trainer; 'global' in `rl.std_mode` and `rl.mean_mode` means
micro-batch-global), so every mode trains the same numbers on the same batch.

Split micro-batches: the trainer's rollouts count pieces of a micro-batch (`plan.pieces_per_microbatch`:
runs of samples each role's batch axis divides), so `runtime.tag_microbatches` may be a fraction;
the micro-batch at the boundary is rolled out in two pieces, one per role, with its samples' own
keys and conditioning, each piece decoded and scored on its own; its training joins them on the
train mesh (trajectory rows, then rewards in sample order), so it trains what one rollout of the
whole micro-batch would give. With several processes the split stays in whole micro-batches.

The helpers here cut a micro-batch (into pieces, into gradient chunks of its training units)
and join what its pieces give back (trajectory rows, reward rows).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from digen_jax.rl.rollout import Conditioning, FinalSamples, Trajectory
from digen_jax.runtime import mesh as mesh_lib
from digen_jax.runtime import plan as plan_lib


@dataclasses.dataclass
class MicroBatch:
    """One micro-batch of an iteration: its inputs, and once rolled out its trajectory and rewards."""

    iteration: int
    index: int
    sample_ids: np.ndarray  # global sample ids (iteration * batch + position)
    prompt_ids: np.ndarray  # (samples,) the prompt of each sample
    cond: Conditioning  # (samples, ...)
    sample_keys: jax.Array
    noise_levels: np.ndarray  # (N,) the iteration's per-step noise levels
    trained: np.ndarray  # (samples, S) trained step indices
    rolled_on: str | None = None  # the device group that rolls it out (its first piece's), set when planned
    piece: tuple[int, int, int] | None = None  # a piece's view of its micro-batch (`piece_of`): (first, end, grain)
    # a split micro-batch: each piece's trajectory and future rewards by first piece (`_rollout`)
    pieces: dict[int, Any] = dataclasses.field(default_factory=dict)
    piece_rewards: dict[int, concurrent.futures.Future] = dataclasses.field(default_factory=dict)
    version: int | None = None  # the policy version that generated it
    traj: Trajectory | FinalSamples | None = None  # what the algorithm's rollout keeps (Trainer.rollout)
    on_trainer: Trajectory | FinalSamples | None = None  # the trajectory moved to the train mesh ahead of its training
    # (1 + K, samples) float32: the weighted total, then each of the K rewards (`Executor.reward_names`)
    rewards: concurrent.futures.Future | None = None



def piece_of(mb: MicroBatch, piece: tuple[int, int, int] | None) -> MicroBatch:
    """`mb`, or the view of its samples of `piece` (first, end, grain) with their own keys."""
    if piece is None:
        return mb
    first, end, grain = piece
    rows = slice(first * len(mb.sample_ids) // grain, end * len(mb.sample_ids) // grain)
    return dataclasses.replace(
        mb, sample_ids=mb.sample_ids[rows], prompt_ids=mb.prompt_ids[rows],
        cond=jax.tree.map(lambda a: a[rows], mb.cond), sample_keys=mb.sample_keys[rows],
        trained=mb.trained[rows], piece=piece, pieces={}, piece_rewards={})

def piece_args(task: plan_lib.Task) -> dict:
    """A piece's trace args: its (first, end, grain) pieces of the micro-batch."""
    return {} if task.piece is None else {"piece": list(task.piece)}

def settle_from(source: concurrent.futures.Future, target: concurrent.futures.Future) -> None:
    """Give `target` `source`'s result or error once it has one."""
    def settle(done: concurrent.futures.Future) -> None:
        error = done.exception() if not done.cancelled() else concurrent.futures.CancelledError()
        target.set_exception(error) if error is not None else target.set_result(done.result())

    source.add_done_callback(settle)


def concatenated(parts: list[concurrent.futures.Future]) -> concurrent.futures.Future:
    """A future of the pieces' reward rows ((1 + K, samples) each, `MicroBatch.rewards`) joined in
    sample order, settled when the last piece is scored (the first error, if one fails); no thread
    waits for it."""
    joined, lock = concurrent.futures.Future(), threading.Lock()

    def settle(_) -> None:
        with lock:
            if joined.done() or not all(p.done() for p in parts):
                return
            errors = [p.exception() for p in parts if p.exception() is not None]
            if errors:
                joined.set_exception(errors[0])
            else:
                joined.set_result(np.concatenate([p.result() for p in parts], axis=-1))

    for part in parts:
        part.add_done_callback(settle)
    return joined


_SHARED_FIELDS = frozenset({"noise_levels", "version"})  # trajectory fields common to all its samples


@functools.partial(jax.jit, static_argnums=1)
def joined(pieces: list, mesh):
    """The pieces of a split micro-batch's trajectory (on the train mesh) as one: the per-sample
    fields' rows in order, batch-split over `mesh`; the fields common to every sample from the first."""
    rows = {f.name: jnp.concatenate([getattr(p, f.name) for p in pieces])
            for f in dataclasses.fields(pieces[0]) if f.name not in _SHARED_FIELDS}
    rows = {name: jax.lax.with_sharding_constraint(a, mesh_lib.batch_sharding(mesh, a.shape)) for name, a in rows.items()}
    return dataclasses.replace(pieces[0], **rows)


@functools.lru_cache(maxsize=16)
def cut_fn(cut, static: int, sharding):
    return jax.jit(lambda units, index: cut(units, index, static), out_shardings=sharding)


def unit_rows(units, start, size: int):
    """Units start .. start + size - 1 (`start` traced: one program serves every chunk)."""
    return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, start, size), units)


def step_units(units, step, per_sample: int):
    """Each sample's unit of its `step`-th trained step (units are sample-major: a[step::per_sample])."""
    return jax.tree.map(
        lambda a: jax.lax.dynamic_index_in_dim(a.reshape(-1, per_sample, *a.shape[1:]), step, axis=1, keepdims=False),
        units,
    )

