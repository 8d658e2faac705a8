"""A mixture-of-experts MLP block (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, Granite MoE, ERNIE 4.5 MoE, gpt-oss,
GLM-4.5):
a router scores every expert for each token, the token runs its top-k experts (each a gated MLP of
its own) and adds their outputs weighted by those scores; Qwen2-MoE adds a shared expert, gated per
token by a sigmoid, Granite 3.1 and 4.0 and ERNIE 4.5 an ungated one (Granite's: the layer's
`shared_mlp`). ERNIE 4.5 routes in fp32 and picks its experts by their scores plus a learned
correction bias, weighting them by the scores alone. gpt-oss's router has a bias and weights its
top-k logits by a softmax over them (in the model's dtype); its experts, stored transposed with
gate and up columns interleaved and a bias on each projection, apply a clamped SwiGLU,
(clamp(up, -L, L) + 1) * g * sigmoid(alpha g) with g = min(gate, L). GLM-4.5 routes as DeepSeek-V3:
sigmoid scores in fp32, experts picked by score plus a correction bias within the best groups of
experts (each group scored by its two best), weighted by their scores renormalized and scaled
(`routed_scaling_factor`), beside an ungated shared expert. The engine's decoder
(engine/decoder.py) runs it in place of the dense MLP on the layers that have one.

The math is transformers' (its `*TopKRouter`, `*Experts` eager loop and `*SparseMoeBlock`), op for
op where rounding matters, so the fp32 mode stays token-identical to Hugging Face `generate` with
`experts_implementation="eager"`: router logits in the model's dtype, softmax in fp32, top-k,
renormalized where the model says (`norm_topk_prob`; Mixtral always; Granite takes the top-k of the
logits and a softmax over those k, in fp32), the weights back in the model's dtype (Mixtral keeps
them in fp32); each expert over its tokens, scaled, then added into a zero output expert by expert
in ascending order (more than one token on CPU: one `index_add_` that adds in that order, in bf16
summing in fp32 and rounding once) (the linears, the router's too, are the engine's: fp32 GEMVs sum
in another order than MKL, as everywhere in the exact mode). Tokens are grouped by expert with one
sort and one host sync a call (transformers: a `where` per expert); a single token calls its k
experts directly. Each expert's two projections are linears in the engine's weight format
(engine.linear), so bf16, int8 and int4 apply to experts too; the router and Qwen2-MoE's
shared-expert gate stay in the model's dtype (int8 or int4 there would move tokens to other
experts; vLLM builds its MoE gates unquantized too), through the engine's GEMV (aten's matmul of
such a small weight cost 70 us a layer at a decode step's rows).

The expert loop depends on the step's routing (which experts, how many tokens each): on CUDA the
decoder's steps with a MoE block are not captured into CUDA graphs (engine/model_runner.py).
"""

from __future__ import annotations

import itertools
from typing import Callable

import torch
import torch.nn.functional as F

from engine.linear import fused_weight

Linear = Callable[[torch.Tensor], torch.Tensor]


def is_moe_block(mlp) -> bool:
    """True for a transformers MoE block (a router, `gate` or Granite's `router`, and 3D-tensor
    `experts`)."""
    return hasattr(mlp, "experts") and (hasattr(mlp, "gate") or hasattr(mlp, "router"))


class MoeMlp:
    """`moe(h [T, hidden]) -> [T, hidden]` in h's dtype."""

    def __init__(self, block, model_type: str, linear: Callable[..., Linear], dense: Callable[..., Linear],
                 act_mul: Callable[[torch.Tensor], torch.Tensor], shared_mlp=None):
        """`block`: the transformers MoE block; `linear(weight [out, in], bias)`: the decoder's
        linear in its weight format, `dense(weight, bias, dtype=None)` unquantized in `dtype` (the
        model's by default); `act_mul`: act(gate) * up of a fused [gate; up] output; `shared_mlp`:
        Granite's layer's ungated shared MLP, or None."""
        router, experts = (block.gate if hasattr(block, "gate") else block.router), block.experts
        statics = getattr(router, "moe_statics", None)      # ERNIE 4.5: fp32 routing, a correction bias
        self.correction = None if statics is None else statics.e_score_correction_bias.detach().float().reshape(-1)
        self.norm_min = float(getattr(router, "norm_min", 0.0))
        # GLM-4.5's (DeepSeek-V3's) sigmoid routing with a correction bias among groups of experts
        sigmoid_bias = getattr(router, "e_score_correction_bias", None)
        self.sigmoid_bias = None if sigmoid_bias is None else sigmoid_bias.detach().float()
        router_bias = getattr(router, "bias", None)          # gpt-oss's
        router_bias = None if router_bias is None else router_bias.detach()
        fp32_router = statics is not None or self.sigmoid_bias is not None     # ERNIE's and GLM's route in fp32
        self.router = (dense(router.weight.detach().float(), None, torch.float32) if fp32_router else
                       dense(router.weight.detach(), router_bias))                             # [E, hidden]
        self.num_experts, self.top_k = router.weight.shape[0], int(router.top_k)
        self.norm_topk = bool(getattr(router, "norm_topk_prob", True))  # Mixtral: always
        self.fp32_scores = model_type == "mixtral"
        self.softmax_of_topk = model_type.startswith("granitemoe")       # granitemoe, -shared, -hybrid
        self.gpt_oss = model_type == "gpt_oss"
        if self.sigmoid_bias is not None:
            self.groups, self.best_groups = int(router.num_group), int(router.topk_group)
            self.scaling = float(router.routed_scaling_factor)
        gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
        e, hidden = self.num_experts, router.weight.shape[1]
        self._act_mul = act_mul
        if self.gpt_oss:
            self._gpt_oss_experts(experts, gate_up, down, linear, hidden)
        elif gate_up.dim() != 3 or gate_up.shape[0] != e or gate_up.shape[2] != hidden or \
                down.shape[:2] != (e, hidden) or getattr(experts, "has_bias", False):
            raise ValueError(f"{model_type}: experts stored as {tuple(gate_up.shape)} / {tuple(down.shape)}; "
                             f"pdserve reads [experts, 2 x intermediate, hidden] / [experts, hidden, intermediate]")
        else:       # per expert: its fused [gate; up] projection and its down projection
            self.experts = [(linear(gate_up[i], None), linear(down[i], None)) for i in range(e)]
        shared = getattr(block, "shared_expert", None)
        if shared is None:
            shared = getattr(block, "shared_experts", None)     # ERNIE 4.5's name
        self.shared = None if shared is None else (linear(*fused_weight([shared.gate_proj, shared.up_proj])),
                                                   linear(*fused_weight([shared.down_proj])))
        if shared_mlp is not None:       # Granite's: [gate; up] fused already, added ungated
            assert self.shared is None
            self.shared = (linear(*fused_weight([shared_mlp.input_linear])),
                           linear(*fused_weight([shared_mlp.output_linear])))
        gate = getattr(block, "shared_expert_gate", None)
        self.shared_gate = None if gate is None else dense(gate.weight.detach(), None)   # [1, hidden]

    def _gpt_oss_experts(self, experts, gate_up: torch.Tensor, down: torch.Tensor, linear: Callable[..., Linear],
                         hidden: int) -> None:
        """gpt-oss's experts: gate_up [E, hidden, 2I] with gate and up columns interleaved, down [E,
        I, hidden], a bias on each; as the engine's linears [gate; up] rows and down, and the
        clamped SwiGLU as the activation."""
        e = self.num_experts
        if gate_up.dim() != 3 or gate_up.shape[:2] != (e, hidden) or down.shape[0] != e or down.shape[2] != hidden:
            raise ValueError(f"gpt_oss: experts stored as {tuple(gate_up.shape)} / {tuple(down.shape)}; pdserve "
                             "reads [experts, hidden, 2 x intermediate] / [experts, intermediate, hidden]")
        width = gate_up.shape[2]
        order = torch.cat((torch.arange(0, width, 2), torch.arange(1, width, 2))).to(gate_up.device)
        gate_up_bias, down_bias = experts.gate_up_proj_bias.detach(), experts.down_proj_bias.detach()
        self.experts = [(linear(gate_up[i].t()[order].contiguous(), gate_up_bias[i][order]),
                         linear(down[i].t().contiguous(), down_bias[i])) for i in range(e)]
        alpha, limit = float(experts.alpha), float(experts.limit)

        def clamped_swiglu(x: torch.Tensor) -> torch.Tensor:      # transformers' GptOssExperts._apply_gate
            gate, up = x.chunk(2, dim=-1)
            gate = gate.clamp(min=None, max=limit)
            up = up.clamp(min=-limit, max=limit)
            return (up + 1) * (gate * torch.sigmoid(gate * alpha))
        self._act_mul = clamped_swiglu

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        if self.sigmoid_bias is not None:        # GLM-4.5
            return self._run(h, *self._sigmoid_route(h))
        if self.gpt_oss:                         # softmax over the top-k logits, in their dtype
            top, chosen = torch.topk(self.router(h), self.top_k, dim=-1)
            return self._run(h, F.softmax(top, dim=-1, dtype=top.dtype), chosen)
        if self.correction is not None:          # ERNIE 4.5
            probs = F.softmax(self.router(h.float()), dim=-1)
            chosen = torch.topk(probs + self.correction, self.top_k, dim=-1)[1]
            weights = probs.gather(1, chosen)
            weights = (weights / weights.sum(dim=-1, keepdim=True).clamp(min=self.norm_min)).to(h.dtype)
            return self._run(h, weights, chosen)
        logits = self.router(h)                                            # [T, E]
        if self.softmax_of_topk:
            top, chosen = torch.topk(logits.float(), self.top_k, dim=-1)
            weights = F.softmax(top, dim=-1)
        else:
            probs = F.softmax(logits, dim=-1, dtype=torch.float)
            weights, chosen = torch.topk(probs, self.top_k, dim=-1)       # [T, k]
            if self.norm_topk:
                weights /= weights.sum(dim=-1, keepdim=True)
        if not self.fp32_scores:
            weights = weights.to(logits.dtype)
        return self._run(h, weights, chosen)

    def _sigmoid_route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] fp32, chosen [T, k]) as transformers' Glm4MoeTopkRouter computes them."""
        scores = self.router(h.float()).sigmoid()
        choice = scores + self.sigmoid_bias
        if self.groups > 1:          # only the experts of the best `best_groups` groups may be picked
            per = self.num_experts // self.groups
            group_scores = choice.view(-1, self.groups, per).topk(2, dim=-1)[0].sum(dim=-1)
            best = torch.topk(group_scores, self.best_groups, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(group_scores).scatter_(1, best, 1).bool().repeat_interleave(per, dim=1)
            choice = choice.masked_fill(~keep, float("-inf"))
        chosen = torch.topk(choice, self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, chosen)
        if self.norm_topk:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, chosen

    def _run(self, h: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """The chosen experts [T, k] weighted by `weights` [T, k], and the shared expert."""
        out = self._one_token(h, weights, chosen) if h.shape[0] == 1 else self._tokens(h, weights, chosen)
        if self.shared is not None:
            gate_up, down = self.shared
            shared = down(self._act_mul(gate_up(h)))
            out = out + (shared if self.shared_gate is None else torch.sigmoid(self.shared_gate(h)) * shared)
        return out

    def _one_token(self, h: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """A decode step of one sequence: its k experts in ascending order, each output added to
        the last (transformers' index_add_ into zeros, whose first add is exact), without the
        grouping's sort and gathers."""
        out = None
        ids = chosen[0].tolist()
        for slot in sorted(range(self.top_k), key=ids.__getitem__):
            gate_up, down = self.experts[ids[slot]]
            y = (down(self._act_mul(gate_up(h))) * weights[:, slot, None]).to(h.dtype)
            out = y if out is None else out + y
        return out

    def _tokens(self, h: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Any number of tokens: the (token, slot) pairs sorted by expert (stable: tokens in order),
        their rows and weights gathered once, each expert's projections over its run of them, the
        activation and the weights over all runs at once, then the adding."""
        flat = chosen.flatten()                                            # token-major: t * k + slot
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // self.top_k
        rows, scales = h[tokens], weights.flatten()[order, None]
        runs = [(expert, slice(start - n, start)) for expert, n, start in
                zip(range(self.num_experts), counts, itertools.accumulate(counts)) if n]
        act = self._act_mul(torch.cat([self.experts[e][0](rows[run]) for e, run in runs]))
        y = torch.cat([self.experts[e][1](act[run]) for e, run in runs]) * scales
        return _add_in_order(h, tokens, y.to(h.dtype), [run for _, run in runs])


def _add_in_order(like: torch.Tensor, index: torch.Tensor, rows: torch.Tensor, runs: list[slice]) -> torch.Tensor:
    """zeros_like(like).index_add_(0, index, rows) with each output's rows added in their order
    (sorted by expert: transformers' order of adds; in fp32 the same sums). On CPU one call adds them
    so (one after another; in bf16 it sums in fp32 and rounds once, where transformers rounds after
    each expert); CUDA's index_add_ adds a call's duplicate indices by atomics in no fixed order, so
    there each run, whose indices are unique, is a call of its own."""
    out = torch.zeros_like(like)
    if like.device.type == "cpu":
        return out.index_add_(0, index, rows)
    for run in runs:
        out.index_add_(0, index[run], rows[run])
    return out
