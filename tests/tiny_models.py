"""Tiny random-weight models for tests (test-only: the runtime never builds models).

`tiny_model_dir` writes a small Hugging Face model directory (llama, qwen2, qwen3, phi3, smollm3,
granite, olmo2, olmo3, gemma2, gemma3_text or mistral shape) that
loads like a real one, in about a second.
"""

from __future__ import annotations

from pathlib import Path

from serving.models import CHATML_TEMPLATE, ModelError

TINY_ARCHS = ("llama", "qwen2", "mistral", "qwen3", "phi3", "smollm3", "granite", "olmo2", "olmo3", "gemma2",
              "gemma3_text")


def tiny_model_dir(path: Path, arch: str = "llama", seed: int = 0, tokenizer_dir: Path | None = None,
                   head_dim: int = 16) -> Path:
    """Write a tiny random-weight causal LM (hidden 64, 2 layers, 4 heads of ``head_dim``, 2 KV heads) into
    ``path``; return it.

    ``arch`` is one of TINY_ARCHS (all but mistral tie embeddings; phi3 has fused qkv_proj and gate_up_proj;
    smollm3's second layer has no RoPE; granite has IBM Granite 3's multipliers; olmo2 its norms after
    each block; gemma3_text a first layer with a sliding window of 8 tokens and local RoPE, a second with
    global RoPE, and Gemma 3's norms, embedding scale and GELU; gemma2 the same windows and norms with
    one RoPE and soft caps small enough to matter in a tiny model: scores at 2, logits at 3; olmo3
    olmo2's norms with the same windows and RoPE of its own per layer type, thetas 10^4 and 5 * 10^5).
    The tokenizer is copied from ``tokenizer_dir`` (e.g. the default model's directory, so prompts tokenize as for the real model);
    without one, a small byte-level tokenizer with ChatML special tokens and a ChatML template is built.
    The weights depend only on (arch, seed, vocab size, head_dim); the global torch RNG is left as it was. ~1 s.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    if arch not in TINY_ARCHS:
        raise ModelError(f"unknown tiny arch {arch!r}; choose one of {', '.join(TINY_ARCHS)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if tokenizer_dir is not None:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    else:
        tokenizer = _builtin_tokenizer()
    config = _tiny_config(arch, tokenizer, head_dim)
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


def _tiny_config(arch: str, tokenizer, head_dim: int = 16):
    from transformers import (Gemma2Config, Gemma3TextConfig, GraniteConfig, LlamaConfig, MistralConfig, Olmo2Config,
                              Olmo3Config, Phi3Config, Qwen2Config, Qwen3Config, SmolLM3Config)

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig, "qwen3": Qwen3Config,
           "phi3": Phi3Config, "smollm3": SmolLM3Config, "granite": GraniteConfig, "olmo2": Olmo2Config,
           "olmo3": Olmo3Config, "gemma2": Gemma2Config, "gemma3_text": Gemma3TextConfig}[arch]
    extra = {"smollm3": {"no_rope_layers": [1, 0]},
             "granite": {"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "logits_scaling": 8.0,
                         "attention_multiplier": 0.0078125},
             "gemma3_text": {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
             "gemma2": {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
                        "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0},
             "olmo3": {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
                       "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                           "full_attention": {"rope_type": "default", "rope_theta": 500000.0}}},
             }.get(arch, {})
    return cls(**extra, vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=2048,
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
