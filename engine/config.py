"""Engine configuration: one frozen dataclass that validates itself on creation."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_QUANTIZATIONS = (None, "int8", "int4")
_ATTENTION_BACKENDS = ("auto", "paged", "torch")
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_kv_memory(spec: str | int | float) -> tuple[str, float]:
    """'auto' -> ('auto', 0); 0 < x <= 1 -> ('fraction', x); '2GiB' or an int -> ('bytes', n)."""
    if isinstance(spec, str) and spec.strip().lower() == "auto":
        return "auto", 0.0
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        if 0 < spec <= 1:
            return "fraction", float(spec)
        if spec > 1 and float(spec).is_integer():
            return "bytes", float(spec)
        raise ValueError(f"kv_cache_memory must be a fraction in (0, 1] or a byte count, got {spec}")
    m = _SIZE_RE.match(str(spec))
    if not m:
        raise ValueError(f"kv_cache_memory {spec!r}: use 'auto', a fraction like 0.5, or a size like '2GiB'")
    value = float(m.group(1)) * _UNITS[(m.group(2) or "b").lower()]
    if value <= 1:
        return "fraction", value
    return "bytes", value


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine needs; shared by the prefill, decode and colocated roles.

    model: a local Hugging Face model directory (see `serving.models.resolve_model`).
    dtype: float32 | bfloat16 | float16 | auto (bf16 on CUDA, fp16 on GPUs without bf16; on CPU
        bf16 where the CPU has native bf16 (AVX512-BF16/AMX) or the engine's GEMVs build for AVX2,
        else fp32). float32 is the exact mode: greedy output token-identical to Hugging Face
        `generate` in fp32.
    quantization: None | int8 | int4: quantization of every linear and the LM head (CPU): int8
        weights per output channel, int4 in groups of 32 with a scale and zero each; with the
        engine's VNNI kernels the activations are rounded to int8 inside each linear too (each
        row in groups of 32, llama.cpp's Q8_0 scheme), without them they stay bf16 (weight-only).
        Faster decode; see engine.linear for how each runs.
    device: auto | cpu | cuda | cuda:N (auto picks CUDA when available).
    attention_backend: how decode attention reads the KV pool: paged (the engine's kernel reads
        K/V in place by block table: C++ on CPU in float32/bfloat16, Triton on CUDA), torch
        (gathers each sequence's blocks, then sdpa; any device and dtype), auto (paged where it
        applies and is available, else torch).
    cuda_graphs: on CUDA with the paged attention backend, replay pure decode steps from CUDA
        graphs captured at start, one per batch bucket (engine.cuda_graphs).
    cpu_gemv: on CPU, run steps of few rows through the engine's GEMV kernels (engine.linear):
        the faster small-batch decode (measured here: bf16 batch 1 1.3x, fp32 2x), at the cost of
        a second, blocked copy of every bf16 weight (2x the weight memory; fp32 and int8/int4
        use their one packed weight). False: oneDNN / MKL for the dense formats and aten's
        kernels for int8/int4 (int8 then weight-only, with a bf16 copy), and one bf16 copy.
    kv_cache_memory: KV pool budget (see engine.memory): on CUDA a fraction is the share of the
        device's total memory for the whole replica (auto: 0.9), the pool getting what the
        weights and the profiled peak activations leave; on CPU a fraction of available RAM
        (auto: min(1 GiB, 25 %)); or a size such as '2GiB' for the pool itself.
    block_size: tokens per KV block.
    max_num_batched_tokens: token budget of one step; also the prefill chunk size.
    max_num_seqs: sequences running at once.
    max_model_len: longest prompt + output; None = the model's limit (`context_limit`: its positions,
        or the original length of a length-dependent RoPE, longrope / dynamic NTK; a value above
        that length serves such a model up to its positions with the RoPE of that many tokens for
        every sequence, `rope_pin`), capped by the pool.
    enable_prefix_caching: reuse full KV blocks of identical prefixes.
    num_threads: torch intra-op threads (None leaves torch's default; 1 is fastest for
        several small CPU processes).
    seed: seeds the sampler for requests that give no seed.
    speculative_tokens: decode steps feed up to this many draft tokens per sequence, proposed by
        prompt lookup (engine.ngram), and keep those the model picks itself: several tokens a step
        when drafts are right, and in float32 the same tokens as without (greedy and seeded
        sampling alike; in bf16 a step's extra rows change the linears' rounding, as a bigger
        batch does). 0: off.
    speculative_max_batch: speculate only while at most this many sequences run (a larger batch
        is bound by compute, where draft rows cost what they save).
    prediction_tokens: a request with a predicted output (SamplingParams.prediction) drafts up to
        this many tokens a step from it (engine.prediction), whatever `speculative_tokens`, as
        long as at most `speculative_max_batch` sequences run; kept as prompt lookup's are. 0:
        predictions are ignored.
    lora_modules: LoRA adapters served beside the base model, name -> a PEFT adapter directory
        (engine.lora); a request runs one by naming it (SamplingParams.lora).
    max_loras: LoRA adapters loaded at run time (a request brings the path of one:
        SamplingParams.lora_path) the engine holds, and runs in one step, at once; the least
        recently used that no request runs makes room for the next, and with none idle the request
        waits in the queue (and so do the requests of run-time adapters behind it), or, its K/V
        landed (decode role), parked with its blocks (engine.lora.LoraSet.use, engine/scheduler.py).
    scheduling_policy: fcfs (first come, first served) or priority (vLLM's: by each request's
        SamplingParams.priority, then arrival; engine/scheduler.py).
    """

    model: str
    dtype: str = "auto"
    quantization: str | None = None
    device: str = "auto"
    attention_backend: str = "auto"
    cuda_graphs: bool = True
    cpu_gemv: bool = True
    kv_cache_memory: str | int | float = "auto"
    block_size: int = 16
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    num_threads: int | None = None
    seed: int = 0
    speculative_tokens: int = 0
    speculative_max_batch: int = 8
    prediction_tokens: int = 8
    lora_modules: dict[str, str] = field(default_factory=dict)
    max_loras: int = 8
    scheduling_policy: str = "fcfs"

    def __post_init__(self):
        if not self.model:
            raise ValueError("model must be a model directory")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.quantization not in _QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {_QUANTIZATIONS}, got {self.quantization!r}")
        if self.quantization and self.dtype not in ("auto", "bfloat16"):
            raise ValueError(f"quantization {self.quantization} computes in bfloat16; dtype {self.dtype!r} "
                             "contradicts it (use auto or bfloat16)")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.attention_backend not in _ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {_ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        parse_kv_memory(self.kv_cache_memory)
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise ValueError(f"block_size must be a power of two up to 256, got {self.block_size}")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be positive")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be positive")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be at least 2")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError("num_threads must be positive")
        if not 0 <= self.speculative_tokens <= 16:
            raise ValueError(f"speculative_tokens must be in [0, 16], got {self.speculative_tokens}")
        if not 0 <= self.prediction_tokens <= 16:
            raise ValueError(f"prediction_tokens must be in [0, 16], got {self.prediction_tokens}")
        if self.speculative_max_batch < 1:
            raise ValueError("speculative_max_batch must be positive")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}")
        if any(not isinstance(name, str) or not name for name in self.lora_modules):
            raise ValueError("lora_modules' names must be non-empty strings")
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be positive, got {self.max_loras}")


# model types the engine's own forward runs (engine/decoder.py); Gemma 3's text models (270M, 1B:
# `gemma3_text`) differ most: RMSNorm scaling by 1 + weight, a scaled embedding, norms before and
# after attention and MLP, GELU-tanh, RoPE and a sliding window per layer type; Gemma 2 as Gemma 3
# without q/k norms or local RoPE, with soft-capped attention scores and logits; OLMo 3 as OLMo 2
# with Gemma 3's sliding layers and RoPE per layer type; Gemma 1 as Gemma 2 with only the norms before
# each block, no windows and no caps; the mixture-of-experts ones (engine/moe.py)
# as their dense relatives with a MoE block for the MLP: Mixtral as Mistral, Qwen2/3-MoE as Qwen2/3,
# OLMoE with OLMo 2's q/k norms over all heads but norms before each block; IBM's Granite MoE
# (3.0: granitemoe; 3.1: granitemoeshared, with an ungated shared MLP) as Granite with a MoE
# block, and Granite 4.0's attention-only checkpoints (granitemoehybrid without Mamba layers: micro,
# 1B, 350M; a shared MLP, with or without experts); EXAONE 4 as OLMo 2's norms after each block with
# Qwen3's per-head q/k norms, and in its hybrid models sliding layers and global ones without RoPE;
# ERNIE 4.5 and Helium as Llama with RoPE on interleaved pairs (engine.model_dims.INTERLEAVED_ROPE),
# GLM-4 (glm: 9B-chat; glm4: 0414) as Phi-3 (fused gate/up) with interleaved RoPE on half of each
# head, q/k/v biases, and (glm4) Gemma 3's norms after attention and MLP; gpt-oss as Mixtral with
# attention sinks, biases on every projection and its router, a clamped SwiGLU in its experts, and
# sliding and full layers alternating (MXFP4 checkpoints dequantized at load: engine.model_runner);
# GLM-4.5 (glm4_moe) as Qwen3-MoE (its q/k norms optional) with q/k/v biases, RoPE on half of each
# head, dense first layers and DeepSeek-V3's routing beside a shared expert
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "ministral", "qwen3", "phi3", "smollm3", "granite", "olmo2",
                         "olmo3", "exaone4", "ernie4_5", "helium", "seed_oss", "arcee", "starcoder2", "nemotron",
                         "stablelm", "phi", "cohere", "cohere2", "gemma", "gemma2", "gemma3_text", "mixtral",
                         "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "granitemoeshared", "granitemoehybrid",
                         "ernie4_5_moe", "glm", "glm4", "gpt_oss", "glm4_moe")
# of the MLP: relu2 is ReLU squared, gelu_new GELU-tanh written out as transformers' NewGELUActivation
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu_new", "relu2")


def unsupported_model(config: dict) -> str | None:
    """Why the engine cannot run a model of this config.json (a dict, or a transformers config's
    `to_dict()`), or None. Torch-free: `pdserve serve` checks a model directory with it before it
    starts anything."""
    model_type = config.get("model_type")
    if model_type == "gemma3" or isinstance(config.get("text_config"), dict):
        return (f"model type {model_type!r} is a multimodal checkpoint (text_config); pdserve runs text-only "
                "decoders (for Gemma 3: the gemma3_text checkpoints, 270M and 1B)")
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {model_type!r} is not supported; pdserve runs {', '.join(SUPPORTED_MODEL_TYPES)}"
    activation = config.get("hidden_activation") or config.get("hidden_act") or "silu"
    if model_type == "gemma" and activation == "gelu":    # transformers reads Gemma 1's legacy "gelu" so
        activation = "gelu_pytorch_tanh"
    if activation not in ACTIVATIONS:
        return f"activation {activation!r} is not supported ({', '.join(ACTIVATIONS)})"
    if config.get("use_bidirectional_attention") or config.get("is_causal") is False:   # transformers >= 5.2's
        return ("bidirectional attention (an embedding model's: use_bidirectional_attention, or is_causal false) is "
                "not supported: the engine's attention is causal")
    if config.get("use_qk_norm") and model_type == "cohere":          # (GLM-4.5's are RMSNorms: they run)
        return "use_qk_norm (Command R+'s LayerNorm of each query and key head) is not supported"
    if config.get("qk_layernorm"):
        return "qk_layernorm (a LayerNorm of each query and key head: StableLM 2 12B) is not supported"
    if config.get("clip_qkv") is not None:
        return "clip_qkv (OLMoE's clamped projections) is not supported"
    quant = config.get("quantization_config")
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if quant and method != "mxfp4":     # gpt-oss's MXFP4 experts are dequantized at load (engine.model_runner)
        return (f"a pre-quantized checkpoint (quant_method {method!r}) is not supported: serve the unquantized "
                "(bf16 / fp16) checkpoint, with engine.quantization int8 or int4 for smaller weights")
    if model_type == "granitemoehybrid":
        return _granite4_problem(config)
    return None


def _granite4_problem(config: dict) -> str | None:
    """Granite 4.0 (granitemoehybrid): only its attention-only checkpoints with RoPE run; its
    hybrid ones (the -h models) have Mamba-2 layers, whose recurrent state is not paged KV."""
    kinds = config.get("layer_types") or config.get("layers_block_type")    # absent: transformers' all Mamba
    mamba = len(kinds) - sum(kind in ("attention", "full_attention") for kind in kinds) if kinds else "all"
    if mamba:
        return (f"{mamba} of the model's layers are Mamba layers (a Granite 4.0 hybrid, -h, checkpoint); "
                "pdserve runs Granite 4.0's attention-only checkpoints (micro, 1b, 350m)")
    if config.get("position_embedding_type") != "rope":
        return (f"position_embedding_type {config.get('position_embedding_type')!r}: attention without RoPE "
                "on every layer is not supported")
    return None


def layer_windows(hf_config) -> list[int]:
    """Per layer, 0 (full attention) or the number of last keys it attends, itself included: the
    layers `layer_types` calls "sliding_attention" (Qwen2/Qwen3 with `use_sliding_window`, Gemma 3's
    local layers), or every layer where a config has a `sliding_window` but no layer types (Mistral
    v0.1's 4096, Phi-3-mini-4k's 2047). Transformers' mask: key k is seen by query q if k > q - W."""
    window = int(getattr(hf_config, "sliding_window", None) or 0)
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is None:
        return [window] * hf_config.num_hidden_layers
    return [window if kind == "sliding_attention" else 0 for kind in layer_types]


def _length_dependent_original(hf_config) -> int | None:
    """The original length of a RoPE whose frequencies change with the sequence's length (`longrope`:
    Phi-3/3.5/4-mini's long contexts; `dynamic` NTK), the least over the layer types' (Gemma 3's,
    OLMo 3's `rope_parameters` by layer type: each is checked); None for a RoPE that does not change."""
    positions = int(getattr(hf_config, "max_position_embeddings", 2048))
    rope = getattr(hf_config, "rope_parameters", None) or {}
    kinds = [r for r in rope.values() if isinstance(r, dict)] if "rope_type" not in rope else [rope]
    originals = [int(params.get("original_max_position_embeddings")
                     or getattr(hf_config, "original_max_position_embeddings", None) or positions)
                 for params in kinds if params.get("rope_type") in ("longrope", "dynamic")]
    return min(originals, default=None)


def context_limit(hf_config, max_model_len: int | None = None) -> int:
    """The longest sequence a model's transformers config allows the engine: its
    `max_position_embeddings` (2048 if absent); for a RoPE whose frequencies change with the
    length (`_length_dependent_original`) the original length, unless `max_model_len` (the
    configured one) asks for more. Transformers switches those frequencies by the longest position
    in a forward, which in a batch of sequences would let one sequence change another's: up to the
    original length every sequence gets the same RoPE, Hugging Face's own for that length; beyond
    it the engine pins the frequencies at `max_model_len` for every sequence (`rope_pin`). (Sliding
    windows do not limit it: the engine's attention implements them, see engine.attention.)"""
    positions = int(getattr(hf_config, "max_position_embeddings", 2048))
    original = _length_dependent_original(hf_config)
    if original is None or (max_model_len or 0) > original:
        return positions
    return min(positions, original)


def rope_pin(hf_config, max_model_len: int | None) -> int | None:
    """The position every RoPE call of the engine adds to a forward's own (its cos/sin dropped), or
    None. A length-dependent RoPE served beyond its original length (`max_model_len` above it) is
    pinned to the frequencies of a sequence of `max_model_len` (at most the model's positions):
    transformers picks them by the longest position in the call, so with this one every sequence,
    prompt chunk and step gets the same, whatever the batch. That is vLLM's rule for Phi-3's
    longrope (the long factors for every sequence iff max_model_len exceeds the original length;
    dynamic NTK scaled for max_model_len): sequences within the original length then see other
    frequencies than transformers gives them alone (its short factors). None: up to the original
    length (the default), Hugging Face's own RoPE."""
    original = _length_dependent_original(hf_config)
    if original is None or (max_model_len or 0) <= original:
        return None
    return min(max_model_len, int(getattr(hf_config, "max_position_embeddings", 2048))) - 1
