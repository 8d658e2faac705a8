"""A LoRA adapter's directory (PEFT's format) read and checked, torch-free: `pdserve serve`
validates its configuration's `lora_modules` with `read_adapter` before it starts anything, the
router checks an adapter loaded at run time with `check_adapter` (its tensors' shapes too, from
the safetensors header), and engine/lora.py loads the tensors with both. What is supported and
what refused: engine/lora.py.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from engine.model_dims import Dims

# the decoder's fused linears and the PEFT modules each is made of, in its output's order
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
         "down": ("down_proj",)}
# Phi-3's checkpoints fuse them already; Granite 4.0's shared MLP is [gate; up] and down; the ungated
# MLPs of StarCoder2 (c_fc, c_proj) and Phi (fc1, fc2) are up and down; Phi's o_proj is `dense`
WHOLE = {"qkv_proj": "qkv", "gate_up_proj": "gate_up", "input_linear": "gate_up", "output_linear": "down",
         "c_fc": "gate_up", "c_proj": "down", "fc1": "gate_up", "fc2": "down", "dense": "o"}
MODULES = {part: name for name, parts in FUSED.items() for part in parts} | WHOLE
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp|shared_mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
NAME_PATTERN = r"^\S(.*\S)?$"     # an adapter name, configured or loaded at run time: one line, no spaces around
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
MAX_HEADER_BYTES = 64 << 20        # a safetensors header beyond this is not an adapter's
NO_ROOM = "no room"  # LoraSet.use: every place is taken by an adapter that a request runs


@dataclass(frozen=True)
class Part:
    """One adapted projection: in layer `layer`, fused linear `linear` (a key of FUSED) from its
    output column `start`, by the tensors named `a` [rank, in] and `b` [width, rank]."""
    layer: int
    linear: str
    start: int
    a: str
    b: str
    rank: int


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


def plan(shapes: dict[str, tuple[int, ...]], dims: Dims) -> list[Part] | str:
    """Where each A/B pair of an adapter (tensor name -> shape) goes in a model of `dims`, or why
    the adapter does not fit it."""
    widths = dims.widths()
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    for key in shapes:
        where = split_key(key)
        if where is None or where[1] not in MODULES:
            return (f"tensor {key!r} is not a LoRA matrix of an attention or MLP projection "
                    f"({', '.join(MODULES)}); only those are supported")
        layer, module, which = where
        if layer >= dims.num_layers:
            return f"{key!r} is for layer {layer}; the model has {dims.num_layers}"
        pairs.setdefault((layer, module), {})[which] = key
    parts = []
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            return f"layer {layer} {module} has lora_{''.join(ab)} only"
        linear = MODULES[module]
        if dims.moe and linear in ("gate_up", "down"):
            return (f"layer {layer} {module}: LoRA on a mixture-of-experts model's MLPs is not supported "
                    "(on its attention projections it is)")
        fan_in, outs = widths[linear]
        if module in WHOLE:
            start, width = 0, sum(outs)
        else:
            k = FUSED[linear].index(module)
            start, width = sum(outs[:k]), outs[k]
        a, b = tuple(shapes[ab["A"]]), tuple(shapes[ab["B"]])
        if len(a) != 2 or len(b) != 2 or a[1] != fan_in or b != (width, a[0]):
            return (f"layer {layer} {module}: lora_A {a} and lora_B {b} do not fit the model's "
                    f"[{width}, {fan_in}] projection")
        parts.append(Part(layer, linear, start, ab["A"], ab["B"], a[0]))
    return parts


def safetensors_shapes(path: str) -> dict[str, tuple[int, ...]] | str:
    """Each tensor's shape in a safetensors file, from its header (no tensor is read), or why not."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 0 < size <= MAX_HEADER_BYTES:
                return f"{path}: not a safetensors file (header of {size} bytes)"
            header = json.loads(f.read(size))
        return {key: tuple(int(n) for n in value["shape"]) for key, value in header.items() if key != "__metadata__"}
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        return f"{path}: not a safetensors file ({type(exc).__name__}: {exc})"


def adapter_dir(path: str) -> str:
    """An adapter's directory as a configuration or a load names it: `~` expanded, made absolute
    on this node (every replica's node reads it at that path)."""
    return os.path.abspath(os.path.expanduser(path))


def check_adapter(path: str, dims: Dims) -> AdapterInfo | str:
    """The adapter at `path` when a model of `dims` can serve it, or why not: its configuration
    (read_adapter) and, in a safetensors file, its tensors' names and shapes (a PyTorch .bin
    file's tensors are checked only when an engine loads them)."""
    info = read_adapter(path)
    if isinstance(info, str) or not info.weights.endswith(".safetensors"):
        return info
    shapes = safetensors_shapes(info.weights)
    if isinstance(shapes, str):
        return shapes
    where = plan(shapes, dims)
    return f"{path}: {where}" if isinstance(where, str) else info
