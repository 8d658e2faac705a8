"""`pdserve plan`: the prefill/decode roofline as a capacity planner (torch-free math).

With N parameters of b bytes and kappa KV bytes per token (2 * layers * kv_heads * head_dim * b):
  prefill intensity  I_p(S)    = 2 N S / (N b + kappa S)        ~ 2S/b, grows with the prompt
  decode intensity   I_d(S, B) = 2 N B / (N b + kappa S B)      <= 2/b = 1 FLOP/byte in bf16 at B = 1
A phase is compute-bound when its intensity exceeds the machine's ridge point (peak FLOP/s over
memory bandwidth). Lower bounds: TTFT(S) = max(2NS / F, (Nb + kappa S) / W); TPOT(S, B) =
max(2NB / F, (Nb + kappa S B) / W); KV transfer = kappa S / link bandwidth. With a sliding window of
w keys on a share f of the layers, a decode step reads S' = S - f max(S - w, 0) tokens' worth in
place of S, and where every layer has one a sequence holds about max(w, its prompt) tokens of KV
(the engine gives back the blocks its window passed); prefill and the hand-off still cover all S.

Measured latencies sit above these bounds; `plan(..., prefill_eff, decode_eff)` divides the bounds by
efficiency factors in (0, 1] (see pdserve/plan/calibrate.py for deriving them from a `pdserve bench`
report). Model specs from a Hugging Face config: pdserve/plan/model.py; the plot: pdserve/plan/plot.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from serving.slo_model import decode_read, experts_fit, experts_read, held_tokens


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer as the roofline sees it; validates itself on creation. A mixture
    of experts has `expert_params` of its `params` in routed experts, `experts_per_token` of
    `experts` a layer: a token computes with `active_params`, a step reads the experts its tokens
    took (`step_params`)."""
    name: str
    params: float
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: float = 2.0
    window: int = 0             # a sliding window's keys (0: none) ...
    window_layers: int = 0      # ... on this many of the layers
    expert_params: float = 0.0
    experts: int = 0
    experts_per_token: int = 0

    def __post_init__(self):
        for field in ("params", "layers", "kv_heads", "head_dim", "dtype_bytes"):
            if not getattr(self, field) > 0:
                raise ValueError(f"ModelSpec.{field} must be positive, got {getattr(self, field)!r}")
        if not (self.window >= 0 and 0 <= self.window_layers <= self.layers
                and (self.window > 0) == (self.window_layers > 0)):
            raise ValueError(f"ModelSpec: a window ({self.window!r}) needs 1 to {self.layers} layers, "
                             f"none needs 0; got {self.window_layers!r}")
        if not experts_fit(self.expert_params, self.params, self.experts, self.experts_per_token):
            raise ValueError(f"ModelSpec: experts ({self.experts!r}, {self.experts_per_token!r} a token, "
                             f"{self.expert_params!r} parameters) must be all 0 or a mixture within the params")

    @property
    def active_params(self) -> float:
        """The parameters one token computes with (all of them in a dense model): those it reads."""
        return self.step_params(1)

    def step_params(self, tokens: float) -> float:
        """The parameters a forward over `tokens` tokens reads: all but the experts no token took."""
        return self.params - self.expert_params * (1 - experts_read(tokens, self.experts, self.experts_per_token))

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def window_share(self) -> float:
        return self.window_layers / self.layers

    def read_tokens(self, s: float) -> float:
        """The tokens' worth of K/V one decode step of a sequence of context `s` reads: a windowed
        layer reads its last `window` keys."""
        return decode_read(s, min(s, self.window), self.window_share)

    def held_tokens(self, total: float, prompt: float) -> float:
        """The KV a sequence of `total` tokens, `prompt` of them arriving at once, keeps reserved."""
        return held_tokens(total, prompt, self.window, self.window_share)

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float       # dense FLOP/s in the model's dtype
    mem_bw: float           # bytes/s
    mem_bytes: float        # device memory
    link_bw: float          # bytes/s between a prefill and a decode replica

    def __post_init__(self):
        for field in ("peak_flops", "mem_bw", "mem_bytes", "link_bw"):
            if not getattr(self, field) > 0:
                raise ValueError(f"Hardware.{field} must be positive, got {getattr(self, field)!r}")

    @property
    def ridge(self) -> float:
        return self.peak_flops / self.mem_bw


MODELS = {
    "qwen2.5-7b": ModelSpec("Qwen2.5-7B", 7.615e9, 28, 4, 128, 2.0),
    "smollm2-135m": ModelSpec("SmolLM2-135M-Instruct", 134.5e6, 30, 3, 64, 4.0),
}
HARDWARE = {  # dense bf16 peaks; link = 400 Gb/s NIC
    "h100": Hardware("H100 SXM", 989e12, 3.35e12, 80e9, 50e9),
    "h200": Hardware("H200 SXM", 989e12, 4.8e12, 141e9, 50e9),
    "a100": Hardware("A100 80GB", 312e12, 2.04e12, 80e9, 25e9),
    "l40s": Hardware("L40S", 362e12, 0.864e12, 48e9, 12.5e9),
}


def prefill_intensity(m: ModelSpec, s: float) -> float:
    return 2 * m.active_params * s / (m.step_params(s) * m.dtype_bytes + m.kv_bytes_per_token * s)


def decode_intensity(m: ModelSpec, s: float, batch: int = 1) -> float:
    return 2 * m.active_params * batch / (m.step_params(batch) * m.dtype_bytes
                                          + m.kv_bytes_per_token * m.read_tokens(s) * batch)


def ttft_bound(m: ModelSpec, hw: Hardware, s: float, cached: float = 0) -> float:
    """A prompt of `s` tokens whose first `cached` are in the prefix cache: only the rest is
    computed, every token's K/V is read or written."""
    return max(2 * m.active_params * (s - cached) / hw.peak_flops,
               (m.step_params(s - cached) * m.dtype_bytes + m.kv_bytes_per_token * s) / hw.mem_bw)


def tpot_bound(m: ModelSpec, hw: Hardware, s: float, batch: float = 1, prompt_tokens: float = 0.0) -> float:
    """A decode step of `batch` sequences of `s` tokens, with `prompt_tokens` of prompts computed in
    it too (local prefill: a conversation's next turn run in its decode replica's steps)."""
    tokens = batch + prompt_tokens
    return max(2 * m.active_params * tokens / hw.peak_flops,
               (m.step_params(tokens) * m.dtype_bytes
                + m.kv_bytes_per_token * (m.read_tokens(s) * batch + prompt_tokens)) / hw.mem_bw)


def decode_context(input_len: float, output_len: float) -> float:
    """The mean KV length a decode step reads over one request's life (prompt + half the output)."""
    return input_len + output_len / 2


def transfer_time(m: ModelSpec, hw: Hardware, s: float) -> float:
    return m.kv_bytes_per_token * s / hw.link_bw


@dataclass(frozen=True)
class Plan:
    prefill_replicas: int
    decode_replicas: int
    decode_batch: int
    ttft: float
    tpot: float
    reason: str


def plan(m: ModelSpec, hw: Hardware, input_len: int, output_len: int, rate: float,
         ttft_slo: float, tpot_slo: float, prefill_eff: float = 1.0, decode_eff: float = 1.0,
         cached_len: int = 0, local_prefill_tokens: int = 0) -> Plan:
    """Replicas per pool for `rate` requests/s meeting both SLOs.

    Predicted times are the roofline bounds divided by the efficiencies (1.0: the bare roofline):
    TTFT = ttft_bound / prefill_eff, TPOT(B) = tpot_bound(B) / decode_eff. The decode batch is the
    largest B whose predicted TPOT meets the SLO and whose KV fits in 90% of memory beside the weights;
    a prefill replica is busy TTFT per request, a decode replica emits B tokens per TPOT.
    `cached_len`: the prompts' leading tokens every replica holds already (a shared system prompt
    or a conversation's earlier turns, with prefix affinity): a prefill computes only the rest, and
    a decode replica holds one copy of them for its whole batch (each sequence still reads them).
    `local_prefill_tokens` (pdserve's `routing.local_prefill_tokens`): where a cached prefix leaves at
    most this many tokens to compute, the decode replicas compute them in their steps (each step
    carries B x computed / output_len prompt tokens on average; TTFT is about two steps: the one
    running, then the one with the prompt) and the prefill pool keeps one replica for prompts the
    caches miss.
    """
    if not (prefill_eff > 0 and decode_eff > 0):
        raise ValueError(f"efficiencies must be positive, got {prefill_eff!r}, {decode_eff!r}")
    if not 0 <= cached_len < input_len:
        raise ValueError(f"the cached prefix ({cached_len} tokens) must be shorter than the prompt ({input_len})")
    ttft = ttft_bound(m, hw, input_len, cached_len) / prefill_eff
    context = decode_context(input_len, output_len)
    computed = input_len - cached_len
    local = 0 < cached_len and computed <= local_prefill_tokens
    rows = computed / output_len if local else 0.0

    def tpot(b: int) -> float:
        return tpot_bound(m, hw, context, b, b * rows) / decode_eff

    kv_room = hw.mem_bytes * 0.9 - m.weight_bytes - m.kv_bytes_per_token * cached_len
    held = m.held_tokens(input_len - cached_len + output_len, input_len - cached_len)
    max_batch_mem = max(int(kv_room // (m.kv_bytes_per_token * held)), 0)
    batch = 0
    for b in range(1, max_batch_mem + 1):
        if tpot(b) > tpot_slo:
            break
        batch = b
    if local:
        ttft = tpot(max(batch, 1)) + tpot_bound(m, hw, context, max(batch, 1), computed) / decode_eff
    if ttft > ttft_slo or batch == 0:
        where = "(calibrated)" if (prefill_eff, decode_eff) != (1.0, 1.0) else "(at the roofline)"
        missed = [f"TTFT {ttft * 1e3:.4g} ms > {ttft_slo * 1e3:.4g} ms"] if ttft > ttft_slo else []
        missed += [f"TPOT {tpot(1) * 1e3:.4g} ms > {tpot_slo * 1e3:.4g} ms"] if tpot(1) > tpot_slo else []
        missed += ["KV memory"] if max_batch_mem == 0 else []
        return Plan(0, 0, 0, ttft, tpot(1), f"SLO unreachable on this hardware {where}: {', '.join(missed)}")
    prefill = 1 if local else math.ceil(rate * ttft / 1.0) or 1     # each replica is busy ttft per request
    tokens_per_decode_replica = batch / tpot(batch)
    decode = math.ceil(rate * output_len / tokens_per_decode_replica) or 1
    where = (f"; prompts' {computed} tokens past the cached prefix prefilled in the decode replicas "
             f"(routing.local_prefill_tokens {local_prefill_tokens})") if local else ""
    return Plan(prefill, decode, batch, ttft, tpot(batch),
                f"decode batch {batch} limited by {'TPOT SLO' if batch < max_batch_mem else 'KV memory'}{where}")


def served_dtype(hardware: str) -> str:
    """The dtype pdserve serves a model in on `hardware` with `engine.dtype: auto`, as the planner
    names it: bf16 on the GPU presets (all have bf16), and on `cpu` (this machine) the engine's own
    choice (`engine.backends.resolve_dtype`: bf16 where the CPU has native bf16 or the
    engine's GEMVs build for AVX2, else fp32). A
    model's config `torch_dtype` does not matter: the engine converts the weights."""
    if hardware != "cpu":
        return "bf16"
    import torch

    from engine.backends import resolve_dtype
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[
        resolve_dtype("auto", torch.device("cpu"))]


_MATMUL_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def measure_cpu(dtype: str = "fp32") -> Hardware:
    """This machine's CPU, measured now with torch's thread count: matmul FLOP/s in `dtype` (the
    served one: bf16 runs twice fp32's rate on a CPU with AVX512-BF16), read
    bandwidth (`mem_bw`: a step streams weights and KV and writes next to nothing) and copy
    bandwidth (`link_bw`: a KV hand-off on one host is a copy). On this project's 2-vCPU host the
    two differ by 1.5-2x (read 40 / 50 GB/s at 1 / 2 threads, copy 61 / 108: a copy's reads and
    writes overlap), and the engine's GEMVs stream weights at 0.9-1.05x the read figure."""
    import time

    import psutil
    import torch

    from engine.linear import cpu_has_native_bf16
    # without native bf16 (an AVX2-only CPU) torch's bf16 matmul is emulated (about 1 GFLOP/s)
    # while the engine's bf16 kernels widen to fp32 and run fp32's FMAs: their peak is fp32's
    matmul = "fp32" if dtype == "bf16" and not cpu_has_native_bf16() else dtype
    a = torch.randn(1024, 1024, dtype=getattr(torch, _MATMUL_DTYPES[matmul]))
    b = torch.randn_like(a)
    a @ b
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    flops = 10 * 2 * 1024**3 / (time.perf_counter() - t0)

    def best_seconds(fn, reps: int) -> float:       # the machine's rate, not its neighbours'
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)
    buf = torch.ones(64 * 2**20)                               # 256 MiB, far beyond the caches
    read_bw = 4 * buf.numel() / best_seconds(buf.sum, 8)
    del buf
    src = torch.empty(64 * 2**20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    copy_bw = 2 * src.numel() / best_seconds(lambda: dst.copy_(src), 8)   # read + write
    how = f"{dtype} matmul" if matmul == dtype else f"{dtype} served, {matmul} matmul"
    return Hardware(f"this CPU (measured, {how})", flops, read_bw, psutil.virtual_memory().total, copy_bw)


def report(m: ModelSpec, hw: Hardware, lengths=(128, 512, 1024, 4096), batches=(1, 8, 64)) -> str:
    window = f", a {m.window}-token window on {m.window_layers} of {m.layers} layers" if m.window else ""
    if m.window and 4 * m.window > max(lengths):
        lengths = (*lengths, 4 * m.window)          # a context the window has passed
    moe = (f" ({m.active_params / 1e9:.3g} B active: {m.experts_per_token} of {m.experts} experts a token)"
           if m.experts else "")
    rows = [f"model {m.name}: {m.params / 1e9:.3g} B params{moe}, {m.dtype_bytes:g} B/param, "
            f"KV {m.kv_bytes_per_token / 1024:.1f} KiB/token{window}",
            f"hardware {hw.name}: {hw.peak_flops / 1e12:.3g} TFLOP/s, {hw.mem_bw / 1e9:.4g} GB/s, "
            f"ridge {hw.ridge:.1f} FLOP/byte, link {hw.link_bw / 1e9:.3g} GB/s", "",
            "| S | prefill FLOP/B | " + " | ".join(f"decode B={b} FLOP/B" for b in batches)
            + " | TTFT bound ms | " + " | ".join(f"TPOT B={b} ms" for b in batches) + " | KV transfer ms |",
            "|" + "---:|" * (4 + 2 * len(batches))]
    for s in lengths:
        rows.append(f"| {s} | {prefill_intensity(m, s):.1f} | "
                    + " | ".join(f"{decode_intensity(m, s, b):.2f}" for b in batches)
                    + f" | {ttft_bound(m, hw, s) * 1e3:.2f} | "
                    + " | ".join(f"{tpot_bound(m, hw, s, b) * 1e3:.2f}" for b in batches)
                    + f" | {transfer_time(m, hw, s) * 1e3:.2f} |")
    return "\n".join(rows)
