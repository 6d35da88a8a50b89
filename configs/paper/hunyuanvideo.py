"""Paper grid: HunyuanVideo (13B), configs/hunyuanvideo.py (480x848, 33 frames, 16 steps) with 16
prompts x 8 videos per iteration instead of 4 x 24, so an iteration can be cut into micro-batches
of whole groups (the same 128 videos' worth of work order of magnitude, more pipeline depth).

    python launch/simulate.py --config=configs/paper/hunyuanvideo.py --pool=h800:16
"""
from configs import hunyuanvideo as base
from configs.paper._common import paper_overrides


def get_config():
    c = base.get_config()
    c.rl.prompts_per_iteration, c.rl.group_size = 16, 8
    return paper_overrides(c)
