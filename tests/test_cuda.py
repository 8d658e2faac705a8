"""The CUDA paths, on a machine with at least one GPU (skipped elsewhere, so never in CI).

  1. the engine on CUDA: fp32 greedy output equals Hugging Face `generate` on the same GPU, and
     bf16 (the GPU default) runs, fills the pool and ends all-free;
  2. kv_transfer with CUDA-resident pools: two pools on one GPU pair over gloo (NCCL cannot pair
     two ranks on one GPU) through pinned host staging, bit-exact into scattered blocks; a CUDA
     pool receiving from a CPU pool; the loopback backend between CUDA pools;
  3. the backend choice: NCCL for pools on two distinct GPUs (only where two exist);
  4. the profiled KV pool: a replica given a share of the device (`kv_cache_memory` 0.3) sizes its
     pool from the measured weights + peak activations and, after serving, has held no more than
     that share; two such engines fit side by side on one GPU (fractional GPUs);
  5. decode attention on CUDA: the Triton paged kernel (the default there) equals the torch
     backend, with and without a sliding window, and greedy output is the same with either,
     captured in CUDA graphs or not; a tiny Gemma 3 (head size 256, a sliding layer) gives HF's
     tokens and log-probabilities on the GPU; a tiny Qwen2-MoE gives HF's tokens, uncaptured;
  6. a LoRA adapter on the GPU: fp32 greedy output equals transformers' with the adapter, and a
     bf16 batch mixing adapter and base rows runs (eagerly: such steps are not captured).

    .venv/bin/pytest -q tests/test_cuda.py

Self-contained (a tiny random model with the built-in tokenizer, random prompts): it needs no
model download, so it runs on a bare GPU machine with torch, transformers and msgpack.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import Completion
from engine.sampling_params import SamplingParams
from kv_transfer import (KVReceiver, KVSender, LoopbackReceiver, LoopbackSender, TransferConfig,
                         choose_backend, fingerprint_for)
from kv_transfer.layout import device_info
from tiny_models import tiny_model_dir, with_random_norms

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SHAPE = (64, 4, 2, 16, 2, 64)       # blocks, layers, K/V, block size, KV heads, head dim
CFG = TransferConfig(connect_timeout_s=15.0, transfer_timeout_s=20.0, chunk_bytes=64 << 10)


def _generate(engine: LLMEngine, prompts, max_tokens: int) -> list[list[int]]:
    done = {f"r{i}": Completion(f"r{i}", p) for i, p in enumerate(prompts)}
    for rid, c in done.items():
        engine.add_request(rid, c.prompt_token_ids, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    while engine.has_work():
        for out in engine.step():
            done[out.request_id].add(out)
    return [done[f"r{i}"].token_ids for i in range(len(prompts))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("cuda-model"), "qwen2", seed=1)


@pytest.fixture(scope="module")
def prompts(model_dir):
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 17, 40, 64, 130, 333, 700, 9)]


def test_engine_fp32_on_cuda_matches_hf_on_cuda(model_dir, prompts):
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", device="cuda",
                                    kv_cache_memory="64MiB", max_num_batched_tokens=128))
    assert engine.runner.kv_pool.is_cuda
    ours = _generate(engine, prompts, 24)
    assert engine.block_manager.all_free()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    with torch.inference_mode():
        refs = [model.generate(torch.tensor([p], device="cuda"), do_sample=False, max_new_tokens=24,
                               attention_mask=torch.ones(1, len(p), dtype=torch.long, device="cuda"))
                [0, len(p):].tolist() for p in prompts]
    assert ours == refs


def test_gemma3_on_cuda_gives_hf_tokens_and_logprobs(tmp_path):
    """A tiny Gemma 3 (head size 256, an 8-token sliding first layer with its own RoPE, random norm
    weights) on the GPU path: Triton decode with the window, decode captured in CUDA graphs, fp32
    norm scales on bf16 rows. fp32 greedy tokens are HF `generate`'s on the GPU; bf16's
    log-probabilities are within 0.03 of HF's fp32 forward (on CPU, HF's own bf16 forward is 0.017
    off and the engine's within the CPU test's 0.02; cuBLAS sums in another order)."""
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    path = with_random_norms(tiny_model_dir(tmp_path / "g3", "gemma3_text", seed=2, head_dim=256))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=gen).tolist() for n in (5, 21, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    for dtype in ("float32", "bfloat16"):
        engine = LLMEngine(EngineConfig(model=str(path), dtype=dtype, device="cuda", kv_cache_memory="64MiB",
                                        block_size=4, max_num_batched_tokens=16))
        assert engine.runner.attention_backend == "triton_paged" and engine.runner.graphs is not None
        assert engine.runner.model.windows == [8, 0]
        for prompt, done in zip(prompts, engine.generate(prompts, params)):
            ids = torch.tensor([prompt + done.token_ids], device="cuda")
            with torch.inference_mode():
                ref = torch.log_softmax(hf(ids).logits[0].float(), dim=-1)
            targets = ids[0, 1:]
            expected = ref[torch.arange(len(targets), device="cuda"), targets].cpu()
            got = torch.tensor([lp.logprob for lp in [*done.prompt_logprobs, *done.logprobs]])
            assert (got - expected).abs().max() < (1e-3 if dtype == "float32" else 0.03), dtype
            if dtype == "float32":
                x = torch.tensor([prompt], device="cuda")
                with torch.inference_mode():
                    greedy = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=12,
                                         min_new_tokens=12, pad_token_id=0, eos_token_id=None)
                assert done.token_ids == greedy[0, len(prompt):].tolist()
        assert engine.block_manager.all_free()


@pytest.mark.parametrize("arch", ["qwen2_moe", "gpt_oss", "glm4_moe"])
def test_a_mixture_of_experts_on_cuda_runs_eagerly_and_gives_hf_tokens(tmp_path, arch):
    """A tiny Qwen2-MoE (4 experts, 2 a token, a shared expert, a dense second layer; engine/moe.py)
    and a tiny gpt-oss (attention sinks in the Triton kernel and in the prompts' eager sdpa, a window
    on its first layer) on the GPU: fp32 greedy tokens are HF `generate`'s (its eager expert loop) on
    the GPU; bf16 runs; neither captures CUDA graphs (the expert loop depends on the routing) and both
    end all-free."""
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    path = tiny_model_dir(tmp_path / "moe", arch, seed=2, head_dim=64)
    if arch == "gpt_oss":           # sinks that matter (a fresh model's are near zero)
        model = AutoModelForCausalLM.from_pretrained(path)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0, 2)
        model.save_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager").cuda().eval()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=gen).tolist() for n in (5, 21, 40)]
    for dtype in ("float32", "bfloat16"):
        engine = LLMEngine(EngineConfig(model=str(path), dtype=dtype, device="cuda", kv_cache_memory="64MiB",
                                        block_size=4, max_num_batched_tokens=16))
        assert engine.runner.model.moe and engine.runner.graphs is None
        ours = _generate(engine, prompts, 12)
        assert engine.block_manager.all_free() and all(ours)
        if dtype == "float32":
            with torch.inference_mode():
                refs = [hf.generate(torch.tensor([p], device="cuda"), do_sample=False, max_new_tokens=12,
                                    attention_mask=torch.ones(1, len(p), dtype=torch.long, device="cuda"))
                        [0, len(p):].tolist() for p in prompts]
            assert ours == refs


def test_engine_bf16_is_the_cuda_default_and_frees_everything(model_dir, prompts):
    engine = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory="64MiB"))
    assert engine.runner.kv_pool.dtype == torch.bfloat16 and engine.runner.kv_pool.is_cuda
    outs = _generate(engine, prompts, 16)
    assert all(1 <= len(o) <= 16 for o in outs) and engine.block_manager.all_free()


def _pools(src_device: str, dst_device: str, dtype=torch.bfloat16):
    torch.manual_seed(3)
    return torch.randn(SHAPE).to(src_device, dtype), torch.zeros(SHAPE, dtype=dtype, device=dst_device)


@pytest.mark.parametrize("src_device,dst_device", [("cuda", "cuda"), ("cpu", "cuda"), ("cuda", "cpu")])
def test_cuda_pools_over_gloo_bit_exact(src_device, dst_device):
    src, dst = _pools(src_device, dst_device)
    fp = fingerprint_for(src, "m")
    src_ids = [5, 6, 7, 8, 40, 2, 33, 34, 35, 1, 60, 61, 62, 63, 9, 10, 11]   # runs and strays
    dst_ids = [50, 3, 4, 20, 21, 22, 23, 24, 0, 44, 45, 12, 13, 14, 15, 16, 17]
    with KVReceiver(dst, fp, CFG) as receiver, KVSender(src, fp, CFG) as sender:
        fut = receiver.expect("cuda", dst_ids)
        res = sender.send(receiver.address, "cuda", src_ids)
        assert res.ok, res.error
        assert fut.result(10).ok
    assert torch.equal(dst[dst_ids].cpu(), src[src_ids].cpu())
    untouched = sorted(set(range(SHAPE[0])) - set(dst_ids))
    assert dst[untouched].abs().sum().item() == 0


def test_cuda_pools_pair_on_gloo_when_they_share_a_gpu():
    kv = torch.zeros(SHAPE, device="cuda")
    info = device_info(kv, "127.0.0.1")
    assert info.kind == "cuda" and choose_backend(info, info) == "gloo"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_distinct_gpus_select_nccl():
    a = device_info(torch.zeros(SHAPE, device="cuda:0"), "127.0.0.1")
    b = device_info(torch.zeros(SHAPE, device="cuda:1"), "127.0.0.1")
    assert choose_backend(a, b) == choose_backend(b, a) == ("nccl" if a.nccl else "gloo")


def test_loopback_between_cuda_pools():
    src, dst = _pools("cuda", "cuda")
    fp = fingerprint_for(src, "m")
    receiver, sender = LoopbackReceiver(dst, fp, CFG), LoopbackSender(src, fp, CFG)
    try:
        fut = receiver.expect("lb", [7, 3, 9, 10])
        assert sender.send(receiver.address, "lb", [1, 2, 3, 50]).ok and fut.result(5).ok
    finally:
        receiver.close()
        sender.close()
    assert torch.equal(dst[[7, 3, 9, 10]], src[[1, 2, 3, 50]])


def test_profiled_pool_keeps_the_replica_within_its_share(model_dir, prompts):
    from engine.backends import attention_kernels

    total = torch.cuda.mem_get_info()[1]
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    allocated_before = torch.cuda.memory_allocated()
    engine = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory=0.3, max_num_batched_tokens=256))
    runner = engine.runner
    assert runner.attention_backend == "triton_paged"       # Triton comes with CUDA builds of torch
    pool_bytes = runner.kv_pool.numel() * runner.kv_pool.element_size()
    assert pool_bytes > 0.1 * total                    # the share went to the pool, not lost
    outs = _generate(engine, prompts, 16)
    assert all(len(o) >= 1 for o in outs) and engine.block_manager.all_free()
    # everything this engine's torch allocations ever held, pool included, stayed within 0.3 x total
    assert torch.cuda.max_memory_allocated() - allocated_before <= 0.3 * total
    second = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory=0.3, max_num_batched_tokens=256))
    assert second.runner.num_blocks > 0.9 * runner.num_blocks    # the first engine's memory is not its share
    assert _generate(second, prompts[:2], 4) and second.block_manager.all_free()
    assert attention_kernels("torch", torch.device("cuda"), torch.bfloat16) == (None, "torch")


def test_triton_paged_attention_equals_the_torch_backend_on_cuda():
    from engine.attention import AttentionMetadata, DecodeBatch, paged_attention
    from engine.kernels.triton_attention import TritonKernels

    g = torch.Generator(device="cuda").manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for heads, kv_heads, dim, bs in ((9, 3, 64, 16), (32, 8, 128, 16), (4, 4, 32, 4)):
            batch, ctx, layers = 6, 300, 3
            nb = -(-ctx // bs)
            n = batch * nb + 2
            pool = torch.randn(n, layers, 2, bs, kv_heads, dim, generator=g, device="cuda").to(dtype)
            tables = torch.randperm(n, generator=g, device="cuda")[:batch * nb].view(batch, nb)
            lens = torch.randint(1, ctx + 1, (batch,), generator=g, device="cuda")
            q = torch.randn(batch, heads, dim, generator=g, device="cuda").to(dtype)
            last = lens - 1
            slots = tables[torch.arange(batch, device="cuda"), last // bs] * (layers * 2 * bs) + last % bs
            flat = pool.view(-1, kv_heads, dim)
            k, v = flat[slots + 2 * bs].clone(), flat[slots + 3 * bs].clone()
            k_rows = tables * (2 * layers)
            keys = torch.arange(nb * bs, device="cuda")[None, :]
            mask = (keys < lens[:, None])[:, None, None, :]
            sinks = torch.randn(heads, generator=g, device="cuda") * 2
            # full attention, a sliding window of the last 40 keys, Gemma 2's soft-capped scores, gpt-oss's sinks
            for window, cap, sink in ((0, 0.0, None), (40, 0.0, None), (40, 0.3, None), (0, 0.0, sinks),
                                      (40, 0.0, sinks)):
                in_window = mask & (keys >= lens[:, None] - window)[:, None, None, :]
                gathered = DecodeBatch(torch.arange(batch, device="cuda"),
                                       blocks=torch.stack((k_rows, k_rows + 1)).view(-1), mask=mask,
                                       window_masks={window: in_window})
                ref = paged_attention(1, q, k, v, AttentionMetadata(pool, slots, gathered, [], True), dim ** -0.5,
                                      window, cap, sink)
                out = TritonKernels.paged_decode_attention(q, pool, tables.contiguous(), lens, 1, dim ** -0.5, window,
                                                           cap, sink)
                assert (out.float() - ref.float()).abs().max().item() < tol, (dtype, heads, kv_heads, dim, window, cap)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_captured_decode_gives_the_eager_torch_tokens(model_dir, prompts, dtype):
    torch.backends.cuda.matmul.allow_tf32 = False
    outs = {}
    for backend, graphs in (("torch", False), ("paged", True)):
        engine = LLMEngine(EngineConfig(model=str(model_dir), dtype=dtype, device="cuda", kv_cache_memory="64MiB",
                                        max_num_batched_tokens=128, max_num_seqs=16, attention_backend=backend,
                                        cuda_graphs=graphs))
        runner = engine.runner
        if graphs:
            assert runner.attention_backend == "triton_paged" and runner.graphs is not None
            assert sorted(runner.graphs.graphs) == [1, 2, 4, 8, 16]
        else:
            assert runner.graphs is None
        outs[backend] = _generate(engine, prompts, 20)
        assert engine.block_manager.all_free()
    if dtype == "float32":
        assert outs["paged"] == outs["torch"]
    else:   # bf16 rounds differently in the two attentions: most sequences agree token for token
        same = sum(a == b for a, b in zip(outs["paged"], outs["torch"]))
        assert same >= len(prompts) // 2, (same, len(prompts))


def test_lora_on_cuda(model_dir, prompts, tmp_path):
    """A LoRA adapter on the GPU: in fp32 greedy output equals transformers' with the adapter applied
    as PEFT does, on the same GPU; in bf16 (graphs captured) a batch mixing the adapter's rows and
    the base model's runs eagerly, the adapter's rows follow it, and every block is free after."""
    from transformers import AutoModelForCausalLM

    from lora_adapters import with_adapter, write_adapter

    torch.backends.cuda.matmul.allow_tf32 = False
    adapter = write_adapter(tmp_path / "a", AutoModelForCausalLM.from_pretrained(model_dir), seed=2, scale=0.1)
    short = prompts[:4]
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", device="cuda", kv_cache_memory="64MiB",
                                    lora_modules={"a": str(adapter)}))
    greedy = dict(temperature=0.0, max_tokens=12, ignore_eos=True)
    ours = [c.token_ids for c in engine.generate(short, SamplingParams(**greedy, lora="a"))]
    model = with_adapter(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), adapter).cuda().eval()
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        refs = [model.generate(torch.tensor([p], device="cuda"), do_sample=False, max_new_tokens=12, min_new_tokens=12,
                               attention_mask=torch.ones(1, len(p), dtype=torch.long, device="cuda"))
                [0, len(p):].tolist() for p in short]
    assert ours == refs
    bf16 = LLMEngine(EngineConfig(model=str(model_dir), dtype="bfloat16", device="cuda", kv_cache_memory="64MiB",
                                  lora_modules={"a": str(adapter)}))
    mixed = bf16.generate(short * 2, [SamplingParams(**greedy, lora=n) for n in ["a"] * 4 + [None] * 4])
    assert [c.token_ids[:2] for c in mixed[:4]] == [r[:2] for r in refs]
    assert [c.token_ids for c in mixed[:4]] != [c.token_ids for c in mixed[4:]]
    assert bf16.block_manager.all_free()
