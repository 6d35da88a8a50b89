r"""Stable Diffusion 3.5 Medium DiffusionNFT, the reference recipe (NVlabs/DiffusionNFT
config/nft.py `sd3_geneval` / `sd3_pickscore` over config/base.py, scripts/train_nft_sd3.py):
configs/sd35.py's model, 512x512, LoRA 32/64 on the joint attention, reward and batch (24 images
per prompt x 48 prompts) with the NFT settings of `sections.nft_recipe`: ODE rollouts of the old
policy with DPM2 over 10 steps and no CFG, 9 of the 10 noise levels trained per sample, beta 1,
the 'ramp' old-policy decay (decay_type 1), KL-to-base weight 1e-4, advantage clip 5, one
update per batch, lr 3e-4, an evaluation EMA of decay 0.9 updated every step. (The reference's
OCR run uses beta 0.1 and the delayed ramp: --config.rl.nft_beta=0.1 --config.rl.nft_decay=ramp_delayed.)

    python launch/train.py --config=configs/sd35_nft.py --workdir=/tmp/sd35_nft \
        --config.model.checkpoint=/ckpt/sd35m-jax --config.model.vae_checkpoint=/ckpt/sd35m-vae-jax \
        --config.data.embedding_cache=/data/sd35-prompts

Throughput run without weights: --config.model.random_init=True --config.data.random_embeddings=True.
CPU smoke run of the tiny variant: --config=configs/sd35_nft.py:tiny
"""
import ml_collections

from configs import sd35
from configs.sections import nft_recipe, tiny_overrides


def get_config(size: str = "full") -> ml_collections.ConfigDict:
    c = nft_recipe(sd35.get_config())
    c.rl.micro_batch_size = 24  # units (sample, noise level) per gradient micro-batch: divides 1152 x 9
    # The tiny size's 4 steps: int(4 * 0.99) = 3 levels per sample
    return tiny_overrides(c, video=False, trained_steps=3) if size == "tiny" else c
