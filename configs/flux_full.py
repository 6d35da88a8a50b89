r"""FLUX.1-dev (12B) Flow-GRPO full fine-tuning, the peers' recipe (`sections.full_ft_recipe`) over
configs/flux.py. `launch/simulate.py --config=configs/flux_full.py --pool=h200:8` prints its memory plan.
"""
from configs import flux
from configs.sections import full_ft_recipe, variant

# `:tiny` trains the steps per sample the base does.
get_config = variant(flux, full_ft_recipe, trained_steps=3)
