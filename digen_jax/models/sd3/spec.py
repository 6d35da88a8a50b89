"""Stable Diffusion 3.5 as data (`family_spec.FamilySpec`); imports no JAX."""
from digen_jax.models.family_spec import FamilySpec, TextPipeline

SPEC = FamilySpec(
    name="sd3", title="stable-diffusion-3.5-medium", full_variant="sd3.5-medium",
    vae="vae_flux", full_vae_variant="sd3", vae_families=("vae_flux",),
    video=False, text_dim="joint_attention_dim", pooled_dim="pooled_projection_dim",
    text_prefix=77, latent_dim="patch_dim",
    embedding={"pooled": True, "mask": False, "lengths": False, "negative": ""},
    # The cap is T5's; the text the transformer receives is CLIP's 77 tokens longer.
    text_pipeline=TextPipeline("StableDiffusion3Pipeline", {"text_encoder": "CLIPTextModelWithProjection",
                                                            "text_encoder_2": "CLIPTextModelWithProjection",
                                                            "text_encoder_3": "T5EncoderModel"},
                               ("tokenizer", "tokenizer_2", "tokenizer_3"), 256, 512),
    # Both attentions of the MMDiT-X blocks (attn, and attn2 where a block has it) and both MLPs;
    # not the last block's text query projection, whose output that block discards.
    lora_targets=(r"(dual|joint)_blocks/(\d+/)?attn2?/(to_|add_)", r"final_block/(\d+/)?attn2?/(to_|add_[kv])",
                  r"/(ff|ff_context)/"),
    flop_terms="sd3",
    ladder="sd3",
)
