r"""Qwen-Image (20B) Flow-GRPO full fine-tuning with the peers' recipe (`sections.full_ft_recipe`):
configs/qwenimage.py's model, step selection, reward and batch; every weight trained and sharded over
the train devices (FSDP), no CFG, 512x512, 10 steps, lr 3e-5, clip range 1e-5, float32 Adam
moments. `launch/simulate.py --config=configs/qwenimage_full.py --pool=h200:8` prints the memory plan
and the speed of every mode; runs refuse a pool the plan does not fit.

Throughput run without weights: --config.model.random_init=True --config.data.random_embeddings=True.
CPU smoke run of the tiny variant: --config=configs/qwenimage_full.py:tiny
"""
import ml_collections

from configs import qwenimage
from configs.sections import full_ft_recipe, tiny_overrides


def get_config(size: str = "full") -> ml_collections.ConfigDict:
    c = full_ft_recipe(qwenimage.get_config())
    return tiny_overrides(c, video=False, trained_steps=2) if size == "tiny" else c
