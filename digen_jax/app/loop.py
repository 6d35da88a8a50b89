"""The training run: a `Run` (workload, trainer, state, checkpoints) and `train`, its loop.

`train(config, workdir)` runs the loop of `launch/train.py` for any workload
(`digen_jax.app.workload`): the shapes task of configs/tiny.py or a model-zoo family, with
Flow-GRPO or DiffusionNFT (`rl.algorithm`), in any schedule mode (`runtime.mode`: each iteration
goes through the runtime executor, which places rollout, reward and training on the device
roles). Every iteration k is a pure
function of (seed, k, state): prompts, noises and step selection derive from
`fold_in(seed, k)`, so a run resumed from a checkpoint replays exactly what an
uninterrupted run would have done.

Outputs in `workdir`: `metrics.jsonl` (one JSON object per iteration), TensorBoard
scalars and image grids under `tb/`, orbax checkpoints under `checkpoints/`.
"""
from __future__ import annotations

import copy
import gc
import json
import math
import os
import sys
from typing import Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from digen_jax.grid import image_grid
from digen_jax.rl import lora, optim
from digen_jax.app import workload as workload_lib
from digen_jax.rl.rollout import Conditioning
from digen_jax.rl.grpo_trainer import GrpoTrainer
from digen_jax.rl.nft_trainer import NftConfig, NftTrainer
from digen_jax.rl.trainer import LAG0_FIGURES, LossConfig, TrainState
from digen_jax.app import machine_checks, precision, run_checkpoints, run_sizing, warm_start
from digen_jax.app import settings as settings_lib
from digen_jax.app import workdir as workdir_lib
from digen_jax.app.errors import ConfigError, RunStopped
from digen_jax.app.validation import validate_config
from digen_jax.runtime import mesh as mesh_lib
from digen_jax.runtime.executor import Executor
from digen_jax.runtime.figures import read_figures


class Run:
    """Everything built once per run: workload (task, model, sampler, reward), trainer, writers.

    It is the `Job` the runtime's executor runs (`runtime.executor.Job`)."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: str, log: Callable[[str], None] = print,
                 validated: bool = False):
        """`validated`: `validate_config` passed `config` already (`train`, the system bench's
        `validate_bench_arguments`); else it runs here."""
        if not validated:
            validate_config(config)
        self.settings = settings_lib.run_settings(config)  # what the executor reads of the config
        self.colocated_sampling = run_sizing.colocated_sampling(config, jax.devices())  # 'auto' on these devices
        self.tag_precision = run_sizing.tag_precision(config, jax.devices())  # 'auto' on these devices
        self.config, self.workdir, self.log = config, workdir, log
        os.makedirs(workdir, exist_ok=True)
        rl = config.rl
        self.workload = workload_lib.make_workload(config, log)
        self.task = self.workload.task
        self.sampler = self.workload.sampler
        self.latent_shape = self.workload.latent_shape
        base = self.workload.base_params
        optimizer = optim.make_optimizer(
            rl.learning_rate, weight_decay=rl.weight_decay, max_grad_norm=rl.max_grad_norm,
            state_dtype=rl.get("optimizer_state_dtype", "param"),
        )
        if rl.lora_rank:
            trainable = lora.init_lora(base, rank=rl.lora_rank, target_patterns=list(rl.lora_targets), key=jax.random.key(config.seed + 1))
            frozen, scale = base, lora.lora_scale(rl.lora_rank, settings_lib.lora_alpha(config))
        else:
            trainable, frozen, scale = base, (base if rl.kl_beta > 0 else None), None
            if frozen is not None:
                trainable = jax.tree.map(jnp.copy, base)
        decoupled, is_cap = precision.decoupled_loss(config)
        loss_cfg = LossConfig(
            clip_range=rl.clip_range,
            adv_clip=rl.adv_clip,
            policy_loss=rl.policy_loss,
            kl_beta=rl.kl_beta,
            decoupled=decoupled,
            is_cap=is_cap,
            onpolicy_anchor=rl.onpolicy_anchor,
            lora_scale=scale,
            ema_decay=rl.ema_decay,
            ema_every=rl.ema_every,
            use_ema=rl.ema,
            max_update_ratio=rl.max_update_ratio,
            rollout_precision=precision.rollout_precision(config),
            lora_base_precision=precision.lora_base_precision(config),
        )
        if rl.algorithm == "nft":
            self.trainer = NftTrainer(self.sampler, frozen, optimizer, loss_cfg,
                                      NftConfig(rl.nft_solver, rl.nft_beta, rl.nft_decay))
        else:
            self.trainer = GrpoTrainer(self.sampler, frozen, optimizer, loss_cfg)
        self.state = self.initial_state(trainable)
        # Every process saves and restores at the same points; with several, the train role's
        # processes write their own shards (run_checkpoints.save) into a directory every process reads.
        self.checkpoints = run_checkpoints.open_manager(workdir, config)
        self._root_key = jax.random.key(config.seed)
        self.eval_ids, self.eval_cond = self.workload.eval_batch(config.train.eval_prompts)
        self.eval_keys = jax.random.split(jax.random.key(config.seed + 8), config.train.eval_prompts)
        self._writer = None

    def initial_state(self, trainable):
        """The train state `trainable` starts from, in host memory (the CPU backend); the executor
        places it on its train devices' shardings and holds the live one. Built on one
        accelerator, full fine-tuning's weights and Adam moments (Qwen-Image-20B: 82 GB in bf16)
        would not fit it, and the copy kept there for other modes and resumes would crowd the
        sharded run. With an accelerator only the weights are copied to host memory: the rest
        (`Trainer.unbuilt_state`) is made where the executor places it, so the host never holds
        the moments beside their offloaded buffers."""
        host = mesh_lib.host_device()
        if host.platform == jax.devices()[0].platform:  # no accelerator: the host is where it is built
            return self.trainer.init_state(trainable)
        return self.trainer.unbuilt_state(jax.device_put(trainable, host))

    @property
    def writer(self):
        if self._writer is None:
            self._writer = summary_writer(os.path.join(self.workdir, "tb"))
        return self._writer

    # ---------------------------------------------------------------- what the executor runs
    @property
    def abstract_params(self):
        """The transformer's boxed abstract parameters (their logical axes name the shardings)."""
        return self.workload.family.abstract_params(self.workload.model_cfg)

    @property
    def decoder_params(self):
        return self.workload.decoder_params

    def release_base_params(self) -> None:
        """Forget the workload's copy of the base weights (the trainer holds the placed one)."""
        self.workload.base_params = None

    def prompt_batch(self, k: int) -> tuple[jax.Array, Conditioning]:
        """Iteration k's prompt ids (P,) and their conditioning (one row per prompt, not per sample)."""
        return self.workload.prompt_batch(k)

    def sample_key(self, k: int) -> jax.Array:
        """The key iteration k's sample noises derive from."""
        return jax.random.fold_in(jax.random.fold_in(self._root_key, k), workload_lib.SAMPLES)

    def decode(self, latents: jax.Array, decoder_params=None) -> jax.Array:
        return self.workload.decode(latents, decoder_params)

    def reward(self, decoded: np.ndarray, prompt_ids: jax.Array) -> tuple[np.ndarray, dict]:
        return self.workload.reward(decoded, prompt_ids)

    def images(self, latents: jax.Array) -> np.ndarray:
        """(B, H, W, 3) float32 in [0, 1] previews of final latents (a video's middle frame)."""
        return self.workload.images(latents)

    def score(self, latents: jax.Array, ids: jax.Array) -> tuple[np.ndarray, dict]:
        """Rewards (B,) of final latents (decoded first) and the per-reward arrays, for sample prompt ids."""
        return self.workload.score(latents, ids)

    def evaluate(self, state: TrainState, executor: Executor | None = None) -> float:
        """Mean reward of deterministic (ODE) samples of the fixed eval prompts (EMA weights if kept).

        With an executor the samples roll out where its micro-batches do (`Executor.sample`: the
        rollout role, whatever process owns it) and every process scores its own copy of the
        pixels, so all return the same value. Without one: where the state lives (one process).
        """
        weights = state.ema if state.ema is not None else state.trainable
        zeros = np.zeros((self.sampler.num_steps,), np.float32)
        if executor is not None:
            pixels = executor.sample(weights, self.eval_cond, self.eval_keys, zeros, state.version)
        elif jax.process_count() > 1:
            raise ValueError(
                "Run.evaluate needs the executor in a multi-process run (the state lives on some processes only)"
            )
        else:
            params = self.trainer.params_for(weights)
            traj = self.sampler.rollout(params, self.eval_cond, self.eval_keys, zeros, self.latent_shape, state.version)
            pixels = self.decode(traj.final)
        rewards, _ = self.reward(np.asarray(pixels), self.eval_ids)
        return float(np.mean(rewards))


class AutoMode:
    """`runtime.mode='auto'` during a run: once its first iterations measured every task kind, every
    mode is re-ranked from those costs (`run_sizing.rerank`) and the run switches, once, to one
    predicted faster by more than `runtime.auto_switch_margin`, on the same `Run` (models,
    trainer and reward are not rebuilt). The re-rank happens at the first iteration boundary
    where the chosen mode's rollout, training, update and reward (and sync) costs were measured
    and its split has settled (the next iteration would keep the last one's), or at iteration
    `runtime.auto_rerank_after` at the latest; then the choice is final (no flapping).

    A mode that prefetched part of the next iteration (TCSS) gets one more iteration, planned
    without prefetching, which trains what it carried (stale as recorded); the switch comes at
    the boundary after it. Checkpoints record the choice (`record`): a resumed run goes on in the
    chosen mode without measuring again.
    """

    def __init__(self, config: ml_collections.ConfigDict, pool: str, recorded: dict | None, log: Callable[[str], None]):
        """`pool`: where the mode was chosen (`train`'s `auto`); `recorded`: what the checkpoint the
        run resumes from records (`run_checkpoints.auto_record`), applied to `config` here."""
        self.config, self.pool, self.log = config, pool, log
        self.after = int(config.runtime.auto_rerank_after)
        self.margin = float(config.runtime.auto_switch_margin)
        self.decided = self.after == 0
        self.target: dict | None = None  # the runtime keys to switch to at the next possible boundary
        if recorded is not None:
            runtime = dict(recorded["runtime"])
            if runtime != run_sizing.auto_runtime(config):
                run_sizing.apply_runtime(config, runtime)
                try:
                    validate_config(config)
                except ConfigError as e:
                    raise RunStopped(f"the checkpoint records runtime.mode='auto' running {runtime}, which this run "
                                     f"refuses: {e}; resume on the devices it ran on, or start a new --workdir") from e
            self.decided = self.decided or bool(recorded["decided"])
            state = "chosen from measured costs" if self.decided else "chosen before the run; re-ranked later"
            log(f"runtime.mode='auto' resumes in {config.runtime.mode} ({config.runtime.micro_batches} micro-batches, "
                f"{state}), as the checkpoint records")

    def record(self) -> dict:
        """What a checkpoint records (`run_checkpoints.auto_record`): the runtime keys the run goes on
        with (a switch decided and not made yet included) and whether they are final."""
        return {"decided": self.decided, "runtime": self.target or run_sizing.auto_runtime(self.config)}

    def _due(self, k: int, executor: Executor, measured: dict) -> bool:
        if k >= self.after > 0:
            return True
        kinds = ["rollout", "train", "update", "reward"] + ([] if executor.meshes.colocated else ["sync"])
        if any(kind not in measured for kind in kinds):
            return False
        return not executor.elastic_split or (executor.split is not None and executor.split_for(k) == executor.split)

    def rerank_if_due(self, k: int, executor: Executor) -> None:
        """At the boundary before iteration `k`: re-rank from `executor`'s measured costs when it is
        time (the class docstring says when), log one line, and decide."""
        if self.decided:
            return
        measured = executor.measured_profile()  # every process: process 0's values
        if not self._due(k, executor, measured):
            return
        self.decided = True
        try:
            r = run_sizing.rerank_config(self.config, self.pool, jax.devices(), measured, self.margin)
        except ValueError as e:
            self.log(f"runtime.mode='auto' keeps {self.config.runtime.mode}: the measured re-rank fails here ({e})")
            return
        self.log(run_sizing.rerank_line(r, f"after {k} measured iterations"))
        if not r.switch:
            return
        candidate = copy.deepcopy(self.config)
        run_sizing.apply_sizing(candidate, r.choice)
        try:
            validate_config(candidate)
            if jax.process_count() > 1 and run_checkpoints.writers(candidate) != run_checkpoints.writers(self.config):
                raise ConfigError("its train role is on other processes, which the run's checkpoints are not "
                                  "written by")
        except ConfigError as e:
            self.log(f"runtime.mode='auto' keeps {self.config.runtime.mode}: {r.choice.prediction.mode} is refused ({e})")
            return
        self.target = run_sizing.auto_runtime(candidate)
        if executor.carried:
            executor.stop_prefetching()
            self.log(f"runtime.mode='auto': iteration {k} trains the micro-batches {executor.mode} prefetched, "
                     "prefetching none; the switch follows it")

    def switch_ready(self, executor: Executor) -> bool:
        """Whether a switch is decided and `executor` carries nothing into the next iteration."""
        return self.target is not None and not executor.carried

    def switch(self, run: Run, executor: Executor) -> Executor:
        """The executor of the chosen mode over `run`, holding `executor`'s train state (which is closed)."""
        executor.drain()
        run_sizing.apply_runtime(self.config, self.target)
        self.target = None
        run.settings = settings_lib.run_settings(self.config)
        run.colocated_sampling = run_sizing.colocated_sampling(self.config, jax.devices())
        run.tag_precision = run_sizing.tag_precision(self.config, jax.devices())
        executor.close()
        # Its weight copies (the rollout role's, a gathered sampling copy) go before the new roles'
        # are placed: a large model's would not fit beside them. The train state stays until the
        # new executor has placed its copy.
        executor.weights = None
        gc.collect()
        initial, run.state = run.state, executor.state
        try:
            switched = Executor(run, log=self.log, after=executor)
        finally:
            run.state = initial
        executor.state = None
        gc.collect()
        rt = self.config.runtime
        self.log(f"runtime.mode='auto' switched from {executor.mode} to {rt.mode} ({rt.micro_batches} micro-batches"
                 + ("" if switched.meshes.colocated else f", {rt.rollout_devices}+{rt.train_devices} devices") + ")")
        return switched


_LAG0_KEYS = {f"{name}_{stat}" for name in LAG0_FIGURES for stat in ("mean", "max")}


def summary_writer(logdir: str):
    """A tensorboardX SummaryWriter. tensorboardX imports torch wherever it is installed (seconds
    of start-up, and torch is no runtime dependency) only to accept torch tensors, which this loop
    never logs: unless torch is loaded already, it is imported with `import torch` failing."""
    hide_torch = "torch" not in sys.modules
    if hide_torch:
        sys.modules["torch"] = None  # the import system's "not importable" marker
    try:
        from tensorboardX import SummaryWriter
    finally:
        if hide_torch:
            del sys.modules["torch"]
    return SummaryWriter(logdir)


def _host(metrics: dict) -> dict:
    out = {}
    for k, v in read_figures(metrics).items():
        if isinstance(v, (str, dict)):
            out[k] = v
            continue
        v = np.asarray(v)
        out[k] = v.item() if v.ndim == 0 else v.tolist()
        if k in _LAG0_KEYS and not math.isfinite(out[k]):
            out[k] = None  # no unit of the iteration was at version lag 0
    return out


def _keep_rows_through(path: str, step: int, log: Callable[[str], None]) -> None:
    """Keep the metrics rows through `step`. Those past it (written by a run killed after its last
    checkpoint; this run trains those iterations again) and those that are no metrics row (a
    write cut short by a kill or a full disk, an edited line) move to metrics.dropped.jsonl."""
    kept, dropped, bad = [], [], 0
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            line = line if line.endswith("\n") else line + "\n"
            try:
                past = json.loads(line)["step"] > step
            except (ValueError, TypeError, KeyError):
                bad += 1
                dropped.append(line)
                continue
            (dropped if past else kept).append(line)
    if not dropped:
        return
    aside = os.path.join(os.path.dirname(path), "metrics.dropped.jsonl")
    with open(aside, "a") as f:
        f.writelines(dropped)
    if bad:
        log(f"{path}: moved {bad} row(s) that are no metrics row (a write cut short, or an edited line) to {aside}")
    with open(f"{path}.tmp", "w") as f:  # replaced whole: a failed rewrite leaves the rows as they were
        f.writelines(kept)
    os.replace(f"{path}.tmp", path)


def _skip_reason(m: dict, rl) -> str:
    """Why an iteration's update was skipped, from its metrics (`Trainer.apply_update`'s checks)."""
    ratio = m["update_ratio"]
    if math.isfinite(ratio) and ratio > rl.max_update_ratio:
        return f"an update {ratio:.3g} times the parameters' norm (over rl.max_update_ratio={rl.max_update_ratio})"
    return "a non-finite reward, loss, gradient or update"


def train(config: ml_collections.ConfigDict, workdir: str, log: Callable[[str], None] = print, *,
          validated: bool = False, auto: str | None = None) -> TrainState:
    """Run (or resume) the training loop of `config` in `workdir`; returns the final state.

    Every iteration goes through the runtime executor in `config.runtime.mode` (colocated by
    default); its figures (samples/s, bubbles, staleness, sync time) are read one iteration late.
    Expected faults (a workdir in use, a checkpoint of another config or unreadable, a full disk,
    a failed save) raise `RunStopped` with a message. `runtime.mode='auto'` is resolved first, on
    this run's devices (`run_sizing.choose_mode`), and the choice logged; after the first
    iterations every mode is re-ranked once from their measured task costs and the run may switch
    (`AutoMode`). `validated`: the caller resolved the mode and ran `validate_config` on `config`
    already (launch/train.py). `auto`: the pool `runtime.mode='auto'` was chosen on where the
    caller resolved it ('local': this run's devices, or a `--autosize` pool spec); None unless
    `config` says 'auto' (then 'local').
    """
    if config.runtime.mode == run_sizing.AUTO_MODE:
        auto = auto or "local"
        if validated:
            raise ValueError("runtime.mode='auto' must be resolved (run_sizing.choose_mode) before validation")
    if not validated:
        if config.runtime.mode == run_sizing.AUTO_MODE:
            log(run_sizing.choose_mode(config, auto, jax.devices()))
        validate_config(config)
    # Several processes share the workdir; process 0 writes the metrics, trace and TensorBoard files.
    writes_files = jax.process_index() == 0
    lock = workdir_lib.WorkdirLock(workdir) if writes_files else None
    if lock is not None and lock.unsupported:
        log(lock.unsupported)
    try:
        return _train(config, workdir, log, writes_files, auto)
    except Exception as e:
        if not isinstance(e, RunStopped) and workdir_lib.disk_error(e):
            raise RunStopped(workdir_lib.disk_message(e, workdir, "writing the run's outputs")) from e
        raise
    finally:
        if lock is not None:
            lock.release()


def _finish_save(run: Run, step: int | None, log: Callable[[str], None] | None = None) -> None:
    """Wait for the save of checkpoint `step` (None: nothing pending) and turn its failure into
    RunStopped (logged instead when `log` is given: another error is on its way out)."""
    if step is None:
        return
    try:
        run.checkpoints.wait_until_finished()
    except Exception as e:  # noqa: BLE001 (every failure of an asynchronous save ends up here)
        what = f"saving checkpoint {step}"
        message = (workdir_lib.disk_message(e, run.workdir, what) if workdir_lib.disk_error(e) else
                   f"{what} failed: {workdir_lib.short_reason(e)}; the run stopped (rerun to resume from the last "
                   "good checkpoint)")
        if log is None:
            raise RunStopped(message) from e
        log(message)


def _train(config: ml_collections.ConfigDict, workdir: str, log: Callable[[str], None], writes_files: bool,
           auto_pool: str | None) -> TrainState:
    if config.train.start_over:
        workdir_lib.start_over(workdir, log)
    inspection = run_checkpoints.open_manager(workdir, config)
    # before any compute
    candidates = run_checkpoints.resume_candidates(inspection, config, log, auto=auto_pool is not None)
    recorded = None
    if auto_pool is not None and candidates:
        recorded = run_checkpoints.auto_record(run_checkpoints.read_meta(inspection, candidates[0]))
    inspection.close()
    auto = None if auto_pool is None else AutoMode(config, auto_pool, recorded, log)
    if not candidates:  # a run's outputs are never removed: starting at 0 over them is refused
        workdir_lib.refuse_history(workdir)
    init_from = None
    if config.train.init_from and candidates:
        log(f"train.init_from={config.train.init_from!r} ignored: resuming this workdir's own checkpoints")
    elif config.train.init_from:
        init_from = machine_checks.check_init_from(config)
    run = Run(config, workdir, log, validated=True)
    metrics_path = os.path.join(workdir, "metrics.jsonl")
    if init_from is not None:
        run.state = run.initial_state(warm_start.load_init_from(*init_from, run.state.trainable, config, log))
    executor = Executor(run, log=log)
    # The executor holds the live state on its train devices; a training run never reads the
    # initial copy in host memory again (full fine-tuning's weights and Adam moments: 72 GB for
    # FLUX.1-dev with bf16 moments, beside the pinned buffers of offloaded ones).
    run.state = None
    start, changed = run_checkpoints.restore_first_readable(executor, run.checkpoints, candidates, config, log,
                                                            auto=recorded)
    total = config.train.iterations
    if start > total:
        executor.close()
        raise RunStopped(
            f"train.iterations={total} is below the iteration this run resumes from (checkpoint {start} in "
            f"{workdir}): give train.iterations={start} or more to go on with it, or another --workdir for a new run.")
    if writes_files and start and os.path.exists(metrics_path):
        _keep_rows_through(metrics_path, start, log)
    log(f"training {total - start} iterations of {config.rl.prompts_per_iteration * config.rl.group_size} samples "
        f"(from iteration {start}) in {workdir}, runtime.mode={config.runtime.mode}, "
        f"{config.rl.num_updates_per_batch} update(s) per iteration (the policy version counts updates)")
    if start < total:  # XLA compiles each program at its first call: the first lines come after it
        log("compiling the rollout, reward and training programs (the first iteration's line follows them)")

    def emit(k: int, plan, metrics: dict) -> None:
        m = _host(metrics)
        m.update(executor.timing(k, plan))
        if k == start and changed:
            m["config_changes"] = changed  # the noted keys this resume changed: {key: [old, new]}
        if writes_files:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(m) + "\n")
            for name, value in m.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    run.writer.add_scalar(name, value, m["step"])
            for group, value in m["bubble_frac"].items():
                run.writer.add_scalar(f"bubble_frac/{group}", value, m["step"])
        extra = f" eval {m['eval_reward_mean']:.3f}" if "eval_reward_mean" in m else ""
        if "clip_frac" in m:  # GRPO
            figures = f"kl {m['kl']:.2e} clip_frac {m['clip_frac']:.4f} approx_kl {m['approx_kl']:.2e}"
        else:  # DiffusionNFT
            figures = f"rho {m['nft_rho_mean']:.3f} old_dev {m['nft_old_deviation']:.2e} ref {m['nft_ref_penalty']:.2e}"
        log(
            f"[{m['step']:4d}/{total}] reward {m['reward_mean']:.3f} ± {m['reward_std']:.3f}{extra} "
            f"loss {m['loss']:+.3e} {figures} {m['samples_per_s']:.1f} samples/s"
        )
        if m["skipped"]:
            log(f"  update {m['step']} skipped ({m['nonfinite_streak']} in a row): {_skip_reason(m, config.rl)}")
        if m["nonfinite_streak"] >= config.rl.max_nonfinite_in_row:
            raise FloatingPointError(
                f"{m['nonfinite_streak']} updates in a row were skipped (rl.max_nonfinite_in_row="
                f"{config.rl.max_nonfinite_in_row}), the last for {_skip_reason(m, config.rl)}; stopping. "
                "The run diverges: lower rl.learning_rate or check the rewards"
            )

    pending, saving = None, None  # saving: the checkpoint being written in the background

    def settle(report: Callable[[str], None] | None = None) -> None:
        nonlocal saving
        step, saving = saving, None
        _finish_save(run, step, report)

    try:
        for k in range(start, total):
            if saving is not None and not run.checkpoints.is_saving_in_progress():
                settle()  # a failed save stops the run here, not at the next save
            if auto is not None:
                auto.rerank_if_due(k, executor)
                if auto.switch_ready(executor):
                    if pending is not None:
                        emit(*pending)  # its figures are the old executor's
                        pending = None
                    executor = auto.switch(run, executor)
            plan, metrics = executor.iteration(k)
            if config.train.eval_every and (k + 1) % config.train.eval_every == 0:
                executor.drain()  # evaluation's programs must not interleave with a group's prefetch
                if (k + 1) // config.train.eval_every == start // config.train.eval_every + 1:  # first since start
                    log(f"evaluating {config.train.eval_prompts} fixed prompts (compiling the evaluation sampler first)")
                metrics["eval_reward_mean"] = run.evaluate(executor.state, executor)
            if config.train.image_every and (k + 1) % config.train.image_every == 0:
                finals = executor.last_finals()[:: config.rl.group_size][:16]
                if writes_files:
                    prompts = run.task.prompt_text(executor.last_prompt_ids()[:: config.rl.group_size][:16])
                    grid = np.asarray(image_grid(run.images(finals), prompts))
                    run.writer.add_image("samples", grid, k + 1, dataformats="HWC")
            if pending is not None:
                emit(*pending)  # the previous iteration's metrics: reading them does not stall this one
            pending = (k, plan, metrics)
            if config.train.checkpoint_every and (k + 1) % config.train.checkpoint_every == 0:
                emit(*pending)  # a checkpoint never runs ahead of metrics.jsonl
                pending = None
                settle()
                run_checkpoints.save(executor, run.checkpoints, k + 1, config, auto=auto.record() if auto else None)
                saving = k + 1
        if pending is not None:
            executor.drain()  # the last iteration's prefetched rollouts belong to its timing
            emit(*pending)
        if total > start and (not config.train.checkpoint_every or total % config.train.checkpoint_every):
            settle()
            run_checkpoints.save(executor, run.checkpoints, total, config, auto=auto.record() if auto else None)
            saving = total
        settle()
    finally:
        # Commit the saves already started even when an iteration fails (a reward server that
        # died, say): an exception leaving the process would discard the last good checkpoint.
        settle(report=log)
        executor.close()
    if writes_files:
        run.writer.flush()
    return executor.state
