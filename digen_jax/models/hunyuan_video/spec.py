"""HunyuanVideo as data (`family_spec.FamilySpec`); imports no JAX."""
from digen_jax.models.family_spec import FamilySpec, TextPipeline

SPEC = FamilySpec(
    name="hunyuan_video", title="HunyuanVideo", full_variant="t2v",
    vae="vae_hunyuan_video", full_vae_variant="hunyuan_video", vae_families=("vae_hunyuan_video",),
    video=True, text_dim="text_embed_dim", pooled_dim="pooled_projection_dim",
    embedding={"pooled": True, "mask": True, "lengths": True, "negative": None},
    text_pipeline=TextPipeline("HunyuanVideoPipeline", {"text_encoder": "LlamaModel", "text_encoder_2": "CLIPTextModel"},
                               ("tokenizer", "tokenizer_2"), 256, None),
    # The token refiner stays frozen.
    lora_targets=(
        r"(double|single)_blocks/(\d+/)?attn/(to_|add_)",
        r"double_blocks/(\d+/)?(ff|ff_context)/",
        r"single_blocks/(\d+/)?proj_(mlp|out)/",
    ),
    flop_terms="hunyuan_video",
    temporal_patch=lambda cfg: cfg.patch_size_t,
    ladder="hunyuan_video",
)
