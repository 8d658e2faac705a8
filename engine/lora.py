"""LoRA adapters (PEFT's format) served beside the base model, many at once: a request names one
(`SamplingParams.lora`), and each linear adds that adapter's low-rank update to its rows,
`x W^T + s * (x A^T) B^T`, the base weights untouched, so one step mixes rows of several adapters
and of the base model (as vLLM's multi-LoRA does).

Who calls: the model runner loads a `LoraSet` from `EngineConfig.lora_modules` at start (each
directory read by engine/lora_config.py, which a configuration's validation also runs, torch-free),
gives each step's rows a `LoraBatch` (`LoraSet.batch`), and the decoder calls `LoraBatch.add`
after each linear. The engine's admission refuses a request naming an adapter it does not serve.

Supported: `peft_type` LORA on the attention's and the MLP's projections (q_proj, k_proj, v_proj,
o_proj, gate_proj, up_proj, down_proj, or Phi-3's fused qkv_proj and gate_up_proj), any rank per
module, `lora_alpha` with `use_rslora`, adapters for some layers only. Refused with the reason:
DoRA, `modules_to_save`, rank or alpha patterns, LoRA biases, other modules (embeddings, the LM
head), tensors that do not fit the model. The update is PEFT's unmerged forward op for op
(`F.linear(F.linear(x, A), B) * scaling`, added to the base output), so a float32 engine with an
adapter computes what transformers with PEFT does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.lora_config import FUSED, MODULES, WHOLE, read_adapter, split_key


class LoraSet:
    """The adapters an engine serves: slot i (1..n) is `names[i - 1]`; slot 0 is the base model.
    `weights[slot][layer][linear]`: the parts of that fused linear the adapter updates, each
    (first output column, A [r, in], B [width, r], scaling)."""

    def __init__(self, names: tuple[str, ...], weights: list[list[dict[str, list[tuple]]]]):
        self.names = names
        self.weights = [[]] + weights
        self._slots = {name: i + 1 for i, name in enumerate(names)}

    def slot(self, name: str | None) -> int:
        return 0 if name is None else self._slots[name]

    @classmethod
    def load(cls, modules: dict[str, str], model, dtype, device) -> LoraSet | None:
        """Every adapter of `modules` (name -> directory) for `model` (engine.decoder's
        DecoderModel: its layers and linears' widths), in `dtype` on `device`; None for none.
        Raises ValueError when an adapter cannot be served."""
        if not modules:
            return None
        widths = _widths(model)
        return cls(tuple(modules), [_load_one(name, path, widths, len(model.layers), dtype, device)
                                    for name, path in modules.items()])

    def batch(self, row_slots: list[int], device) -> LoraBatch | None:
        """The adapters of a step whose row r runs `row_slots[r]`; None when none runs one."""
        groups: dict[int, list[int]] = {}
        for row, slot in enumerate(row_slots):
            if slot:
                groups.setdefault(slot, []).append(row)
        if not groups:
            return None
        return LoraBatch(self, [(slot, torch.tensor(rows, device=device)) for slot, rows in groups.items()])


class LoraBatch:
    """One step's rows by adapter: `groups` of (slot, row indices)."""

    def __init__(self, loras: LoraSet, groups: list):
        self.loras, self.groups = loras, groups

    def add(self, layer: int, linear: str, x, out) -> None:
        """Add each group's update of `linear` (a key of FUSED) in layer `layer` to `out`, the base
        linear's output [rows, width] of input `x` [rows, in], in place."""
        for slot, rows in self.groups:
            parts = self.loras.weights[slot][layer].get(linear)
            if not parts:
                continue
            xs = x.index_select(0, rows)
            for start, a, b, scaling in parts:
                delta = F.linear(F.linear(xs, a), b) * scaling
                out[:, start:start + b.shape[0]].index_add_(0, rows, delta)


def _widths(model) -> dict[str, tuple[int, list[int]]]:
    """Per fused linear: (input width, output width of each of its FUSED parts)."""
    d, nh, nkv = model.head_dim, model.num_heads, model.num_kv_heads
    hidden, inter = model.hidden_size, model.intermediate_size
    return {"qkv": (hidden, [nh * d, nkv * d, nkv * d]), "o": (nh * d, [hidden]),
            "gate_up": (hidden, [inter, inter]), "down": (inter, [hidden])}


def _load_one(name: str, path: str, widths: dict, num_layers: int, dtype, device) -> list[dict[str, list[tuple]]]:
    info = read_adapter(path)
    if isinstance(info, str):
        raise ValueError(f"LoRA adapter {name!r}: {info}")
    tensors = _read_tensors(info.weights)
    pairs: dict[tuple[int, str], dict[str, object]] = {}
    for key, tensor in tensors.items():
        where = split_key(key)
        if where is None or where[1] not in MODULES:
            raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA matrix of an attention or MLP "
                             f"projection ({', '.join(MODULES)}); only those are supported")
        layer, module, which = where
        if layer >= num_layers:
            raise ValueError(f"LoRA adapter {name!r}: {key!r} is for layer {layer}; the model has {num_layers}")
        pairs.setdefault((layer, module), {})[which] = tensor
    layers: list[dict[str, list[tuple]]] = [{} for _ in range(num_layers)]
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: layer {layer} {module} has lora_{''.join(ab)} only")
        linear = MODULES[module]
        fan_in, parts = widths[linear]
        if module in WHOLE:
            start, width = 0, sum(parts)
        else:
            k = FUSED[linear].index(module)
            start, width = sum(parts[:k]), parts[k]
        a, b = ab["A"], ab["B"]
        rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != fan_in or b.shape != (width, rank):
            raise ValueError(f"LoRA adapter {name!r}: layer {layer} {module}: lora_A {tuple(a.shape)} and lora_B "
                             f"{tuple(b.shape)} do not fit the model's [{width}, {fan_in}] projection")
        layers[layer].setdefault(linear, []).append(
            (start, a.to(device, dtype).contiguous(), b.to(device, dtype).contiguous(), info.scaling(rank)))
    return layers


def _read_tensors(path: str) -> dict:
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file
        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=True)
