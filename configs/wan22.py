r"""Wan2.2 Flow-GRPO: the Wan2.1 recipe (configs/wan21.py: 480x832, 33 frames, 20 sampling steps,
the Wan SDE step on every step and steps 0-18 trained, 4 videos per prompt, two updates per batch,
KL 0.004, clip range 1e-3, lr 1e-4, LoRA 32/64 on attention and MLP, per-group std) on the two
Wan2.2 text-to-video models, each at its released flow shift and guidance:

* `:ti2v_5b` (default): Wan2.2-TI2V-5B, one 5.0 B transformer on the Wan2.2 VAE (48 latent
  channels, 16x spatial compression, so sides are multiples of 32), flow shift 5, CFG 5.
  Text-to-video by default; `data.first_frames` (a text file with one image path per line of
  the prompt file) starts each prompt's videos from its image, as the released TI2V pipeline
  does: the image's latent stays clean as frame 0 and its tokens take timestep 0
  (docs/models.md section 9; the encoder converts with --family=vae_wan_encoder and is passed as
  model.vae_encoder_checkpoint).
* `:t2v_a14b`: Wan2.2-T2V-A14B, two 14.3 B experts of the Wan2.1-14B architecture on the Wan2.1
  VAE; steps with timestep >= 875 (boundary_ratio 0.875) run the high-noise expert, the rest the
  low-noise one, in rollout and training alike; LoRA adapts both. Flow shift 12; CFG 4 on the
  high-noise steps and 3 on the low-noise ones (`sampling.cfg_scale_2`), as released.

Real run (converted weights and an embedding cache, see README "Model-zoo configs"):

    python convert/diffusers_to_orbax.py --model_dir=/ckpt/Wan2.2-TI2V-5B-Diffusers/transformer --family=wan22 \
        --out=/ckpt/wan22-5b-jax
    python convert/diffusers_to_orbax.py --model_dir=/ckpt/Wan2.2-TI2V-5B-Diffusers/vae --out=/ckpt/wan22-vae-jax
    python launch/train.py --config=configs/wan22.py --workdir=/tmp/wan22 \
        --config.model.checkpoint=/ckpt/wan22-5b-jax --config.model.vae_checkpoint=/ckpt/wan22-vae-jax \
        --config.data.embedding_cache=/data/wan-prompts

T2V-A14B: convert both experts into one checkpoint (convert/diffusers_to_orbax.py --model_dir_2) and
use the Wan2.1 VAE (configs/wan21.py's).

The tiny sizes: --config=configs/wan22.py:tiny (TI2V structure, tiny Wan2.2 VAE, each prompt's
videos starting from a synthetic image), --config=configs/wan22.py:tiny_a14b (the pair of
experts, tiny Wan2.1 VAE).
"""
import ml_collections

from configs import schema, wan21
from configs.sections import ATTENTION_MLP_TARGETS, tiny_overrides

# The released models: transformer variant, sample_shift and guidance (Wan2.2's configs); A14B
# guides its low-noise expert with a second scale.
MODELS = {
    "ti2v_5b": dict(variant="ti2v-5b", flow_shift=5.0, cfg_scale=5.0),
    "t2v_a14b": dict(variant="t2v-a14b", flow_shift=12.0, cfg_scale=4.0, cfg_scale_2=3.0),
}
SIZES = ("ti2v_5b", "t2v_a14b", "tiny", "tiny_a14b")


def get_config(size: str = "ti2v_5b") -> ml_collections.ConfigDict:
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r} for configs/wan22.py; one of {SIZES}")
    released = MODELS["t2v_a14b" if size in ("t2v_a14b", "tiny_a14b") else "ti2v_5b"]
    c = wan21.get_config()  # what differs from the Wan2.1 recipe:
    c.model.family = "wan22"
    c.model.variant = released["variant"]
    c.sampling.ladder_options = {"flow_shift": released["flow_shift"]}
    c.sampling.cfg_scale = released["cfg_scale"]  # true CFG against the cache's negative prompt
    if "cfg_scale_2" in released:
        c.sampling.cfg_scale_2 = released["cfg_scale_2"]
    c.rl.lora_targets = ATTENTION_MLP_TARGETS["wan22"]  # in both A14B experts alike
    if released["variant"] == "ti2v-5b":  # text-to-video unless data.first_frames names images
        c = schema.add_groups(c, "first_frame")
    if size in ("tiny", "tiny_a14b"):
        c = tiny_overrides(c, video=True, trained_steps=3)
        c.model.variant = size.replace("_", "-")
    if size == "tiny":  # the TI2V path: each prompt's videos start from its drawn image
        c.data.first_frames = "synthetic"
    return c
