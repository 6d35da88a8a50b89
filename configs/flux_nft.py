r"""FLUX.1-dev (12B) DiffusionNFT (docs/algorithms.md section A12): configs/flux.py's model, LoRA
(64/128 on attention and MLP), reward and batch (24 images per prompt x 48 prompts) with the
reference's NFT settings (NVlabs/DiffusionNFT config/nft.py; `sections.nft_recipe`): ODE
rollouts of the old policy with DPM2 over 10 steps, embedded guidance 3.5 but no true CFG, 9 of
the 10 noise levels trained per sample, beta 1, the 'ramp' old-policy decay, KL-to-base weight
1e-4, one update per batch, lr 3e-4, an evaluation EMA of decay 0.9.

    python launch/train.py --config=configs/flux_nft.py --workdir=/tmp/flux_nft \
        --config.model.checkpoint=/ckpt/flux-dev-jax --config.model.vae_checkpoint=/ckpt/flux-vae-jax \
        --config.data.embedding_cache=/data/flux-prompts

Throughput run without weights: --config.model.random_init=True --config.data.random_embeddings=True.
CPU smoke run of the tiny variant: --config=configs/flux_nft.py:tiny
"""
import ml_collections

from configs import flux
from configs.sections import nft_recipe, tiny_overrides


def get_config(size: str = "full") -> ml_collections.ConfigDict:
    c = nft_recipe(flux.get_config())
    c.sampling.num_steps = 10  # the reference's NFT rollouts (SD3.5-M) take 10 DPM2 steps
    # configs/flux.py's 24 units (sample, noise level) per gradient micro-batch divide 1152 x 9
    # The tiny size's 4 steps: int(4 * 0.99) = 3 levels per sample
    return tiny_overrides(c, video=False, trained_steps=3) if size == "tiny" else c
