"""The GPU decode path's parts that a CPU can check (tests/test_cuda.py runs the rest on a GPU).

- Batch buckets for CUDA graphs, and the static-buffer decode step that graphs replay
  (engine.cuda_graphs with capture off): padded up to a bucket by repeating row 0, it gives the
  same greedy tokens as the plain step, for batches that need padding and ones that do not.
- The Triton paged-attention kernel (engine.kernels.triton_attention) under Triton's CPU
  interpreter: it equals the torch backend on random pools (full and sliding-window attention),
  and an engine whose decode runs it
  through the static-buffer path gives the torch backend's greedy tokens. Skipped where Triton is
  not installed (CUDA builds of torch bring it; `make install` adds it for this check).
- `benchmarks/gpu_check.sh` runs on a bare GPU image (torch, transformers, msgpack, pytest: no Ray,
  no pydantic, no gguf): tests/test_cuda.py and the GPU benchmarks import with those blocked.
"""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs, batch_buckets
from engine.kernels import cpu_kernels
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tiny_models import tiny_model_dir

ROOT = Path(__file__).resolve().parent.parent


def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]


def _generate(path, prompts, static: bool, backend="paged", kernels=None):
    eng = LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu", kv_cache_memory="8MiB",
                                 block_size=4, max_num_batched_tokens=64, max_num_seqs=8, attention_backend=backend))
    runner = eng.runner
    if kernels is not None:
        runner.kernels = kernels
    if static:
        runner.graphs = DecodeGraphs(runner.model, runner.kv_pool, runner.kernels, 8,
                                     -(-runner.max_model_len // 4), capture=False)
        calls = []
        run = runner.graphs.run
        runner.graphs.run = lambda *a: calls.append(a[0].shape[0]) or run(*a)
    out = [c.token_ids for c in eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))]
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    if static:
        assert calls and max(calls) == len(prompts)     # pure decode steps went through the static path
    return out


@pytest.mark.skipif(cpu_kernels() is None, reason="the CPU kernel could not be built here")
@pytest.mark.parametrize("batch", [3, 4, 5])
def test_static_buffer_decode_matches_the_plain_step(tmp_path, batch):
    path = tiny_model_dir(tmp_path / "m", "qwen2", seed=2)
    prompts = [list(range(7 + i, 7 + i + 5 + 6 * i)) for i in range(batch)]
    assert _generate(path, prompts, static=True) == _generate(path, prompts, static=False)


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _has_triton(), reason="Triton is not installed")
def test_triton_kernel_under_the_interpreter(tmp_path):
    path = tiny_model_dir(tmp_path / "m", "llama", seed=4)
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]
        from engine.attention import AttentionMetadata, DecodeBatch, paged_attention
        from engine.kernels.triton_attention import TritonKernels
        from test_gpu_paths_on_cpu import _generate
        g = torch.Generator().manual_seed(0)
        for heads, kv_heads, dim, bs in ((9, 3, 64, 16), (4, 4, 32, 4), (6, 2, 16, 1)):
            B, ctx, L = 3, 37, 2
            nb = -(-ctx // bs); n = B * nb + 2
            pool = torch.randn(n, L, 2, bs, kv_heads, dim, generator=g)
            tables = torch.randperm(n, generator=g)[:B * nb].view(B, nb)
            lens = torch.tensor([ctx, 5, 20])
            q = torch.randn(B, heads, dim, generator=g)
            sinks = torch.randn(heads, generator=g) * 2
            # full, sliding windows (the last 6 / 19 keys), Gemma 2's soft-capped scores and gpt-oss's sinks
            for window, cap, sink in ((0, 0.0, None), (6, 0.0, None), (19, 0.0, None), (0, 0.3, None),
                                      (6, 0.3, None), (0, 0.0, sinks), (6, 0.0, sinks)):
                out = TritonKernels.paged_decode_attention(q, pool, tables, lens, 1, dim ** -0.5, window, cap, sink)
                k_rows = tables * (2 * L)
                keys = torch.arange(nb * bs)[None, :]
                mask = (keys < lens[:, None])[:, None, None, :]
                in_window = mask & (keys >= lens[:, None] - window)[:, None, None, :]
                dec = DecodeBatch(torch.arange(B), blocks=torch.stack((k_rows, k_rows + 1)).view(-1), mask=mask,
                                  window_masks={{window: in_window}})
                # the store writes the K/V already at each last position: a no-op
                last = lens - 1
                slots = tables[torch.arange(B), last // bs] * (L * 2 * bs) + last % bs
                flat = pool.view(-1, kv_heads, dim)
                k, v = flat[slots + 2 * bs].clone(), flat[slots + 3 * bs].clone()
                ref = paged_attention(1, q, k, v, AttentionMetadata(pool, slots, dec, [], True), dim ** -0.5, window,
                                      cap, sink)
                err = (out - ref).abs().max().item()
                assert err < 1e-5, (heads, kv_heads, dim, bs, window, err)
        prompts = [[5, 6, 7], list(range(10, 27)), list(range(30, 41))]
        path = {str(path)!r}
        assert _generate(path, prompts, static=True, kernels=TritonKernels()) == \\
            _generate(path, prompts, static=False, backend="torch")
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]


# what a bare GPU image lacks (the device machine's package list: torch, transformers, triton, msgpack,
# pytest, but none of these); test_cuda.py is collected and the GPU benchmarks import without them
_BARE_GPU_IMAGE = """
import importlib, importlib.abc, runpy, sys
MISSING = {"ray", "pydantic", "fastapi", "starlette", "uvicorn", "gguf"}
class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in MISSING:
            raise ImportError(f"not on a bare GPU image: {name}")
sys.meta_path.insert(0, Missing())
sys.path[:0] = ["tests", "benchmarks"]
for script in ("benchmarks/gpu_decode_check.py", "benchmarks/kv_transfer_bench.py", "benchmarks/gpu_roofline_check.py"):
    runpy.run_path(script, run_name="imported")          # module level only: main() is not called
import pytest
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-o", "filterwarnings=ignore::DeprecationWarning",
                      "--co", "tests/test_cuda.py"]))
"""


def test_the_gpu_check_needs_no_ray_pydantic_or_gguf():
    out = subprocess.run([sys.executable, "-c", _BARE_GPU_IMAGE], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert re.search(r"\b\d+ tests? collected", out.stdout), out.stdout[-1000:]
