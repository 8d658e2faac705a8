"""KV pool budgets (engine.memory): the arithmetic behind `kv_cache_memory` on CPU and CUDA.
(The CUDA profiling run itself is checked in tests/test_cuda.py.) And the freed heap handed back
after the model is built."""

import platform
import subprocess
import sys
from pathlib import Path

import pytest

from engine.config import EngineConfig, parse_kv_memory
from engine.llm_engine import LLMEngine
from engine.memory import GIB, CudaUsage, cpu_kv_budget, cuda_kv_budget
from tiny_models import tiny_model_dir

H200 = 140 * GIB


def test_cpu_budgets():
    assert cpu_kv_budget(*parse_kv_memory("auto"), available=16 * GIB) == GIB
    assert cpu_kv_budget(*parse_kv_memory("auto"), available=2 * GIB) == GIB // 2
    assert cpu_kv_budget(*parse_kv_memory(0.5), available=8 * GIB) == 4 * GIB
    assert cpu_kv_budget(*parse_kv_memory("300MiB"), available=8 * GIB) == 300 * 2**20


def test_cuda_share_of_total_minus_what_the_model_needs():
    usage = CudaUsage(total=H200, free=120 * GIB, peak_torch=20 * GIB, non_torch=GIB)
    budget, how = cuda_kv_budget(*parse_kv_memory("auto"), usage)
    assert budget == int(0.9 * H200) - 21 * GIB
    assert "0.90 x" in how and "20.00 GiB" in how
    # half a GPU: the share is of total memory, whatever another replica holds
    budget, _ = cuda_kv_budget(*parse_kv_memory(0.45), usage)
    assert budget == int(0.45 * H200) - 21 * GIB


def test_cuda_budget_never_exceeds_what_is_free():
    # another process holds most of the device: the share would not fit, the free memory caps it
    usage = CudaUsage(total=H200, free=30 * GIB, peak_torch=10 * GIB, non_torch=GIB)
    assert cuda_kv_budget(*parse_kv_memory(0.9), usage)[0] == int(0.98 * 30 * GIB)
    assert cuda_kv_budget(*parse_kv_memory("100GiB"), usage)[0] == int(0.98 * 30 * GIB)
    assert cuda_kv_budget(*parse_kv_memory("2GiB"), usage)[0] == 2 * GIB


def test_cuda_share_smaller_than_the_model_leaves_nothing():
    usage = CudaUsage(total=H200, free=120 * GIB, peak_torch=20 * GIB, non_torch=GIB)
    assert cuda_kv_budget(*parse_kv_memory(0.1), usage)[0] < 0


def test_a_budget_without_room_for_a_block_is_a_clear_error(tmp_path):
    path = tiny_model_dir(tmp_path / "m", "llama")
    with pytest.raises(ValueError, match="leaves no room for a KV block"):
        LLMEngine(EngineConfig(model=str(path), device="cpu", kv_cache_memory="1KiB"))


def test_the_profiling_step_runs_the_largest_step_and_leaves_the_pool_alone(tmp_path):
    # on CUDA this step is what the pool is sized around (tests/test_cuda.py); here: it runs at
    # the configured token budget and touches nothing of the real pool
    path = tiny_model_dir(tmp_path / "m", "llama")
    eng = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", kv_cache_memory="4MiB",
                                 max_num_batched_tokens=300, block_size=16))
    before = eng.runner.kv_pool.clone()
    temp = eng.runner.run_largest_step()
    s = eng.runner.kv_shape
    assert temp == 19 * s.bytes_per_block            # ceil(300 / 16) blocks
    assert eng.runner.kv_pool.equal(before)


# blocks of 4 MiB freed while one after them lives: glibc keeps them in its heap (its mmap threshold
# has grown past 4 MiB after a 30 MiB block came and went), so RSS stays up until they are returned
_FREED_HEAP = """
import torch
from engine.memory import return_freed_heap
def rss(): return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) * 1024
big = torch.ones(30 * 2**20 // 4); del big
blocks = [torch.ones(2**20) for _ in range(60)]
keep = blocks[-1]
del blocks
before = rss()
print(return_freed_heap(), before - rss())
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's heap and malloc_trim")
def test_return_freed_heap_gives_the_freed_blocks_back():
    out = subprocess.run([sys.executable, "-c", _FREED_HEAP], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    returned, dropped = out.stdout.split()
    assert returned == "True"
    assert int(dropped) > 150 * 2**20          # of the 236 MiB freed (measured: 236 MiB returned)
