"""The tiny CPU default: Flow-GRPO on a synthetic shapes task, end to end on two CPU cores.

A tiny FLUX-family transformer works in pixel space (no VAE): a (3, H, W) image is packed
2x2 into (H/2 * W/2) tokens of 12 channels, as FLUX packs its latents. It is pretrained
briefly by flow matching on prompts like "a red square in the top left" whose renders
follow the prompt only partly (label noise), so it follows prompts imperfectly; Flow-GRPO
then trains it against a programmatic reward that checks colour, shape and position.

    python launch/train.py --config=configs/tiny.py --workdir=/tmp/digen
    python launch/train.py --config=configs/tiny.py --workdir=/tmp/digen --config.train.iterations=10
"""
import ml_collections

from configs import schema
from configs.sections import ATTENTION_MLP_TARGETS


def get_config() -> ml_collections.ConfigDict:
    # The shapes task's FLUX-family transformer in pixel space (model.arch), pretrained on the
    # task when model.checkpoint is empty; what differs from configs/schema.py's defaults:
    c = schema.config("shapes")
    c.model.dtype = c.model.param_dtype = "float32"
    c.model.remat_policy = "none"

    c.sampling.num_steps = 8
    c.sampling.noise_level = 0.7

    c.rl.prompts_per_iteration = 8
    c.rl.group_size = 8
    c.rl.grad_chunk_size = 112
    c.rl.lora_rank = 0  # full fine-tuning
    c.rl.lora_alpha = 0.0
    c.rl.lora_merge_for_sampling = True
    c.rl.lora_targets = ATTENTION_MLP_TARGETS["flux"]

    c.reward.weights = {"shapes": 1.0}

    c.train.iterations = 40
    c.train.eval_every = 5  # ODE samples of fixed eval prompts, EMA weights when enabled
    c.train.eval_prompts = 32
    c.train.checkpoint_every = 10

    # Two optimizer updates per batch (the default, Flow-GRPO's recipe), one per micro-batch: the
    # second half is trained one update off-policy, which is where clip_frac and approx_kl move.
    c.runtime.micro_batches = 2
    c.runtime.train_devices = 1  # the tiny model gains nothing from splitting over (fake) devices
    c.sharding.train_rules = schema.FSDP_RULES
    return c
