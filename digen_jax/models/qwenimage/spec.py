"""Qwen-Image as data (`family_spec.FamilySpec`); imports no JAX."""
from digen_jax.models.family_spec import FamilySpec, TextPipeline

SPEC = FamilySpec(
    name="qwenimage", title="Qwen-Image", full_variant="qwen-image",
    vae="vae_qwenimage", full_vae_variant="wan2.1", vae_families=("vae_qwenimage", "vae_wan"),
    video=False, text_dim="joint_attention_dim", pooled_dim=None,
    embedding={"pooled": False, "mask": True, "lengths": True, "negative": " "},
    text_pipeline=TextPipeline("QwenImagePipeline", {"text_encoder": "Qwen2_5_VLForConditionalGeneration"},
                               ("tokenizer",), 512, 1024),
    lora_targets=(r"attn/(to_|add_)", r"/(img_mlp|txt_mlp)/"),
    flop_terms="qwenimage",
    ladder="qwen_image",
)
