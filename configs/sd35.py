r"""Stable Diffusion 3.5 Medium (2.2B) Flow-GRPO, the reference recipe (yifan123/flow_grpo
config/grpo.py `geneval_sd3` / `general_ocr_sd3`, scripts/train_sd3.py): 512x512, 10 sampling
steps with SDE noise level 0.7 on every step and the first 9 trained, true CFG 4.5 against the
empty prompt (in rollouts and in the trainer's recomputed velocity), 24 images per prompt x 48
prompts, two optimizer updates per batch (the second off-policy), KL weight 0.04, clip range
1e-4, lr 3e-4, LoRA 32/64, EMA on (decay 0.9 every 8 steps), per-prompt advantages with the
global std. The reference evaluates with 40 ODE steps; here evaluation uses the training ladder.

LoRA targets: the reference adapts the joint attention's projections of every block (peft
`attn.{to_q,to_k,to_v,to_out.0,add_q_proj,add_k_proj,add_v_proj,to_add_out}`), not the MMDiT-X
blocks' second attention `attn2` nor the MLPs; `sections.ATTENTION_MLP_TARGETS["sd3"]` is the
wider attention-and-MLP set the other zoo configs use. The last block's `add_q_proj` is left
out: that block discards its text outputs, so an adapter there never gets a gradient.

Real run (converted weights and an embedding cache; Flow-GRPO encodes T5 to 128 tokens):

    python convert/diffusers_to_orbax.py --model_dir=/ckpt/stable-diffusion-3.5-medium/transformer \
        --out=/ckpt/sd35m-jax
    python convert/diffusers_to_orbax.py --model_dir=/ckpt/stable-diffusion-3.5-medium/vae --out=/ckpt/sd35m-vae-jax
    python convert/encode_prompts.py --family=sd3 --prompts=prompts.txt --max_sequence_length=128 \
        --encoder_dir=/ckpt/stable-diffusion-3.5-medium --out=/data/sd35-prompts
    python launch/train.py --config=configs/sd35.py --workdir=/tmp/sd35 \
        --config.model.checkpoint=/ckpt/sd35m-jax --config.model.vae_checkpoint=/ckpt/sd35m-vae-jax \
        --config.data.embedding_cache=/data/sd35-prompts

Throughput run without weights: --config.model.random_init=True --config.data.random_embeddings=True.
CPU smoke run of the tiny variant: --config=configs/sd35.py:tiny
"""
import ml_collections

from configs.sections import algorithm_keys, runtime_section, sharding_section, tiny_overrides

# The reference's peft targets: the joint attention (`attn`) of every block, both streams
# (in the last block, which drops its text outputs, the text keys and values only).
JOINT_ATTENTION_TARGETS = (r"(dual|joint)_blocks/(\d+/)?attn/(to_|add_)", r"final_block/(\d+/)?attn/(to_|add_[kv])")


def get_config(size: str = "full") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0

    c.model = ml_collections.ConfigDict()
    c.model.family = "sd3"
    c.model.variant = "sd3.5-medium"  # with random_init: a digen_jax.models.sd3.VARIANTS entry ('tiny' for CPU)
    c.model.checkpoint = ""  # converted transformer dir (convert/diffusers_to_orbax.py)
    c.model.vae_checkpoint = ""  # converted VAE dir (AutoencoderKL, SD3's scaling and shift)
    c.model.random_init = False  # random transformer and VAE weights of `variant` (throughput runs)
    c.model.num_layers = 0  # with random_init: > 0 keeps that many blocks (short throughput runs)
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "bfloat16"
    c.model.attention_impl = "auto"
    c.model.remat_policy = "full"
    c.model.scan_layers = True  # False unrolls blocks: no per-layer weight copies, longer compiles
    # Numerics of the rollouts' forward: 'bf16' = the model's dtype, 'fp8' = e4m3 block matmuls (README).
    c.model.rollout_precision = "bf16"
    c.model.vae_decode_batch = 8  # samples per VAE decode call

    c.data = ml_collections.ConfigDict()
    c.data.embedding_cache = ""  # convert/encode_prompts.py --family=sd3 output (with the negative "")
    c.data.random_embeddings = False  # random prompt embeddings of the model's shapes instead
    c.data.text_len = 77 + 128  # random embeddings: CLIP's 77 positions, then T5's 128 (the reference's)
    c.data.num_prompts = 1024  # random embeddings: distinct prompts

    c.sampling = ml_collections.ConfigDict()
    c.sampling.height = 512
    c.sampling.width = 512
    c.sampling.num_steps = 10
    c.sampling.ladder = "sd3"  # FlowMatchEuler, static shift 3
    c.sampling.ladder_options = {}  # keyword overrides of the ladder function
    c.sampling.guidance = 0.0  # no embedded guidance
    c.sampling.cfg_scale = 4.5  # true CFG against the cache's negative prompt ""
    c.sampling.cfg_rescale = False
    c.sampling.sde_type = "sde"
    c.sampling.noise_level = 0.7

    c.rl = ml_collections.ConfigDict()
    c.rl.prompts_per_iteration = 48
    c.rl.group_size = 24
    c.rl.step_selection = "fraction"  # SDE on every step; steps 0-8 of 10 trained
    c.rl.timestep_fraction = 0.99
    c.rl.sde_window_size = 2
    c.rl.sde_window_range = (0, 5)
    c.rl.window_shift_every = 25
    c.rl.std_mode = "global"
    c.rl.mean_mode = "group"
    c.rl.std_ddof = 0
    c.rl.std_eps = 1e-4
    c.rl.adv_clip = 5.0
    c.rl.clip_range = 1e-4
    c.rl.policy_loss = "ppo"
    c.rl.kl_beta = 0.04  # the GenEval and OCR runs' (PickScore: 0.01)
    c.rl.num_updates_per_batch = 2  # the second update of a batch is off-policy
    c.rl.micro_batch_size = 24  # training units (sample, step) per gradient micro-batch
    # Decoupled PPO (proximal policy) for off-policy updates; None: on with model.rollout_precision='fp8'
    c.rl.decoupled = ml_collections.config_dict.placeholder(bool)
    c.rl.is_cap = ml_collections.config_dict.placeholder(float)  # None: untruncated (2 for FP8 rollouts, README)
    c.rl.onpolicy_anchor = "trainer"
    c.rl.learning_rate = 3e-4
    c.rl.weight_decay = 1e-4
    c.rl.max_grad_norm = 1.0
    c.rl.lora_rank = 32
    c.rl.lora_alpha = 64.0
    c.rl.lora_merge_for_sampling = False
    c.rl.lora_targets = JOINT_ATTENTION_TARGETS  # regexes searched in each kernel's path
    c.rl.ema = True
    c.rl.ema_decay = 0.9
    c.rl.ema_every = 8
    c.rl.max_nonfinite_in_row = 3
    c.rl.max_update_ratio = 1.0
    c.rl.optimizer_state_dtype = "param"  # Adam moments: "param" (the weights' dtype) | "float32"
    c.rl.update(algorithm_keys())  # rl.algorithm and the DiffusionNFT keys (configs/sections.py)

    c.reward = ml_collections.ConfigDict()
    # The reference trains on GenEval, OCR or PickScore; a cheap host reward here, any registered one works.
    c.reward.weights = {"jpeg_compressibility": 1.0}
    c.reward.frame_stride = 1

    c.train = ml_collections.ConfigDict()
    c.train.iterations = 300
    c.train.eval_every = 0
    c.train.eval_prompts = 16
    c.train.image_every = 10
    c.train.checkpoint_every = 20
    c.train.keep_checkpoints = 2
    c.train.on_corrupt_checkpoint = "fallback"  # an unreadable latest checkpoint: "fallback" to the one before, or "stop"
    c.train.init_from = ""  # a workdir: start from its latest checkpoint's trainable weights (fresh optimizer, iteration 0)
    c.train.start_over = False  # True: move all the workdir holds to WORKDIR/previous_runs/N/, start at iteration 0

    # Colocated by default (any device count); on a multi-GPU host try e.g.
    # --config.runtime.mode=gap+tsp+tag+tcss --config.runtime.rollout_devices=1 --config.runtime.train_devices=1
    c.runtime = runtime_section(micro_batches=4)
    # LoRA on a 2.2B model: the frozen base is replicated on every train device (data parallel).
    c.sharding = sharding_section(fsdp=False)
    return tiny_overrides(c, video=False, trained_steps=3) if size == "tiny" else c
