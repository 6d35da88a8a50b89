r"""Qwen-Image (20B) DiffusionNFT (docs/algorithms.md section A12): `sections.nft_recipe` over
configs/qwenimage.py (model, LoRA 64/128, 512x512, reward, 16 images per prompt x 32 prompts);
the GRPO config's true CFG 4 is off.
"""
from configs import qwenimage
from configs.sections import nft_recipe, variant

# `:tiny` trains int(4 * 0.99) = 3 of its 4 steps per sample.
get_config = variant(qwenimage, nft_recipe, trained_steps=3)
