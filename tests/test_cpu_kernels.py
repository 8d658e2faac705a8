"""The engine's CPU kernels (engine/kernels) against the torch ops they replace.

- RMSNorm and residual add + RMSNorm (the bf16 decoder's norms) equal F.rms_norm on bf16 rows up
  to one bf16 rounding step in rare elements, and the residual sum exactly; with an fp32 weight
  (Gemma's 1 + weight) the fp32 result rounded once; SiLU-and-multiply equals F.silu(gate) * up
  the same way.

- On random pools, shuffled block tables and ragged context lengths, the in-place kernel gives
  the torch backend's output (gather + sdpa) within float rounding, for fp32 and bf16, head
  sizes with and without a compiled-in specialization (64, 128, 256), GQA groups of 1-4 and
  several block sizes, with full attention and within sliding windows.
- A whole engine in the exact mode (fp32) gives the same greedy tokens with either backend,
  through prompt chunks and decode, and frees its blocks.
- Asking for the kernel where it cannot run is a clear error.
- The int8 and int4 GEMV kernels round the activations to int8 in groups of 32: the int8 one
  gives its documented sums (the products summed exactly), the int4 one the dequantized weight
  times the rounded activations, both within one bf16 rounding, and x @ dequant(w).T within the
  activations' rounding; both for shapes that are not multiples of their blocks or
  groups, every row count of one pass and some that take more, with and without bias; a NaN
  activation makes its row's outputs NaN; they refuse a weight that is not in their layout.
- RoPE + K/V store fused (the bf16 decode step's) gives the unfused ops' q and pool rows.
- The dense GEMVs (fp32 and bf16 steps of few rows) give x @ w.T (+ bias) within fp32 summation
  error (and one bf16 rounding), for sizes that are not multiples of their vectors or channel
  groups, every row count of one pass and some that take more; an fp32 row's output does not
  depend on the rows beside it; engine.linear's dense layers switch to them at few rows and back
  above their thresholds; they refuse what is not their dtype or layout.
- Where the CPU has AMX-BF16, the AMX GEMM on the bf16 GEMV's blocked weight gives the same
  product within one bf16 rounding for partial and whole tiles and several passes, per row
  independently of the rows beside it, is what bf16_gemv runs from 2 rows, keeps a NaN in its
  row, and refuses inputs that are not whole tiles; elsewhere it is refused with a clear error.
  int4's AMX path (its weight widened to bf16, x unrounded) gives x @ widened(w).T the same way
  for the same shapes and row counts. Where the CPU has AMX-INT8, int8's AMX path gives the
  documented sums of x split into two int8 limbs a row, within one bf16 rounding, per row
  independently. Both are what int8_gemv / int4_gemv run from their `*_amx_from()` rows (below
  them the int8-rounded activations' sums, as documented).
- Greedy sampling's row argmax gives torch's indices (first of ties, NaN as the maximum, infinities).
- Sampling's whole-row draw gives the argmax of the logits plus the sampler's torch noise for
  every token (vector and scalar paths, peaked and flat rows, -inf and +inf, temperatures
  near 0), the first NaN's index for a row with one, index 0 for a row of -inf.
- Top-k / nucleus candidates: each row's `width` largest logits in order with their ids, equal
  logits by the smaller id (a stable sort's order), and the row's logsumexp within fp32 rounding,
  for peaked, flat, rounded (ties), constant and mostly -inf rows, widths 1 to the vocabulary;
  NaN rows give NaN, rows of -inf / +inf their logsumexp as torch's.
- The prefill kernel (a bf16 prompt chunk's causal attention over its blocks in place) gives an
  fp32 attention's output within bf16 rounding, fresh and after a past, for GQA groups of 1-8, head
  sizes 64, 128 and 256 and odd block sizes, and within sliding windows; it takes the decoder's strided queries, reads nothing
  outside the context, and refuses what it cannot read. A bf16 engine runs every longer prompt
  chunk through it (its prompt log-probabilities within 0.05 of sdpa's), fp32 never.
"""

import functools

import pytest
import torch
import torch.nn.functional as F

from engine.attention import AttentionMetadata, DecodeBatch, eager_sdpa, paged_attention
from engine import decoder, linear
from engine.config import EngineConfig
from engine.kernels import cpu_kernels
from engine.llm_engine import LLMEngine
from engine.backends import KERNEL_CHUNK_ROWS, KVShape, attention_kernels, paged_kernel_problem
from engine.sampling_params import SamplingParams
from tiny_models import tiny_model_dir

KERNELS = cpu_kernels()
needs_kernel = pytest.mark.skipif(KERNELS is None, reason="the CPU kernel could not be built here")


def _decode_case(dtype, batch, max_ctx, heads, kv_heads, dim, block_size, layers=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    max_blocks = -(-max_ctx // block_size)
    n_blocks = batch * max_blocks + 3
    pool = torch.randn(n_blocks, layers, 2, block_size, kv_heads, dim, generator=g).to(dtype)
    tables = torch.randperm(n_blocks, generator=g)[:batch * max_blocks].view(batch, max_blocks)
    lens = torch.randint(1, max_ctx + 1, (batch,), generator=g)
    lens[0] = max_ctx
    query = torch.randn(batch, heads, dim, generator=g).to(dtype)
    return pool, tables, lens, query


def _both_backends(pool, tables, lens, query, layer, scale, window=0, softcap=0.0, sinks=None):
    """(kernel output, torch output) for one decode step of `layer` (a sliding-window layer of
    `window` keys unless 0; scores soft-capped at `softcap` unless 0; gpt-oss's attention `sinks`
    [H] unless None); the new token's K/V is the one already in the pool at the last position, so
    the store step changes nothing."""
    batch = query.shape[0]
    n_layers, block_size = pool.shape[1], pool.shape[3]
    last = lens - 1
    slots = tables[torch.arange(batch), last // block_size] * (n_layers * 2 * block_size) + last % block_size
    flat = pool.view(-1, pool.shape[4], pool.shape[5])
    key = flat[slots + 2 * layer * block_size].clone()
    value = flat[slots + (2 * layer + 1) * block_size].clone()
    rows = torch.arange(batch)
    k_rows = tables * (2 * n_layers)
    keys = torch.arange(tables.shape[1] * block_size)[None, :]
    mask = (keys < lens[:, None])[:, None, None, :]
    # the last `window` keys of each row, written out here rather than by the engine's window_mask
    in_window = ((keys < lens[:, None]) & (keys >= lens[:, None] - window))[:, None, None, :]
    gathered = DecodeBatch(rows, blocks=torch.stack((k_rows, k_rows + 1)).view(-1), mask=mask,
                           window_masks={window: in_window})
    in_place = DecodeBatch(rows, tables=tables.contiguous(), lens=lens.contiguous())
    ref = paged_attention(layer, query, key, value, AttentionMetadata(pool, slots, gathered, [], True), scale, window,
                          softcap, sinks)
    out = paged_attention(layer, query, key, value,
                          AttentionMetadata(pool, slots, in_place, [], True, KERNELS), scale, window, softcap, sinks)
    return out, ref


@needs_kernel
@pytest.mark.parametrize("rows,hidden", [(1, 576), (7, 576), (300, 576), (5, 100)])   # 100: a partial vector
def test_norm_kernels_match_torch(rows, hidden):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, hidden, generator=g) * 3).bfloat16()
    d = torch.randn(rows, hidden, generator=g).bfloat16()
    w = (torch.rand(hidden, generator=g) + 0.5).bfloat16()
    ref = F.rms_norm(x, (hidden,), w, eps=1e-5)
    out = KERNELS.rms_norm(x, w, 1e-5)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert (out.float() - ref.float()).abs().max() <= ref.float().abs().max() * 2**-7   # one bf16 step
    assert (out != ref).float().mean() < 0.01
    s, h = KERNELS.add_rms_norm(x, d, w, 1e-5)
    assert torch.equal(s, x + d)
    ref_h = F.rms_norm(x + d, (hidden,), w, eps=1e-5)
    assert (h.float() - ref_h.float()).abs().max() <= ref_h.float().abs().max() * 2**-7
    assert (h != ref_h).float().mean() < 0.01
    x32, w32 = x.float(), w.float()
    assert torch.allclose(KERNELS.rms_norm(x32, w32, 1e-5), F.rms_norm(x32, (hidden,), w32, eps=1e-5), atol=1e-5)
    # bf16 rows scaled by an fp32 weight (Gemma's 1 + weight): fp32 math, one rounding at the end
    w_fine = 1 + torch.rand(hidden, generator=g) * 0.01               # bf16 would round most to 1
    for out, rows in ((KERNELS.rms_norm(x, w_fine, 1e-5), x), (KERNELS.add_rms_norm(x, d, w_fine, 1e-5)[1], x + d)):
        want = F.rms_norm(rows.float(), (hidden,), w_fine, eps=1e-5)
        assert out.dtype == torch.bfloat16
        assert (out.float() - want).abs().max() <= want.abs().max() * 2**-8      # its one rounding
    assert (KERNELS.rms_norm(x, w_fine, 1e-5) != KERNELS.rms_norm(x, w_fine.bfloat16(), 1e-5)).any()


@needs_kernel
@pytest.mark.parametrize("rows,inter", [(1, 1536), (9, 1536), (130, 100)])    # 100: not a multiple of 64
def test_silu_mul_matches_torch(rows, inter):
    gate_up = (torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(rows)) * 4).bfloat16()
    g, u = gate_up.chunk(2, dim=-1)
    ref = F.silu(g) * u
    out = KERNELS.silu_mul(gate_up)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, inter)
    # the same two roundings; another fp32 exp can tip silu(g) over a bf16 rounding boundary (one
    # step of it), which the product's rounding carries into at most two steps of the result, rarely
    two_steps = torch.maximum(ref.float().abs(), out.float().abs()) * 2**-6
    assert ((out.float() - ref.float()).abs() <= two_steps).all()
    assert (out != ref).float().mean() < 0.01
    with pytest.raises(RuntimeError, match="even width"):
        KERNELS.silu_mul(gate_up[:, 1:])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows, width, rank, some", [(1, 960, 48, False), (5, 300, 7, True), (12, 3072, 32, True),
                                                     (3, 1, 1, False)])
def test_lora_add_matches_torch(dtype, rows, width, rank, some):
    """lora_add_ (engine/lora.py's update of a bf16 linear's few rows): out[rows] += (a x) b_t in
    fp32, rounded once; the rows not named are left as they were."""
    g = torch.Generator().manual_seed(rows * width + rank)
    x = torch.randn(rows, 576, generator=g).to(dtype)
    a, b_t = torch.randn(rank, 576, generator=g) * 0.1, torch.randn(rank, width, generator=g) * 0.1
    out = torch.randn(rows, width, generator=g).to(dtype)
    picked = torch.tensor([r for r in range(rows) if r % 2 == 0]) if some else None
    want = out.float().clone()
    idx = torch.arange(rows) if picked is None else picked
    want[idx] += (x[idx].float() @ a.t()) @ b_t
    KERNELS.lora_add_(out, x, a, b_t, picked)
    tolerance = 2**-7 if dtype == torch.bfloat16 else 1e-4
    assert ((out.float() - want).abs() <= tolerance * want.abs().clamp(min=1)).all()
    if some:
        untouched = [r for r in range(rows) if r % 2]
        assert torch.equal(out[untouched].float(), want[untouched])
    with pytest.raises(RuntimeError, match="must fit"):
        KERNELS.lora_add_(out, x, a[:, 1:].contiguous(), b_t, None)


def _quantized_layer(quantize, out_f: int, in_f: int, with_bias: bool):
    """(generator, w, bias, layer, dequantized w) of engine.linear's `_int8` / `_int4` on a random
    weight, with the engine's kernels."""
    g = torch.Generator().manual_seed(out_f * in_f)
    w = torch.randn(out_f, in_f, generator=g) * 0.05
    bias = (torch.randn(out_f, generator=g) * 0.1).bfloat16() if with_bias else None
    layer, dequantize = quantize(w, bias, KERNELS)
    return g, w, bias, layer, dequantize()


def _int8_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 and int4 kernels' rounding of x [rows, k] (gemv_cpu.h quantize_rows), in float64:
    each row's groups of 32 inputs (zeros past the end) rounded to integers by 127 / their max;
    returns them [rows, groups, 32] and each group's scale, max / 127 [rows, groups, 1]."""
    rows, k = x.shape
    kp = -(-k // 32) * 32
    xg = F.pad(x.float(), (0, kp - k)).view(rows, kp // 32, 32)
    amax = xg.abs().amax(-1, keepdim=True)
    # 127 / max as a division (torch's `127.0 / amax` multiplies by a reciprocal: another rounding)
    xq = (xg * torch.where(amax > 0, torch.full_like(amax, 127.0).div(amax), 0)).round().double()
    return xq, (amax / 127).double()


def _amx_from(fmt: str) -> float:
    """The row count from which int8_gemv (AMX-INT8 tiles, for inputs in whole 64-byte tiles) /
    int4_gemv (bf16 tiles) run on AMX here (inf: never)."""
    if not (KERNELS.amx_int8_available() if fmt == "int8" else KERNELS.amx_available()):
        return float("inf")
    return getattr(KERNELS, f"{fmt}_gemv_amx_from")()


def _assert_int8_limbs_sums(y: torch.Tensor, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                            bias: torch.Tensor | None) -> None:
    """y is int8's AMX path's documented sums (amx_int8_cpu.cpp): each row of x rounded to integers
    v by 16383 / its max (fp32, to nearest even), y = scale * s * (v @ q.T) + bias with s = max /
    16383, within fp32 arithmetic on the int32 sums and one bf16 rounding."""
    xf = x.float()
    amax = xf.abs().amax(1, keepdim=True)
    v = (xf * torch.where(amax > 0, torch.full_like(amax, 16383.0).div(amax), 0)).round().double()
    assert v.abs().max() <= 16383
    s, q = (amax / 16383).double(), q.double()
    ref = (v @ q.t()) * s * scale.double() + (0 if bias is None else bias.double())
    bound = ((v.abs() @ q.abs().t()) * s * scale.double()) * 2**-21 + ref.abs() * 2**-8 + 1e-12
    assert ((y.double() - ref).abs() <= bound).all(), (y.shape, ((y.double() - ref).abs() - bound).max().item())


def _assert_product(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    """y is x @ w.T (+ bias) within an fp32 sum's error and one bf16 rounding (the AMX GEMMs)."""
    ref = x.double() @ w.double().t() + (0 if bias is None else bias.double())
    bound = (x.double().abs() @ w.double().abs().t()) * x.shape[1] * 2**-24 + ref.abs() * 2**-8 + 1e-12
    assert ((y.double() - ref).abs() <= bound).all(), (y.shape, ((y.double() - ref).abs() - bound).max().item())


def _int8_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """int8_gemv's sums as its header writes them, in float64: engine.linear's weight quantization,
    the rounded activations, the integer products summed exactly, times the group's and the
    channel's scales."""
    scale = (w.abs().amax(1) / 127).clamp(min=1e-8)
    q = (w / scale[:, None]).round().clamp(-127, 127).double()
    xq, xs = _int8_activations(x)
    k, kp = x.shape[1], xq.shape[1] * 32
    dots = torch.einsum("rgk,ngk->rng", xq, F.pad(q, (0, kp - k)).view(-1, kp // 32, 32))
    y = (dots * xs.view(x.shape[0], 1, -1)).sum(-1) * scale.bfloat16().double()
    return y if bias is None else y + bias.double()


@needs_kernel
@pytest.mark.parametrize("out_f,in_f", [(37, 77), (960, 576), (5, 2), (576, 1536), (40, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_gemv_gives_its_documented_sums(out_f, in_f, with_bias):
    # (37, 77): channels not a multiple of 16, inputs not of 32; SmolLM2's fused QKV and down
    g, w, bias, layer, dequantized = _quantized_layer(linear._int8, out_f, in_f, with_bias)
    for rows in [*range(1, 34), 40, 67]:             # passes: 16, then 8s (17-33, 40, 67: more than one)
        x = torch.randn(rows, in_f, generator=g).bfloat16()
        x[0, :min(in_f, 32)] = 0                     # a group of zeros: scale 0, no division by it
        y = layer(x)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, out_f)
        if rows >= _amx_from("int8") and in_f % 64 == 0:     # AMX-INT8 tiles, x in two int8 limbs
            scale = (w.abs().amax(1) / 127).clamp(min=1e-8)
            q = (w / scale[:, None]).round().clamp(-127, 127)
            _assert_int8_limbs_sums(y, x, q, scale.bfloat16().float(), bias)
            continue
        ref = _int8_reference(x, w, bias)
        err = (y.double() - ref).abs()
        assert (err <= ref.abs() * 2**-8 + ref.abs().max() * 1e-5).all(), (rows, err.max().item())
        # and x @ dequant(w).T within the activations' rounding (about 0.5 % in norm)
        exact = x.double() @ dequantized.double().t() + (0 if bias is None else bias.double())
        assert (y.double() - exact).norm() <= 0.015 * exact.norm()
    assert layer(x[:0]).shape == (0, out_f)


@needs_kernel
@pytest.mark.parametrize("out_f,in_f", [
    (37, 96),
    (48, 32),
    (576, 1536),     # SmolLM2's down projection
])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int4_gemv_gives_the_dequantized_weight_times_the_rounded_activations(out_f, in_f, with_bias):
    g, _, bias, layer, dequantized = _quantized_layer(linear._int4, out_f, in_f, with_bias)
    for rows in [*range(1, linear.KERNEL_SMALL_ROWS + 1), 20, 40]:      # passes of 8: 9-32 and 40 take more
        x = torch.randn(rows, in_f, generator=g).bfloat16()
        x[0, :32] = 0                                # a group of zeros: scale 0, no division by it
        xq, xs = _int8_activations(x)
        ref = (xq * xs).view(rows, -1) @ dequantized.double().t() + (0 if bias is None else bias.double())
        y = layer(x)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, out_f)
        if rows >= _amx_from("int4"):                # on AMX tiles: x not rounded, w rounded to bf16
            _assert_product(y, x, dequantized.bfloat16(), bias)
            continue
        err = (y.double() - ref).abs()
        assert (err <= ref.abs() * 2**-8 + ref.abs().max() * 1e-5).all(), (rows, err.max().item())
        # and x @ dequant(w).T within the activations' rounding (about 0.5 % in norm)
        exact = x.double() @ dequantized.double().t() + (0 if bias is None else bias.double())
        assert (y.double() - exact).norm() <= 0.015 * exact.norm()


@needs_kernel
@pytest.mark.parametrize("in_f", [96, 77])           # 77: a last group past the inputs' end
def test_activations_round_to_int8_exactly_as_documented(in_f):
    # Through an int8 layer whose weight is 127 x identity (q = 127, channel scale 1): output n is
    # 127 * xq[n] * xs, so an activation rounded one step off (1 / |xq| >= 1 / 127 relative) breaks
    # the 2^-8 bound; the other kernel tests only bound the sums. Ties included: a group whose max
    # is 127 rounds x * 1.0, and k + 0.5 goes to the even neighbour (torch's round, like the kernel).
    g = torch.Generator().manual_seed(in_f)
    layer, _ = linear._int8(torch.eye(in_f) * 127, None, KERNELS)
    for rows in (1, 2, 3, 5, 9):
        x = (torch.randn(rows, in_f, generator=g) * 3).bfloat16()
        x[0, :32] = torch.arange(32) - 15.5                  # every .5 tie
        x[0, 31] = 127                                       # ... with a max of 127: scale 1
        xq, xs = _int8_activations(x)
        ref = 127 * (xq * xs).view(rows, -1)[:, :in_f]
        y = layer(x).double()
        assert ((y - ref).abs() <= ref.abs() * 2**-8 + 1e-30).all(), rows
    assert torch.equal(xq[0, 0, :31], torch.arange(31.).sub(15.5).round().double())   # the ties checked


@needs_kernel
@pytest.mark.parametrize("quantize", [linear._int8, linear._int4])
def test_int_gemvs_carry_a_nan_activation_into_its_rows_outputs(quantize):
    # rounding x to int8 must not turn a NaN into a 0 (the vector max drops NaNs; a NaN rounds to
    # the integer 0): the row's outputs are NaN, as a bf16 product's are, and the other rows finite
    _, _, _, layer, _ = _quantized_layer(quantize, 48, 128, False)
    for rows in (3, 40):                             # 40: on AMX tiles where the CPU has them
        x = torch.randn(rows, 128).bfloat16()
        x[1, 37] = float("nan")
        y = layer(x).float()
        assert torch.isnan(y[1]).all() and torch.isfinite(y[0]).all() and torch.isfinite(y[2:]).all()


@needs_kernel
def test_quant_gemv_refuses_what_is_not_its_layout():
    w = torch.randn(32, 64)
    x = torch.randn(2, 64).bfloat16()
    q = w.to(torch.int8)
    with pytest.raises(RuntimeError, match="uint8"):
        KERNELS.int8_gemv(x, q, torch.ones(32), None, 32)                 # [out, in], not blocks of 16
    with pytest.raises(RuntimeError, match="uint8"):
        KERNELS.int8_gemv(x, linear._blocks_of_16(q), torch.ones(32), None, 32)   # pairs, not quads
    with pytest.raises(RuntimeError, match="bf16"):
        KERNELS.int8_gemv(x.float(), linear._int8_quads(q), torch.ones(32), None, 32)
    packed, sz = linear._int4_blocks(torch.zeros(32, 64, dtype=torch.int32), torch.ones(32, 2).bfloat16(),
                                     torch.zeros(32, 2).bfloat16())
    with pytest.raises(RuntimeError, match="multiple of 32"):
        KERNELS.int4_gemv(torch.randn(2, 48).bfloat16(), packed, sz, None, 32)
    with pytest.raises(RuntimeError, match="bias"):
        KERNELS.int4_gemv(x, packed, sz, torch.zeros(31).bfloat16(), 32)


needs_vector_gemv = pytest.mark.skipif(KERNELS is None or not KERNELS.gemv_vectorized(),
                                       reason="the dense GEMVs are used only where they build with AVX512-BF16 or AVX2")


class _Counting:
    """The real kernels, recording the row count of every call of kernel `name` in `calls`."""

    def __init__(self, name: str, calls: list):
        self._name, self._calls = name, calls

    def __getattr__(self, attr):
        kernel = getattr(KERNELS, attr)
        if attr != self._name:
            return kernel
        return lambda x, *rest: self._calls.append(x.shape[0]) or kernel(x, *rest)


def _dense_gemv(w, bias, x):
    """The kernel for w's dtype: fp32_gemv on w itself, bf16_gemv on its blocked copy."""
    if w.dtype == torch.float32:
        return KERNELS.fp32_gemv(x, w, bias)
    return KERNELS.bf16_gemv(x, linear._blocks_of_16(w), bias, w.shape[0])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_f,in_f", [
    (37, 77),          # neither a multiple of the channel groups nor of the vectors; odd inputs
    (960, 576),        # SmolLM2's fused QKV
    (3, 1536),         # fewer channels than a group
    (130, 33),
])
@pytest.mark.parametrize("with_bias", [False, True])
def test_dense_gemv_matches_a_double_precision_product(dtype, out_f, in_f, with_bias):
    g = torch.Generator().manual_seed(out_f + in_f)
    w = (torch.randn(out_f, in_f, generator=g) * 0.05).to(dtype)
    bias = (torch.randn(out_f, generator=g) * 0.1).to(dtype) if with_bias else None
    xs = torch.randn(19, in_f, generator=g).to(dtype)
    full = _dense_gemv(w, bias, xs)
    for rows in [*range(1, 9), 9, 16, 17, 19]:     # 9-16: one pass in bf16, two in fp32; 17, 19: more
        x = xs[:rows]
        ref = x.double() @ w.double().t() + (0 if bias is None else bias.double())
        y = _dense_gemv(w, bias, x)
        assert y.dtype == dtype and y.shape == (rows, out_f)
        err = (y.double() - ref).abs()
        # fp32: the classic bound of a sum of in_f products; bf16: one rounding of the fp32 sum
        bound = (x.double().abs() @ w.double().abs().t()) * in_f * 2**-24 + 1e-12
        if dtype == torch.bfloat16:
            bound = bound + ref.abs() * 2**-8
        assert (err <= bound).all(), (rows, err.max().item())
        if dtype == torch.float32:
            # batch-invariant: row r alone, or beside other rows, gives the same numbers
            assert torch.equal(y, full[:rows]), rows
            assert torch.equal(_dense_gemv(w, bias, x[-1:]), y[-1:]), rows


needs_amx = pytest.mark.skipif(KERNELS is None or not KERNELS.amx_available(),
                               reason="this CPU (or its OS) offers no AMX-BF16 tiles")


@needs_amx
@pytest.mark.parametrize("out_f,in_f", [
    (37, 64),          # a partial block of channels, two tiles of inputs
    (4000, 576),       # many L2 chunks of blocks a thread (passes of 32 rows over each)
    (48, 1536),        # an odd number of blocks (a 2-block pass and a 1-block one)
])
@pytest.mark.parametrize("with_bias", [False, True])
def test_amx_gemm_matches_a_double_precision_product_and_is_what_bf16_gemv_runs(out_f, in_f, with_bias):
    """bf16_gemm_amx (AMX tiles on the GEMV's blocked weight): x @ w.T (+ bias) within one bf16
    rounding of an fp32 sum, for row counts that fill 1 or 2 tiles of x, partly or wholly, and
    more than one pass of 32 rows; each row's numbers do not depend on the rows beside it; and
    bf16_gemv hands it its calls from 2 rows (dense_gemv_cpu.cpp kAmxFrom) on such a CPU."""
    g = torch.Generator().manual_seed(out_f + in_f)
    w = (torch.randn(out_f, in_f, generator=g) * 0.05).bfloat16()
    bias = (torch.randn(out_f, generator=g) * 0.1).bfloat16() if with_bias else None
    blocks = linear._blocks_of_16(w)
    xs = torch.randn(70, in_f, generator=g).bfloat16()
    full = KERNELS.bf16_gemm_amx(xs, blocks, bias, out_f)
    for rows in (1, 15, 16, 17, 32, 33, 70):
        x = xs[:rows]
        y = KERNELS.bf16_gemm_amx(x, blocks, bias, out_f)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, out_f)
        _assert_product(y, x, w, bias)
        assert torch.equal(y, full[:rows]), rows                   # row r beside others or alone
        assert torch.equal(KERNELS.bf16_gemm_amx(x[-1:], blocks, bias, out_f), y[-1:]), rows
        if rows >= 2:
            assert torch.equal(KERNELS.bf16_gemv(x, blocks, bias, out_f), y), rows


@needs_amx
def test_amx_gemm_carries_a_nan_into_its_rows_outputs_and_refuses_what_it_cannot_take():
    w = torch.randn(32, 64).bfloat16()
    blocks = linear._blocks_of_16(w)
    x = torch.randn(5, 64).bfloat16()
    x[2, 7] = float("nan")
    y = KERNELS.bf16_gemm_amx(x, blocks, None, 32).float()
    assert torch.isnan(y[2]).all() and torch.isfinite(y[[0, 1, 3, 4]]).all()
    assert KERNELS.bf16_gemm_amx(x[:0], blocks, None, 32).shape == (0, 32)
    with pytest.raises(RuntimeError, match="multiple of 32"):            # inputs not whole tiles
        KERNELS.bf16_gemm_amx(torch.randn(4, 48).bfloat16(), linear._blocks_of_16(torch.randn(32, 48).bfloat16()), None, 32)
    with pytest.raises(RuntimeError, match="w:"):
        KERNELS.bf16_gemm_amx(x, blocks[:1], None, 32)
    with pytest.raises(RuntimeError, match="bias"):
        KERNELS.bf16_gemm_amx(x, blocks, torch.zeros(31).bfloat16(), 32)


def _random_int4(out_f: int, in_f: int, g: torch.Generator):
    """(int4_gemv's weight arguments, the AMX path's widened weight [out, in]) for random int4
    values, scales and zeros in the kernel's layout."""
    q = torch.randint(0, 16, (out_f, in_f), generator=g)
    groups = (out_f, in_f // 32)
    scale, zero = (torch.rand(groups, generator=g) * 0.01).bfloat16(), (torch.randn(groups, generator=g) * 0.01).bfloat16()
    w = (q.view(out_f, -1, 32) - 8) * scale.float()[..., None] + zero.float()[..., None]
    return linear._int4_blocks(q, scale, zero), w.view(out_f, in_f).bfloat16()


@needs_amx
@pytest.mark.parametrize("out_f,in_f", [(37, 96), (4000, 576), (48, 1536)])    # as the bf16 GEMM's
def test_amx_int4_gemm_multiplies_the_widened_weight_and_is_what_int4_gemv_runs_from_many_rows(out_f, in_f):
    """int4_gemm_amx widens int4's weight to bf16 ((q - 8) s + z rounded to bf16) a chunk of blocks
    at a time and multiplies unrounded x on AMX tiles: x @ w.T (+ bias) within an fp32 sum's error
    and one bf16 rounding; each row independent of the rows beside it; and int4_gemv hands it its
    calls from `int4_gemv_amx_from()` rows (below it: x rounded to int8)."""
    gemm, gemv = KERNELS.int4_gemm_amx, KERNELS.int4_gemv
    g = torch.Generator().manual_seed(out_f + in_f)
    args, widened = _random_int4(out_f, in_f, g)
    bias = (torch.randn(out_f, generator=g) * 0.1).bfloat16()
    xs = torch.randn(70, in_f, generator=g).bfloat16()
    full = gemm(xs, *args, bias, out_f)
    amx_from = _amx_from("int4")
    for rows in (1, 15, 16, 17, 23, 24, 31, 32, 33, 70):
        x = xs[:rows]
        y = gemm(x, *args, bias, out_f)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, out_f)
        _assert_product(y, x, widened, bias)
        assert torch.equal(y, full[:rows]), rows                   # row r beside others or alone
        assert torch.equal(gemm(x[-1:], *args, bias, out_f), y[-1:]), rows
        assert torch.equal(gemv(x, *args, bias, out_f), y) == (rows >= amx_from), rows
    assert gemm(xs[:0], *args, bias, out_f).shape == (0, out_f)


@needs_amx
def test_amx_int4_gemm_refuses_what_it_cannot_take():
    gemm = KERNELS.int4_gemm_amx
    packed, sz = linear._int4_blocks(torch.zeros(32, 64, dtype=torch.int32), torch.ones(32, 2).bfloat16(),
                                     torch.zeros(32, 2).bfloat16())
    with pytest.raises(RuntimeError, match="multiple of 32"):
        gemm(torch.randn(2, 48).bfloat16(), packed, sz, None, 32)
    with pytest.raises(RuntimeError, match="bias"):
        gemm(torch.randn(2, 64).bfloat16(), packed, sz, torch.zeros(31).bfloat16(), 32)


needs_amx_int8 = pytest.mark.skipif(KERNELS is None or not KERNELS.amx_int8_available(),
                                    reason="this CPU (or its OS) offers no AMX-INT8 tiles")


@needs_amx_int8
@pytest.mark.parametrize("out_f,in_f", [
    (37, 64),          # a partial block of channels, one tile of inputs
    (4000, 576),       # many L2 chunks of blocks a thread (each walked again for every 16 rows)
    (48, 1536),        # an odd number of blocks (a 2-block pass and a 1-block one)
])
@pytest.mark.parametrize("with_bias", [False, True])
def test_amx_int8_gemm_gives_its_limbs_sums_and_is_what_int8_gemv_runs_from_many_rows(out_f, in_f, with_bias):
    """int8_gemm_amx splits each row of x into two int8 limbs on one scale and sums them against
    the weight's quads on AMX-INT8 tiles: the documented sums within one bf16 rounding, x @ w.T
    within bf16 rounding (15 bits a row), each row independent of the rows beside it (a row of
    zeros too); int8_gemv hands it its calls from `int8_gemv_amx_from()` rows."""
    g = torch.Generator().manual_seed(out_f * 7 + in_f)
    q = torch.randint(-127, 128, (out_f, in_f), generator=g, dtype=torch.int8)
    scale = (torch.rand(out_f, generator=g) * 1e-3 + 1e-4).bfloat16().float()
    args = (linear._int8_quads(q), F.pad(scale, (0, -out_f % 16)))
    bias = (torch.randn(out_f, generator=g) * 0.1).bfloat16() if with_bias else None
    xs = torch.randn(130, in_f, generator=g).bfloat16()
    xs[3] = 0                                        # a row of zeros: scale 0, no division by it
    xs[5, 7] = 40.0                                  # an outlier: the rest of its row on a coarser step
    gemm = KERNELS.int8_gemm_amx
    full = gemm(xs, *args, bias, out_f)
    for rows in (1, 15, 16, 17, 31, 32, 33, 70, 130):
        x = xs[:rows]
        y = gemm(x, *args, bias, out_f)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, out_f)
        _assert_int8_limbs_sums(y, x, q.float(), scale, bias)
        exact = x.double() @ (q.double() * scale.double()[:, None]).t() + (0 if bias is None else bias.double())
        assert (y.double() - exact).norm() <= 0.005 * exact.norm(), rows
        assert torch.equal(y, full[:rows]), rows                   # row r beside others or alone
        assert torch.equal(gemm(x[-1:], *args, bias, out_f), y[-1:]), rows
        assert torch.equal(KERNELS.int8_gemv(x, *args, bias, out_f), y) == (rows >= _amx_from("int8")), rows
    assert gemm(xs[:0], *args, bias, out_f).shape == (0, out_f)


@needs_amx_int8
def test_amx_int8_gemm_refuses_what_it_cannot_take():
    q = torch.randint(-127, 128, (32, 96), dtype=torch.int8)     # 96 inputs: not whole 64-byte tiles
    with pytest.raises(RuntimeError, match="multiple of 64"):
        KERNELS.int8_gemm_amx(torch.randn(20, 96).bfloat16(), linear._int8_quads(q), torch.ones(32), None, 32)
    # int8_gemv runs such inputs on its VNNI kernel instead, at every row count
    x = torch.randn(20, 96).bfloat16()
    assert torch.equal(KERNELS.int8_gemv(x, linear._int8_quads(q), torch.ones(32), None, 32),
                       torch.cat([KERNELS.int8_gemv(x[i:i + 1], linear._int8_quads(q), torch.ones(32), None, 32)
                                  for i in range(20)]))
    with pytest.raises(RuntimeError, match="scale"):
        KERNELS.int8_gemm_amx(torch.randn(4, 64).bfloat16(), linear._int8_quads(q[:, :64]), torch.ones(31), None, 32)


def test_amx_availability_is_a_plain_answer_everywhere():
    # where the kernels build, the op answers (False on CPUs without AMX or where the OS refuses its
    # tiles) instead of faulting; bf16_gemm_amx is then refused, not run
    if KERNELS is None:
        pytest.skip("the CPU kernel could not be built here")
    assert KERNELS.amx_available() or not KERNELS.amx_int8_available()     # AMX-INT8 needs the tiles
    if not KERNELS.amx_available():
        with pytest.raises(RuntimeError, match="AMX"):
            KERNELS.bf16_gemm_amx(torch.randn(4, 64).bfloat16(), torch.zeros(2, 32, 32).bfloat16(), None, 32)
        with pytest.raises(RuntimeError, match="AMX"):
            KERNELS.int4_gemm_amx(torch.randn(4, 64).bfloat16(), torch.zeros(2, 2, 256, dtype=torch.uint8),
                                  torch.ones(2, 2, 2, 16).bfloat16(), None, 32)
    if not KERNELS.amx_int8_available():
        with pytest.raises(RuntimeError, match="AMX-INT8"):
            KERNELS.int8_gemm_amx(torch.randn(4, 64).bfloat16(), torch.zeros(2, 16, 64, dtype=torch.uint8),
                                  torch.ones(32), None, 32)


@needs_kernel
def test_argmax_rows_gives_torchs_indices_ties_nan_and_infinities_included():
    g = torch.Generator().manual_seed(0)
    for trial in range(400):
        rows, width = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 200, (1,), generator=g))
        x = torch.randn(rows, width, generator=g)
        if trial % 3 == 0:
            x = x.round()                          # ties: the first index wins
        if trial % 5 == 0:
            x[:, ::3] = float("-inf")
        if trial % 7 == 0:
            x[0, width // 2] = float("nan")        # a NaN is the maximum (its first index)
        if trial % 11 == 0:
            x[:] = float("-inf")
        if trial % 13 == 0:
            x[-1, -1] = float("inf")
        assert torch.equal(KERNELS.argmax_rows(x), x.argmax(dim=-1)), (trial, rows, width)
    big = torch.randn(3, 49152, generator=g)
    assert torch.equal(KERNELS.argmax_rows(big), big.argmax(dim=-1))
    assert torch.equal(KERNELS.argmax_rows(big[:, ::2]), big[:, ::2].argmax(dim=-1))     # not contiguous
    with pytest.raises(RuntimeError, match="fp32"):
        KERNELS.argmax_rows(big.bfloat16())


@needs_kernel
def test_gumbel_argmax_rows_is_the_argmax_of_the_logits_plus_the_samplers_noise():
    from engine.sampler import _noise
    g = torch.Generator().manual_seed(0)

    def reference(x, keys):
        return (x.double() + _noise(keys, torch.arange(x.shape[1])[None, :])).argmax(dim=-1)
    for trial in range(300):
        rows, width = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(1, 300, (1,), generator=g))
        x = torch.randn(rows, width, generator=g) * [0.1, 3.0, 30.0, 3000.0][trial % 4]   # flat .. T near 0
        if trial % 5 == 0:
            x[:, ::3] = float("-inf")
        if trial % 13 == 0:
            x[-1, width // 2] = float("inf")
        keys = torch.randint(-2**63, 2**63 - 1, (rows,), generator=g)
        assert torch.equal(KERNELS.gumbel_argmax_rows(x, keys), reference(x, keys)), (trial, rows, width)
    keys = torch.randint(-2**63, 2**63 - 1, (64,), generator=g)
    big = torch.randn(64, 49152, generator=g) * 4
    assert torch.equal(KERNELS.gumbel_argmax_rows(big, keys), reference(big, keys))
    assert torch.equal(KERNELS.gumbel_argmax_rows(big[:, 1::2], keys), reference(big[:, 1::2], keys))
    odd = torch.full((2, 1001), float("-inf"))
    odd[0, 700], odd[0, 999], odd[1, 3:] = float("nan"), float("nan"), 0.0
    assert KERNELS.gumbel_argmax_rows(odd, keys[:2])[0] == 700          # the first NaN
    assert KERNELS.gumbel_argmax_rows(odd[:1, :600], keys[:1])[0] == 0   # every token -inf
    assert KERNELS.gumbel_argmax_rows(odd[1:], keys[:1])[0] >= 3
    with pytest.raises(RuntimeError, match="fp32"):
        KERNELS.gumbel_argmax_rows(big.bfloat16(), keys)
    with pytest.raises(RuntimeError, match="one a row"):
        KERNELS.gumbel_argmax_rows(big, keys[:3])


@needs_kernel
def test_top_candidates_are_a_stable_sorts_first_logits_with_the_rows_logsumexp():
    g = torch.Generator().manual_seed(0)

    def check(x, width, where):
        values, ids, log_total = KERNELS.top_candidates(x, width)
        ref_values, ref_ids = x.sort(dim=-1, descending=True, stable=True)
        assert torch.equal(values, ref_values[:, :width]) and torch.equal(ids, ref_ids[:, :width]), where
        torch.testing.assert_close(log_total, x.logsumexp(dim=-1), rtol=2e-6, atol=2e-6, msg=str(where))
    for trial in range(300):
        rows, vocab = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(1, 700, (1,), generator=g))
        x = torch.randn(rows, vocab, generator=g) * [0.01, 1.0, 4.0, 300.0][trial % 4]
        if trial % 3 == 0:
            x = x.round()                                   # ties
        if trial % 5 == 0:
            x[:, torch.rand(vocab, generator=g) < 0.9] = float("-inf")   # a grammar's mask: few finite
        if trial % 7 == 0:
            x[-1] = 2.5                                     # every logit equal
        width = int(torch.randint(1, vocab + 1, (1,), generator=g)) if trial % 2 else min(vocab, 256)
        check(x, width, (trial, rows, vocab, width))
    big = torch.randn(8, 49152, generator=g) * 4
    for width in (1, 256, 300, 49152):
        check(big, width, width)
    check(big[:, 1::2], 256, "strided")
    odd = torch.randn(3, 1000, generator=g)
    odd[0, 500], odd[1], odd[2] = float("nan"), float("-inf"), float("-inf")
    odd[2, 7] = float("inf")
    values, ids, log_total = KERNELS.top_candidates(odd, 10)
    assert values[0].isnan().all() and log_total[0].isnan()
    assert log_total[1:].tolist() == [float("-inf"), float("inf")] and ids[2, 0] == 7
    with pytest.raises(RuntimeError, match="width"):
        KERNELS.top_candidates(odd, 1001)


@needs_kernel
@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "int4"])
def test_gemv_passes_over_l2_chunks_give_what_single_passes_give(fmt):
    """More rows than one pass takes (bf16 and int8: 16, the others 8) take a first pass and then
    passes of 8 over chunks of a thread's weights (gemv_cpu.h `passes_in_chunks`); a weight of many
    chunks (4000 x 576: several per thread for every format) gives, for 19 and 43 rows, exactly
    what the row slices of those passes give alone (one pass over the whole share each, the same
    per-pass kernels), so every channel and row is computed once and in place; no rows, no pass.
    (On AVX2 bf16 takes 10 rows and more in one packed pass, dense_gemv_cpu.cpp `packed_rows`; the
    slices still agree because it and the 3-4-row kernel sum each output in input order.)"""
    if fmt in ("fp32", "bf16") and not KERNELS.gemv_vectorized():
        pytest.skip("the dense GEMVs are used only where they build with AVX512-BF16 or AVX2")
    g = torch.Generator().manual_seed(11)
    w = torch.randn(4000, 576, generator=g) * 0.05
    x = torch.randn(43, 576, generator=g)
    if fmt in ("fp32", "bf16"):
        dtype = torch.float32 if fmt == "fp32" else torch.bfloat16
        w, x = w.to(dtype), x.to(dtype)
        layer = lambda rows: _dense_gemv(w, None, rows)                      # noqa: E731
    else:
        layer, _ = (linear._int8 if fmt == "int8" else linear._int4)(w, None, KERNELS)
        x = x.bfloat16()
    first = 16 if fmt in ("bf16", "int8") else 8
    amx_from = _amx_from(fmt) if fmt in ("int8", "int4") else float("inf")
    for rows in (19, 43):
        if rows >= amx_from:           # AMX tiles, not GEMV passes (test_amx_quantized_gemms_...)
            continue
        starts = [0, *range(first, rows, 8), rows]
        passes = [layer(x[a:b]) for a, b in zip(starts, starts[1:])]
        assert torch.equal(layer(x[:rows]), torch.cat(passes)), rows
    assert layer(x[:0]).shape == (0, 4000)                              # no rows: no pass at all


@needs_vector_gemv
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_layers_use_the_gemv_where_it_is_faster(dtype, monkeypatch):
    # fp32: the GEMV up to DENSE_SMALL_ROWS rows, MKL above (on the same weight); bf16: the GEMV at
    # every row count (a prompt chunk's 300 rows too), so no oneDNN packed copy is ever made
    g = torch.Generator().manual_seed(3)
    w, bias = torch.randn(48, 64, generator=g), torch.randn(48, generator=g)
    few = linear.dense_small_rows(dtype, KERNELS)
    assert few == linear.DENSE_SMALL_ROWS[dtype] and linear.dense_small_rows(dtype, None) == 0
    assert (few is None) == (dtype == torch.bfloat16)
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", None)   # a packed copy: TypeError
    calls = []
    counting = _Counting("fp32_gemv" if dtype == torch.float32 else "bf16_gemv", calls)
    layer = linear.make_linear(w, bias, "float32" if dtype == torch.float32 else "bfloat16", dtype,
                               kernels=counting)
    row_counts = (1, 64, 65, 300) if few is None else (1, few, few + 1)
    for rows in row_counts:
        x = torch.randn(rows, 64, generator=g).to(dtype)
        y = layer(x)
        ref = F.linear(x.double(), w.to(dtype).double(), bias.to(dtype).double())
        assert torch.allclose(y.double(), ref, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2)
    assert calls == (list(row_counts) if few is None else [1, few])


@needs_vector_gemv
@pytest.mark.parametrize("gemv", [True, False])
def test_cpu_gemv_off_leaves_the_linears_to_onednn(tmp_path, gemv):
    # EngineConfig.cpu_gemv = False: the decoder's linears never call the engine's GEMV (one bf16
    # weight copy); on: a decode-sized step does
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir(tmp_path), dtype=torch.bfloat16)
    calls = []
    model = decoder.DecoderModel(hf, "bfloat16", torch.bfloat16, _Counting("bf16_gemv", calls), gemv=gemv)
    h = torch.randn(1, hf.config.hidden_size).bfloat16()
    model.layers[0].qkv(h)
    model.lm_head(h)
    assert calls == ([1, 1] if gemv else [])


@needs_kernel
def test_dense_gemv_refuses_what_is_not_its_layout():
    w = torch.randn(32, 16)
    with pytest.raises(RuntimeError, match="fp32"):
        KERNELS.fp32_gemv(torch.randn(2, 16).bfloat16(), w, None)
    with pytest.raises(RuntimeError, match="in"):
        KERNELS.fp32_gemv(torch.randn(2, 15), w, None)
    with pytest.raises(RuntimeError, match="bias"):
        KERNELS.fp32_gemv(torch.randn(2, 16), w, torch.zeros(7))
    with pytest.raises(RuntimeError, match="bf16"):
        KERNELS.bf16_gemv(torch.randn(2, 16).bfloat16(), w.bfloat16(), None, 32)    # [out, in], not blocks


@needs_kernel
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("heads,kv_heads,dim,block_size,max_ctx", [
    (9, 3, 64, 16, 70),     # SmolLM2's attention
    (9, 3, 64, 16, 300),    # ... over longer contexts (vectorized path: many 16-key steps, prefetched ahead)
    (8, 2, 128, 8, 70),     # the other specialized head size (vectorized path: a group of 4 in two chunks)
    (4, 1, 256, 16, 300),   # Gemma 3's head size (vectorized path: one head a chunk)
    (14, 2, 64, 1, 70),     # a group of 7 (vectorized path: two chunks), block size 1
    (4, 4, 32, 4, 70),      # no GQA, a head size without specialization
    (6, 2, 16, 1, 70),      # block size 1
    (17, 1, 64, 16, 70),    # a group of 17 (vectorized path: chunks of 6 heads and a rest of 5)
    (32, 2, 128, 16, 300),  # a group of 16 over 128 dims (vectorized path: five chunks of 3, a rest of 1)
])
def test_kernel_matches_torch_backend(dtype, tol, heads, kv_heads, dim, block_size, max_ctx):
    pool, tables, lens, query = _decode_case(dtype, batch=5, max_ctx=max_ctx, heads=heads, kv_heads=kv_heads,
                                             dim=dim, block_size=block_size)
    # full attention, then sliding windows: within a block, across blocks, longer than some rows
    for layer, window in ((0, 0), (2, 0), (2, 1), (1, 7), (0, 37)):
        out, ref = _both_backends(pool, tables, lens, query, layer, dim ** -0.5, window)
        assert out.shape == ref.shape == (5, heads * dim) and out.dtype == dtype
        assert (out.float() - ref.float()).abs().max().item() <= tol
    full, _ = _both_backends(pool, tables, lens, query, 0, dim ** -0.5)
    assert (full.float() - out.float()).abs().max() > 10 * tol      # the window changed what rows saw
    # Gemma 2's soft-capped scores (a cap far below these scores' spread, so it shows), also windowed
    for layer, window in ((0, 0), (1, 7)):
        out, ref = _both_backends(pool, tables, lens, query, layer, dim ** -0.5, window, softcap=0.3)
        assert (out.float() - ref.float()).abs().max().item() <= tol
    plain, _ = _both_backends(pool, tables, lens, query, 1, dim ** -0.5, 7)
    assert (plain.float() - out.float()).abs().max() > 10 * tol     # the cap changed what rows saw
    # gpt-oss's attention sinks, one a query head, about the scores' size (some above every score
    # of a row), also windowed: the torch backend runs eager_sdpa, transformers' math
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(1)) * 2
    for layer, window in ((0, 0), (1, 7)):
        out, ref = _both_backends(pool, tables, lens, query, layer, dim ** -0.5, window, sinks=sinks)
        assert (out.float() - ref.float()).abs().max().item() <= tol
    assert (plain.float() - out.float()).abs().max() > 10 * tol     # the sinks changed what rows saw


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_softmax_survives_scores_far_below_zero(dtype):
    # every key alike and each query pointing away from it: all scores about -290, whose exp
    # underflows to 0 unless the softmax subtracts their true maximum (the padding past a
    # sequence's length must not count as a score of 0); the output is then the values' mean
    pool, tables, lens, query = _decode_case(dtype, batch=5, max_ctx=70, heads=9, kv_heads=3, dim=64,
                                             block_size=16)
    pool[:, :, 0] = 3.0                                     # every K row of every layer
    query = torch.full_like(query, -12.0)
    out, ref = _both_backends(pool, tables, lens, query, 1, 0.125)
    assert torch.isfinite(out.float()).all()
    assert (out.float() - ref.float()).abs().max().item() <= (2e-6 if dtype == torch.float32 else 1.6e-2)


@needs_kernel
def test_rope_store_matches_the_unfused_ops():
    # RoPE then the K/V store, fused, against decoder._rope + the store of paged_attention: the same
    # q and pool rows up to one bf16 rounding, and no other pool row touched
    g = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, bs, layers, t = 9, 3, 64, 16, 3, 5
    pool = torch.randn(8, layers, 2, bs, kv_heads, dim, generator=g).bfloat16()
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, generator=g).bfloat16()
    angle = torch.rand(t, dim // 2, generator=g) * 6
    cos, sin = torch.cat([angle.cos()] * 2, -1).bfloat16(), torch.cat([angle.sin()] * 2, -1).bfloat16()
    per_block = layers * 2 * bs
    slots = torch.tensor([0, 5, 3 * per_block + 5, 7 * per_block + 15, per_block + 2])   # layer-0 K slots
    layer = 1
    fused_pool = pool.clone()
    q = KERNELS.rope_store(qkv, cos, sin, fused_pool, slots, layer, heads, kv_heads)
    qk = decoder._rope(qkv[:, :(heads + kv_heads) * dim].view(t, heads + kv_heads, dim).float(),
                       cos[:, None].float(), sin[:, None].float())
    flat = pool.view(-1, kv_heads, dim)
    flat[slots + 2 * layer * bs] = qk[:, heads:].bfloat16()
    flat[slots + (2 * layer + 1) * bs] = qkv[:, (heads + kv_heads) * dim:].view(t, kv_heads, dim)
    assert q.shape == (t, heads, dim)
    assert (q.float() - qk[:, :heads]).abs().max() <= qk.abs().max() * 2**-8
    assert (fused_pool.float() - pool.float()).abs().max() <= qk.abs().max() * 2**-8
    changed = (fused_pool.view(-1, kv_heads * dim) != pool.view(-1, kv_heads * dim)).any(-1)
    assert changed.sum() <= 2 * t                  # at most the rounding of the rows it wrote
    with pytest.raises(RuntimeError, match="slot"):
        KERNELS.rope_store(qkv, cos, sin, fused_pool, slots + pool.numel(), layer, heads, kv_heads)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_reads_only_the_context(dtype):
    # poisoning every K/V slot past each sequence's length (and the padding blocks) changes nothing
    pool, tables, lens, query = _decode_case(dtype, batch=4, max_ctx=40, heads=4, kv_heads=2,
                                             dim=64, block_size=16)
    before = KERNELS.paged_decode_attention(query, pool, tables, lens, 1, 0.125)
    poisoned = pool.clone()
    used = torch.zeros(pool.shape[0], pool.shape[3], dtype=torch.bool)
    for b in range(4):
        for pos in range(int(lens[b])):
            used[tables[b, pos // 16], pos % 16] = True
    poisoned.permute(0, 3, 1, 2, 4, 5)[~used] = float("nan")   # [blocks, token, ...]
    assert poisoned.isnan().any()
    after = KERNELS.paged_decode_attention(query, poisoned, tables, lens, 1, 0.125)
    assert torch.equal(before, after)


@needs_kernel
def test_kernel_refuses_what_it_cannot_read():
    pool, tables, lens, query = _decode_case(torch.float32, batch=2, max_ctx=8, heads=4, kv_heads=2,
                                             dim=16, block_size=4)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        KERNELS.paged_decode_attention(query.to(torch.bfloat16), pool, tables, lens, 0, 0.25)
    with pytest.raises(RuntimeError, match="layer out of range"):
        KERNELS.paged_decode_attention(query, pool, tables, lens, 3, 0.25)
    with pytest.raises(RuntimeError, match="int64"):
        KERNELS.paged_decode_attention(query, pool, tables.int(), lens, 0, 0.25)


@needs_kernel
def test_engine_gives_the_same_tokens_with_either_backend(tmp_path):
    path = tiny_model_dir(tmp_path / "m", "llama", seed=3)
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    results = {}
    for backend in ("paged", "torch"):
        # 16-token budget: the 40-token prompt runs in chunks with a past, beside decode tokens
        eng = LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu", kv_cache_memory="8MiB",
                                     block_size=4, max_num_batched_tokens=16, attention_backend=backend))
        assert eng.runner.attention_backend == {"paged": "cpu_paged", "torch": "torch"}[backend]
        results[backend] = [c.token_ids for c in eng.generate(prompts, params)]
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    assert results["paged"] == results["torch"]
    assert all(len(t) == 20 for t in results["torch"])


@needs_kernel
def test_short_chunks_after_a_cached_prefix_are_kernel_rows(tmp_path):
    """A prefix-cache hit leaves a tail of 2-4 prompt tokens after a past: with the paged backend
    they are rows of the kernel's call (no sdpa span), with the same tokens as the torch backend
    and as an engine without the prefix cache."""
    path = tiny_model_dir(tmp_path / "m", "llama", seed=5)
    base = list(range(5, 45))
    prompts = [base[:32]] + [base[:32 + t] for t in (2, 3, 4)]     # block size 4: 8 cached blocks, then t
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    results, tails = {}, {}
    for backend, caching in (("paged", True), ("torch", True), ("paged", False)):
        eng = LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu", kv_cache_memory="8MiB",
                                     block_size=4, attention_backend=backend, enable_prefix_caching=caching))
        seen, prepare = [], eng.runner._prepare

        def spy(chunks, prepare=prepare, seen=seen):
            out = prepare(chunks)
            for ch in chunks:
                if ch.start > 0 and ch.num_tokens > 1:
                    seen.append((ch.num_tokens, len(out[3].prefills)))
            return out
        eng.runner._prepare = spy
        results[backend, caching] = [eng.generate([p], params)[0].token_ids for p in prompts]   # one at a time
        tails[backend, caching] = seen
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    assert results["paged", True] == results["torch", True] == results["paged", False]
    assert sorted(n for n, _ in tails["paged", True]) == [2, 3, 4]
    assert all(spans == 0 for _, spans in tails["paged", True])      # kernel rows, no sdpa span
    assert all(spans == 1 for _, spans in tails["torch", True])      # the torch backend: an sdpa span
    assert tails["paged", False] == []                                # no cache: no tail with a past


def test_backend_choice_and_refusals():
    cpu = torch.device("cpu")
    assert attention_kernels("torch", cpu, torch.float32) == (None, "torch")
    assert attention_kernels("auto", cpu, torch.float16) == (None, "torch")   # no fp16 kernel: torch
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        attention_kernels("paged", cpu, torch.float16)
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineConfig(model="m", attention_backend="flash")
    assert attention_kernels("auto", cpu, torch.float32)[1] == ("torch" if KERNELS is None else "cpu_paged")


def test_the_start_up_check_of_a_paged_kernel():
    # what a CUDA runner runs on its Triton kernel before trusting it (a failure falls back to torch)
    shape = KVShape(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="bfloat16")
    cpu = torch.device("cpu")
    if KERNELS is not None:
        assert paged_kernel_problem(KERNELS, 9, shape, cpu, torch.bfloat16) is None
        assert paged_kernel_problem(KERNELS, 9, shape, cpu, torch.float32) is None

    class Wrong:
        @staticmethod
        def paged_decode_attention(q, pool, tables, lens, layer, scale, window=0, softcap=0.0, sinks=None):
            return torch.zeros(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype)

    class Broken:
        @staticmethod
        def paged_decode_attention(*args):
            raise RuntimeError("no kernel image for this GPU")

    assert "max difference" in paged_kernel_problem(Wrong(), 9, shape, cpu, torch.float32)
    assert "no kernel image" in paged_kernel_problem(Broken(), 9, shape, cpu, torch.float32)


# ---- prompt-chunk attention (paged_prefill_attention) --------------------------------------------

needs_prefill_kernel = pytest.mark.skipif(KERNELS is None or not KERNELS.prefill_attention_supported(64),
                                          reason="the prefill kernel builds only with AVX512-BF16 or AVX2")


def _prefill_case(n, past, heads, kv_heads, dim, block_size, layers=2, seed=0):
    """A bf16 pool with a sequence of past + n tokens in shuffled blocks (and spare ones), its
    table, and the chunk's queries."""
    g = torch.Generator().manual_seed(seed)
    used = -(-(past + n) // block_size)
    pool = torch.randn(used + 3, layers, 2, block_size, kv_heads, dim, generator=g).bfloat16()
    table = torch.randperm(used + 3, generator=g)[:used]
    query = torch.randn(n, heads, dim, generator=g).bfloat16()
    return pool, table, query


def _prefill_reference(pool, table, query, past, layer, scale, window=0, softcap=0.0, sinks=None):
    """The chunk's causal attention in fp32 over its context gathered from the pool (each query's
    last `window` keys only, unless 0; scores soft-capped at `softcap` unless 0; attention sinks
    [H] unless None)."""
    n, heads, dim = query.shape
    block_size = pool.shape[3]
    pos = torch.arange(past + n)
    k = pool[table[pos // block_size], layer, 0, pos % block_size].float().transpose(0, 1)[None]
    v = pool[table[pos // block_size], layer, 1, pos % block_size].float().transpose(0, 1)[None]
    q_pos = past + torch.arange(n)[:, None]
    mask = (pos[None, :] <= q_pos) & ((pos[None, :] > q_pos - window) if window else True)
    sdpa = F.scaled_dot_product_attention
    if softcap or sinks is not None:
        sdpa = functools.partial(eager_sdpa, softcap=softcap, sinks=None if sinks is None else sinks.view(-1, 1, 1))
    o = sdpa(query.float().transpose(0, 1)[None], k, v, attn_mask=mask[None, None], scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1).reshape(n, heads * dim)


@needs_prefill_kernel
@pytest.mark.parametrize("n,past,heads,kv_heads,dim,block_size", [
    (1, 0, 9, 3, 64, 16),        # one token
    (37, 0, 9, 3, 64, 16),       # a fresh prompt, not a multiple of the 16-position tiles
    (128, 0, 9, 3, 64, 16),      # SmolLM2's shape
    (45, 20, 9, 3, 64, 16),      # a chunk after a past that ends inside a block
    (33, 100, 4, 4, 128, 5),     # no GQA, head size 128, a block size that is not a power of 2
    (70, 3, 8, 1, 64, 7),        # one KV head for 8 query heads
    (200, 300, 9, 3, 64, 16),    # many tiles, on threads
    (40, 17, 4, 1, 256, 16),     # Gemma 3's head size
])
def test_prefill_kernel_matches_attention_in_fp32(n, past, heads, kv_heads, dim, block_size):
    pool, table, query = _prefill_case(n, past, heads, kv_heads, dim, block_size)
    out = KERNELS.paged_prefill_attention(query, pool, table, past, 1, dim ** -0.5)
    ref = _prefill_reference(pool, table, query, past, 1, dim ** -0.5)
    assert out.dtype == torch.bfloat16 and out.shape == (n, heads * dim)
    # bf16 probabilities and output: about two bf16 roundings of the largest value (measured 0.3 %)
    assert (out.float() - ref).abs().max() <= 1e-2 * ref.abs().max()


@needs_prefill_kernel
@pytest.mark.parametrize("n,past,window", [
    (37, 0, 5),       # windows inside one 16-key tile ...
    (45, 20, 16),     # ... of a tile's width, after a past
    (200, 300, 40),   # the rows' first tiles move; no row sees the first tiles of the context
    (50, 0, 64),      # longer than the chunk: as full attention
])
def test_prefill_kernel_attends_within_a_sliding_window(n, past, window):
    pool, table, query = _prefill_case(n, past, 9, 3, 64, 16)
    out = KERNELS.paged_prefill_attention(query, pool, table, past, 1, 0.125, window)
    ref = _prefill_reference(pool, table, query, past, 1, 0.125, window)
    assert (out.float() - ref).abs().max() <= 1e-2 * ref.abs().max()
    full = _prefill_reference(pool, table, query, past, 1, 0.125)
    if past + n > window:
        assert (full - ref).abs().max() > 0.1 * ref.abs().max()
    else:
        assert torch.equal(out, KERNELS.paged_prefill_attention(query, pool, table, past, 1, 0.125))


@needs_prefill_kernel
@pytest.mark.parametrize("n,past,window,dim", [(37, 0, 0, 64), (45, 20, 16, 64), (40, 17, 0, 256)])
def test_prefill_kernel_soft_caps_scores(n, past, window, dim):
    """Gemma 2's attn_logit_softcapping: cap * tanh(scale * s / cap) before the softmax (a cap far
    below these scores' spread, so it shows)."""
    pool, table, query = _prefill_case(n, past, 4, 2, dim, 16)
    out = KERNELS.paged_prefill_attention(query, pool, table, past, 1, dim ** -0.5, window, 0.3)
    ref = _prefill_reference(pool, table, query, past, 1, dim ** -0.5, window, softcap=0.3)
    assert (out.float() - ref).abs().max() <= 1e-2 * ref.abs().max()
    plain = _prefill_reference(pool, table, query, past, 1, dim ** -0.5, window)
    assert (plain - ref).abs().max() > 0.1 * ref.abs().max()


@needs_prefill_kernel
@pytest.mark.parametrize("n,past,window,dim", [(37, 0, 0, 64), (45, 20, 16, 64), (200, 300, 40, 64), (40, 17, 0, 128)])
def test_prefill_kernel_takes_attention_sinks(n, past, window, dim):
    """gpt-oss's attention sinks: a logit per query head in each row's softmax, with a zero value
    (some above every score of a row: the max the kernel subtracts must include them)."""
    pool, table, query = _prefill_case(n, past, 8, 2, dim, 16)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(2)) * 2
    out = KERNELS.paged_prefill_attention(query, pool, table, past, 1, dim ** -0.5, window, 0.0, sinks)
    ref = _prefill_reference(pool, table, query, past, 1, dim ** -0.5, window, sinks=sinks)
    assert (out.float() - ref).abs().max() <= 1e-2 * ref.abs().max()
    plain = _prefill_reference(pool, table, query, past, 1, dim ** -0.5, window)
    assert (plain - ref).abs().max() > 0.05 * ref.abs().max()       # 7 % at 200 after 300, where rows see most keys


@needs_prefill_kernel
def test_prefill_kernel_takes_a_strided_query_and_reads_only_the_context():
    n, past, heads, kv_heads, dim, bs = 40, 21, 9, 3, 64, 16
    pool, table, query = _prefill_case(n, past, heads, kv_heads, dim, bs)
    before = KERNELS.paged_prefill_attention(query, pool, table, past, 1, 0.125)
    # the queries as the decoder passes them: the first columns of the fused QKV output
    qkv = torch.cat([query.view(n, -1), torch.randn(n, 2 * kv_heads * dim).bfloat16()], dim=1)
    strided = qkv[:, :heads * dim].view(n, heads, dim)
    assert not strided.is_contiguous()
    assert torch.equal(KERNELS.paged_prefill_attention(strided, pool, table, past, 1, 0.125), before)
    # NaN in every slot outside the context (other layers, positions past the chunk, spare blocks)
    poisoned = torch.full_like(pool, float("nan"))
    pos = torch.arange(past + n)
    poisoned[table[pos // bs], 1, :, pos % bs] = pool[table[pos // bs], 1, :, pos % bs]
    assert poisoned.isnan().any()
    assert torch.equal(KERNELS.paged_prefill_attention(query, poisoned, table, past, 1, 0.125), before)


@needs_prefill_kernel
def test_prefill_kernel_refuses_what_it_cannot_read():
    pool, table, query = _prefill_case(8, 4, 4, 2, 64, 4)
    with pytest.raises(RuntimeError, match="bfloat16"):
        KERNELS.paged_prefill_attention(query.float(), pool.float(), table, 4, 0, 0.125)
    with pytest.raises(RuntimeError, match="head size 32"):
        small = _prefill_case(8, 4, 4, 2, 32, 4)
        KERNELS.paged_prefill_attention(small[2], small[0], small[1], 4, 0, 0.125)
    with pytest.raises(RuntimeError, match="does not cover"):
        KERNELS.paged_prefill_attention(query, pool, table[:2], 4, 0, 0.125)
    with pytest.raises(RuntimeError, match="not in the pool"):
        KERNELS.paged_prefill_attention(query, pool, table + 100, 4, 0, 0.125)
    with pytest.raises(RuntimeError, match="layer out of range"):
        KERNELS.paged_prefill_attention(query, pool, table, 4, 2, 0.125)
    assert not KERNELS.prefill_attention_supported(80) and KERNELS.prefill_attention_supported(256)


def _bf16_engine(path):
    """A bf16 engine of the tiny model at `path`: blocks of 4 tokens, 16-token prompt chunks."""
    return LLMEngine(EngineConfig(model=str(path), dtype="bfloat16", device="cpu", kv_cache_memory="8MiB",
                                  block_size=4, max_num_batched_tokens=16))


def _spy_on_prefill_kernel(eng) -> list:
    """Route `eng`'s kernels through a spy; the list it returns fills with (tokens, past) of each
    prefill-kernel call."""
    calls, real = [], KERNELS.paged_prefill_attention

    class Spy:
        def __getattr__(self, attr):
            return getattr(KERNELS, attr)

        @staticmethod
        def paged_prefill_attention(query, pool, table, past, layer, scale, window=0, softcap=0.0, sinks=None):
            calls.append((query.shape[0], past))
            return real(query, pool, table, past, layer, scale, window, softcap, sinks)
    eng.runner.kernels = Spy()
    return calls


@needs_prefill_kernel
def test_bf16_engine_runs_prompt_chunks_through_the_prefill_kernel(tmp_path):
    """bf16 on CPU: every prompt chunk of more than KERNEL_CHUNK_ROWS tokens (fresh, and after a
    past when the token budget splits a prompt) is one prefill-kernel call, and the prompt's
    log-probabilities agree with the sdpa path's; on an AMX CPU chunks from `sdpa_from` tokens run
    sdpa (the same numbers within bf16 rounding); fp32 (the exact mode) keeps sdpa."""
    path = tiny_model_dir(tmp_path / "m", "llama", seed=7, head_dim=64)
    prompts = [list(range(5, 5 + n)) for n in (9, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=0)
    logprobs = {}
    for kernel in (True, False):
        eng = _bf16_engine(path)
        assert eng.runner.prefill_kernel
        assert (eng.runner.sdpa_from is not None) == KERNELS.amx_available()
        eng.runner.prefill_kernel, eng.runner.sdpa_from = kernel, None     # the kernel at every length
        calls = _spy_on_prefill_kernel(eng)
        roped = []                      # rows of each rope_store call: RoPE + K/V store fused
        eng.runner.model._kernels = _Counting("rope_store", roped)
        done = eng.generate(prompts, params)
        logprobs[kernel] = torch.tensor([lp.logprob for c in done for lp in c.prompt_logprobs])
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
        layers = eng.runner.kv_shape.num_layers
        if kernel:    # 9 tokens in one chunk; 40 under a budget of 16 (shared with the first): past > 0
            assert (9, 0) in calls and any(past > 0 for _, past in calls)
            assert len(calls) % layers == 0 and all(n > KERNEL_CHUNK_ROWS for n, _ in calls)
            assert max(roped) >= 16           # prompt steps take the fused RoPE + store too
        else:
            # only all-decode steps fuse: two decode rows and at most a short chunk's kernel rows
            assert calls == [] and max(roped) <= 2 + KERNEL_CHUNK_ROWS
    assert logprobs[True].shape == (47,)
    assert (logprobs[True] - logprobs[False]).abs().max() < 0.05
    # where the CPU has AMX (engine.backends.AMX_SDPA_FROM), chunks from sdpa_from tokens run
    # sdpa instead, fresh or after a past; shorter ones keep the kernel: the same log-probabilities
    eng = _bf16_engine(path)
    eng.runner.sdpa_from = 10
    calls = _spy_on_prefill_kernel(eng)
    done = eng.generate(prompts, params)
    mixed = torch.tensor([lp.logprob for c in done for lp in c.prompt_logprobs])
    assert calls and all(n < 10 for n, _ in calls) and (9, 0) in calls     # the 9-token prompt: kernel
    assert (mixed - logprobs[False]).abs().max() < 0.05
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    fp32 = LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu", kv_cache_memory="8MiB"))
    assert fp32.runner.attention_backend == "cpu_paged" and not fp32.runner.prefill_kernel


@needs_kernel
def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_one():
    """torch's build lock is a file; a build killed midway leaves it, and torch then waits for it
    forever (a CI run hung so). Under pdserve's flock it is stale by definition and removed."""
    import subprocess
    import sys
    from pathlib import Path

    from torch.utils.cpp_extension import _get_build_directory

    from engine.kernels import _extension_name
    stale = Path(_get_build_directory(_extension_name(), verbose=False)) / "lock"
    stale.touch()
    done = subprocess.run([sys.executable, "-c", "from engine.kernels import cpu_kernels; "
                           "assert cpu_kernels() is not None"], cwd=Path(__file__).resolve().parents[1],
                          timeout=300, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not stale.exists()
