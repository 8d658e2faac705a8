"""A decoder's dimensions from its transformers config, torch-free, read one way everywhere: the
decoder (engine/decoder.py), the KV pool's shape (engine/backends.py), LoRA adapters' shapes
(engine/lora_config.py, which the router also runs) and the benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass

# Model types whose RoPE rotates interleaved pairs of a head's dimensions, (2i, 2i + 1) (GLM's
# style: GLM-4, ERNIE 4.5, Helium, Cohere), where the engine's rotates (i, i + rotary / 2): the engine reorders
# their query and key projections' output rows per head at load (`Dims.rope_order`), which turns the
# one rotation into the other and leaves every query-key product the same (a LoRA adapter's B rows
# on them are reordered so too).
INTERLEAVED_ROPE = ("ernie4_5", "ernie4_5_moe", "helium", "glm", "glm4", "cohere", "cohere2")
# Model types whose MLP is not gated, down(act(up(x))) (Arcee's AFM and Nemotron with ReLU^2,
# StarCoder2 and Phi with GELU-tanh): their up projection is the decoder's `gate_up` linear whole,
# whose gate part is 0 wide (Dims.widths)
UNGATED_MLP = ("arcee", "starcoder2", "nemotron", "phi")
# Model types whose norms are LayerNorms, not RMSNorms: with a bias (Nemotron's scale by 1 + weight) but
# Cohere's, which transformers computes in fp32 by its own ops
LAYER_NORM = ("starcoder2", "nemotron", "stablelm", "phi", "cohere", "cohere2")
# ... of which these have no bias (Cohere's LayerNorm) ...
LAYER_NORM_NO_BIAS = ("cohere", "cohere2")
# Model types whose attention and MLP always sit side by side on one norm's output (StableLM's do where
# its config says `use_parallel_residual`): one norm a layer
PARALLEL_BLOCK = ("phi", "cohere", "cohere2")


@dataclass(frozen=True)
class Dims:
    """The projections' shapes: `num_kv_heads` is `num_key_value_heads`, or the query heads' count
    where the config has none (no GQA); `head_dim` the config's, else hidden_size / heads; `moe`:
    the MLPs are mixtures of experts (engine/moe.py; `intermediate_size` is then not every MLP's);
    `interleaved_rope`: the model type is one of INTERLEAVED_ROPE; `rotary_dim`: how many of a
    head's first dimensions RoPE rotates (0: all; the decoder sets it from the model's rotary
    module, GLM's rotate half); `gated`: the MLP is act(gate) * up (not UNGATED_MLP)."""
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    moe: bool = False
    interleaved_rope: bool = False
    rotary_dim: int = 0
    gated: bool = True

    @classmethod
    def of_config(cls, cfg) -> Dims:
        """From a transformers config, or its config.json as a dict."""
        def get(key):
            return cfg.get(key) if isinstance(cfg, dict) else getattr(cfg, key, None)
        heads = get("num_attention_heads")
        moe = bool(get("num_local_experts") or get("num_experts") or get("moe_num_experts"))    # ERNIE's name
        # Granite 4.0 without experts: its shared MLP is the MLP
        granite4 = get("model_type") == "granitemoehybrid" and not moe
        return cls(get("hidden_size"), get("shared_intermediate_size" if granite4 else "intermediate_size"), heads,
                   get("num_key_value_heads") or heads, get("head_dim") or get("hidden_size") // heads,
                   get("num_hidden_layers"), moe, get("model_type") in INTERLEAVED_ROPE,
                   gated=get("model_type") not in UNGATED_MLP)

    def rope_order(self, start: int, width: int) -> list[int] | None:
        """For output rows [start, start + width) of the fused [q; k; v] projection: the order of
        those rows (indices from 0) the engine computes them in, or None where it keeps theirs. With
        interleaved RoPE each query and key head's row 2i moves to i and 2i + 1 to rotary / 2 + i
        for i < rotary / 2 (its rows past the rotary ones, and the value rows, stay)."""
        rotated = (self.num_heads + self.num_kv_heads) * self.head_dim          # the q and k rows
        if not self.interleaved_rope or start >= rotated:
            return None
        assert start % self.head_dim == 0 and start + width <= rotated, (start, width)
        d, r = self.head_dim, self.rotary_dim or self.head_dim
        head = [2 * i for i in range(r // 2)] + [2 * i + 1 for i in range(r // 2)] + list(range(r, d))
        return [h + i for h in range(0, width, d) for i in head]

    def widths(self) -> dict[str, tuple[int, list[int]]]:
        """Per fused linear of the decoder: (input width, output width of each of its parts, in
        engine/lora_config.py's FUSED order; an ungated MLP's gate 0 wide)."""
        d, nh, nkv, inter = self.head_dim, self.num_heads, self.num_kv_heads, self.intermediate_size
        return {"qkv": (self.hidden_size, [nh * d, nkv * d, nkv * d]), "o": (nh * d, [self.hidden_size]),
                "gate_up": (self.hidden_size, [inter if self.gated else 0, inter]),
                "down": (inter, [self.hidden_size])}
