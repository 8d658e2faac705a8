"""pdserve's shared engine: paged KV, continuous batching, one ragged forward per step.

Torch-free bookkeeping: `sequence`, `block_manager`, `scheduler`, `sampling_params`.
Tensors: `model_runner` (with `backends`, `decoder`, `linear` and `attention`), `sampler`. Orchestration: `llm_engine`
(synchronous) and `async_engine` (a background thread feeding asyncio streams).
The bottom layer, beside `kv_transfer/`: it imports neither that nor anything above it
(`serving/`, the pools, the router, `pdserve/`); import-linter checks it in `make test`.
"""
