r"""Stable Diffusion 3.5 Medium DiffusionNFT, the reference recipe (NVlabs/DiffusionNFT config/nft.py
`sd3_geneval` / `sd3_pickscore`, scripts/train_nft_sd3.py): `sections.nft_recipe` over
configs/sd35.py. The reference's OCR run: --config.rl.nft_beta=0.1 --config.rl.nft_decay=ramp_delayed.
"""
from configs import sd35
from configs.sections import nft_recipe, variant

# `:tiny` trains int(4 * 0.99) = 3 of its 4 steps per sample.
get_config = variant(sd35, nft_recipe, trained_steps=3)
