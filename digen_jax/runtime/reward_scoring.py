"""Scoring a micro-batch's rewards on the host threads, beside the device work.

A micro-batch's rewards are scored as soon as its rollout is dispatched (queue scheduling), on
the executor's reward thread pool. With several processes one process scores them, the one that
holds the decoded samples whole, and shares them through the key-value store (`SharedValues`):
no pixels cross between roles and no device program enters the order the lanes keep.
"""
from __future__ import annotations

import concurrent.futures

import jax
import jax.numpy as jnp
import numpy as np

from digen_jax.runtime import plan as plan_lib
from digen_jax.runtime.microbatch import MicroBatch, piece_args
from digen_jax.runtime.transfer import whole_on_one_process


class RewardScoring:
    """The executor's reward scoring (mixed into `Executor`: it uses the executor's `job`, `pool`,
    `shared`, `tracer` and `reward_names`)."""

    def _rewards(self, mb: MicroBatch, decoded: jax.Array) -> concurrent.futures.Future:
        """The future rewards of `mb` from its `decoded` samples (on the reward threads).

        Several processes: one process scores them, the one that holds the samples whole (the
        lowest of their devices' processes, after a gather inside their role if it spans several),
        and shares them (`SharedValues`); the others read them there. So no pixels cross between
        roles and no device program is added to the order the lanes keep (dispatch.py). The
        scoring's start and end (the tracers' common clock) travel with them, so every process's
        trace holds the reward event (`Tracer.record_elsewhere`).
        """
        if jax.process_count() == 1:
            return self.pool.submit(lambda: self._score(mb, decoded)[0])
        whole, scorer = whole_on_one_process(decoded)
        name = f"rewards/{mb.iteration}/{mb.index}"
        if jax.process_index() != scorer:
            task = self._reward_task(mb)
            self.tracer.expect_elsewhere(task)

            def traced(timed: np.ndarray) -> np.ndarray:  # [start, end, *reward rows] in float64
                self.tracer.record_elsewhere(task, float(timed[0]), float(timed[1]), process=scorer,
                                             sample_ids=mb.sample_ids.tolist())
                # exact: float32 values travelled as float64
                return timed[2:].astype(np.float32).reshape(1 + len(self.reward_names), -1)

            def settle(future: concurrent.futures.Future) -> None:  # no event: done all the same
                if future.cancelled() or future.exception() is not None:
                    self.tracer.record_elsewhere(task)

            future = self.shared.read_later(name, np.float64, then=traced)
            future.add_done_callback(settle)
            return future

        def score_and_share() -> np.ndarray:
            try:
                rewards, start, end = self._score(mb, whole)
            except BaseException as e:
                self.shared.fail(name, e)
                raise
            self.shared.publish(name, np.concatenate([[start, end], rewards.ravel().astype(np.float64)]))
            return rewards

        return self.pool.submit(score_and_share)

    @staticmethod
    def _reward_task(mb: MicroBatch) -> plan_lib.Task:
        return plan_lib.Task("reward", "reward", mb.iteration, mb.index, mb.version, piece=mb.piece)

    def _score(self, mb: MicroBatch, decoded: jax.Array) -> tuple[np.ndarray, float, float]:
        """Reward rows (1 + K, B) float32 of a decoded micro-batch (`MicroBatch.rewards`), and the
        start and end of their scoring."""
        pixels = np.asarray(decoded)  # device-to-host copies only: no device program from this thread
        start = self.tracer.now()
        # Reward models that run on a device (CLIP scorers) use a device that decoded this
        # micro-batch: the reward role's when it has devices (single-device programs, no collectives).
        with jax.default_device(decoded.addressable_shards[0].device):
            total, per_reward = self.job.reward(pixels, jnp.asarray(mb.prompt_ids))
        rewards = np.stack([total] + [per_reward[n] for n in self.reward_names]).astype(np.float32)
        end = self.tracer.now()
        task = self._reward_task(mb)
        self.tracer.record_done(task, start, end, sample_ids=mb.sample_ids.tolist(), **piece_args(task))
        return rewards, start, end
