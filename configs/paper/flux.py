"""Paper grid: FLUX.1-dev (12B), the Flow-GRPO recipe of configs/flux.py (512x512, 6 steps, 48 prompts x 24 images), one update per iteration (configs/paper/_common.py).

    python launch/simulate.py --config=configs/paper/flux.py --pool=h800:16
"""
from configs import flux as base
from configs.paper._common import paper_overrides


def get_config():
    return paper_overrides(base.get_config())
