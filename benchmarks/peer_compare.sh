#!/usr/bin/env bash
# Served comparison against llama.cpp's llama-server on the same model (../shared/PEERS.md's
# workloads W1-W4), one load generator, both servers up, each workload run against
# pdserve and then llama-server (`pdserve bench --compare`), fresh prompts per workload.
#
#   LLAMA_SERVER=/path/to/llama-server GGUF=/path/to/SmolLM2-135M-Instruct.Q4_1.gguf \
#       bash benchmarks/peer_compare.sh [extra `pdserve serve` flags, e.g. --config FILE]
#
# WORKLOADS="W1 W2" runs only those (default: all four).
# Build llama-server and extract the GGUF as the README's Benchmarks section says. Logs and JSON
# go to bench_out/peers/. Ports are free ones picked at start; both servers are stopped at exit.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${LLAMA_SERVER:?set LLAMA_SERVER to the llama-server binary}" "${GGUF:?set GGUF to the Q4_1 GGUF}"
PY=.venv/bin/python
OUT=bench_out/peers
mkdir -p "$OUT"
free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
P1=$(free_port); P2=$(free_port)
pids=()
cleanup() { for p in "${pids[@]}"; do kill -INT "$p" 2>/dev/null || true; done; sleep 3
            for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

.venv/bin/pdserve serve --port "$P1" --model-cache .cache/models "$@" > "$OUT/pdserve.log" 2>&1 &
pids+=($!)
"$LLAMA_SERVER" -m "$GGUF" -t 2 -tb 2 -np 8 -c 16384 -cb --no-webui --host 127.0.0.1 --port "$P2" \
    > "$OUT/llama.log" 2>&1 &
pids+=($!)
for url in "http://127.0.0.1:$P1/health" "http://127.0.0.1:$P2/health"; do
    for _ in $(seq 300); do curl -sf "$url" > /dev/null && break; sleep 1; done
    curl -sf "$url" > /dev/null || { echo "not up: $url" >&2; tail -n 20 "$OUT"/*.log >&2; exit 1; }
done
# a run with failed requests still prints its table (bench exits 1): go on to the next workload
bench() { "$PY" -m pdserve.bench --url "http://127.0.0.1:$P1" --compare "http://127.0.0.1:$P2" --no-progress "$@" \
          || echo "(some requests failed: see the table)"; }
# warm-up (first requests pay one-time costs on both sides)
bench --requests 4 --concurrency 2 --input-len 64 --output-len 8 --seed 99 > /dev/null
echo "load average before the workloads: $(cut -d' ' -f1-3 /proc/loadavg)"
WORKLOADS=${WORKLOADS:-W1 W2 W3 W4}
want() { [[ " $WORKLOADS " == *" $1 "* ]]; }
if want W1; then echo "== W1: 1 stream, 128 -> 64"
bench --concurrency 1 --requests 8 --input-len 128 --jitter 0 --output-len 64 --seed 1 --json "$OUT/w1.json"; fi
if want W2; then echo "== W2: 8 streams, closed loop, 128 -> 64"
bench --concurrency 8 --requests 32 --input-len 128 --jitter 0 --output-len 64 --seed 2 --json "$OUT/w2.json"; fi
if want W3; then echo "== W3: 4 streams, closed loop, 1024 -> 32 (TPOT while long prompts prefill)"
bench --concurrency 4 --requests 16 --input-len 1024 --jitter 0 --output-len 32 --seed 3 --json "$OUT/w3.json"; fi
if want W4; then echo "== W4: Poisson 0.6 and 1.1 req/s, 256 -> 64, SLO TTFT 1 s / TPOT 100 ms"
bench --rates 0.6,1.1 --requests 24 --input-len 256 --jitter 0 --output-len 64 --ttft-slo 1 --tpot-slo 0.1 --seed 4 \
    --json "$OUT/w4.json"; fi
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
