"""LoRA adapters (PEFT's format) served beside the base model, many at once: a request names one
(`SamplingParams.lora`), and each linear adds that adapter's low-rank update to its rows,
`x W^T + s * (x A^T) B^T`, the base weights untouched, so one step mixes rows of several adapters
and of the base model (as vLLM's multi-LoRA does).

Who calls: the model runner holds a `LoraSet`, loaded with `EngineConfig.lora_modules` at start
(each directory read by engine/lora_config.py, which a configuration's validation also runs,
torch-free), gives each step's rows a `LoraBatch` (`LoraSet.batch`), and the decoder calls
`LoraBatch.add` after each linear. The engine's admission refuses a request naming an adapter it
does not serve, and loads one a request brings the path of (an adapter the router loaded at run
time: `LoraSet.check`, then `LoraSet.use` when the scheduler may start it).

Supported: `peft_type` LORA on the attention's and the MLP's projections (q_proj, k_proj, v_proj,
o_proj, gate_proj, up_proj, down_proj, or Phi-3's fused qkv_proj and gate_up_proj, or Granite 4.0's
shared_mlp.input_linear ([gate; up]) and output_linear, or StarCoder2's c_fc and c_proj), any rank per
module, `lora_alpha` with `use_rslora`, adapters for some layers only. Refused with the reason:
DoRA, `modules_to_save`, rank or alpha patterns, LoRA biases, other modules (embeddings, the LM
head), tensors that do not fit the model. The update is PEFT's unmerged forward,
`base(x) + (x A^T) B^T * scaling`: in a float32 model (the exact mode) PEFT's ops part by part (its
greedy output is token-identical to transformers + PEFT's, tests/test_lora.py), in other models in
fewer ops (`LoraBatch.add`). On CUDA a step with adapter rows runs eagerly (not from a captured
graph: engine.model_runner).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from engine.lora_config import NO_ROOM, plan, read_adapter
from engine.model_dims import Dims


@dataclass
class LinearUpdate:
    """An adapter's update of one fused linear. `a`: the A matrices of the parts it adapts stacked
    [sum of ranks, in]. A float32 model (the exact mode) runs PEFT's ops one part at a time:
    `parts`, per part (first output column, its rows of `x a^T`, B transposed, scaling), `b_t`
    None. Other models: `b_t`, the parts' B matrices transposed, scaled and laid out
    block-diagonally [sum of ranks, the linear's width], so `(x a^T) b_t` is every part's update
    at once, `parts` empty. In float32 on a CPU (see LoraBatch.add), else in the model's dtype."""
    a: torch.Tensor
    b_t: torch.Tensor | None
    parts: list[tuple[int, slice, torch.Tensor, float]]


FP32_BELOW = 64    # rows under which a bf16 model's update is computed in float32 on a CPU (LoraBatch.add)
KERNEL_BELOW = 16  # ... and through the engine's kernel (lora_cpu.cpp) rather than torch's ops


class LoraSet:
    """The adapters an engine holds, by key (name, load id: 0 for the configuration's, the
    router's id for one loaded at run time). Slot 0 is the base model; `weights[slot][layer]`:
    fused linear name -> the adapter's `LinearUpdate` of it (None: a free slot).

    The configuration's adapters (`EngineConfig.lora_modules`) are loaded at start and kept. One
    loaded at run time (a request carrying its path: SamplingParams.lora_path) is read when the
    engine admits its first request (`check`: ahead on a worker thread where the replica can,
    `prepare` through LLMEngine.prepare, so admission only finds it read), and placed when the
    scheduler may start that request (`use`, called by the engine before each step): at most
    `max_loras` such are held, the next one evicting the least recently used that no running or
    starting request runs; when every one is in use there is no room (`NO_ROOM`) and the request
    waits in the queue until one goes idle (the engine drains one for it: engine/lora_places.py), as
    vLLM's scheduler keeps a request waiting past `max_loras` adapters (a request whose K/V has
    landed already, decode role, waits parked with its blocks: engine/scheduler.py). Only the
    engine's thread calls the rest, between steps (a step's LoraBatch reads slots no placement can
    free: they are in use)."""

    def __init__(self, model, device, kernels=None, max_loras: int = 8):
        """`model`: engine.decoder's DecoderModel (its widths and dtype)."""
        self.weights: list[list[dict[str, LinearUpdate]] | None] = [[]]
        self._slots: dict[tuple[str, int], int] = {}
        self._last_use: dict[tuple[str, int], int] = {}      # run-time adapters: the admission tick
        self._tick = 0
        self.loads = self.evictions = 0          # of run-time adapters, for the replica's metrics
        self._prepared: OrderedDict[tuple[str, int], list] = OrderedDict()      # read ahead, not yet used
        self._prepared_lock = threading.Lock()
        self.dtype, self.device, self.max_loras = model.dtype, device, max_loras
        self.kernels = kernels          # engine.kernels (CPU), for LoraBatch.add; None: torch's ops only
        self.dims: Dims = model.dims

    @property
    def empty(self) -> bool:
        return not self._slots

    def holds(self, key: tuple[str, int]) -> bool:
        return key in self._slots

    def last_used(self, key: tuple[str, int]) -> int:
        """When run-time adapter `key` (held) was last placed or used, in `use` calls."""
        return self._last_use[key]

    def slot(self, key: tuple[str, int] | None) -> int:
        return 0 if key is None else self._slots[key]

    def held(self) -> list[tuple[str, int]]:
        """The keys of the adapters loaded now, the configuration's first."""
        return list(self._slots)

    def add_configured(self, modules: dict[str, str]) -> None:
        """At start: every adapter of `modules` (name -> directory). Raises ValueError when one
        cannot be served."""
        for name, path in modules.items():
            self._place((name, 0), _load_one(name, path, self.dims, self.dtype, self.device))

    def needs(self, key: tuple[str, int]) -> bool:
        """Any thread: whether the run-time adapter `key` is neither held nor read ahead."""
        with self._prepared_lock:
            return key not in self._slots and key not in self._prepared

    def prepare(self, name: str, lora_id: int, path: str) -> None:
        """Any thread: read run-time adapter `name` (load `lora_id`) at `path` ahead, for `use` to
        place; the last `max_loras` read ahead are kept (a request that left before its admission
        leaves one behind; with more adapters waiting, the first ones are read again when placed).
        A failure is left for `check` to report."""
        key = (name, lora_id)
        if not self.needs(key):
            return
        try:
            weights = _load_one(name, path, self.dims, self.dtype, self.device)
        except Exception:  # noqa: BLE001 - check() reads it again and reports why
            return
        self._keep_prepared(key, weights)

    def _keep_prepared(self, key: tuple[str, int], weights: list) -> None:
        with self._prepared_lock:
            self._prepared[key] = weights
            while len(self._prepared) > self.max_loras:
                self._prepared.popitem(last=False)

    def check(self, name: str, lora_id: int, path: str) -> str | None:
        """Admission of a request running run-time adapter `name` (load `lora_id`, at `path`): None
        where it is held or read (read now, on this thread, where `prepare` did not), else why it
        cannot be served (a 400)."""
        key = (name, lora_id)
        if not self.needs(key):
            return None
        weights = self._read(name, path)
        if isinstance(weights, str):
            return weights
        self._keep_prepared(key, weights)
        return None

    def use(self, name: str, lora_id: int, path: str, busy: set) -> str | None:
        """Place run-time adapter `name` (load `lora_id`, at `path`) for a request to start: held
        already, or loaded once the least recently used run-time adapter whose key is not in `busy`
        (those of the requests running or starting) is evicted where `max_loras` are held. None when held; `NO_ROOM` when every one held is in use (the request waits);
        else why it cannot be served (a 400: its file, read again where it was not kept read, no
        longer serves)."""
        key = (name, lora_id)
        self._tick += 1
        if key in self._slots:
            self._last_use[key] = self._tick
            return None
        if len(self._last_use) >= self.max_loras:        # never more: nothing places past the bound
            idle = [k for k in self._last_use if k not in busy]
            if not idle:
                return NO_ROOM
            self._drop(min(idle, key=self._last_use.__getitem__))
        with self._prepared_lock:
            weights = self._prepared.pop(key, None)
        weights = weights or self._read(name, path)
        if isinstance(weights, str):
            return weights
        self._place(key, weights)
        self._last_use[key] = self._tick
        self.loads += 1
        return None

    def _read(self, name: str, path: str) -> list[dict[str, LinearUpdate]] | str:
        """Adapter `name`'s weights from `path`, or why it cannot be served."""
        try:
            return _load_one(name, path, self.dims, self.dtype, self.device)
        except ValueError as exc:
            return str(exc)
        except Exception as exc:  # noqa: BLE001 - an unreadable file, whatever its reader raises
            return f"LoRA adapter {name!r}: {path}: {type(exc).__name__}: {exc}"

    def _place(self, key: tuple[str, int], weights: list[dict[str, LinearUpdate]]) -> None:
        free = next((i for i, w in enumerate(self.weights) if w is None), None)
        if free is None:
            free = len(self.weights)
            self.weights.append(None)
        self.weights[free] = weights
        self._slots[key] = free

    def _drop(self, key: tuple[str, int]) -> None:
        self.weights[self._slots.pop(key)] = None
        del self._last_use[key]
        self.evictions += 1

    def batch(self, row_slots: list[int], device) -> LoraBatch | None:
        """The adapters of a step whose row r runs `row_slots[r]`; None when none runs one."""
        groups: dict[int, list[int]] = {}
        for row, slot in enumerate(row_slots):
            if slot:
                groups.setdefault(slot, []).append(row)
        if not groups:
            return None
        if len(groups) == 1 and len(next(iter(groups.values()))) == len(row_slots):
            return LoraBatch(self, [(next(iter(groups)), None)])        # every row on one adapter
        return LoraBatch(self, [(slot, torch.tensor(rows, device=device)) for slot, rows in groups.items()])


class LoraBatch:
    """One step's rows by adapter: `groups` of (slot, row indices, or None for every row)."""

    def __init__(self, loras: LoraSet, groups: list):
        self.loras, self.groups = loras, groups

    def add(self, layer: int, linear: str, x, out) -> None:
        """Add each group's update of `linear` (a key of FUSED) in layer `layer` to `out`, the base
        linear's output [rows, width] of input `x` [rows, in], in place. A float32 model (the exact
        mode) runs PEFT's ops, `base + (x A^T) B^T * scaling` part by part (q, k, v: one product
        with their stacked A); a bf16 model one product with A and one with the block-diagonal B,
        added: on a CPU in float32 for groups of fewer than FP32_BELOW rows (products this small
        cost 20-30 us each in bf16 through oneDNN, 3-5 in fp32; rounded once, where they are
        added; under KERNEL_BELOW rows all of it, the group's rows gathered and scattered too, in
        one op of the engine's kernels where they built, `lora_add_`), else in the model's dtype
        and added inside the product (`addmm_`; a 512-row chunk on a CPU: 3x faster than in
        float32; there the float32 weights are converted per call, a few microseconds against the
        chunk's milliseconds, so a CPU keeps one copy)."""
        for slot, rows in self.groups:
            update = self.loras.weights[slot][layer].get(linear)
            if update is None:
                continue
            n = x.shape[0] if rows is None else rows.shape[0]
            few = n < FP32_BELOW
            if not update.parts and update.a.dtype != out.dtype and n < KERNEL_BELOW and self.loras.kernels \
                    is not None and out.is_contiguous() and x.is_contiguous():      # a CPU, few rows: one op
                self.loras.kernels.lora_add_(out, x, update.a, update.b_t, rows)
                continue
            xs = x if rows is None else x.index_select(0, rows)
            if update.parts:                    # a float32 model: PEFT's ops
                xa = F.linear(xs, update.a)
                for start, ranks, b_t, scaling in update.parts:
                    target = out[:, start:start + b_t.shape[1]]
                    if rows is None:
                        target.addmm_(xa[:, ranks], b_t, alpha=scaling)
                    else:
                        target.index_add_(0, rows, xa[:, ranks] @ b_t, alpha=scaling)
                continue
            a, b_t = update.a, update.b_t
            if a.dtype != out.dtype and few:     # a CPU, few rows: in float32
                delta = F.linear(xs.float(), a) @ b_t
                if rows is None:
                    out.add_(delta)
                else:
                    out.index_add_(0, rows, delta.to(out.dtype))
                continue
            if a.dtype != out.dtype:
                a, b_t = a.to(out.dtype), b_t.to(out.dtype)
            if rows is None:
                out.addmm_(F.linear(xs, a), b_t)
            else:
                out.index_add_(0, rows, F.linear(xs, a) @ b_t)


def _load_one(name: str, path: str, dims: Dims, dtype, device) -> list[dict[str, LinearUpdate]]:
    """Adapter `name` at `path` for a model of `dims` computing in `dtype` on `device`, per layer;
    raises ValueError (the reason) when it cannot be served."""
    info = read_adapter(path)
    if isinstance(info, str):
        raise ValueError(f"LoRA adapter {name!r}: {info}")
    tensors = _read_tensors(info.weights)
    placed = plan({key: tuple(t.shape) for key, t in tensors.items()}, dims)
    if isinstance(placed, str):
        raise ValueError(f"LoRA adapter {name!r}: {placed}")
    widths, num_layers = dims.widths(), dims.num_layers
    found: list[dict[str, list]] = [{} for _ in range(num_layers)]
    for part in placed:
        b = tensors[part.b]
        order = dims.rope_order(part.start, b.shape[0]) if part.linear == "qkv" else None
        found[part.layer].setdefault(part.linear, []).append(
            (part.start, tensors[part.a], b if order is None else b[order], info.scaling(part.rank)))
    # float32 on a CPU (a bf16 model's small groups compute in it, big ones convert: LoraBatch.add)
    keep = torch.float32 if torch.device(device).type == "cpu" else dtype
    layers: list[dict[str, LinearUpdate]] = [{} for _ in range(num_layers)]
    for layer, linears in enumerate(found):
        for linear, parts in linears.items():
            at, slices = 0, []
            for _, a, _, _ in parts:
                slices.append(slice(at, at + a.shape[0]))
                at += a.shape[0]
            stacked = torch.cat([a for _, a, _, _ in parts]).to(device, keep).contiguous()
            if dtype == torch.float32:
                layers[layer][linear] = LinearUpdate(stacked, None, [
                    (start, ranks, b.to(device, keep).t().contiguous(), scaling)
                    for (start, _, b, scaling), ranks in zip(parts, slices)])
                continue
            block = torch.zeros(at, sum(widths[linear][1]))
            for (start, _, b, scaling), ranks in zip(parts, slices):
                block[ranks, start:start + b.shape[0]] = b.t() * scaling
            layers[layer][linear] = LinearUpdate(stacked, block.to(device, keep), [])
    return layers


def _read_tensors(path: str) -> dict:
    if path.endswith(".safetensors"):
        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=True)
