r"""Qwen-Image (20B) DiffusionNFT (docs/algorithms.md section A12): configs/qwenimage.py's model,
LoRA (64/128 on attention and MLP), 512x512, 10 steps, reward and batch (16 images per prompt x
32 prompts) with the reference's NFT settings (NVlabs/DiffusionNFT config/nft.py;
`sections.nft_recipe`): ODE rollouts of the old policy with DPM2 and no CFG (the GRPO config's
true CFG 4 is off), 9 of the 10 noise levels trained per sample, beta 1, the 'ramp' old-policy
decay, KL-to-base weight 1e-4, one update per batch, lr 3e-4, an evaluation EMA of decay 0.9.

    python launch/train.py --config=configs/qwenimage_nft.py --workdir=/tmp/qwen_nft \
        --config.model.checkpoint=/ckpt/qwen-image-jax --config.model.vae_checkpoint=/ckpt/qwen-image-vae-jax \
        --config.data.embedding_cache=/data/qwen-prompts

Throughput run without weights: --config.model.random_init=True --config.data.random_embeddings=True.
CPU smoke run of the tiny variant: --config=configs/qwenimage_nft.py:tiny
"""
import ml_collections

from configs import qwenimage
from configs.sections import nft_recipe, tiny_overrides


def get_config(size: str = "full") -> ml_collections.ConfigDict:
    c = nft_recipe(qwenimage.get_config())
    c.rl.micro_batch_size = 16  # units (sample, noise level) per gradient micro-batch: divides 512 x 9
    # The tiny size's 4 steps: int(4 * 0.99) = 3 levels per sample
    return tiny_overrides(c, video=False, trained_steps=3) if size == "tiny" else c
