"""Paper grid: Qwen-Image (20B), the veRL-Omni reference setting of configs/qwenimage.py (512x512, 10 steps, true CFG, 32 prompts x 16 images), one update per iteration (configs/paper/_common.py).

    python launch/simulate.py --config=configs/paper/qwenimage.py --pool=h800:16
"""
from configs import qwenimage as base
from configs.paper._common import paper_overrides


def get_config():
    return paper_overrides(base.get_config())
