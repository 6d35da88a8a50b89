r"""`launch/bench.py` with XLA's compiled memory of the transformer programs recorded.

Every argument goes to launch/bench.py. Before the first call of each rollout step, gradient,
update check and update program (per executor: modes compile their own), the program is lowered and compiled
once more for `compiled.memory_analysis()` (argument, output, temporary and aliased bytes per
device), printed as it comes and written to --memory_out, to set against the memory plan
(digen_jax/runtime/memory_plan.py) of the same config:

    python benchmarks/compiled_memory.py --memory_out=/tmp/programs.json --mode=system \
        --config=configs/qwenimage.py --config.rl.lora_rank=0 ...
"""
from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "launch"))

import bench  # noqa: E402  (launch/bench.py: its flags and main)
from absl import flags  # noqa: E402

from digen_jax import cli  # noqa: E402
from digen_jax.rl import rollout, trainer  # noqa: E402

_MEMORY_OUT = flags.DEFINE_string("memory_out", "compiled_memory.json", "Where the programs' memory analyses go.")
FIELDS = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes",
          "generated_code_size_in_bytes", "host_argument_size_in_bytes", "host_output_size_in_bytes",
          "host_temp_size_in_bytes")
RECORDS: list[dict] = []


def recording(name: str, fn):
    """`fn` (a jitted function) that records its compiled memory analysis before its first call."""
    seen = []

    def call(*args, **kwargs):
        if not seen:
            seen.append(True)
            try:
                analysis = fn.lower(*args, **kwargs).compile().memory_analysis()
                record = {"program": name, **{k: getattr(analysis, k, None) for k in FIELDS}}
            except Exception as e:  # noqa: BLE001 -- a failed analysis is a finding, not a stop
                record = {"program": name, "error": repr(e)[:500]}
            RECORDS.append(record)
            print("compiled memory:", json.dumps(record), flush=True)
            with open(_MEMORY_OUT.value, "w") as f:
                json.dump(RECORDS, f, indent=1)
        return fn(*args, **kwargs)

    return call


def install() -> None:
    pin = trainer.Trainer.pin_state_sharding

    def pinned(self, state_sharding):
        pin(self, state_sharding)
        self._grad = recording("gradient", self._grad)
        if hasattr(self._check_update, "lower"):  # pinning again re-jits only the step, not the check
            self._check_update = recording("update_check", self._check_update)
        self._commit_update = recording("update", self._commit_update)

    trainer.Trainer.pin_state_sharding = pinned
    init = rollout.Sampler.__init__

    def sampler_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.step = recording("rollout_step", self.step)

    rollout.Sampler.__init__ = sampler_init


if __name__ == "__main__":
    install()
    cli.run(bench.main)
