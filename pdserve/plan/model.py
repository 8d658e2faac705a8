"""Model specs for `pdserve plan`: a preset name or a Hugging Face `config.json` (a config's sliding
window is read through transformers' config class).

`resolve_spec(model, dtype, params)` is the one entry point the CLI calls:
  1. `model` names a preset in `pdserve.plan.roofline.MODELS`, or is a path to an HF model directory or its
     `config.json`, a GGUF file (the config transformers reads from its metadata) or a Hugging Face id
     in the local Hugging Face cache (its snapshot's config.json);
  2. for a config, `spec_from_config` reads layers / KV heads / head_dim and the sliding window
     (`windows`), and counts parameters with `count_params` (dense llama-like decoders: Llama,
     Qwen2, Mistral, SmolLM, ...; the mixtures of experts the engine runs, with their routed
     experts' share from `moe_params`);
  3. `dtype` (bf16 / fp16 / fp32) overrides the bytes per parameter, else the config's `torch_dtype`
     (or `dtype`), else bf16; `params` overrides the counted parameters.
Errors are `ValueError`s with a message fit for the user (the CLI prints them and exits 2).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

from engine.config import unsupported_model
from engine.model_dims import LAYER_NORM, LAYER_NORM_NO_BIAS, PARALLEL_BLOCK, UNGATED_MLP
from pdserve.plan.roofline import MODELS, ModelSpec
from serving.gguf_models import ModelError, gguf_config
from serving.models import hub_snapshot, is_hub_id, served_name

DTYPE_BYTES = {"bf16": 2.0, "bfloat16": 2.0, "fp16": 2.0, "float16": 2.0, "half": 2.0,
               "fp32": 4.0, "float32": 4.0, "float": 4.0}
_QKV_BIAS_TYPES = {"qwen2"}          # model types with q/k/v biases but no `attention_bias` key
_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")
# the mixtures of experts the engine runs (engine/moe.py), whose experts are counted
_MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "granitemoeshared", "granitemoehybrid",
              "ernie4_5_moe", "gpt_oss", "glm4_moe")
_MOE_SIZED = ("qwen2_moe", "qwen3_moe", "ernie4_5_moe", "glm4_moe")      # experts of `moe_intermediate_size`
_GRANITE_SHARED = ("granitemoeshared", "granitemoehybrid")    # Granite's ungated shared MLP beside its experts


def load_config(path: str | Path) -> dict:
    """The config dict from an HF model directory or a `config.json` path; ValueError if unreadable.

    Multimodal configs that nest the language model under `text_config` return that inner dict.
    Floats JSON cannot hold are read back as transformers writes them (`{"__float__": "Infinity"}`:
    Granite 4.0's `time_step_limit`).
    """
    p = Path(path)
    p = p / "config.json" if p.is_dir() else p
    try:
        cfg = json.loads(p.read_text(), object_hook=_special_float)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read a Hugging Face config from {p}: {exc}") from exc
    if not isinstance(cfg, dict):
        raise ValueError(f"{p} is not a JSON object")
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg["text_config"], "_name_or_path": cfg.get("_name_or_path", "")}
    return cfg


def _special_float(obj: dict):
    value = obj.get("__float__") if len(obj) == 1 else None
    return float(value.lower().replace("infinity", "inf")) if value in ("Infinity", "-Infinity", "NaN") else obj


def _need(cfg: dict, key: str) -> int:
    if not isinstance(cfg.get(key), int) or cfg[key] <= 0:
        raise ValueError(f"config lacks a positive integer {key!r} (pass --params and a preset instead)")
    return cfg[key]


def head_dim(cfg: dict) -> int:
    """`head_dim` if the config has one, else hidden_size / num_attention_heads."""
    return cfg.get("head_dim") or _need(cfg, "hidden_size") // _need(cfg, "num_attention_heads")


def count_params(cfg: dict) -> int:
    """Parameters of a dense llama-like decoder from its config, within a few % of the real count.

    Embeddings V*H; per layer q/o projections H*(heads*hd), k/v projections H*(kv*hd) (+ biases when
    `attention_bias`, q/k/v only for glm and glm4, or q/k/v biases for qwen2 and where `use_qkv_bias`
    (stablelm); seed_oss's o_proj bias when `attention_out_bias`), gated MLP 3*H*I (ungated,
    UNGATED_MLP's: 2*H*I; + biases when `mlp_bias`; ERNIE 4.5's and StarCoder2's `use_bias`, and
    Phi always: on every projection, and Phi's LM head V), two RMSNorm weights of H (one norm where
    attention and MLP sit side by side, `use_parallel_residual`, Phi and Cohere; four for gemma2,
    gemma3_text and glm4; LAYER_NORM's LayerNorms but Cohere's have a bias of H each, the final one
    too; and
    qwen3's / exaone4's / olmo2's / olmo3's / gemma3_text's q/k norms); a final norm H; lm_head V*H
    unless `tie_word_embeddings` (absent: untied, as LlamaConfig / Qwen2Config / MistralConfig
    default; gpt-oss's attention_bias defaults to true, and its attention sinks add heads a layer).
    A mixture of experts the engine runs (Mixtral,
    Qwen2-MoE, Qwen3-MoE, OLMoE, Granite MoE, ERNIE 4.5 MoE, gpt-oss, GLM-4.5) has its MoE layers' MLPs counted by
    `moe_params`; any other MoE config raises ValueError, as does a Granite 4.0 with Mamba layers
    (its MLP without experts is its shared MLP, `shared_intermediate_size`).
    """
    if any(k in cfg for k in _MOE_KEYS) and cfg.get("model_type") not in _MOE_TYPES:
        raise ValueError(f"mixture-of-experts configs other than {', '.join(_MOE_TYPES)} are not modelled")
    granite4 = cfg.get("model_type") == "granitemoehybrid"
    if granite4 and (problem := unsupported_model(cfg)):
        raise ValueError(problem)
    h, layers = _need(cfg, "hidden_size"), _need(cfg, "num_hidden_layers")
    inter = _need(cfg, "shared_intermediate_size" if granite4 else "intermediate_size")
    vocab, heads = _need(cfg, "vocab_size"), _need(cfg, "num_attention_heads")
    kv, hd = cfg.get("num_key_value_heads") or heads, head_dim(cfg)
    model_type = cfg.get("model_type")
    # biases on every projection: ERNIE 4.5's and StarCoder2's `use_bias`, Phi's always
    use_bias = model_type in ("ernie4_5", "ernie4_5_moe", "starcoder2") and bool(cfg.get("use_bias"))
    every_bias = model_type == "phi" or use_bias
    attn_bias = bool(cfg.get("attention_bias", model_type == "gpt_oss")) or every_bias
    qkv_bias = attn_bias or model_type in _QKV_BIAS_TYPES or bool(cfg.get("use_qkv_bias")) or (
        model_type == "qwen2_moe" and cfg.get("qkv_bias", True))
    attn = 2 * h * heads * hd + 2 * h * kv * hd
    o_bias = attn_bias and model_type not in ("glm", "glm4", "glm4_moe")   # GLM's o_proj has none
    if model_type == "seed_oss":                                          # its own key for o_proj's
        o_bias = bool(cfg.get("attention_out_bias", False))
    attn += qkv_bias * (heads * hd + 2 * kv * hd) + o_bias * h
    up = 1 if model_type in UNGATED_MLP else 2                            # up (and gate) projections
    mlp = (up + 1) * h * inter + (bool(cfg.get("mlp_bias", False)) or every_bias) * (up * inter + h)
    # RMSNorm weights on queries and keys, in head_dims: qwen3 one head each, olmo2 every head
    qk_norm = {"qwen3": 2, "qwen3_moe": 2, "exaone4": 2, "olmo2": heads + kv, "olmo3": heads + kv, "olmoe": heads + kv,
               "gemma3_text": 2, "glm4_moe": 2 * bool(cfg.get("use_qk_norm"))}.get(model_type, 0) * hd
    norms = {"gemma2": 4, "gemma3_text": 4, "glm4": 4}.get(model_type, 2) * h
    if cfg.get("use_parallel_residual") or model_type in PARALLEL_BLOCK:   # attention, MLP beside
        norms = h
    final_norm = h
    if model_type in LAYER_NORM and model_type not in LAYER_NORM_NO_BIAS:   # a bias beside each weight
        norms, final_norm = 2 * norms, 2 * h
    moe = _moe_layers(cfg)
    mlps = (layers - len(moe)) * mlp + sum(moe.values())
    embed = vocab * h
    lm_head = (0 if cfg.get("tie_word_embeddings", False) else vocab * h) + (model_type == "phi") * vocab
    sinks = heads if model_type == "gpt_oss" else 0
    return embed + layers * (attn + norms + qk_norm + sinks) + mlps + final_norm + lm_head


def moe_params(cfg: dict) -> tuple[int, int, int]:
    """(the routed experts' parameters over all layers, experts a layer, experts a token) of a
    mixture of experts the engine runs; (0, 0, 0) for a dense model."""
    moe = _moe_layers(cfg)
    if not moe:
        return 0, 0, 0
    experts, h = _experts(cfg), _need(cfg, "hidden_size")
    per_token = cfg.get("num_experts_per_tok") or _need(cfg, "moe_k")          # ERNIE's name
    return len(moe) * experts * _one_expert(cfg), experts, per_token


def _one_expert(cfg: dict) -> int:
    """An expert's parameters: its gated MLP's three projections, and gpt-oss's biases on them."""
    h, size = _need(cfg, "hidden_size"), _expert_size(cfg)
    return 3 * h * size + (cfg.get("model_type") == "gpt_oss") * (2 * size + h)


def _experts(cfg: dict) -> int:
    return int(cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("moe_num_experts")
               or cfg.get("n_routed_experts") or 0)


def _expert_size(cfg: dict) -> int:
    """An expert's intermediate size: Qwen's and ERNIE's `moe_intermediate_size`, else `intermediate_size`."""
    return _need(cfg, "moe_intermediate_size" if cfg.get("model_type") in _MOE_SIZED else "intermediate_size")


def _moe_layers(cfg: dict) -> dict[int, int]:
    """{layer: its MLP block's parameters} for the layers whose MLP is a mixture of experts (as
    transformers builds them: Qwen's `mlp_only_layers` and `decoder_sparse_step`, ERNIE's
    `moe_layer_start_index` / `_end_index` / `_interval` leave some dense), with the router, and
    Qwen2-MoE's shared expert and its gate (Granite's shared MLP; ERNIE's shared experts and its
    router's correction bias; GLM-4.5's shared experts after its `first_k_dense_replace` dense layers)."""
    if cfg.get("model_type") not in _MOE_TYPES or _experts(cfg) == 0:
        return {}
    h, layers, experts = _need(cfg, "hidden_size"), _need(cfg, "num_hidden_layers"), _experts(cfg)
    block = experts * h + experts * _one_expert(cfg) + (cfg.get("model_type") == "gpt_oss") * experts   # router bias
    if cfg.get("model_type") == "qwen2_moe":
        block += 3 * h * _need(cfg, "shared_expert_intermediate_size") + h
    if cfg.get("model_type") in _GRANITE_SHARED:
        block += 3 * h * int(cfg.get("shared_intermediate_size") or 0)
    if cfg.get("model_type") == "glm4_moe":   # shared experts (the correction bias: a buffer); dense first layers
        block += 3 * h * _expert_size(cfg) * int(cfg.get("n_shared_experts") or 0)
        return {i: block for i in range(int(cfg.get("first_k_dense_replace", 1)), layers)}
    if cfg.get("model_type") == "ernie4_5_moe":
        shared = _expert_size(cfg) * int(cfg.get("moe_num_shared_experts") or 0)
        block += experts + 3 * h * shared + bool(cfg.get("use_bias")) * bool(shared) * (2 * shared + h)
        start, end = int(cfg.get("moe_layer_start_index", 1)), int(cfg.get("moe_layer_end_index", -1))
        step, end = int(cfg.get("moe_layer_interval") or 1), layers - 1 if end == -1 else end
        return {i: block for i in range(layers) if (i + 1) % step == 0 and start <= i <= end}
    if cfg.get("model_type") not in ("qwen2_moe", "qwen3_moe"):
        return {i: block for i in range(layers)}
    dense, step = set(cfg.get("mlp_only_layers") or ()), int(cfg.get("decoder_sparse_step") or 1)
    return {i: block for i in range(layers) if i not in dense and (i + 1) % step == 0}


def dtype_bytes(dtype: str | None, cfg: dict | None = None) -> float:
    """Bytes per parameter: `dtype` if given, else the config's torch_dtype/dtype, else bf16 (2)."""
    name = dtype or (cfg or {}).get("torch_dtype") or (cfg or {}).get("dtype") or "bf16"
    if str(name).lower() not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}; one of bf16, fp16, fp32")
    return DTYPE_BYTES[str(name).lower()]


def windows(cfg: dict) -> tuple[int, int]:
    """(the sliding window, how many layers have it) as the engine reads a config: `layer_windows`
    (engine/config.py) on transformers' own config class, which derives each family's layer types
    (Qwen2/Qwen3's use_sliding_window and max_window_layers, Gemma 2/3's and OLMo 3's patterns);
    (0, 0) without one. A model type transformers does not know is read as its keys say."""
    from transformers import AutoConfig

    from engine.config import layer_windows
    fields = {k: v for k, v in cfg.items() if k != "model_type"}
    try:
        hf = AutoConfig.for_model(cfg.get("model_type", ""), **fields)
    except (ValueError, TypeError, KeyError):
        hf = SimpleNamespace(**cfg)
    per_layer = [w for w in layer_windows(hf) if w]
    return (max(per_layer), len(per_layer)) if per_layer else (0, 0)


def spec_from_config(cfg: dict, name: str, dtype: str | None = None, params: float | None = None) -> ModelSpec:
    """A ModelSpec from an HF config dict (see `count_params` for what is counted, `windows` for
    the sliding window)."""
    heads = _need(cfg, "num_attention_heads")
    window, window_layers = windows(cfg)
    counted = count_params(cfg)
    expert_params, experts, per_token = moe_params(cfg)
    # `params` (--params) replaces the count; a mixture's experts keep their share of it
    total = float(params or counted)
    return ModelSpec(name=name, params=total, layers=_need(cfg, "num_hidden_layers"),
                     kv_heads=cfg.get("num_key_value_heads") or heads, head_dim=head_dim(cfg),
                     dtype_bytes=dtype_bytes(dtype, cfg), window=window, window_layers=window_layers,
                     expert_params=expert_params * total / counted, experts=experts, experts_per_token=per_token)


def resolve_spec(model: str, dtype: str | None = None, params: float | None = None) -> ModelSpec:
    """A preset (optionally with dtype/params replaced) or a spec built from the HF config of a model
    as `pdserve serve --model` names it: a directory or its config.json, a GGUF file (its metadata;
    nothing converted) or a Hugging Face id in the local Hugging Face cache."""
    if model in MODELS:
        spec = MODELS[model]
        changes = {"dtype_bytes": dtype_bytes(dtype)} if dtype else {}
        return dataclasses.replace(spec, **changes, **({"params": float(params)} if params else {}))
    p = Path(model).expanduser()
    if p.is_file() and p.suffix.lower() == ".gguf":
        try:
            return spec_from_config(gguf_config(p), served_name(model), dtype, params)
        except ModelError as exc:
            raise ValueError(str(exc)) from None
    if not p.exists():
        snapshot = _cached(model)
        if snapshot is None:
            raise ValueError(f"--model {model!r} is neither a preset ({', '.join(MODELS)}), nor a path to an HF "
                             "model directory, its config.json or a .gguf file, nor a Hugging Face id in the local "
                             "Hugging Face cache")
        return spec_from_config(load_config(snapshot), model, dtype, params)
    cfg = load_config(p)
    name = (p.parent.name if p.is_file() else p.name) or cfg.get("_name_or_path") or "model"
    return spec_from_config(cfg, name, dtype, params)


def _cached(model: str) -> Path | None:
    """The local Hugging Face cache's snapshot of `model` if it reads as an id and is there whole."""
    try:
        return hub_snapshot(model) if is_hub_id(model) else None
    except ModelError:
        return None
