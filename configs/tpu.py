"""A model-zoo config on a Cloud TPU slice: `--config=configs/tpu.py:NAME` or `:NAME/SIZE` runs
configs/NAME.py (of SIZE, e.g. `wan21/81f_480p`, `qwenimage/tiny`) with `sections.tpu_overrides`
(splash attention, every role's weights sharded, jax.distributed from the TPU metadata). README "TPU":

    python launch/train.py --config=configs/tpu.py:qwenimage --workdir=/tmp/qwen-tpu \\
        --config.model.checkpoint=... --config.data.embedding_cache=...
"""
import importlib

import ml_collections

from configs.sections import tpu_overrides


def get_config(spec: str = "qwenimage") -> ml_collections.ConfigDict:
    name, _, size = spec.partition("/")
    try:
        zoo = importlib.import_module(f"configs.{name}")
    except ModuleNotFoundError:
        raise ValueError(f"configs/tpu.py:{spec}: no model-zoo config configs/{name}.py") from None
    return tpu_overrides(zoo.get_config(size) if size else zoo.get_config())
