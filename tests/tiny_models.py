"""Tiny random-weight models for tests (test-only: the runtime never builds models).

`tiny_model_dir` writes a small Hugging Face model directory (llama, qwen2, qwen3, phi3, smollm3,
granite, granitemoehybrid (Granite 4.0 attention-only, no experts), olmo2, olmo3, exaone4,
ernie4_5, helium, seed_oss, arcee, starcoder2, nemotron, stablelm, phi, cohere, cohere2,
glm, glm4, gemma, gemma2,
gemma3_text, mistral or ministral shape, or a mixture of experts: mixtral, qwen2_moe, qwen3_moe,
olmoe, granitemoe, granitemoeshared, ernie4_5_moe, gpt_oss, glm4_moe) that loads like a real one, in about a
second.
"""

from __future__ import annotations

from pathlib import Path

from serving.models import CHATML_TEMPLATE, ModelError

TINY_ARCHS = ("llama", "qwen2", "mistral", "ministral", "qwen3", "phi3", "smollm3", "granite", "granitemoehybrid",
              "olmo2", "olmo3", "exaone4", "ernie4_5", "helium", "seed_oss", "arcee", "starcoder2", "nemotron",
              "stablelm", "phi", "cohere", "cohere2", "glm", "glm4", "gemma", "gemma2", "gemma3_text")
TINY_MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "granitemoeshared", "ernie4_5_moe",
                  "gpt_oss", "glm4_moe")
_GRANITE = {"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "logits_scaling": 8.0,
            "attention_multiplier": 0.0078125}


def tiny_model_dir(path: Path, arch: str = "llama", seed: int = 0, tokenizer_dir: Path | None = None,
                   head_dim: int = 16, overrides: dict | None = None) -> Path:
    """Write a tiny random-weight causal LM (hidden 64, 2 layers, 4 heads of ``head_dim``, 2 KV heads) into
    ``path``; return it.  ``arch`` is one of TINY_ARCHS or TINY_MOE_ARCHS (4 experts of intermediate size 32,
    2 a token; ernie4_5_moe with a shared expert and a dense first layer; qwen2_moe with its shared expert and
    a dense second layer, top-k weights not renormalized, as olmoe's, whose heads are always 16 wide: its q/k
    norms span hidden_size, hidden / heads (helium's too: its o_proj is [hidden, hidden]; stablelm's and
    phi's, whose configs have no head_dim); all but mistral tie
    embeddings; phi3 has fused qkv_proj and gate_up_proj; smollm3's second layer has no RoPE; granite has IBM
    Granite 3's multipliers, as the granitemoe* do (granitemoeshared with a shared MLP of 64,
    granitemoehybrid's of 128 its only MLP); olmo2 its norms after each block; gemma3_text a first layer with
    a sliding window of 8 tokens and local RoPE, a second with global RoPE, and Gemma 3's norms, embedding
    scale and GELU; gemma (Gemma 1) its norms, embedding scale and GELU (as the legacy "gelu"), no window;
    gemma2 the same windows and norms with one RoPE and soft caps small enough to matter in a tiny model:
    scores at 2, logits at 3; olmo3 olmo2's norms with the same windows and RoPE of its own per layer type,
    thetas 10^4 and 5 * 10^5; exaone4 olmo2's norms with qwen3's per-head q/k norms, the same windows and no
    RoPE on its second, global, layer; ernie4_5, helium, glm and glm4 RoPE on interleaved pairs (glm's on half
    of each head), ernie4_5 with biases on every projection, glm4 with Gemma 3's norms; seed_oss with q/k/v,
    o_proj and MLP biases; arcee's ungated ReLU^2 MLP with biases; ministral's first layer with a sliding
    window of 8 tokens; starcoder2 LayerNorms, an ungated GELU-tanh MLP (c_fc, c_proj), biases everywhere
    and a window of 8 on every layer; nemotron LayerNorms scaling by 1 + weight, an ungated ReLU^2 MLP,
    biases and RoPE on half of each head; stablelm LayerNorms, q/k/v biases, RoPE on a quarter of each head
    and attention and MLP side by side, `use_parallel_residual`; phi the same with an ungated GELU MLP, fc1
    and fc2, biases on every projection and the LM head, and RoPE on half of each head; cohere and cohere2 the
    side by side block on Cohere's LayerNorms (no bias), RoPE on interleaved pairs and a logit scale, cohere2's
    first layer with a window of 8, its second, global, without RoPE; gpt_oss attention sinks, biases on every
    projection and its router, a first layer with a window of 8, a full second; glm4_moe a dense first layer,
    its experts in 2 groups of which tokens pick from 1, a shared expert, a routed scale of 2.5, q/k norms, q/k/v
    biases and RoPE on half of each head). The tokenizer is
    copied from ``tokenizer_dir`` (e.g. the default model's directory, so prompts tokenize as for the real
    model); without one, a small byte-level tokenizer with ChatML special tokens and a ChatML template is
    built. ``overrides``: more config keys (e.g. granitemoehybrid with experts). The weights depend only on
    (arch, seed, vocab size, head_dim, overrides); the global torch RNG is left as it was. ~1 s.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    if arch not in TINY_ARCHS + TINY_MOE_ARCHS:
        raise ModelError(f"unknown tiny arch {arch!r}; choose one of {', '.join(TINY_ARCHS + TINY_MOE_ARCHS)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if tokenizer_dir is not None:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    else:
        tokenizer = _builtin_tokenizer()
    config = _tiny_config(arch, tokenizer, head_dim, overrides or {})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                                               eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def with_random_norms(path: Path) -> Path:
    """The checkpoint at ``path`` with every RMSNorm weight random around 1 (a fresh model's are all
    ones; Gemma's all zeros, scaling by 1 + weight), saved in place; returns ``path``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1, 0.5)
    model.save_pretrained(path)
    return path


def _tiny_config(arch: str, tokenizer, head_dim: int, overrides: dict):
    from transformers import (ArceeConfig, Cohere2Config, CohereConfig, Ernie4_5Config, Ernie4_5_MoeConfig,
                              Exaone4Config, Gemma2Config, Gemma3TextConfig, GemmaConfig, Glm4Config, GlmConfig,
                              Glm4MoeConfig, GptOssConfig, GraniteConfig, GraniteMoeConfig, GraniteMoeHybridConfig,
                              GraniteMoeSharedConfig, HeliumConfig, LlamaConfig, MinistralConfig, MistralConfig,
                              MixtralConfig, NemotronConfig, Olmo2Config, Olmo3Config, OlmoeConfig, Phi3Config,
                              PhiConfig, Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig, SeedOssConfig,
                              SmolLM3Config, StableLmConfig, Starcoder2Config)

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig, "qwen3": Qwen3Config,
           "phi3": Phi3Config, "smollm3": SmolLM3Config, "granite": GraniteConfig, "olmo2": Olmo2Config,
           "olmo3": Olmo3Config, "gemma": GemmaConfig, "gemma2": Gemma2Config, "gemma3_text": Gemma3TextConfig, "mixtral": MixtralConfig,
           "qwen2_moe": Qwen2MoeConfig, "qwen3_moe": Qwen3MoeConfig, "olmoe": OlmoeConfig,
           "granitemoe": GraniteMoeConfig, "granitemoeshared": GraniteMoeSharedConfig,
           "granitemoehybrid": GraniteMoeHybridConfig, "exaone4": Exaone4Config,
           "ernie4_5": Ernie4_5Config, "helium": HeliumConfig, "ernie4_5_moe": Ernie4_5_MoeConfig,
           "glm": GlmConfig, "glm4": Glm4Config, "ministral": MinistralConfig, "seed_oss": SeedOssConfig,
           "arcee": ArceeConfig, "starcoder2": Starcoder2Config, "nemotron": NemotronConfig,
           "stablelm": StableLmConfig, "phi": PhiConfig, "cohere": CohereConfig, "cohere2": Cohere2Config,
           "gpt_oss": GptOssConfig, "glm4_moe": Glm4MoeConfig}[arch]
    granite_moe = {**_GRANITE, "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32}
    moe = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}
    extra = {"smollm3": {"no_rope_layers": [1, 0]},
             "granite": _GRANITE,
             "granitemoe": granite_moe,
             "granitemoeshared": {**granite_moe, "shared_intermediate_size": 64},
             "granitemoehybrid": {**_GRANITE, "num_local_experts": 0, "shared_intermediate_size": 128,
                                  "layer_types": ["attention", "attention"], "position_embedding_type": "rope"},
             "ernie4_5": {"use_bias": True},      # ERNIE 4.5's biases on every projection (0.3B has none)
             # its first layer dense, as ERNIE-4.5-21B-A3B's; one shared expert
             "ernie4_5_moe": {"moe_num_experts": 4, "moe_k": 2, "moe_intermediate_size": 32,
                              "moe_num_shared_experts": 1, "moe_layer_start_index": 1},
             "gemma": {"hidden_act": "gelu"},      # Gemma 1's checkpoints' legacy name of GELU-tanh
             "seed_oss": {"attention_bias": True, "attention_out_bias": True, "mlp_bias": True},
             "arcee": {"mlp_bias": True},
             "starcoder2": {"use_bias": True, "sliding_window": 8},
             "nemotron": {"attention_bias": True, "mlp_bias": True},
             "stablelm": {"use_qkv_bias": True, "use_parallel_residual": True},
             "phi": {"hidden_act": "gelu_new", "partial_rotary_factor": 0.5},
             "cohere": {"logit_scale": 0.5},
             "cohere2": {"logit_scale": 0.5, "sliding_window": 8,
                         "layer_types": ["sliding_attention", "full_attention"]},
             "ministral": {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
             "gemma3_text": {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
             "gemma2": {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
                        "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0},
             "olmo3": {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
                       "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                           "full_attention": {"rope_type": "default", "rope_theta": 500000.0}}},
             "exaone4": {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
             "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32},
             "qwen2_moe": {**moe, "num_experts": 4, "shared_expert_intermediate_size": 64, "mlp_only_layers": [1],
                           "norm_topk_prob": False},
             "qwen3_moe": {**moe, "num_experts": 4, "norm_topk_prob": True},
             "olmoe": {"num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32, "norm_topk_prob": False},
             "glm4_moe": {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                          "n_shared_experts": 1, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
                          "routed_scaling_factor": 2.5, "use_qk_norm": True, "attention_bias": True,
                          "partial_rotary_factor": 0.5},
             "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
                         "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
                         # gpt-oss's YaRN, its factor from a shorter original length (its 4096 x 32)
                         "rope_parameters": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0,
                                             "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                                             "original_max_position_embeddings": 256}},
             }.get(arch, {})
    extra = {"intermediate_size": 128, **extra, **overrides}
    return cls(**extra, vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2,
               head_dim=16 if arch in ("olmoe", "helium", "stablelm", "phi") else head_dim,
               max_position_embeddings=2048,
               tie_word_embeddings=arch != "mistral", bos_token_id=tokenizer.bos_token_id,
               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


def _builtin_tokenizer():
    """Byte-level BPE with no merges: ids 0-2 are <|endoftext|>, <|im_start|>, <|im_end|> (as in SmolLM2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {tok: i for i, tok in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<|endoftext|>", bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", pad_token="<|im_end|>", chat_template=CHATML_TEMPLATE,
                                   model_max_length=2048)


def tiny_gguf(model_dir: Path, out: Path, arch: str = "llama", quantize: str | None = None) -> Path:
    """Write the tiny llama at ``model_dir`` (tiny_model_dir's, tied embeddings, a byte-level BPE
    tokenizer) as the GGUF file ``out``, the way llama.cpp's converter does: its metadata under
    ``arch``'s keys (another arch than llama makes a file the engine must refuse), float32 tensors
    under GGUF names, Q and K rows permuted to llama.cpp's RoPE layout, the tokenizer as a "gpt2" vocab
    with its merges (the default model's tokenizer: ~10 s to convert) or, for the built-in one that
    has none, zero scores, and the chat template; ``quantize`` (a GGML type gguf-py quantizes, e.g.
    "Q8_0", "Q4_1") stores the matrices in it (norms stay float32, as llama.cpp keeps them). Returns ``out``."""
    import json

    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    cfg = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(model_dir.name)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_rope_dimension_count(cfg["head_dim"])
    specials = {t["id"]: t["content"] for t in tok["added_tokens"] if t["special"]}
    tokens = {i: t for t, i in tok["model"]["vocab"].items()} | specials
    assert sorted(tokens) == list(range(cfg["vocab_size"])), "a vocab with holes"
    w.add_tokenizer_model("gpt2")
    w.add_token_list([tokens[i] for i in range(len(tokens))])
    w.add_token_types([gguf.TokenType.CONTROL if i in specials else gguf.TokenType.NORMAL for i in range(len(tokens))])
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    if merges:
        w.add_token_merges(merges)
    else:       # the built-in tokenizer's: transformers derives merges from scores then (none here)
        w.add_token_scores([0.0] * len(tokens))
    for add, key in ((w.add_bos_token_id, "bos_token_id"), (w.add_eos_token_id, "eos_token_id"),
                     (w.add_pad_token_id, "pad_token_id")):
        add(cfg[key])
    w.add_chat_template((model_dir / "chat_template.jinja").read_text())
    names = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for key, tensor in load_file(model_dir / "model.safetensors").items():
        module = key.removesuffix(".weight")
        if module.startswith("model.layers."):
            index, part = module.removeprefix("model.layers.").split(".", 1)
            name = f"blk.{index}.{names[part]}"
        else:
            name = names[module]
        if part_heads := {"attn_q": heads, "attn_k": kv_heads}.get(name.rsplit(".", 1)[-1]):
            # llama.cpp's permute: each head's rotary halves interleaved (transformers' loader undoes it)
            rows = tensor.shape[0]
            tensor = tensor.reshape(part_heads, 2, rows // part_heads // 2, -1).swapaxes(1, 2).reshape(tensor.shape)
        tensor = np.ascontiguousarray(tensor, dtype=np.float32)
        if quantize and tensor.ndim == 2:
            qtype = getattr(gguf.GGMLQuantizationType, quantize)
            w.add_tensor(f"{name}.weight", gguf.quants.quantize(tensor, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(f"{name}.weight", tensor)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
