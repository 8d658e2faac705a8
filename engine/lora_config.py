"""A LoRA adapter's directory (PEFT's format) read and checked, torch-free: `pdserve serve`
validates its configuration's `lora_modules` with `read_adapter` before it starts anything, and
engine/lora.py loads the tensors with it. What is supported and what refused: engine/lora.py.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

# the decoder's fused linears and the PEFT modules each is made of, in its output's order
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
         "down": ("down_proj",)}
WHOLE = {"qkv_proj": "qkv", "gate_up_proj": "gate_up"}     # Phi-3's checkpoints fuse them already
MODULES = {part: name for name, parts in FUSED.items() for part in parts} | WHOLE
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


@dataclass(frozen=True)
class AdapterInfo:
    """An adapter directory's configuration, read and checked: `scaling` per rank (alpha / r, or
    alpha / sqrt(r) with rsLoRA) and where its tensors are."""
    path: str
    alpha: float
    rslora: bool
    weights: str

    def scaling(self, rank: int) -> float:
        return self.alpha / (math.sqrt(rank) if self.rslora else rank)


def read_adapter(path: str) -> AdapterInfo | str:
    """The adapter at `path` (a PEFT LoRA directory), or why it cannot be served."""
    where = Path(path)
    config_file = where / "adapter_config.json"
    if not config_file.is_file():
        return f"{path}: no adapter_config.json (a PEFT LoRA adapter's directory)"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        return f"{config_file}: {exc}"
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        return f"{path}: peft_type {config.get('peft_type') if isinstance(config, dict) else None!r} (only LORA)"
    for key, what in (("use_dora", "DoRA"), ("modules_to_save", "modules_to_save (whole modules trained)"),
                      ("rank_pattern", "rank_pattern"), ("alpha_pattern", "alpha_pattern"),
                      ("lora_bias", "LoRA biases")):
        if config.get(key):
            return f"{path}: {what} is not supported"
    weights = next((where / name for name in WEIGHT_FILES if (where / name).is_file()), None)
    if weights is None:
        return f"{path}: no {' or '.join(WEIGHT_FILES)}"
    alpha, rank = config.get("lora_alpha", 8), config.get("r", 8)
    if not isinstance(alpha, (int, float)) or not isinstance(rank, int) or rank < 1:
        return f"{path}: lora_alpha {alpha!r} and r {rank!r} must be numbers (r a positive integer)"
    return AdapterInfo(str(where), float(alpha), bool(config.get("use_rslora")), str(weights))


def split_key(key: str) -> tuple[int, str, str] | None:
    """(layer, PEFT module, "A" or "B") of a tensor's name, or None when it is not one of ours."""
    m = _KEY.search(key)
    return None if m is None else (int(m.group(1)), m.group(2), m.group(3))
