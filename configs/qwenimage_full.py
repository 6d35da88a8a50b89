r"""Qwen-Image (20B) Flow-GRPO full fine-tuning, the peers' recipe (`sections.full_ft_recipe`) over
configs/qwenimage.py. `launch/simulate.py --config=configs/qwenimage_full.py --pool=h200:8` prints its memory plan.
"""
from configs import qwenimage
from configs.sections import full_ft_recipe, variant

# `:tiny` trains the steps per sample the base does.
get_config = variant(qwenimage, full_ft_recipe, trained_steps=2)
