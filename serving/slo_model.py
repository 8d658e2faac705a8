"""The per-replica service-time model and the SLO fleet sizing (torch-free, pure arithmetic).

One formula prices every engine step, prefill, decode or mixed (colocated):
    compute = 2 N (prefill_tokens + decode_seqs) / (F * prefill_eff)
    memory  = (N b + kappa (decode_context_tokens + prefill_tokens)) / (W * decode_eff)
    step    = max(compute, memory)
(a mixture of experts: N its active parameters, N b the weights the step's tokens read,
`step_weight_bytes`: the experts none of them took are not read)
i.e. the roofline of `pdserve plan` (pdserve/plan/roofline.py) with compute running at `prefill_eff` of
peak and memory traffic at `decode_eff` of bandwidth, the two efficiencies `pdserve plan --calibrate`
measures. The simulator (pdserve/plan/sim_*.py) steps replicas with it; the SLO autoscaling policy
(serving/slo_autoscaling.py) sizes both pools with `size_fleet`:
  1. prefill: a replica serves a prompt of S tokens, C of them in its prefix cache, in
     `prefill_time(S - C)` (the step's KV reads of the cached part are not priced); the router sends each prompt
     to the least-loaded replica, so the pool is an M/D/P queue: TTFT p90 ~ s + the p90 of the
     Erlang-C (M/M/P) wait, halved for deterministic service; the least P meeting the SLO;
  2. decode: the largest batch B whose step meets the TPOT SLO, fits the KV budget and `max_num_seqs`;
     a replica then emits B / tpot(B) tokens/s; D = rate * (out - 1) / (utilization * B / tpot(B));
  3. `correction` factors (measured / predicted, from the live percentiles) scale both service times.
Local prefill (`routing.local_prefill_tokens`: a conversation's next turn, computed by the decode
replica that holds its history): `Workload.local_share` of the requests skip the prefill pool; their
prompt tokens (`local_len` each) ride in the decode steps, `local_rows` per sequence per step, and
their TTFT is about two decode steps (the one running when it arrives, then the one carrying its
chunk). TTFT p90 is over every request (`mixed_ttft_p90`: the local prefills' TTFT where they
are a tenth of the requests or more and slower than the pool's tail, else the pool's quantile).
Sliding windows (`window`, on `window_share` of the KV): a decode step reads a windowed layer's last
`window` keys only (`decode_read`), and where every layer has one a sequence keeps about its window
reserved (`held_tokens`: the engine gives back the blocks the window passed).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


def decode_read(context_tokens: float, windowed_tokens: float, window_share: float) -> float:
    """The tokens' worth of K/V (priced at kappa) a decode step reads for sequences of
    `context_tokens` in all, `windowed_tokens` of them within their windows (the sum of
    min(context, window)): a windowed layer (`window_share` of the KV) reads only its window's keys.
    Without a window (share 0) that is all of `context_tokens`."""
    return context_tokens - window_share * (context_tokens - windowed_tokens)


def experts_read(tokens: float, experts: int, per_token: int) -> float:
    """The expected share of a mixture of experts' routed experts that a forward over `tokens`
    tokens reads, each token taking `per_token` of a layer's `experts` (uniform routing): 1 - (1 -
    k/E)^tokens; 1 without experts (experts 0)."""
    return 1.0 if experts == 0 else 1.0 - (1.0 - per_token / experts) ** max(tokens, 0.0)


def experts_fit(expert_part: float, whole: float, experts: int, per_token: int) -> bool:
    """A model's routed experts (`expert_part` of its `whole` parameters or bytes, `per_token` of
    `experts` a token) are all 0, or a mixture within the whole."""
    return (0 <= expert_part < whole and 0 <= per_token <= experts
            and (experts > 0) == (per_token > 0) == (expert_part > 0))


def held_tokens(total: float, prompt: float, window: int, window_share: float) -> float:
    """The KV a sequence of `total` tokens (`prompt` of them arriving at once) keeps reserved: all of
    it, but where every layer has a window the engine gives back the blocks the window passed, so
    about the window, and the whole prompt while it lands."""
    return max(prompt, min(total, window)) if window_share == 1 else total


@dataclass(frozen=True)
class StepModel:
    """One replica's engine as the roofline sees it, with calibrated efficiencies and engine limits."""
    params: float                   # N, parameters
    weight_bytes: float             # N b
    kv_bytes_per_token: float       # kappa
    peak_flops: float               # F
    mem_bw: float                   # W, bytes/s
    link_bw: float                  # prefill -> decode KV transfer, bytes/s
    prefill_eff: float = 1.0
    decode_eff: float = 1.0
    kv_tokens: int = 1 << 20        # tokens of KV one replica holds
    max_num_seqs: int = 256         # running batch limit
    max_batched_tokens: int = 8192  # token budget of one step (prefill chunk)
    window: int = 0                 # a sliding window's keys (0: none)
    window_share: float = 0.0       # the share of the KV bytes in layers with that window (1: all)
    # a mixture of experts: `params` are those a token computes with, `weight_bytes` all of them, of
    # which `expert_bytes` are the routed experts', each token taking `experts_per_token` of `experts`
    expert_bytes: float = 0.0
    experts: int = 0
    experts_per_token: int = 0

    def __post_init__(self):
        for k, v in asdict(self).items():
            if k not in ("window", "window_share", "expert_bytes", "experts", "experts_per_token") and not v > 0:
                raise ValueError(f"StepModel.{k} must be positive, got {v!r}")
        if not experts_fit(self.expert_bytes, self.weight_bytes, self.experts, self.experts_per_token):
            raise ValueError(f"StepModel: experts ({self.experts!r} experts, {self.experts_per_token!r} a token, "
                             f"{self.expert_bytes!r} bytes) must be all 0 or a mixture within the weights")
        if not (self.window >= 0 and 0 <= self.window_share <= 1 and (self.window_share > 0) == (self.window > 0)):
            raise ValueError(f"StepModel.window_share must be in (0, 1] with a window, 0 without one; got "
                             f"{self.window_share!r} with window {self.window!r}")

    def decode_read(self, context_tokens: float, windowed_tokens: float) -> float:
        return decode_read(context_tokens, windowed_tokens, self.window_share)

    def held_tokens(self, total: float, prompt: float) -> float:
        return held_tokens(total, prompt, self.window, self.window_share)

    def step_weight_bytes(self, tokens: float) -> float:
        """The weights a step over `tokens` tokens reads: all but the routed experts no token took."""
        unread = 1.0 - experts_read(tokens, self.experts, self.experts_per_token)
        return self.weight_bytes - self.expert_bytes * unread

    def step_time(self, prefill_tokens: float, decode_seqs: float = 0, decode_context_tokens: float = 0) -> float:
        tokens = prefill_tokens + decode_seqs
        compute = 2 * self.params * tokens / (self.peak_flops * self.prefill_eff)
        memory = (self.step_weight_bytes(tokens) + self.kv_bytes_per_token * (decode_context_tokens + prefill_tokens)) \
            / (self.mem_bw * self.decode_eff)
        return max(compute, memory)

    def prefill_time(self, prompt_tokens: float) -> float:
        """Prefill of one prompt alone, in chunks of `max_batched_tokens`."""
        chunks = max(1, math.ceil(prompt_tokens / self.max_batched_tokens))
        return sum(self.step_time(min(self.max_batched_tokens, prompt_tokens - i * self.max_batched_tokens))
                   for i in range(chunks))

    def decode_step(self, batch: float, context: float, prompt_tokens: float = 0.0) -> float:
        """A decode step of `batch` sequences of mean KV length `context` that also computes
        `prompt_tokens` of prompts (local prefill)."""
        return self.step_time(prompt_tokens, batch, batch * self.decode_read(context, min(context, self.window)))

    def tpot(self, batch: float, context: float, prompt_rows: float = 0.0) -> float:
        """Decode step time of `batch` sequences of mean KV length `context`, each bringing
        `prompt_rows` prompt tokens a step on average (local prefill: `Workload.local_rows`)."""
        return self.decode_step(batch, context, batch * prompt_rows)

    def transfer_time(self, prompt_tokens: float) -> float:
        return self.kv_bytes_per_token * prompt_tokens / self.link_bw


@dataclass(frozen=True)
class Workload:
    rate: float           # requests/s
    input_len: float      # mean prompt tokens
    output_len: float     # mean output tokens
    cached_len: float = 0.0   # mean prompt tokens found in a prefix cache (not computed), over all requests
    local_share: float = 0.0  # of the requests, those a decode replica prefilled itself (local prefill)
    local_len: float = 0.0    # mean prompt tokens such a request computed

    def __post_init__(self):
        if not (0 <= self.local_share <= 1 and self.local_len >= 0):
            raise ValueError(f"Workload.local_share must be in [0, 1] and local_len >= 0, got "
                             f"{self.local_share!r}, {self.local_len!r}")

    @property
    def prefill_rate(self) -> float:
        """Prompts/s the prefill pool computes."""
        return self.rate * (1 - self.local_share)

    @property
    def computed_len(self) -> float:
        """The mean prompt tokens a prefill computes: the tokens computed over all requests, less the
        local prefills' share, over the handed-off requests."""
        if self.local_share >= 1:
            return 1.0
        computed = self.input_len - self.cached_len - self.local_share * self.local_len
        return max(computed / (1 - self.local_share), 1.0)

    @property
    def local_rows(self) -> float:
        """Prompt tokens a decoding sequence brings to each decode step, on average: a replica
        finishing B / out sequences a step starts as many, `local_share` of them with `local_len`."""
        return self.local_share * self.local_len / max(self.output_len, 1.0)

    @property
    def context(self) -> float:
        """The mean KV length a decode step reads over a request's life (prompt + half the output)."""
        return self.input_len + self.output_len / 2


@dataclass(frozen=True)
class FleetSize:
    prefill: int
    decode: int
    decode_batch: int
    ttft_p90: float       # predicted at these counts
    tpot: float           # predicted at decode_batch
    reason: str


def erlang_c(servers: int, load: float) -> float:
    """Probability an arrival waits in an M/M/c queue with `servers` and offered `load` (= rate x service)."""
    if load >= servers:
        return 1.0
    b = 1.0                               # Erlang B by recursion, then C
    for k in range(1, servers + 1):
        b = load * b / (k + load * b)
    rho = load / servers
    return b / (1 - rho + rho * b)


def ttft_p90(service: float, rate: float, replicas: int = 1, tail: float = 0.1) -> float:
    """Predicted TTFT p90 of a prefill pool of `replicas` fed `rate` prompts/s; inf if saturated.
    `tail`: the quantile's tail (0.1: the p90).

    M/M/c wait tail P(W > t) = C exp(-(c - a) t / s), so its p90 is s ln(10 C) / (c - a) when C > 0.1;
    halved, as an M/D/c queue waits about half as long."""
    load = rate * service
    if load >= replicas:
        return math.inf
    c = erlang_c(replicas, load)
    wait = service * math.log(c / tail) / (replicas - load) / 2 if c > tail else 0.0
    return service + wait


def _mixed_p90(pool_quantile, share: float, local_ttft: float) -> float:
    """The p90 over every request when `share` of them take `local_ttft` and the rest the pool's
    times (`pool_quantile(tail)`: the time a `tail` of them exceed): the x where P(TTFT > x) =
    share [local_ttft > x] + (1 - share) P_pool(> x) crosses 0.1. The pool's quantile at the tail
    0.1 / (1 - share) where that is past `local_ttft`; else `local_ttft` once share >= 0.1 (a tenth
    of the requests take it), else the pool's quantile at (0.1 - share) / (1 - share) up to it."""
    beyond = pool_quantile(0.1 / (1 - share)) if share < 0.9 else 0.0
    if beyond >= local_ttft:
        return beyond
    if share >= 0.1:
        return local_ttft
    return min(local_ttft, pool_quantile((0.1 - share) / (1 - share)))


def mixed_ttft_p90(service: float, w: Workload, replicas: int, local_ttft: float) -> float:
    """TTFT p90 over every request, `w.local_share` of them prefilled locally in `local_ttft` and
    the rest by a pool of `replicas` (`ttft_p90`); inf if the pool saturates."""
    if w.prefill_rate * service >= replicas:
        return math.inf
    return _mixed_p90(lambda tail: ttft_p90(service, w.prefill_rate, replicas, tail), w.local_share, local_ttft)


def local_ttft(m: StepModel, w: Workload, batch: float, correction: float = 1.0) -> float:
    """A local prefill's TTFT at a decode batch of `batch`: the step running when it arrives, then
    the step carrying its chunk (0 without local prefills)."""
    if w.local_share <= 0:
        return 0.0
    return (m.tpot(batch, w.context, w.local_rows) + m.decode_step(batch, w.context, w.local_len)) * correction


def decode_batch(m: StepModel, w: Workload, tpot_slo: float, correction: float = 1.0) -> int:
    """Largest batch meeting the TPOT SLO within the KV budget and max_num_seqs (0: unreachable)."""
    kv_limit = int(m.kv_tokens // max(m.held_tokens(w.input_len + w.output_len, w.input_len), 1))
    lo, hi = 0, min(m.max_num_seqs, kv_limit)
    while lo < hi:                      # tpot is monotone in the batch
        mid = (lo + hi + 1) // 2
        if m.tpot(mid, w.context, w.local_rows) * correction <= tpot_slo:
            lo = mid
        else:
            hi = mid - 1
    return lo


def size_fleet(m: StepModel, w: Workload, ttft_slo: float, tpot_slo: float, utilization: float = 0.8,
               correction: tuple[float, float] = (1.0, 1.0), max_replicas: int = 100_000) -> FleetSize:
    """The least prefill and decode replicas predicted to meet both SLOs at this workload.

    `utilization` caps how busy the decode pool runs at its SLO batch (headroom for bursts);
    `correction` = (prefill, decode) multipliers of the service times. Unreachable SLOs return
    counts of 0 with the reason. Local prefills (`w.local_share`) load the decode steps, not the
    prefill pool, which keeps at least one replica (for the prompts a decode replica's cache misses).
    """
    cp, cd = correction
    service = m.prefill_time(w.computed_len) * cp
    batch = decode_batch(m, w, tpot_slo, cd)
    local = local_ttft(m, w, max(batch, 1), cd)
    best = _mixed_p90(lambda tail: service, w.local_share, local)    # prefill replicas never waited for
    if best > ttft_slo or batch == 0:
        why = "TTFT" if batch else "TPOT/KV"
        return FleetSize(0, 0, batch, best, m.tpot(1, w.input_len) * cd, f"{why} SLO unreachable per replica")
    prefill = max(1, math.ceil(w.prefill_rate * service))
    while prefill < max_replicas and mixed_ttft_p90(service, w, prefill, local) > ttft_slo:
        prefill += 1
    tpot = m.tpot(batch, w.context, w.local_rows) * cd
    tokens_per_s = utilization * batch / tpot
    decode = max(1, math.ceil(w.rate * max(w.output_len - 1, 0) / tokens_per_s))
    local_note = f", {w.local_share:.0%} prefilled locally" if w.local_share else ""
    return FleetSize(prefill, min(decode, max_replicas), batch, mixed_ttft_p90(service, w, prefill, local), tpot,
                     f"decode batch {batch}{local_note}")
