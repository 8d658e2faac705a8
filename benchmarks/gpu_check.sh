#!/usr/bin/env bash
# Every GPU check in one run (about 6 minutes on one H200 or H100), for a session that is lent a GPU:
#   1. tests/test_cuda.py: the CUDA engine (fp32 == HF on the GPU, bf16 default, the KV pool sized
#      by profiling within a share of the device, two engines on one GPU; the Triton kernel with a
#      sliding window; a tiny Gemma 3 against HF on the GPU) and kv_transfer
#      with CUDA-resident pools (one GPU: gloo through pinned host staging), bit-exact;
#   2. benchmarks/gpu_decode_check.py: decode step ms, eager torch attention vs the Triton paged
#      kernel vs the paged kernel replayed from CUDA graphs;
#   2b. benchmarks/kv_transfer_bench.py --device cuda: GB/s of that path against raw gloo;
#   3. benchmarks/gpu_roofline_check.py: prefill MFU and decode bandwidth utilization of a
#      random-weight Qwen2.5-7B-shaped model beside `pdserve plan` (the GPU's peaks by its name).
# Needs only python3 with torch (CUDA build: it brings Triton), transformers, msgpack, pytest and
# llguidance (no Ray, no model download): benchmarks/gpu_wheels.sh fetches what the image lacks.
# Logs go to $OUT (the device tool's folder) or bench_out/gpu.
#
#   bash benchmarks/gpu_check.sh
set -o pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
LOGS=${OUT:-bench_out/gpu}
mkdir -p "$LOGS"
# wheels the image lacks (llguidance), carried as .whl from benchmarks/gpu_wheels.sh
if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
"$PY" -c "import llguidance" 2>/dev/null \
    || echo "llguidance is missing: every engine test will fail to import (benchmarks/gpu_wheels.sh, carry .whl)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$LOGS/gpu.txt"
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
    | tee -a "$LOGS/gpu.txt"
status=0
# the ini's warning filters name pydantic, which a bare GPU image may lack
timeout 240 "$PY" -m pytest -q -rs -o "filterwarnings=ignore::DeprecationWarning" tests/test_cuda.py 2>&1 \
    | tee "$LOGS/test_cuda.log" || status=1
timeout 100 "$PY" benchmarks/gpu_decode_check.py 2>&1 | tee "$LOGS/decode.log" || status=1
timeout 100 "$PY" benchmarks/kv_transfer_bench.py --device cuda --repeats 5 2>&1 | tee "$LOGS/kv_cuda.log" || status=1
timeout 160 "$PY" benchmarks/gpu_roofline_check.py 2>&1 | tee "$LOGS/roofline.log" || status=1
exit $status
