"""The split of each iteration: how many micro-batches the trainer rolls out itself (TAG) and how
many of the next iteration are prefetched (TCSS), fixed by the settings or chosen every
iteration from measured task costs.

Elastic splits: with `runtime.tag_microbatches` or `runtime.prefetch_microbatches` < 0 the
split of each iteration is chosen by `plan.choose_split` (keeping the last one while it is
predicted within its tolerance of the best) from the task times measured in
the previous iteration (a piece's time counted per micro-batch; with several processes, from
process 0's measured costs, broadcast: the plan must be the same everywhere); the first
iteration uses no trainer rollouts and no prefetch. The measured times and the last split
travel with each checkpoint, so a resumed run's first split is the one the uninterrupted run
chose.
"""
from __future__ import annotations

import jax
import numpy as np

from digen_jax.runtime import plan as plan_lib


class ElasticSplit:
    """The executor's split choice (mixed into `Executor`: it uses the executor's `settings`,
    `mode`, `flags`, `grain`, `microbatches`, `carried`, `split`, `measured`, `meshes` and
    `shared`)."""

    def _fixed_split(self) -> tuple[int | None, int | None]:
        """(tag in pieces, prefetch) as the settings fix them; None where the executor chooses from costs."""
        rt = self.settings.runtime
        fixed_tag = round(rt.tag_microbatches * self.grain) if rt.tag_microbatches >= 0 else None
        fixed_prefetch = rt.prefetch_microbatches if rt.prefetch_microbatches >= 0 or not self.flags.tcss else None
        if not self.flags.tag:
            fixed_tag = 0
        if not self.flags.tcss or rt.staleness == 0 or self.prefetch_stopped:
            fixed_prefetch = 0
        return fixed_tag, fixed_prefetch

    # Set (`stop_prefetching`) for the last iteration of a mode the run leaves: nothing of the next
    # iteration is rolled out with this mode's weights and groups.
    prefetch_stopped = False

    def stop_prefetching(self) -> None:
        """Prefetch nothing from the next iteration on (it still trains what was carried into it)."""
        self.prefetch_stopped = True

    @property
    def elastic_split(self) -> bool:
        """Whether iterations choose their (tag, prefetch) from measured costs."""
        return None in self._fixed_split()

    def split_for(self, k: int, costs: plan_lib.Costs | None = None) -> tuple[int, int]:
        """(tag in pieces of `grain`, prefetch) of iteration k: fixed by config, or chosen from
        measured costs (`costs`, default `_agreed_costs()`)."""
        fixed_tag, fixed_prefetch = self._fixed_split()
        if fixed_tag is not None and fixed_prefetch is not None:
            return fixed_tag, fixed_prefetch
        costs = costs or self._agreed_costs()
        if costs is None:
            return fixed_tag or 0, fixed_prefetch or 0
        tag, prefetch = plan_lib.choose_split(self.mode, self.microbatches, costs, fixed_tag=fixed_tag,
                                              fixed_prefetch=fixed_prefetch, updates=self.settings.num_updates_per_batch,
                                              grain=self.grain, keep=self.split)
        return min(tag, (self.microbatches - len(self.carried)) * self.grain), prefetch

    def _agreed_costs(self) -> plan_lib.Costs | None:
        """`measured_costs()`, with several processes process 0's on every one: the split and the
        order of the crossing programs derive from them and must be alike everywhere (a
        different plan or order would issue different cross-process programs and hang them
        all), and each process times its own reward scoring. Every process calls it at the
        same point: process 0 publishes them through the key-value store, not by a device
        collective, which would enter the devices' program order between the lanes' programs."""
        costs = self.measured_costs()
        if jax.process_count() == 1 or self.meshes.colocated:
            return costs
        self._agreements += 1
        name = f"costs/{self._agreements}"
        if jax.process_index() == 0:
            values = [np.nan] * 6 if costs is None else [
                costs.rollout["rollout"], costs.rollout["train"], costs.train, costs.update, costs.sync, costs.reward]
            self.shared.publish(name, np.asarray(values, np.float64))
        got = [float(v) for v in self.shared.read(name, np.float64)]  # process 0 too: the same bits everywhere
        if np.isnan(got[0]):
            return None
        roll_r, roll_t, train, update, sync, reward = got
        return plan_lib.Costs(rollout={"rollout": roll_r, "train": roll_t, "shared": roll_r},
                              reward=reward, train=train, update=update, sync=sync)

    def measured_costs(self) -> plan_lib.Costs | None:
        def typical(kind, group):  # the median: robust to a stray slow task (a late compile, a host pause)
            values = self.measured.get((kind, group))
            return float(np.median(values)) if values else None

        if self.meshes.colocated:  # one group: rollout and training share every device
            roll, train = typical("rollout", "shared"), typical("train", "shared")
            if roll is None or train is None:
                return None
            return plan_lib.Costs(rollout={"shared": roll}, reward=typical("reward", "reward") or 0.0, train=train,
                                  update=typical("update", "shared") or 0.0, sync=0.0)
        roll_r, roll_t, train = typical("rollout", "rollout"), typical("rollout", "train"), typical("train", "train")
        if roll_r is None or train is None:
            return None
        if roll_t is None:  # never measured: assume the trainer's speed per device matches rollout's
            roll_t = roll_r * self.meshes.rollout.devices.size / self.meshes.train.devices.size
        return plan_lib.Costs(
            rollout={"rollout": roll_r, "train": roll_t, "shared": roll_r},
            reward=typical("reward", "reward") or 0.0,
            train=train,
            update=typical("update", "train") or 0.0,
            sync=typical("sync", "link") or 0.0,
        )

    # The kinds of `measured_profile`: (task kind, group) of the rolling and training groups.
    PROFILE_KINDS = ("rollout", "trainer_rollout", "train", "update", "reward", "sync")

    def measured_profile(self) -> dict[str, float]:
        """The median seconds of each task kind measured so far, by the names
        `simulator.Calibration.of` takes ('rollout': the rollout role's or the shared group's;
        'trainer_rollout': the train role's own rollouts); a kind never measured is absent. With
        several processes process 0's, on every one (`_agreed_costs` says why): a choice made from
        them must be the same everywhere. Every process calls it at the same point."""
        rolling, training = ("shared", "shared") if self.meshes.colocated else ("rollout", "train")
        keys = dict(zip(self.PROFILE_KINDS, (("rollout", rolling), ("rollout", "train"), ("train", training),
                                             ("update", training), ("reward", "reward"), ("sync", "link"))))
        if self.meshes.colocated:
            del keys["trainer_rollout"], keys["sync"]
        values = {name: float(np.median(self.measured[key])) for name, key in keys.items() if self.measured.get(key)}
        if jax.process_count() == 1:
            return values
        self._agreements += 1
        name = f"profile/{self._agreements}"
        if jax.process_index() == 0:
            self.shared.publish(name, np.asarray([values.get(k, np.nan) for k in self.PROFILE_KINDS], np.float64))
        got = self.shared.read(name, np.float64)  # process 0 too: the same bits everywhere
        return {k: float(v) for k, v in zip(self.PROFILE_KINDS, got) if not np.isnan(v)}
