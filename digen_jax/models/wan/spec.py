"""Wan2.1-T2V as data (`family_spec.FamilySpec`); imports no JAX."""
from digen_jax.models.family_spec import FamilySpec, TextPipeline

SPEC = FamilySpec(
    name="wan", title="Wan2.1-T2V-14B", full_variant="t2v-14b",
    vae="vae_wan", full_vae_variant="wan2.1", vae_families=("vae_wan",),
    video=True, text_dim="text_dim", pooled_dim=None,
    # umT5 zeroed past the real length and padded to 512: no mask, `lengths` says where the zeros start.
    embedding={"pooled": False, "mask": False, "lengths": True, "negative": ""},
    text_pipeline=TextPipeline("WanPipeline", {"text_encoder": "UMT5EncoderModel"}, ("tokenizer",), 512, None),
    lora_targets=(r"blocks/(\d+/)?attn[12]/to_", r"blocks/(\d+/)?ffn/"),
    flop_terms="wan",
    temporal_patch=lambda cfg: cfg.patch_size[0],
    ladder="wan",
)
