"""The order of the programs that cross processes, which every process must issue alike.

Several processes (roles on different hosts): every process runs this same loop, one thread per
group, and calls the same device programs (those without devices of its own return at once).
Programs that cross processes (trajectory moves, weight syncs) are issued by every lane of a
process that has devices in them at the same place in one order (`Crossings._crossings`). Host-derived
inputs (prompts, sample keys, advantages) are computed alike on every process and placed by each
on its own devices (`transfer.transfer` of uncommitted arrays); a micro-batch's rewards are
scored by the process that holds its decoded samples and shared (`reward_scoring`), as are the
iteration's figures (`Executor._figures`), so the main thread issues no cross-process program between
two plans; evaluation samples, images and checkpoints are read from each process's own copy
(`to_every_process`) after every lane is drained.
"""
from __future__ import annotations

import jax

from digen_jax.runtime import dispatch as dispatch_lib
from digen_jax.runtime import plan as plan_lib
from digen_jax.runtime.microbatch import MicroBatch
from digen_jax.runtime.trace import TRAJECTORY


class Crossings:
    """Where the executor's lanes meet at programs that cross processes (mixed into `Executor`:
    it uses the executor's `meshes`)."""

    def _crossings(self, plan: plan_lib.IterationPlan, mbs: list[MicroBatch], costs: plan_lib.Costs | None):
        """The tasks to dispatch for `plan` and which other lanes of this process meet each one's
        crossing (`dispatch.Lanes.crossing`). One process: the plan's tasks; nobody meets.

        Several processes: a weight sync whose transfer crosses processes is met at its place in
        the plan by the lanes of this process whose devices it touches. A trajectory crossing
        processes moves in a task of its own (`TRAJECTORY`, on the train lane) that both lanes
        issue where their streams reach it about together, estimated from `costs`
        (`dispatch.place_moves`): a move program starts on each device once every device got
        to it, so one issued right after its rollout would hold the trainer's stream until that
        rollout ended, and one issued at its training's place in the plan would wait on the
        rolling stream behind every rollout the plan puts before that training. Every process
        computes the same order from the same costs (`_agreed_costs`).
        """
        tasks = [t for t in plan.tasks if t.kind != "reward"]
        if jax.process_count() == 1 or self.meshes.colocated:
            return tasks, None
        mine = set(jax.local_devices())

        def local_lanes(groups) -> frozenset[str] | None:
            """The groups' lanes with devices on this process; None when nothing crosses processes."""
            devices = [d for g in groups for d in self.meshes.for_group(g).devices.flat]
            if len(set(groups)) < 2 or len({d.process_index for d in devices}) < 2:
                return None
            return frozenset(g for g in groups if mine & set(self.meshes.for_group(g).devices.flat))

        meets, syncs = {}, []
        sequences = {"rollout": [], "train": []}
        for task in tasks:
            if task.kind == "sync" and (lanes := local_lanes(("rollout", "train"))) is not None:
                meets[task.key] = lanes
                syncs.append(dispatch_lib.Crossing(task, {name: len(seq) for name, seq in sequences.items()}))
            else:
                sequences[dispatch_lib.lane(task)].append(task)
        rolled_on = {(m.iteration, m.index): m.rolled_on for m in mbs}
        where = {name: {t.key: i for i, t in enumerate(seq)} for name, seq in sequences.items()}
        moves = []
        for j, task in enumerate(sequences["train"]):
            source = rolled_on.get((task.iteration, task.index)) if task.kind == "train" else None
            if source is None or (lanes := local_lanes((source, "train"))) is None:
                continue
            move = plan_lib.Task(TRAJECTORY, "train", task.iteration, task.index, task.sample_version,
                                 deps=(("rollout", task.iteration, task.index),))
            produced = where[source].get(("rollout", task.iteration, task.index), -1)
            moves.append((move, source, produced + 1, j))
            meets[move.key] = lanes
        costs = costs or plan_lib.NOMINAL_COSTS
        crossings = dispatch_lib.place_moves(sequences, moves, syncs, costs.of)
        return dispatch_lib.interleave(sequences, crossings), lambda task: meets.get(task.key, frozenset())
