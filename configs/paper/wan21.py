"""Paper grid: Wan2.1-T2V-14B, configs/wan21.py (480x832, 33 frames, 20 steps, true CFG, 16 prompts x 4 videos), one update per iteration (configs/paper/_common.py).

    python launch/simulate.py --config=configs/paper/wan21.py --pool=h800:16
"""
from configs import wan21 as base
from configs.paper._common import paper_overrides


def get_config():
    return paper_overrides(base.get_config())
