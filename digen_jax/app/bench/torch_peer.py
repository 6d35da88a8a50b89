"""The PyTorch peer of the model bench: the diffusers module of the same family, config and shapes
(eager, SDPA with flash/fused kernels, LoRA on the same layers), timed on the same card.

It runs in a process of its own, so each framework has the card to itself. torch and diffusers
are imported inside the functions that use them: the main job does not need them."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import traceback
from typing import Any, Callable

import flax.linen as nn
from flax import traverse_util

from digen_jax.app.bench import model
from digen_jax.app.bench.timing import summary, time_calls


def measure_in_subprocess(worker_argv: Callable[[str], list[str]]) -> dict[str, Any]:
    """Run the peer in a fresh process (JAX never touches the card there) and return its result.

    `worker_argv(path)` is the command line (after the Python interpreter) of a process that runs
    `measure(..., path)`; a process that fails leaves its error, with whatever it wrote before.
    """
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "peer.json")
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        proc = subprocess.run([sys.executable, *worker_argv(path)], env=env, capture_output=True, text=True)
        if not os.path.exists(path):
            return {"error": f"peer exited with {proc.returncode}: {proc.stderr[-4000:]}"}
        with open(path) as f:
            peer = json.load(f)
        if proc.returncode:
            peer["error"] = f"peer exited with {proc.returncode} after {sorted(peer['results'])}: {proc.stderr[-4000:]}"
        return peer


def _lora_names(prepared: dict[str, Any]) -> tuple[re.Pattern, int]:
    """The diffusers Linear modules the JAX LoRA targets adapt, found through the weight-conversion
    rules, as one pattern over module names; and how many modules it must match. A stacked rule's
    `{i}` stands for the checkpoint's block numbers of its stack only (`WeightRule.offset` on), so
    a target that leaves out one stack's layer (SD3's last block) leaves out its modules too."""
    fam, cfg = prepared["fam"], prepared["cfg"]
    shapes = traverse_util.flatten_dict(nn.unbox(fam.abstract_params(cfg)))

    def name_pattern(rule) -> str:
        blocks = "|".join(str(rule.offset + i) for i in range(shapes[rule.path].shape[0])) if "{i}" in rule.key else ""
        return re.escape(rule.key.removesuffix(".weight")).replace(re.escape("{i}"), f"(?:{blocks})")

    keys = [
        name_pattern(rule) for rule in fam.weight_rules(cfg)
        if rule.path[-1] == "kernel" and any(re.search(p, "/".join(rule.path)) for p in prepared["targets"])
    ]
    expected = sum(m.layers for m in prepared["terms"].adapted(prepared["targets"]))
    return re.compile("|".join(f"(?:{k})" for k in keys)), expected


def _inputs(bench: model.ModelBench, prepared: dict[str, Any], device, dtype) -> dict[str, Any]:
    """The diffusers module's keyword inputs of the benchmark shape, random from `bench.seed`."""
    import torch

    family, cfg, batch, text_len = prepared["family"], prepared["cfg"], bench.batch, prepared["text_len"]
    frames, rows, cols = prepared["grid"]
    g = torch.Generator(device="cpu").manual_seed(bench.seed)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(device, dtype)  # noqa: E731
    if family in ("flux", "qwenimage"):
        text_dim = cfg.joint_attention_dim
        hidden = rand(batch, rows * cols, cfg.in_channels)
    elif family == "sd3":  # (B, C, H/8, W/8) latents, patchified inside
        text_dim = cfg.joint_attention_dim
        hidden = rand(batch, cfg.in_channels, 2 * rows, 2 * cols)
    else:
        wan = family in ("wan", "wan22")
        pt = cfg.patch_size[0] if wan else cfg.patch_size_t
        text_dim = cfg.text_dim if wan else cfg.text_embed_dim
        hidden = rand(batch, cfg.in_channels, frames * pt, 2 * rows, 2 * cols)
    text = rand(batch, text_len, text_dim)
    sigma = torch.rand(batch, generator=g).to(device, dtype) * 0.9 + 0.05
    if family == "flux":
        ids = torch.stack(torch.meshgrid(torch.arange(1), torch.arange(rows), torch.arange(cols), indexing="ij"), -1)
        return dict(hidden_states=hidden, encoder_hidden_states=text,
                    pooled_projections=rand(batch, cfg.pooled_projection_dim), timestep=sigma,
                    img_ids=ids.reshape(-1, 3).to(device, dtype),
                    txt_ids=torch.zeros(text_len, 3, device=device, dtype=dtype),
                    guidance=torch.full((batch,), 3.5, device=device, dtype=dtype) if cfg.guidance_embeds else None)
    if family == "qwenimage":
        return dict(hidden_states=hidden, encoder_hidden_states=text, encoder_hidden_states_mask=None, timestep=sigma,
                    img_shapes=[[(1, rows, cols)]] * batch)
    if family in ("wan", "wan22"):  # wan22: TI2V-5B (one transformer)
        return dict(hidden_states=hidden, timestep=sigma * 1000, encoder_hidden_states=text)
    if family == "sd3":
        return dict(hidden_states=hidden, encoder_hidden_states=text,
                    pooled_projections=rand(batch, cfg.pooled_projection_dim), timestep=sigma * 1000)
    return dict(hidden_states=hidden, timestep=sigma * 1000, encoder_hidden_states=text,
                encoder_attention_mask=torch.ones(batch, text_len, device=device, dtype=torch.int64),
                pooled_projections=rand(batch, cfg.pooled_projection_dim),
                guidance=torch.full((batch,), 3500.0, device=device, dtype=dtype) if cfg.guidance_embeds else None)


def _add_lora(module, pattern: re.Pattern, rank: int, scale: float, expected: int) -> str:
    """Freeze `module` and adapt the Linear layers named by `pattern`: peft when installed, else
    a wrapper computing base(x) + scale * B(A(x)). Returns which was used."""
    import torch

    module.requires_grad_(False)
    names = [n for n, m in module.named_modules() if isinstance(m, torch.nn.Linear) and pattern.fullmatch(n)]
    if len(names) != expected:
        raise ValueError(f"the LoRA targets match {len(names)} diffusers Linear layers, the JAX model adapts {expected}")
    try:
        import peft
    except ImportError:
        peft = None
    if peft is not None:
        config = peft.LoraConfig(r=rank, lora_alpha=scale * rank, target_modules=names, lora_dropout=0.0)
        peft.inject_adapter_in_model(config, module)
        return "peft"

    class LoraLinear(torch.nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base = base
            self.down = torch.nn.Linear(base.in_features, rank, bias=False, device=base.weight.device, dtype=base.weight.dtype)
            self.up = torch.nn.Linear(rank, base.out_features, bias=False, device=base.weight.device, dtype=base.weight.dtype)
            torch.nn.init.normal_(self.up.weight, std=0.01)  # non-zero: no timing on zeros

        def forward(self, x):
            return self.base(x) + scale * self.up(self.down(x))

    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, child, LoraLinear(getattr(parent, child)))
    return "manual"


def measure(bench: model.ModelBench, path: str) -> None:
    """Time the diffusers module of `bench`'s family, config and shape; write the JSON to `path`
    after each measurement (a fault that kills the process keeps the ones before)."""
    import contextlib

    import diffusers
    import torch

    from digen_jax.models.conversion import POLICY_FIELDS

    prepared = model.setup(bench)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, bench.dtype)
    cls = getattr(diffusers, prepared["fam"].diffusers_class)
    config = {k: list(v) if isinstance(v, tuple) else v
              for k, v in vars(prepared["cfg"]).items() if k not in POLICY_FIELDS}

    def build():
        torch.manual_seed(bench.seed)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # random init straight in the benchmark dtype, on the card
        try:
            with device:
                return cls.from_config(config).eval()
        finally:
            torch.set_default_dtype(previous)

    if device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        # Flash first, memory-efficient as fallback. Not cuDNN: its backward faults (illegal
        # memory access) on FLUX.1-dev at 512x512 (torch 2.11, H100).
        backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
        attention = lambda: sdpa_kernel(backends)  # noqa: E731
        sync = lambda _: torch.cuda.synchronize()  # noqa: E731
    else:
        attention = contextlib.nullcontext
        sync = lambda _: None  # noqa: E731
    inputs = _inputs(bench, prepared, device, dtype)

    def loss(module):
        return module(**inputs, return_dict=False)[0].float().square().mean()

    def forward(module):
        with torch.no_grad():
            return module(**inputs, return_dict=False)[0]

    def fwd_bwd(module):
        module.zero_grad(set_to_none=True)
        loss(module).backward()

    out: dict[str, Any] = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                           "torch": torch.__version__, "diffusers": diffusers.__version__,
                           "attention": "sdpa (flash, efficient)" if device.type == "cuda" else "sdpa (default)",
                           "results": {}}
    for what in (w for w in bench.what if w in model.PEER_WHATS):
        entry: dict[str, Any] = {}
        try:
            module = build()
            if what == "lora_fwd_bwd":
                pattern, expected = _lora_names(prepared)
                entry["lora_impl"] = _add_lora(module, pattern, bench.lora_rank, bench.lora_scale, expected)
            elif what == "full_fwd_bwd":
                module.requires_grad_(True)
            call = forward if what == "forward" else fwd_bwd
            with attention():
                entry.update(summary(time_calls(lambda: call(module), sync, bench.repeats, bench.warmup),
                                     prepared["flops"][what].total, {}))
        except Exception as e:  # noqa: BLE001 - recorded, and the run goes on
            entry["error"] = f"{type(e).__name__}: {e}"[:4000]
            traceback.print_exc()
        module = None  # the weights are freed before the cache is emptied and the next module is built
        if device.type == "cuda":
            torch.cuda.empty_cache()
        out["results"][what] = entry
        with open(path, "w") as f:  # after each measurement: a fault that kills the process keeps the rest
            json.dump(out, f, indent=1)
