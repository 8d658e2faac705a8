"""The engine's own decoder and its weight formats (engine.decoder, engine.linear).

- Every supported architecture (tiny llama, qwen2 with random q/k/v biases, mistral with an
  untied head, qwen3 with random per-head q/k norms, phi3 with fused projections, smollm3, granite,
  olmo2) in fp32 gives Hugging Face `generate`'s greedy tokens; the log-probabilities of qwen3, a
  partial-RoPE phi3, smollm3 (a layer without RoPE), granite (multipliers) and olmo2 (post-norms)
  are Hugging Face's within fp32's and bf16's rounding; every architecture runs in int8 and int4.
- Each format's linear stays within its rounding of the fp32 product; a quantized layer gives
  the same model whether a step has few rows (int kernel: the engine's where it builds, aten's
  otherwise) or many (dequantized bf16 copy; the engine's int8 and int4 kernels take every row
  count with AVX512-VNNI, each row alone), and both int kernels give the same numbers (within the rounding of the
  activations, which the engine's kernels quantize and aten's do not).
- On the real model, bf16, int8 and int4 move the mean log-likelihood of a fixed text by at most
  their measured tolerances (a perplexity-style check), and every format frees its KV blocks.
- Configurations that cannot run are refused with a clear error. A model with sliding-window layers
  (qwen2's, mistral's) gives Hugging Face's log-probabilities and greedy tokens past its window, on
  every attention path, and serves its whole length; a length-dependent RoPE caps the context at
  its original length, and `max_model_len` beyond it serves every sequence at one pinned RoPE.
"""

import json
import shutil
import statistics

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config, Qwen3Config

from engine.config import EngineConfig, context_limit, layer_windows, rope_pin
from engine.kernels import cpu_kernels
from engine.linear import cpu_has_native_bf16, make_linear, quantized_small_rows
from engine.llm_engine import LLMEngine
from engine.backends import resolve_dtype, weight_format
from engine.sampling_params import SamplingParams
from logprob_compare import engine_logprobs, hf_logprobs
from tiny_models import TINY_ARCHS, TINY_MOE_ARCHS, tiny_model_dir, with_random_norms

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [50, 60, 70, 80, 90, 100, 110, 120, 130, 140, 150, 160, 170, 180, 190,
                                              200, 210, 220, 230, 240, 250]]


def _with_random_extras(path):
    """The checkpoint with random biases (qwen2's q/k/v) and per-head norm weights (qwen3's q/k
    norms), which a fresh model initializes to zeros and ones: a forward that skipped them would
    still agree."""
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.normal_(1, 0.5)
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_every_arch_in_fp32_matches_hf_generate(tmp_path, arch):
    path = tiny_model_dir(tmp_path / arch, arch, seed=5)
    if arch in ("qwen2", "qwen3", "seed_oss", "arcee", "starcoder2", "nemotron", "stablelm", "phi"):
        path = _with_random_extras(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if arch == "qwen2":
        assert hf.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0
    if arch == "qwen3":
        assert (hf.model.layers[0].self_attn.k_norm.weight - 1).abs().sum() > 0
    if arch == "phi3":
        assert hasattr(hf.model.layers[0].self_attn, "qkv_proj") and hasattr(hf.model.layers[0].mlp, "gate_up_proj")
    hf.generation_config.eos_token_id = None
    expected = []
    for p in PROMPTS:
        x = torch.tensor([p])
        out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=12,
                          min_new_tokens=12, pad_token_id=0)
        expected.append(out[0, len(p):].tolist())
    eng = LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu", kv_cache_memory="16MiB",
                                 block_size=4))
    got = eng.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert [c.token_ids for c in got] == expected
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def _with_sharp_attention(path, gain=10.0):
    """The checkpoint with its query and key projections scaled up: a tiny random model's attention
    is otherwise nearly uniform, and RoPE (which only moves the scores) would barely show."""
    model = AutoModelForCausalLM.from_pretrained(path)
    cfg = model.config
    qk_rows = (cfg.num_attention_heads + cfg.num_key_value_heads) * cfg.head_dim
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            if hasattr(attn, "qkv_proj"):
                attn.qkv_proj.weight[:qk_rows] *= gain
            else:
                attn.q_proj.weight.mul_(gain)
                attn.k_proj.weight.mul_(gain)
    model.save_pretrained(path)
    return path


def _with_partial_rotary(path, factor):
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_parameters"]["partial_rotary_factor"] = factor
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("dtype,tolerance", [("float32", 1e-4), ("bfloat16", 0.02)])
@pytest.mark.parametrize("arch", ["qwen3", "phi3-partial", "smollm3", "granite", "granitemoehybrid", "olmo2", "olmo3",
                                  "exaone4", "ernie4_5", "helium", "glm4", "ministral", "seed_oss", "arcee",
                                  "starcoder2", "nemotron", "stablelm", "phi", "cohere", "cohere2", "gemma", "gemma2",
                                  "gemma3_text", "gemma3_text-256", "gemma3_text-torch"])
def test_arch_specifics_give_the_hf_models_logprobs(tmp_path, arch, dtype, tolerance):
    """qwen3's per-head q/k norms, phi3 with RoPE on half of each head (Phi-4-mini's `partial_rotary_factor`), smollm3's
    layer without RoPE, granite's multipliers (Granite 4.0's with its shared MLP), olmo2's norms after each block and
    over all q/k heads at once, exaone4's with per-head q/k norms, a sliding layer and a global one without RoPE,
    ernie4_5's, helium's and glm4's (on half of each head, with Gemma 3's norms) RoPE on interleaved pairs (their q/k
    rows reordered at load; ernie4_5 with biases), ministral's sliding first layer, seed_oss's biases (o_proj's under
    its own key), arcee's ungated ReLU^2 MLP, starcoder2's LayerNorms (random weights and biases here), ungated GELU
    MLP, biases and windows, nemotron's LayerNorms scaling by 1 + weight with its RoPE on half of each head,
    stablelm's attention and MLP side by side on one LayerNorm (`use_parallel_residual`) with RoPE on a quarter of
    each head, phi's too (an ungated GELU MLP written out as transformers' gelu_new, biases on every projection and on
    the LM head), cohere's and cohere2's (Cohere's LayerNorm in fp32, interleaved RoPE tables, the logit scale;
    cohere2's global layer without RoPE), gemma's (Gemma 1: norms scaling by 1 + weight, random here, the embedding
    scale, GELU-tanh), and gemma3_text's (norms before and after each block scaling by 1 + weight, random here; the
    embedding scale; GELU; a sliding first layer with its own RoPE; also with Gemma 3's head size, 256), gemma2's soft
    caps (attention scores made large enough for the caps to bite: without the attention's cap the difference was 1.1,
    without the logits' 0.07; its prompt chunks run the capped sdpa, not the prefill kernel), on every path (bf16 on a
    CPU with native bf16: the prefill and decode kernels and, for all but the partial-RoPE phi3, the fused RoPE + K/V
    store; gemma3_text-torch: bf16 without any kernel, as on CUDA, its fp32 norm scales through torch's ops): the
    log-probabilities of the prompt and of the greedy tokens are Hugging Face's fp32 forward's within the dtype's
    rounding (measured for qwen3: 5e-7 fp32, 0.004 bf16; 0.2 with its norms skipped, whose greedy tokens still
    agree)."""
    head_dim = 16 if arch in ("helium", "stablelm", "phi") else 256 if arch.endswith("-256") else 64  # tiny_model_dir's
    path = _with_random_extras(tiny_model_dir(tmp_path / arch, arch.split("-")[0], seed=5, head_dim=head_dim))
    if arch == "phi3-partial":
        path = _with_partial_rotary(_with_sharp_attention(path), 0.5)
    if arch in ("smollm3", "granite", "granitemoehybrid", "gemma2", "olmo3", "exaone4", "ernie4_5", "helium",
                "glm4", "ministral", "starcoder2", "nemotron", "stablelm", "phi", "cohere", "cohere2"):
        path = _with_sharp_attention(path)
    if arch.startswith(("olmo", "gemma", "exaone", "glm", "starcoder2", "nemotron", "stablelm", "phi", "cohere")):
        path = with_random_norms(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    torch_only = arch.endswith("-torch")
    eng = LLMEngine(EngineConfig(model=str(path), dtype=dtype, device="cpu", kv_cache_memory="16MiB",
                                 block_size=4, max_num_batched_tokens=16, cpu_gemv=not torch_only,
                                 attention_backend="torch" if torch_only else "auto"))
    if torch_only:
        eng.runner.model._kernels = None            # norms, activation and RoPE through torch's ops
    partial = {"phi3-partial": 2, "glm4": 2, "nemotron": 2, "stablelm": 4, "phi": 2}.get(arch, 1)  # RoPE on 1 / partial
    assert eng.runner.model.rotary_dim == head_dim // partial
    assert [layer.rope for layer in eng.runner.model.layers] == [True, arch not in ("smollm3", "exaone4", "cohere2")]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    for prompt, done in zip(PROMPTS, eng.generate(PROMPTS, params)):
        expected, got = hf_logprobs(hf, prompt, done), engine_logprobs(done)    # one per target
        assert got.shape == expected.shape
        assert (got - expected).abs().max() < tolerance, (got - expected).abs().max()
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_every_arch_runs_quantized_and_frees_its_blocks(tmp_path, fmt):
    """The quantized formats share the bf16 path's kernels (norms, fused RoPE + store, paged
    attention) with every architecture's specifics, the mixtures of experts' too: prompts chunked
    under a 16-token budget and decoded run to their length, and every block comes back. (Their quality is checked on the
    real model below.)"""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("weight-only kernels need a oneDNN build")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for arch in TINY_ARCHS + TINY_MOE_ARCHS:
        path = tiny_model_dir(tmp_path / arch, arch, seed=1, head_dim=64)
        eng = LLMEngine(EngineConfig(model=str(path), dtype="bfloat16", quantization=fmt, device="cpu",
                                     kv_cache_memory="8MiB", block_size=4, max_num_batched_tokens=16))
        done = eng.generate([[5, 6, 7, 8], list(range(10, 50))], params)
        assert [len(c.token_ids) for c in done] == [6, 6], arch
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks, arch


KERNELS = cpu_kernels()
# the quantized formats' few-row kernels: aten's (the fallback) and, where they build, the engine's
INT_KERNELS = [pytest.param(None, id="aten"),
               pytest.param(KERNELS, id="engine", marks=pytest.mark.skipif(KERNELS is None, reason="not built"))]


@pytest.mark.parametrize("fmt,tolerance,kernels", [
    ("float32", 1e-6, None), ("bfloat16", 0.01, None),
    *[pytest.param(fmt, tol, *k.values, id=f"{fmt}-{k.id}", marks=k.marks)
      for fmt, tol in (("int8", 0.02), ("int4", 0.12)) for k in INT_KERNELS]])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_formats_stay_within_their_rounding(fmt, tolerance, bias, kernels):
    if fmt in ("int8", "int4") and not torch.backends.mkldnn.is_available():
        pytest.skip("weight-only kernels need a oneDNN build")
    torch.manual_seed(0)
    w, b = torch.randn(96, 128) * 0.05, (torch.randn(96) * 0.1 if bias else None)
    dtype = torch.float32 if fmt == "float32" else torch.bfloat16
    layer = make_linear(w, b, fmt, dtype, kernels=kernels)
    for rows in (1, 3, 8, 9, 33):
        x = torch.randn(rows, 128)
        ref = torch.nn.functional.linear(x, w, b)
        y = layer(x.to(dtype)).float()
        assert y.shape == ref.shape
        assert ((y - ref).norm() / ref.norm()).item() < tolerance, (fmt, rows)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("kernels", INT_KERNELS)
def test_quantized_layer_is_one_model_at_any_row_count(fmt, kernels):
    torch.manual_seed(1)
    w = torch.randn(64, 128) * 0.05
    layer = make_linear(w, None, fmt, torch.bfloat16, kernels=kernels)
    few = quantized_small_rows(kernels)
    rows = 40 if few is None else few + 1     # the engine's VNNI kernels: no copy, so every row count
    x = torch.randn(rows, 128).bfloat16()
    one_by_one = torch.cat([layer(x[i:i + 1]) for i in range(rows)]).float()   # int kernel
    batched = layer(x).float()                     # dequantized bf16 copy, the int kernel, or AMX tiles
    on_amx = (few is None and (kernels.amx_int8_available() if fmt == "int8" else kernels.amx_available())
              and rows >= getattr(kernels, f"{fmt}_gemv_amx_from")())      # int8: on AMX-INT8 tiles
    if few is None and not on_amx:   # one kernel, whose rows (and their activation scales) are independent
        assert torch.equal(one_by_one, batched)
    if on_amx:                       # ... below the row count from which it hands its calls to AMX
        assert torch.equal(one_by_one[:15], layer(x[:15]).float())
    # the paths differ by bf16 rounding (and AMX's unrounded or 15-bit activations: about 0.5 %) only, far
    # below the quantization error itself
    assert ((one_by_one - batched).norm() / batched.norm()).item() < 0.01
    exact = torch.nn.functional.linear(x.float(), w)
    quant_error = ((batched - exact).norm() / exact.norm()).item()
    assert quant_error > 0.002   # it really is quantized: not the fp32 weight in disguise


@pytest.mark.parametrize("kernels", INT_KERNELS)
def test_int4_with_outputs_not_a_multiple_of_16_runs_on_every_path(kernels):
    """aten's int4 packing refuses 40 outputs; without the engine's kernels the layer runs the bf16
    copy of the same quantized weight at every row count instead of failing at model load."""
    torch.manual_seed(3)
    w, x = torch.randn(40, 64) * 0.05, torch.randn(3, 64).to(torch.bfloat16)
    layer = make_linear(w, None, "int4", torch.bfloat16, kernels=kernels)
    one_row = torch.cat([layer(x[i:i + 1]) for i in range(3)]).float()
    wide = layer(x.repeat(4, 1))[:3].float()          # 12 rows: the bf16 copy (aten), the int kernel (VNNI)
    assert one_row.shape == (3, 40) and ((one_row - wide).norm() / wide.norm()).item() < 0.01
    exact = torch.nn.functional.linear(x.float(), w)
    assert 0.002 < ((wide - exact).norm() / exact.norm()).item() < 0.2


@pytest.mark.skipif(KERNELS is None, reason="the engine's CPU kernels could not be built here")
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_engine_and_aten_int_kernels_agree(fmt):
    torch.manual_seed(2)
    w, b = torch.randn(64, 96) * 0.05, torch.randn(64) * 0.1
    ours, aten = (make_linear(w, b, fmt, torch.bfloat16, kernels=k) for k in (KERNELS, None))
    # aten adds the bias after rounding, the engine's kernel before: a bf16 step apart at most; the
    # engine's kernels also round the activations to int8 (groups of 32; about 0.5 % here)
    for rows in range(1, 5):
        x = torch.randn(rows, 96).bfloat16()
        assert ((ours(x).float() - aten(x).float()).norm() / aten(x).float().norm()).item() < 0.02


def _mean_loglik(model_dir, ids, dtype, quantization):
    eng = LLMEngine(EngineConfig(model=str(model_dir), dtype=dtype, quantization=quantization, device="cpu",
                                 kv_cache_memory="64MiB"))
    [c] = eng.generate([ids], SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=0, ignore_eos=True))
    assert len(c.token_ids) == 4
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    return statistics.fmean(t.logprob for t in c.prompt_logprobs)


@pytest.fixture(scope="module")
def text_ids(default_model_dir):
    from transformers import AutoTokenizer
    text = ("The history of computing spans centuries, from the abacus to mechanical calculators and the first "
            "programmable machines. Punched cards stored programs and data for early tabulating machines, and "
            "vacuum tubes gave way to transistors and then to integrated circuits.")
    return AutoTokenizer.from_pretrained(default_model_dir)(text)["input_ids"]


@pytest.fixture(scope="module")
def fp32_loglik(default_model_dir, text_ids):
    return _mean_loglik(default_model_dir, text_ids, "float32", None)


# measured on this project's CPU on this text (session 11): bf16 +0.004, int8 -0.036, int4 -0.078 with the
# engine's VNNI kernels, whose activations are int8 too (int8 -0.045 through its scalar loop at every
# row count; weight-only int8 +0.006, int4 -0.084; on benchmarks/format_quality.py's longer text
# int8 +0.008, int4 -0.077)
@pytest.mark.slow
@pytest.mark.parametrize("quant,tolerance", [(None, 0.03), ("int8", 0.06), ("int4", 0.2)])
def test_formats_keep_the_real_models_log_likelihood(default_model_dir, text_ids, fp32_loglik, quant, tolerance):
    got = _mean_loglik(default_model_dir, text_ids, "bfloat16", quant)
    assert -5 < fp32_loglik < -1               # a real language model on English text
    assert abs(got - fp32_loglik) < tolerance, (got, fp32_loglik)


def test_auto_dtype_on_cpu_is_bf16_where_it_is_the_faster_format():
    from engine.kernels import cpu_kernels
    kernels = cpu_kernels()
    vectorized = kernels is not None and kernels.gemv_vectorized()
    expected = torch.bfloat16 if cpu_has_native_bf16() or vectorized else torch.float32
    assert resolve_dtype("auto", torch.device("cpu")) == expected
    # without the engine's GEMVs only native bf16 makes bf16 the faster format
    assert resolve_dtype("auto", torch.device("cpu"), gemv=False) == (
        torch.bfloat16 if cpu_has_native_bf16() else torch.float32)
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32


def test_a_length_dependent_rope_caps_the_context_and_a_sliding_window_does_not():
    assert context_limit(LlamaConfig(max_position_embeddings=8192)) == 8192
    # sliding windows are attention the engine implements: the whole length, the window per layer
    mistral = MistralConfig(max_position_embeddings=32768, sliding_window=4096, num_hidden_layers=3)
    assert context_limit(mistral) == 32768 and layer_windows(mistral) == [4096] * 3
    assert layer_windows(MistralConfig(sliding_window=None, num_hidden_layers=2)) == [0, 0]
    assert layer_windows(LlamaConfig(num_hidden_layers=2)) == [0, 0]
    # Qwen2/Qwen3 carry a window that applies only with use_sliding_window (to the layers from
    # max_window_layers on)
    assert layer_windows(Qwen2Config(sliding_window=4096, num_hidden_layers=2)) == [0, 0]
    qwen3 = Qwen3Config(max_position_embeddings=32768, sliding_window=4096, use_sliding_window=True,
                        max_window_layers=1, num_hidden_layers=2)
    assert context_limit(qwen3) == 32768 and layer_windows(qwen3) == [0, 4096]
    # RoPE whose frequencies change with the length: the original length
    longrope = {"rope_type": "longrope", "long_factor": [2.0] * 8, "short_factor": [1.0] * 8}
    phi = Phi3Config(max_position_embeddings=131072, original_max_position_embeddings=4096, hidden_size=64,
                     num_attention_heads=4, rope_scaling=longrope)
    assert context_limit(phi) == context_limit(phi, 4096) == 4096 and rope_pin(phi, None) is rope_pin(phi, 4096) is None
    # ... unless max_model_len asks for more: the positions, RoPE pinned at that length (up to the positions)
    assert context_limit(phi, 4097) == 131072 and rope_pin(phi, 4097) == 4096 and rope_pin(phi, 10**6) == 131071
    dynamic = LlamaConfig(max_position_embeddings=8192, rope_scaling={
        "rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 4096})
    assert context_limit(dynamic) == 4096 and context_limit(dynamic, 8192) == 8192 and rope_pin(dynamic, 8192) == 8191
    assert rope_pin(LlamaConfig(max_position_embeddings=8192), 8192) is None     # a static RoPE: nothing to pin
    assert context_limit(LlamaConfig(max_position_embeddings=131072, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})) == 131072       # static: the whole length


def _with_longrope(path, original: int, positions: int, long_everywhere: bool = False):
    """The checkpoint's config with Phi-3's longrope over `original` of `positions` positions: short
    factors 1, long factors 1..8 (`long_everywhere`: the short ones too, so that transformers uses the
    long factors at every length)."""
    cfg = json.loads((path / "config.json").read_text())
    half = cfg["head_dim"] // 2
    long = [float(f) for f in range(1, half + 1)]
    cfg.update(max_position_embeddings=positions, original_max_position_embeddings=original)
    cfg["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 1.0,
                              "short_factor": long if long_everywhere else [1.0] * half, "long_factor": long,
                              "original_max_position_embeddings": original}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_a_longrope_model_beyond_its_original_length_runs_every_sequence_at_the_long_factors(tmp_path):
    """Phi-3's longrope (short factors up to the original length, long ones beyond, picked by
    transformers per forward from its longest position): by default the engine serves the original
    length, Hugging Face's short factors; with `max_model_len` above it, every sequence runs at the
    long factors (vLLM's rule) alone or batched with others: a 40-token prompt beyond the original
    32 and a 10-token one within it, together and each alone, give the log-probabilities of the same
    checkpoint whose short factors are its long ones (transformers' long-factor model at every
    length). The 10-token prompt's differ from the plain model's (the factors matter here)."""
    path = _with_longrope(_with_sharp_attention(tiny_model_dir(tmp_path / "phi3", "phi3", seed=5)), 32, 128)
    reference = shutil.copytree(path, tmp_path / "long-everywhere")
    _with_longrope(reference, 32, 128, long_everywhere=True)
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    everywhere = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    long_prompt, short_prompt = [(7 * i) % 200 + 3 for i in range(40)], [(5 * i) % 200 + 3 for i in range(10)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0, prompt_logprobs=0)

    default = LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu", kv_cache_memory="16MiB",
                                     block_size=4))
    assert default.max_model_len == 32
    [done] = default.generate([short_prompt], params)
    assert (engine_logprobs(done) - hf_logprobs(plain, short_prompt, done)).abs().max() < 1e-4
    pinned = LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu", kv_cache_memory="16MiB",
                                    block_size=4, max_model_len=128))
    assert pinned.max_model_len == 128
    batched = pinned.generate([long_prompt, short_prompt], params)
    alone = [pinned.generate([p], params)[0] for p in (long_prompt, short_prompt)]
    for prompt, done in [*zip((long_prompt, short_prompt), batched), *zip((long_prompt, short_prompt), alone)]:
        assert (engine_logprobs(done) - hf_logprobs(everywhere, prompt, done)).abs().max() < 1e-4
    short_done = alone[1]
    assert (engine_logprobs(short_done) - hf_logprobs(plain, short_prompt, short_done)).abs().max() > 0.05
    assert pinned.block_manager.num_free_blocks == pinned.block_manager.num_blocks


def _with_window(path, arch: str, window: int | None):
    """The checkpoint's config with a sliding window: qwen2's second layer (`use_sliding_window`
    from `max_window_layers` 1), mistral's every layer; None removes it."""
    cfg = json.loads((path / "config.json").read_text())
    cfg["sliding_window"] = window
    if arch == "qwen2":
        cfg.update(use_sliding_window=window is not None, max_window_layers=1)
        cfg.pop("layer_types", None)     # saved by transformers; recomputed from the keys above at load
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("dtype,backend,tolerance", [("float32", "auto", 1e-4), ("float32", "torch", 1e-4),
                                                     ("bfloat16", "auto", 0.02)])
@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_a_sliding_window_model_matches_hf_past_its_window(tmp_path, arch, dtype, backend, tolerance):
    """A window of 6 keys (qwen2: its second layer; mistral: both) over prompts of 10 and 21
    tokens and 12 generated: prompt chunks under a 16-token budget (fresh and after a past), then
    decode, on every path (fp32: sdpa's windowed masks and the paged decode kernel, or the torch
    backend's gathered decode; bf16 on a CPU with native bf16: the prefill and decode kernels with
    the fused RoPE + K/V store). The log-probabilities of the prompt and of the greedy tokens are
    Hugging Face's fp32 forward's, whose greedy tokens (`generate`, fp32) they are; without the
    window they would be off by more than 0.1 (checked)."""
    path = _with_window(_with_sharp_attention(tiny_model_dir(tmp_path / arch, arch, seed=5, head_dim=64), 4.0),
                        arch, 6)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eng = LLMEngine(EngineConfig(model=str(path), dtype=dtype, device="cpu", kv_cache_memory="16MiB", block_size=4,
                                 max_num_batched_tokens=16, attention_backend=backend))
    assert eng.runner.model.windows == ([0, 6] if arch == "qwen2" else [6, 6])
    assert eng.max_model_len == 2048
    if backend == "torch" and arch == "qwen2":        # a shorter configured length is kept
        assert LLMEngine(EngineConfig(model=str(path), device="cpu", kv_cache_memory="8MiB",
                                      max_model_len=16)).max_model_len == 16
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    done = eng.generate(PROMPTS, params)
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    full = AutoModelForCausalLM.from_pretrained(_with_window(path, arch, None), dtype=torch.float32).eval()
    for prompt, out in zip(PROMPTS, done):
        expected, got = hf_logprobs(hf, prompt, out), engine_logprobs(out)
        assert (got - expected).abs().max() < tolerance, (got - expected).abs().max()
        assert (hf_logprobs(full, prompt, out) - expected).abs().max() > 0.1
        if dtype == "float32":
            x = torch.tensor([prompt])
            greedy = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=12,
                                 min_new_tokens=12, pad_token_id=0, eos_token_id=None)
            assert out.token_ids == greedy[0, len(prompt):].tolist()


def _blocks_in_use(eng) -> int:
    return eng.block_manager.num_blocks - eng.block_manager.num_free_blocks


@pytest.mark.parametrize("mode", ["colocated", "speculative", "split"])
def test_a_sliding_window_model_gives_back_the_blocks_its_window_passed(tmp_path, mode):
    """Mistral with a window of 6 keys on every layer, blocks of 4: a 21-token prompt (chunks of 16)
    and 30 greedy tokens hold at most 3 blocks while decoding (the window's keys and the next
    token's slot; without giving back they grow to 13), and the tokens are still Hugging Face's
    fp32 `generate`'s: in one engine, with prompt-lookup drafts (a repetitive prompt, so drafts are
    fed and some accepted), and prefilled in one engine and decoded in another (the decode engine
    receives the whole prompt and gives back what its window has passed as it lands)."""
    path = _with_window(_with_sharp_attention(tiny_model_dir(tmp_path / "m", "mistral", seed=5, head_dim=64), 4.0),
                        "mistral", 6)
    prompt = PROMPTS[1] if mode != "speculative" else [5, 6, 7, 8, 9] * 4 + [5]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    x = torch.tensor([prompt])
    want = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=30, min_new_tokens=30,
                       pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()

    def engine(**kw):
        return LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu", kv_cache_memory="4MiB",
                                      block_size=4, max_num_batched_tokens=16, **kw))

    eng = engine(speculative_tokens=3 if mode == "speculative" else 0)
    assert eng.block_manager.window == 6
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    in_use, tokens = [], []
    if mode == "split":
        eng.add_request("r", prompt, params, hold_blocks=True)
        while eng.has_work():
            tokens += [t for out in eng.step() for t in out.new_token_ids]
        assert len(eng.held_blocks("r")) == 6            # the prefill role keeps (and sends) them all
        decode = engine()
        blocks = decode.reserve(len(prompt))
        decode.import_kv(blocks, eng.export_kv("r"))
        eng.release("r")
        assert decode.add_prefilled("r", prompt, tokens[0], params, blocks).new_token_ids == tokens
        in_use.append(_blocks_in_use(decode))
        eng = decode
    else:
        eng.add_request("r", prompt, params)
    while eng.has_work():
        for out in eng.step():
            tokens += out.new_token_ids
        in_use.append(_blocks_in_use(eng))
    assert tokens == want
    decoding = in_use[1:] if mode != "split" else in_use
    assert max(decoding) <= 3 and eng.block_manager.all_free()
    if mode == "speculative":
        assert eng.num_accepted_tokens > 0


def test_an_unsupported_architecture_is_refused_at_load(tmp_path):
    from transformers import GPTNeoXConfig      # Pythia: a fused, head-interleaved query_key_value
    config = GPTNeoXConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                           num_attention_heads=4)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "neox")
    with pytest.raises(ValueError, match="model type 'gpt_neox' is not supported; pdserve runs llama, .*qwen3"):
        LLMEngine(EngineConfig(model=str(tmp_path / "neox"), device="cpu", kv_cache_memory="8MiB"))


def test_impossible_configurations_are_refused():
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(model="m", quantization="int3")
    with pytest.raises(ValueError, match="computes in bfloat16"):
        EngineConfig(model="m", dtype="float32", quantization="int8")
    cfg = EngineConfig(model="m", quantization="int4")
    with pytest.raises(ValueError, match="runs on CPU"):
        weight_format(cfg, torch.device("cuda"), torch.bfloat16)
    with pytest.raises(ValueError, match="runs on CPU"):     # auto resolved to fp32 on a CPU without bf16
        weight_format(cfg, torch.device("cpu"), torch.float32)
    assert weight_format(cfg, torch.device("cpu"), torch.bfloat16) == "int4"
    assert weight_format(EngineConfig(model="m"), torch.device("cpu"), torch.float32) == "float32"
    with pytest.raises(ValueError, match="groups of 32 inputs"):
        make_linear(torch.randn(8, 40), None, "int4", torch.bfloat16)
