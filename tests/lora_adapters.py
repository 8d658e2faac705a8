"""Test helper: random LoRA adapters in PEFT's format for the tiny models, and the reference they
are checked against: the transformers model with each adapted projection wrapped as PEFT wraps it
(`base(x) + lora_B(lora_A(x)) * scaling`, PEFT's unmerged forward; peft itself is not a
dependency)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
GRANITE4_MLP = ("input_linear", "output_linear")     # Granite 4.0's shared MLP: [gate; up] and down


def write_adapter(path: Path, model, modules=ATTENTION + MLP, rank: int = 4, alpha: float = 8.0, seed: int = 0,
                  layers=None, config: dict | None = None, scale: float = 0.3) -> Path:
    """A PEFT LoRA adapter for transformers model `model` in directory `path`: A and B random
    (PEFT starts B at zero; random here so the update shows), `scale` their standard deviation.
    `layers`: the layers adapted (default all); `config`: extra adapter_config.json keys."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors, g = {}, torch.Generator().manual_seed(seed)
    for i, layer in enumerate(model.model.layers):
        if layers is not None and i not in layers:
            continue
        for name in modules:
            owner = "self_attn" if name in ATTENTION or name in ("qkv_proj", "dense") else (
                "shared_mlp" if name in GRANITE4_MLP else "mlp")
            proj = getattr(getattr(layer, owner), name)
            prefix = f"base_model.model.model.layers.{i}.{owner}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, proj.in_features, generator=g) * scale
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(proj.out_features, rank, generator=g) * scale
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(modules),
        "base_model_name_or_path": "tiny", "task_type": "CAUSAL_LM", **(config or {})}))
    return path


class LoraReference(torch.nn.Module):
    """A projection as PEFT runs it with a LoRA adapter."""

    def __init__(self, base, a, b, scaling):
        super().__init__()
        self.base, self.a, self.b, self.scaling = base, a, b, scaling

    def forward(self, x):
        return self.base(x) + F.linear(F.linear(x, self.a.to(x.dtype)), self.b.to(x.dtype)) * self.scaling


def with_adapter(model, adapter_dir: Path):
    """`model` (transformers) with the adapter at `adapter_dir` applied as PEFT applies it."""
    from safetensors.torch import load_file
    config = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    tensors = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
    for key, a in tensors.items():
        if ".lora_A." not in key:
            continue
        b = tensors[key.replace(".lora_A.", ".lora_B.")]
        rank = a.shape[0]
        scaling = config["lora_alpha"] / (math.sqrt(rank) if config.get("use_rslora") else rank)
        owner_path = key.removeprefix("base_model.model.").split(".lora_A.")[0]
        *parents, name = owner_path.split(".")
        owner = model
        for part in parents:
            owner = getattr(owner, part)
        setattr(owner, name, LoraReference(getattr(owner, name), a, b, scaling))
    return model
