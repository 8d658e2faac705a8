"""A lean forward for Llama-family decoders (Llama, Mistral, Ministral, Qwen2, Qwen3, Phi-3,
SmolLM3, Granite, OLMo 2, OLMo 3, EXAONE 4, ERNIE 4.5, Helium, Seed-OSS, Arcee AFM, StarCoder2,
Nemotron, StableLM, Phi 1.5/2, Cohere (Command R, R7B), GLM-4, Gemma 1, 2 and 3 text): the
engine's model code.

Weights come from the stock transformers model (`AutoModelForCausalLM`, so every checkpoint
format it reads works: safetensors, the GGUF-converted default model); the forward is ours:
one ragged row of tokens, fused Q/K/V and gate/up projections in the engine's weight format
(`engine.linear`), and paged attention (`engine.attention`). Per layer it is a dozen torch ops
where transformers' modules spend several times that in Python, which at small batch is most
of a step on a CPU. The math is the transformers one, op for op where rounding matters
(RMSNorm in fp32, RoPE from the model's own rotary module, residuals in the model's dtype), so
the fp32 mode stays token-identical to Hugging Face `generate`. Qwen3 differs from Llama only by
an RMSNorm over each query and key head (its `q_norm`/`k_norm`) before RoPE; Phi-3 by checkpoints
with Q/K/V and gate/up already fused (`qkv_proj`, `gate_up_proj`) and, in Phi-4-mini, RoPE on a
part of each head (`partial_rotary_factor`: the first `rotary_dim` dimensions); SmolLM3 by layers
without RoPE (`no_rope_layers`), which the fused RoPE + K/V store kernel runs with cos 1, sin 0;
Granite by four constants: the embeddings, each block's output (before its residual add) and the
logits scaled, and `attention_multiplier` as the attention's scale; OLMo 2 by norms after each block
instead of before (`x + norm(attn(x))`, `x + norm(mlp(x))`) and q/k norms over all heads at once
(OLMo 3 too, with Gemma 3's sliding layers and RoPE per layer type; EXAONE 4 with Qwen3's per-head
q/k norms and, in its hybrid models, sliding layers and global layers without RoPE);
Arcee's AFM (`arcee`) by an ungated MLP, down(relu(up(x))^2); StarCoder2 and Nemotron by LayerNorms
with a bias (Nemotron's scaling by 1 + weight) and ungated MLPs (GELU-tanh; ReLU^2), StarCoder2 with
biases on every projection and a sliding window, Nemotron with RoPE on half of each head; StableLM
by LayerNorms and, where `use_parallel_residual`, attention and MLP side by side on one norm's output;
Phi (Phi-1.5, Phi-2) likewise, with an ungated GELU MLP (fc1, fc2) and biases on every projection and
on the LM head; Cohere likewise with its own LayerNorm (no bias, in fp32), RoPE on interleaved pairs
(its rotary tables interleaved too, reordered as the q/k rows are) and a logit scale, Cohere 2 with
sliding layers and global ones without RoPE;
Gemma 3 (`gemma3_text`) by norms both before and after attention and MLP (`x + norm(attn(norm(x)))`),
RMSNorm scaling by 1 + weight (folded into the weights at load), an embedding scaled by
sqrt(hidden) in the model's dtype, Qwen3's per-head q/k norms, a GELU-tanh gated MLP,
`query_pre_attn_scalar` as the attention's scale, and per layer type ("sliding_attention" /
"full_attention") its own RoPE frequencies and a sliding window (see engine.attention); Gemma 2
(`gemma2`) as Gemma 3 without the q/k norms and with one RoPE, plus soft caps, `cap * tanh(x /
cap)`, on the attention's scores (`attn_logit_softcapping`: in the attention kernels, and in
sdpa's math written out where a prompt chunk runs sdpa, engine.attention.eager_sdpa) and on the
logits (`final_logit_softcapping`); Gemma 1 (`gemma`) as Gemma 2 with only the norms before each
block and neither windows nor caps. Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE are their dense relatives
(Mistral, Qwen2, Qwen3, OLMo 2's q/k norms with norms before each block) with a mixture-of-experts
block for the MLP (engine/moe.py), and Granite MoE is Granite with one (`block_sparse_moe`; 3.1's
with an ungated `shared_mlp` beside it); Granite 4.0's attention-only checkpoints
(`granitemoehybrid`) are Granite whose MLP is that shared MLP, experts beside it or not. gpt-oss
(`gpt_oss`) is Mixtral with biases on every projection, sliding and full layers alternating,
attention sinks (a logit per query head in every softmax, engine.attention) and a rotary module
whose cos/sin cover half a head (doubled here to the engine's full-width tables).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from engine import weight_arena
from engine.attention import AttentionMetadata, fused_attention, paged_attention
from engine.backends import dtype_name
from engine.config import layer_windows, unsupported_model
from engine.linear import fused_weight, make_linear
from engine.lora import LoraBatch
from engine.model_dims import LAYER_NORM, PARALLEL_BLOCK, Dims
from engine.moe import MoeMlp, is_moe_block

class _Layer:
    # in_norm/post_norm: the norms before attention and before the MLP; OLMo 2 (post-norm) has none
    # before attention (in_norm None), and post_norm/ff_norm after attention and after the MLP;
    # Gemma 3 has all four: in_norm, attn_norm (after attention), post_norm (before the MLP), ff_norm.
    # q_norm/k_norm: RMSNorm weights of each query and key head [head_dim] (Qwen3) or of all of them
    # at once [heads * head_dim] (OLMo 2), None elsewhere; rope: False for SmolLM3's layers without
    # positions; rope_kind: the layer type whose RoPE it takes (Gemma 3), else None; window: 0 or
    # its sliding window; moe: the layer's mixture-of-experts block (engine.moe) in place of gate_up
    # and down, or None; sinks: gpt-oss's attention sinks [heads] in fp32, else None
    __slots__ = ("index", "in_norm", "attn_norm", "post_norm", "ff_norm", "qkv", "o", "gate_up", "down", "moe",
                 "q_norm", "k_norm", "rope", "rope_kind", "window", "sinks")


class DecoderModel:
    """`forward(input_ids [T], positions [T], meta, lora) -> hidden [T, hidden]` and
    `lm_head(hidden [n, hidden]) -> logits [n, vocab]` in the model's dtype (Gemma 2's: fp32).
    `lora` (engine.lora.LoraBatch, or None): the step's rows that run a LoRA adapter, whose update
    each linear of theirs adds (the LM head has none)."""

    def __init__(self, hf_model, weight_format: str, dtype: torch.dtype, kernels=None, gemv: bool = True,
                 rope_pin: int | None = None):
        """`rope_pin`: a position every RoPE call includes (engine.config.rope_pin), or None."""
        cfg = hf_model.config
        problem = unsupported_model(cfg.to_dict())
        if problem:
            raise ValueError(problem)
        self.dtype = dtype
        self.model_type = cfg.model_type
        self.dims = dims = Dims.of_config(cfg)
        self.num_heads, self.num_kv_heads, self.head_dim = dims.num_heads, dims.num_kv_heads, dims.head_dim
        self.hidden_size, self.intermediate_size = cfg.hidden_size, dims.intermediate_size
        # Granite's attention_multiplier, Gemma's query_pre_attn_scalar ** -0.5, else head_dim ** -0.5
        pre_attn = getattr(cfg, "query_pre_attn_scalar", None)
        self.scale = float(getattr(cfg, "attention_multiplier", None) or (pre_attn or self.head_dim) ** -0.5)
        self.activation = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None) or "silu"
        # Gemma's RMSNorm and Nemotron's LayerNorm scale by 1 + weight: the 1 is added to the weights here
        self.norm_offset = 1.0 if cfg.model_type in ("gemma", "gemma2", "gemma3_text", "nemotron") else 0.0
        self.layer_norm = cfg.model_type in LAYER_NORM         # LayerNorms with a bias (StarCoder2, ...)
        # Gemma 2's soft caps (cap * tanh(x / cap)) of the attention scores and of the logits; 0: none
        self.attn_softcap = float(getattr(cfg, "attn_logit_softcapping", None) or 0.0)
        self.final_softcap = float(getattr(cfg, "final_logit_softcapping", None) or 0.0)
        self.embedding_multiplier = float(getattr(cfg, "embedding_multiplier", 1.0))
        self.residual_multiplier = float(getattr(cfg, "residual_multiplier", 1.0))
        self.logits_scaling = float(getattr(cfg, "logits_scaling", 1.0))
        # EXAONE 4's hybrid models (a sliding window on some layers): no RoPE on the global layers
        # (Cohere 2's too)
        self.global_nope = cfg.model_type in ("exaone4", "cohere2") and getattr(cfg, "sliding_window", None) is not None
        self.cohere = cfg.model_type in ("cohere", "cohere2")   # its own LayerNorm, logit_scale, RoPE tables
        self.logit_scale = float(getattr(cfg, "logit_scale", None) or 1.0)
        self.eps = next(v for v in (getattr(cfg, k, None) for k in ("rms_norm_eps", "norm_epsilon", "norm_eps",
                                                                     "layer_norm_eps")) if v is not None)
        # `kernels` (engine.kernels, CPU): the GEMV kernels for the linears (engine.linear) in every
        # dtype unless `gemv` is off (EngineConfig.cpu_gemv); in bf16 also the one-pass RMSNorm (and
        # residual add + RMSNorm), SiLU-and-multiply and RoPE + K/V store kernels, while fp32 keeps
        # transformers' ops (the exact mode)
        self._linear_kernels = kernels if gemv else None
        self._kernels = kernels if dtype == torch.bfloat16 else None
        body = hf_model.model
        self.embed = body.embed_tokens.weight.detach().to(dtype)
        # Gemma's embedding scale (sqrt(hidden), rounded to the model's dtype as transformers does)
        scale = getattr(body.embed_tokens, "embed_scale", None)
        self.embed_scale = None if scale is None else scale.detach().to(self.embed.device, dtype)
        self.rotary = body.rotary_emb
        self._pin = None if rope_pin is None else torch.tensor([[rope_pin]], device=self.embed.device)
        # RoPE per layer type (Gemma 3: its own frequencies for sliding and full layers), else one
        self.rope_kinds = getattr(self.rotary, "layer_types", None) or [None]
        # dimensions of each head that RoPE rotates (< head_dim with a partial rotary factor)
        self._table_order = None
        self._half_tables = cfg.model_type == "gpt_oss"      # its rotary module's cos/sin: one half of a head
        probe = torch.zeros(1, 1, dtype=dtype, device=self.embed.device)
        self.rotary_dim = self._rotary(probe, torch.zeros(1, 1, dtype=torch.long, device=probe.device),
                                       self.rope_kinds[0])[0].shape[-1]
        assert self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0
        if self.cohere:      # its tables interleaved, (f0, f0, f1, f1, ...): as the engine's, (f0, f1, .., f0, f1, ..)
            half = torch.arange(0, self.rotary_dim, 2, device=self.embed.device)
            self._table_order = torch.cat((half, half + 1))
        if self.rotary_dim < self.head_dim:        # partial RoPE (Dims.rope_order: GLM's interleaved half)
            self.dims = dims = dataclasses.replace(dims, rotary_dim=self.rotary_dim)
        self.norm = self._norm_weight(body.norm if hasattr(body, "norm") else body.final_layernorm)   # Phi's
        self.windows = layer_windows(cfg)          # per layer: 0, or its sliding window (keys)
        # the CPU tensors the linears read each call, in the order the forward calls them; moved
        # into one arena (huge pages where Linux gives them) once the LM head is built
        self._arena_list: list[torch.Tensor] = []
        self.layers = [self._layer(i, layer, weight_format) for i, layer in enumerate(body.layers)]
        self.post_norms = self.layers[0].in_norm is None          # OLMo 2
        # attention and MLP side by side on one norm's output, x + attn(ln(x)) + mlp(ln(x)) (Phi;
        # StableLM's use_parallel_residual)
        self.parallel = self.layers[0].post_norm is None and not self.post_norms
        assert all((layer.post_norm is None) == self.parallel for layer in self.layers)
        assert self.parallel or self.model_type not in PARALLEL_BLOCK, "the planner counts one norm a layer"
        self.sandwich = self.layers[0].attn_norm is not None      # Gemma 3
        self.rope_everywhere = all(layer.rope for layer in self.layers)   # False for SmolLM3
        self.moe = any(layer.moe is not None for layer in self.layers)    # a mixture of experts
        self.sinks = any(layer.sinks is not None for layer in self.layers)   # attention sinks (gpt-oss)
        assert all((layer.in_norm is None) == self.post_norms for layer in self.layers)
        assert all((layer.attn_norm is not None) == self.sandwich for layer in self.layers)
        head = hf_model.lm_head
        self.vocab_size = head.out_features
        self._head = self._linear(head.weight.detach(), _bias(head), weight_format)
        self._weights = weight_arena.pack(self._arena_list)      # the arena (its tensors hold it too)
        del self._arena_list

    def _layer(self, i: int, hf_layer, fmt: str) -> _Layer:
        attn, (mlp, shared_mlp) = hf_layer.self_attn, _mlp_modules(hf_layer)
        layer = _Layer()
        layer.index = i
        norm = getattr(hf_layer, "input_layernorm", None)
        layer.in_norm = None if norm is None else self._norm_weight(norm)
        pre_mlp = getattr(hf_layer, "pre_feedforward_layernorm", None)
        glm4 = getattr(hf_layer, "post_self_attn_layernorm", None)     # GLM-4's names for Gemma 3's norms
        if glm4 is not None:
            layer.attn_norm = self._norm_weight(glm4)
            layer.post_norm = self._norm_weight(hf_layer.post_attention_layernorm)
        elif pre_mlp is None:      # (none in a parallel block: StableLM's use_parallel_residual)
            norm = getattr(hf_layer, "post_attention_layernorm", None)
            layer.attn_norm, layer.post_norm = None, None if norm is None else self._norm_weight(norm)
        else:                # Gemma 3: post_attention_layernorm normalizes the attention's output
            layer.attn_norm = self._norm_weight(hf_layer.post_attention_layernorm)
            layer.post_norm = self._norm_weight(pre_mlp)
        norm = getattr(hf_layer, "post_feedforward_layernorm", getattr(hf_layer, "post_mlp_layernorm", None))
        layer.ff_norm = None if norm is None else self._norm_weight(norm)
        layer.qkv = self._qkv(attn, fmt)
        o = attn.o_proj if hasattr(attn, "o_proj") else attn.dense            # Phi's name
        layer.o = self._linear(o.weight.detach(), _bias(o), fmt)
        layer.moe = layer.gate_up = layer.down = None
        if mlp is not None and is_moe_block(mlp):   # Qwen2-MoE's mlp_only_layers: dense
            layer.moe = MoeMlp(mlp, self.model_type, lambda w, b: self._linear(w, b, fmt),
                               # the router (ERNIE 4.5's in fp32): not quantized
                               lambda w, b, dtype=self.dtype: self._linear(w, b, dtype_name(dtype), dtype),
                               self._act_mul, shared_mlp)
        elif mlp is not None and self.dims.gated:
            layer.gate_up = self._fused(mlp, "gate_up_proj", ("gate_proj", "up_proj"), fmt)
            layer.down = self._linear(mlp.down_proj.weight.detach(), _bias(mlp.down_proj), fmt)
        elif mlp is not None:      # ungated (engine.model_dims.UNGATED_MLP): up alone, by one of three names
            up, down = next((getattr(mlp, u), getattr(mlp, d)) for u, d in (("up_proj", "down_proj"),
                            ("c_fc", "c_proj"), ("fc1", "fc2")) if hasattr(mlp, u))
            layer.gate_up = self._linear(*fused_weight([up]), fmt)
            layer.down = self._linear(*fused_weight([down]), fmt)
        else:                      # Granite 4.0 without experts: its shared MLP ([gate; up] fused) is the MLP
            layer.gate_up = self._linear(*fused_weight([shared_mlp.input_linear]), fmt)
            layer.down = self._linear(*fused_weight([shared_mlp.output_linear]), fmt)
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        assert (q_norm is None) == (k_norm is None)
        layer.q_norm = None if q_norm is None else self._norm_weight(q_norm)
        layer.k_norm = None if k_norm is None else self._norm_weight(k_norm)
        layer.rope = bool(getattr(attn, "use_rope", True)) and not (self.global_nope and not self.windows[i])
        kind = getattr(attn, "layer_type", None) or getattr(attn, "attention_type", None)     # OLMo 3's name
        layer.rope_kind = kind if self.rope_kinds != [None] else None
        assert layer.rope_kind in self.rope_kinds
        layer.window = self.windows[i]
        sinks = getattr(attn, "sinks", None)
        layer.sinks = None if sinks is None else sinks.detach().float().contiguous()
        return layer

    def _norm_weight(self, norm) -> torch.Tensor | tuple:
        """An RMSNorm's scale: its weight in the model's dtype, or Gemma's 1 + weight, added and
        kept in fp32 as transformers scales by it (bf16 would round 1.01 to 1.0078); a LayerNorm's
        (weight, bias) in the model's dtype, Nemotron's weight + 1 (added in fp32)."""
        if self.layer_norm:
            weight = (norm.weight.detach().float() + self.norm_offset).to(self.dtype)
            bias = getattr(norm, "bias", None)                   # Cohere's have none
            return weight, None if bias is None else bias.detach().to(self.dtype)
        if not self.norm_offset:
            return norm.weight.detach().to(self.dtype)
        return norm.weight.detach().float() + self.norm_offset

    def _rotary(self, x: torch.Tensor, positions: torch.Tensor, kind: str | None):
        """cos, sin [1, T, rotary_dim] of `positions` [1, T] from the model's rotary module; with a
        pin, computed beside the pinned position (whose own are dropped), so that a length-dependent
        RoPE takes the pinned length's frequencies."""
        t = positions.shape[-1]
        if self._pin is not None:
            positions = torch.cat((positions, self._pin), dim=-1)
        cos, sin = self.rotary(x, positions) if kind is None else self.rotary(x, positions, kind)
        if self._table_order is not None:          # Cohere's, reordered (set in __init__)
            cos, sin = cos[..., self._table_order], sin[..., self._table_order]
        if self._half_tables:                      # gpt-oss's: both halves rotate by the same angles
            cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        return (cos, sin) if self._pin is None else (cos[:, :t], sin[:, :t])

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [n, vocab] of final hidden states [n, hidden], in the model's dtype (Gemma 2's
        soft-capped ones in fp32, which every caller turns them into)."""
        logits = self._head(hidden)
        if self.logit_scale != 1.0:                # Cohere's, a multiplier
            logits = logits * self.logit_scale
        if self.logits_scaling != 1.0:
            logits = logits / self.logits_scaling
        if self.final_softcap:   # Gemma 2, as transformers: divide, tanh, multiply; in place in fp32
            # (bf16's three passes over [32, 49152] took 2.1-2.6 ms here, fp32's 0.7 with the widening)
            logits = logits.float().div_(self.final_softcap).tanh_().mul_(self.final_softcap)
        return logits

    def _qkv(self, attn, fmt: str):
        """The fused [q; k; v] projection; for interleaved RoPE (engine.model_dims.INTERLEAVED_ROPE)
        with its query and key rows reordered per head (`Dims.rope_order`), biases too."""
        weight, bias = self._fused_weight(attn, "qkv_proj", ("q_proj", "k_proj", "v_proj"))
        if self.dims.interleaved_rope:
            assert getattr(attn, "q_norm", None) is None        # its weights would need the same order
            rotated = (self.num_heads + self.num_kv_heads) * self.head_dim        # the q and k rows
            order = torch.tensor(self.dims.rope_order(0, rotated) + list(range(rotated, weight.shape[0])))
            weight, bias = weight[order], None if bias is None else bias[order]
        return self._linear(weight, bias, fmt)

    def _fused(self, module, fused_name: str, part_names: tuple[str, ...], fmt: str):
        """One linear: `module`'s fused projection where the checkpoint has one (Phi-3), else its
        parts concatenated in order ([q; k; v], [gate; up])."""
        return self._linear(*self._fused_weight(module, fused_name, part_names), fmt)

    @staticmethod
    def _fused_weight(module, fused_name: str, part_names: tuple[str, ...]):
        """`_fused`'s (weight, bias)."""
        fused = getattr(module, fused_name, None)
        return fused_weight([fused] if fused is not None else [getattr(module, name) for name in part_names])

    def _linear(self, weight: torch.Tensor, bias: torch.Tensor | None, fmt: str, dtype: torch.dtype | None = None):
        """`dtype`: what it computes in, the model's by default."""
        return make_linear(weight, bias, fmt, dtype or self.dtype, kernels=self._linear_kernels, keep=self._arena_list)

    def _norm(self, x: torch.Tensor, weight) -> torch.Tensor:
        """The model's norm of rows x by `_norm_weight`'s weight: an RMSNorm, or a LayerNorm."""
        if self.cohere:                            # transformers' CohereLayerNorm op for op, in fp32
            h = x.float()
            mean = h.mean(-1, keepdim=True)
            variance = (h - mean).pow(2).mean(-1, keepdim=True)
            return (weight[0].float() * ((h - mean) * torch.rsqrt(variance + self.eps))).to(x.dtype)
        if self.layer_norm:                        # transformers' nn.LayerNorm's op
            return F.layer_norm(x, (x.shape[-1],), *weight, eps=self.eps)
        if self._kernels is not None:
            return self._kernels.rms_norm(x, weight, self.eps)        # bf16 rows, a bf16 or fp32 weight
        if weight.dtype != x.dtype:
            # Gemma's fp32 scale on bf16 rows (CUDA): transformers' math, one rounding at the end
            return (F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps) * weight).to(x.dtype)
        if self.dtype == torch.float32:
            # transformers' LlamaRMSNorm op for op (the exact mode): normalize, then scale
            return weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)
        # one fused op; it accumulates in fp32 and scales before rounding (closer to fp32 than
        # transformers' normalize-round-scale)
        return F.rms_norm(x, (x.shape[-1],), weight, eps=self.eps)

    def _act_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """act(gate) * up of the fused projection's two halves (act(up) of an ungated MLP's): SiLU
        (bf16 on CPU: one kernel), Gemma's GELU with the tanh approximation (transformers'
        `gelu_pytorch_tanh`) or ReLU squared (`relu2`: Arcee's)."""
        if not self.dims.gated:
            return self._act(gate_up)
        if self.activation == "silu" and self._kernels is not None:
            return self._kernels.silu_mul(gate_up)
        g, u = gate_up.chunk(2, dim=-1)
        return self._act(g) * u

    def _act(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation == "silu":
            return F.silu(x)
        if self.activation == "relu2":        # transformers' ReLUSquaredActivation: relu, then square
            return torch.square(F.relu(x))
        if self.activation == "gelu_new":     # transformers' NewGELUActivation op for op (Phi; the exact mode)
            return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
        return F.gelu(x, approximate="tanh")

    def _qk_norm(self, qkv: torch.Tensor, layer: _Layer) -> torch.Tensor:
        """qkv [T, (H + 2 Hkv) * D] with the queries and keys RMS-normalized, each head (Qwen3) or
        all heads as one vector (OLMo 2); v as is."""
        t, nh, nkv, d = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        per_head = layer.q_norm.shape[0] == d
        q = qkv[:, :nh * d].reshape(t * nh if per_head else t, -1).contiguous()       # [rows, norm width]
        k = qkv[:, nh * d:(nh + nkv) * d].reshape(t * nkv if per_head else t, -1).contiguous()
        q, k = self._norm(q, layer.q_norm), self._norm(k, layer.k_norm)
        return torch.cat([q.view(t, nh * d), k.view(t, nkv * d), qkv[:, (nh + nkv) * d:]], dim=1)

    def _add_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor):
        """(x + delta, norm(x + delta)): the residual add and the next norm."""
        if self._kernels is not None and not self.layer_norm:
            return self._kernels.add_rms_norm(x, delta, weight, self.eps)
        x = x + delta
        return x, self._norm(x, weight)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                lora: LoraBatch | None = None) -> torch.Tensor:
        x = F.embedding(input_ids, self.embed)
        if self.embedding_multiplier != 1.0:
            x = x * self.embedding_multiplier
        if self.embed_scale is not None:
            x = x * self.embed_scale
        rm = self.residual_multiplier
        nh, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        t = x.shape[0]
        # bf16 steps whose attention all reads the pool in place (decode rows, and prompt chunks
        # through the prefill kernel): RoPE and the K/V store in one op per layer
        fused = self._kernels is not None and meta.in_place and self.rotary_dim == d
        # per RoPE kind: cos/sin [T, 1, rotary_dim], broadcast over heads, in the model's dtype (OLMo
        # 2's rotary module returns float32), and as [T, rotary_dim] for the fused kernel
        ropes = {}
        for kind in self.rope_kinds:
            cos, sin = self._rotary(x[None], positions[None], kind)   # [1, T, rotary_dim]
            cos, sin = cos[0, :, None].to(x.dtype), sin[0, :, None].to(x.dtype)
            ropes[kind] = cos, sin, cos[:, 0], sin[:, 0]
        if fused and not self.rope_everywhere:
            cos2 = ropes[self.rope_kinds[0]][2]
            no_rope = torch.ones_like(cos2), torch.zeros_like(cos2)   # the kernel's RoPE as the identity
        h = x if self.post_norms else self._norm(x, self.layers[0].in_norm)    # the attention's input
        for i, layer in enumerate(self.layers):
            qkv = _project(layer.qkv, h, lora, i, "qkv")
            if layer.q_norm is not None:
                qkv = self._qk_norm(qkv, layer)
            cos, sin, cos2, sin2 = ropes[layer.rope_kind]
            if fused:
                c, s = (cos2, sin2) if layer.rope else no_rope
                a = fused_attention(layer.index, qkv, c, s, nh, meta, self.scale, self._kernels.rope_store,
                                    layer.window, self.attn_softcap, layer.sinks)
            else:
                qk = qkv[:, :(nh + nkv) * d].view(t, nh + nkv, d)
                if layer.rope:
                    qk = _rope(qk, cos, sin)                                   # q and k heads at once
                v = qkv[:, (nh + nkv) * d:].view(t, nkv, d)
                a = paged_attention(layer.index, qk[:, :nh], qk[:, nh:], v, meta, self.scale, layer.window,
                                    self.attn_softcap, layer.sinks)
            out = _project(layer.o, a, lora, i, "o")
            if self.post_norms:      # OLMo 2: x + norm(attention(x)), then x + norm(mlp(x))
                x = x + self._norm(out, layer.post_norm)
                x = h = x + self._norm(self._mlp(layer, x, lora), layer.ff_norm)
                continue
            next_norm = self.layers[i + 1].in_norm if i + 1 < len(self.layers) else self.norm
            if self.parallel:        # both of the same h, added in transformers' order
                if self.model_type == "phi":                # attention + mlp + x
                    x, h = self._add_norm(x, out + self._mlp(layer, h, lora), next_norm)
                    continue
                x = x + (out if rm == 1.0 else out * rm)    # StableLM: (x + attention) + mlp
                out = self._mlp(layer, h, lora)
                x, h = self._add_norm(x, out if rm == 1.0 else out * rm, next_norm)
                continue
            if self.sandwich:        # Gemma 3: the attention's and the MLP's outputs normalized too
                out = self._norm(out, layer.attn_norm)
            x, h = self._add_norm(x, out if rm == 1.0 else out * rm, layer.post_norm)
            out = self._mlp(layer, h, lora)
            if self.sandwich:
                out = self._norm(out, layer.ff_norm)
            x, h = self._add_norm(x, out if rm == 1.0 else out * rm, next_norm)
        return self._norm(x, self.norm) if self.post_norms else h

    def _mlp(self, layer: _Layer, h: torch.Tensor, lora: LoraBatch | None) -> torch.Tensor:
        if layer.moe is not None:        # no LoRA on experts (engine/lora_config.py refuses it)
            return layer.moe(h)
        act = self._act_mul(_project(layer.gate_up, h, lora, layer.index, "gate_up"))
        return _project(layer.down, act, lora, layer.index, "down")


def _mlp_modules(hf_layer) -> tuple:
    """(the layer's MLP, dense or MoE, or None; Granite's ungated shared MLP, or None): `mlp`
    elsewhere, Granite MoE's `block_sparse_moe` (None in Granite 4.0 without experts) and
    `shared_mlp` (Granite 3.1 and 4.0)."""
    mlp = getattr(hf_layer, "mlp", None)
    if mlp is None:
        mlp = getattr(hf_layer, "block_sparse_moe", None)
    shared = getattr(hf_layer, "shared_mlp", None)
    assert mlp is not None or shared is not None
    return mlp, shared


def _project(linear, x: torch.Tensor, lora: LoraBatch | None, layer: int, name: str) -> torch.Tensor:
    """A linear of layer `layer` (`name`: engine.lora's name for it) with its LoRA updates added."""
    out = linear(x)
    if lora is not None:
        lora.add(layer, name, x, out)
    return out


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:          # partial: RoPE on the first `rotary` dimensions, the rest as is
        return torch.cat((_rope(x[..., :rotary], cos, sin), x[..., rotary:]), dim=-1)
    half = rotary // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _bias(linear) -> torch.Tensor | None:
    return None if linear.bias is None else linear.bias.detach()
