"""FLUX.1-dev as data (`family_spec.FamilySpec`); imports no JAX."""
from digen_jax.models.family_spec import FamilySpec, TextPipeline

SPEC = FamilySpec(
    name="flux", title="FLUX.1-dev", full_variant="dev",
    vae="vae_flux", full_vae_variant="flux1", vae_families=("vae_flux",),
    video=False, text_dim="joint_attention_dim", pooled_dim="pooled_projection_dim",
    # T5 padded to 512 (no mask) and CLIP's pooled vector; embedded guidance, no true CFG.
    embedding={"pooled": True, "mask": False, "lengths": False, "negative": None},
    text_pipeline=TextPipeline("FluxPipeline", {"text_encoder": "CLIPTextModel", "text_encoder_2": "T5EncoderModel"},
                               ("tokenizer", "tokenizer_2"), 512, 512),
    # Single blocks: proj_mlp and the fused proj_out.
    lora_targets=(r"attn/(to_|add_)", r"/(ff|ff_context)/", r"single_blocks/(\d+/)?proj_(mlp|out)/"),
    flop_terms="flux",
    ladder="flux",
)
