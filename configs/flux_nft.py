r"""FLUX.1-dev (12B) DiffusionNFT (docs/algorithms.md section A12): `sections.nft_recipe` over
configs/flux.py (model, LoRA 64/128, reward, 24 images per prompt x 48 prompts): DPM2 ODE rollouts
over 10 steps, embedded guidance 3.5 but no true CFG, 9 of the 10 noise levels trained per sample.
"""
from configs import flux
from configs.sections import nft_recipe, variant

# `:tiny` trains int(4 * 0.99) = 3 of its 4 steps per sample.
get_config = variant(flux, nft_recipe, trained_steps=3)
