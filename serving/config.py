"""Serving configuration: pydantic models with a description on every field.

`AppConfig` is what `build_app` takes and what the Serve config YAML holds under
`args:`. Cross-field checks (prefill and decode must agree on the KV format) run on load. The
pools' scaling options live in serving/scaling_config.py, the chat template's reader in
serving/chat_template.py.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, field_validator, model_validator

from engine.config import EngineConfig
from engine.lora_config import NAME_PATTERN, adapter_dir, read_adapter
from serving.chat_template import chat_template_text
from serving.config_base import ConfigModel as _Model
from serving.models import DEFAULT_ALIASES, DEFAULT_MODEL_ID, served_name
from serving.scaling_config import AutoscalingOptions, SloAutoscalingOptions


class EngineOptions(_Model):
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights, activations and KV dtype; auto = bf16 on CUDA (fp16 without bf16) and on "
                            "CPUs with native bf16 (AVX512-BF16/AMX), else fp32. float32 is the exact mode "
                            "(greedy output token-identical to Hugging Face generate).")
    quantization: Literal["int8", "int4"] | None = Field(
        None, description="Quantization of every linear and the LM head (CPU): int8 (int8 weights per channel; the "
                          "engine's kernel rounds the activations to int8 too, in groups of 32, as llama.cpp's "
                          "Q8_0) or int4 (groups of 32, activations the same): faster decode, some quality cost; may "
                          "differ between pools (the KV stays bf16).")
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N.")
    attention_backend: Literal["auto", "paged", "torch"] = Field(
        "auto", description="Decode attention: paged (the engine's kernel reads K/V from the pool in place: C++ "
                            "on CPU in fp32/bf16, Triton on CUDA), torch (gather + sdpa; any device), auto "
                            "(paged where it applies).")
    cuda_graphs: bool = Field(
        True, description="CUDA with the paged backend: replay pure decode steps from CUDA graphs captured "
                          "at start, one per batch bucket.")
    cpu_gemv: bool = Field(
        True, description="CPU: steps of few rows run the engine's GEMV kernels (faster small-batch decode; "
                          "bf16 then holds a second, blocked copy of every weight). False: one bf16 copy.")
    kv_cache_memory: str | float = Field(
        "auto", description="KV pool budget: 'auto', a fraction of free memory, or a size like '1GiB'.")
    block_size: int = Field(16, description="Tokens per KV block (must match across pools).")
    max_num_batched_tokens: int = Field(512, description="Token budget per engine step (prefill chunk size).")
    max_num_seqs: int = Field(64, description="Most sequences running at once in one replica.")
    max_model_len: int | None = Field(
        None, description="Longest prompt + output; default: the model's (for longrope / dynamic NTK RoPE its "
                          "original length; more serves every sequence with the RoPE of this length, as vLLM).")
    enable_prefix_caching: bool = Field(True, description="Reuse K/V blocks of identical prompt prefixes.")
    num_threads: int | Literal["auto"] | None = Field(
        "auto", description="torch intra-op threads a replica owns (CPU); auto = its pool's num_cpus (at least 1); "
                            "None = torch's default (every CPU). With share_idle_cpus it also borrows idle replicas'.")

    speculative_tokens: int = Field(
        0, ge=0, le=16, description="Decode steps feed up to this many draft tokens per sequence, proposed by prompt "
                                    "lookup, and keep those the model picks itself: several tokens a step where the "
                                    "output repeats its context; in float32 the same output as without (bf16: up to "
                                    "the rounding a bigger batch also changes). 0: off.")
    speculative_max_batch: int = Field(
        8, ge=1, description="Speculate only while at most this many sequences run in the replica.")
    prediction_tokens: int = Field(
        8, ge=0, le=16, description="A request with a predicted output (the chat request's `prediction`) drafts up "
                                    "to this many tokens a step from it, whatever speculative_tokens, kept as prompt "
                                    "lookup's drafts are (the output does not change). 0: predictions are ignored.")

    def engine_config(self, model_dir: str, **app_wide) -> EngineConfig:
        """The engine's configuration (`num_threads` resolved: AppConfig.engine_for), with the
        settings every pool shares (`app_wide`: AppConfig's lora_modules, max_loras,
        scheduling_policy)."""
        assert self.num_threads != "auto", "resolve num_threads through AppConfig.engine_for"
        return EngineConfig(model=model_dir, **app_wide, **self.model_dump())


class PoolConfig(_Model):
    num_replicas: int = Field(1, ge=1, description="Replicas in this pool when `autoscaling` is not set.")
    autoscaling: AutoscalingOptions | None = Field(None, description="Scale this pool on its own signal.")
    graceful_shutdown_timeout_s: float = Field(
        120.0, gt=0, description="A replica being removed finishes its running streams for up to this long.")
    num_cpus: float = Field(0.0, ge=0, description="Ray CPUs reserved per replica.")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per replica (CUDA is used when >0 and available).")
    resources: dict[str, float] = Field(default_factory=dict,
                                        description="Custom Ray resources per replica (e.g. a node type).")
    max_ongoing_requests: int = Field(256, ge=1, description="Requests a replica accepts at once.")
    max_queued_requests: int = Field(1024, ge=1, description="Requests queued for this pool beyond what its "
                                                           "replicas accept; above it callers get 429.")
    engine: dict[str, Any] = Field(default_factory=dict,
                                   description="Engine options of this pool that differ from the shared ones.")

    @field_validator("engine")
    @classmethod
    def _engine_keys(cls, v: dict) -> dict:
        EngineOptions.model_validate(v)   # known keys, valid values; kept as a partial override
        return v


class TransferOptions(_Model):
    connect_timeout_s: float = Field(10.0, gt=0, description="Building a sender-receiver pair.")
    transfer_timeout_s: float = Field(30.0, gt=0, description="One KV transfer, header to ack.")
    lease_s: float = Field(120.0, gt=0, description="Decode side: a reservation (made before the prefill "
                           "runs) whose KV has not landed this long after it is freed; covers the prefill's "
                           "queue, the prefill and the push.")
    max_pairs_per_peer: int = Field(4, ge=1, description="Prefill side: KV transfers in flight at once to one "
                                    "decode replica, each on its own pair (a stalled one holds only its own).")
    secret: str = Field("", description="Shared secret a sender must present to a receiver ('' = none).")
    host: str = Field("auto", description="Address the decode replicas' KV rendezvous binds and publishes; "
                                          "auto = the Ray node's IP.")
    chunk_bytes: int = Field(0, ge=0, le=1 << 31, description="Largest KV data message; 0 = by backend "
                             "(4 MiB gloo, 32 MiB NCCL). A block larger than this travels alone.")

    @model_validator(mode="after")
    def _valid_for_kv_transfer(self):
        self.transfer_config()   # TransferConfig checks each field and their relations (ValueError)
        return self

    def transfer_config(self):
        from kv_transfer import TransferConfig
        return TransferConfig(connect_timeout_s=self.connect_timeout_s, transfer_timeout_s=self.transfer_timeout_s,
                              lease_s=self.lease_s, max_pairs_per_peer=self.max_pairs_per_peer,
                              chunk_bytes=self.chunk_bytes, secret=self.secret)


class RoutingOptions(_Model):
    prefix_affinity: bool = Field(True, description="Each pool: send a prompt to the replica this router already "
                                  "sent its longest prefix to (prefix-cache hits: a prefill replica computes less, a "
                                  "decode replica is sent less K/V), while that replica's load allows.")
    max_imbalance_tokens: int = Field(2048, ge=0, description="Prefill and colocated pools: affinity yields to the "
                                      "load ranking when the replica's queued prompt tokens exceed the least loaded "
                                      "one's by more.")
    decode_max_imbalance_tokens: int = Field(2048, ge=0, description="Decode pool: affinity yields to the load "
                                             "ranking when the replica's KV held (tokens) exceeds the least loaded "
                                             "one's by more than this plus the prompt tokens it matched there.")
    max_blocks: int = Field(200_000, ge=1, description="Prompt blocks the router remembers (least recently "
                            "used go first; about 200 bytes each).")
    local_prefill_tokens: int = Field(64, ge=0, description="Disaggregated: a decode replica whose prefix cache "
                                      "holds a prompt's beginning and all but at most this many of its tokens (the "
                                      "next turn of a conversation it decoded), counting the prompt tokens it has "
                                      "queued already, computes them itself, inside its decode steps, instead of the "
                                      "prefill pool and a KV hand-off; anything else goes to the prefill pool. 0: "
                                      "every prompt goes to the prefill pool.")


class GoodputOptions(_Model):
    """The targets a finished request must meet to count as goodput (`pdserve_goodput_requests_total`)."""
    ttft_s: float = Field(1.0, gt=0, description="Time to first token at most this, seconds.")
    tpot_s: float = Field(0.1, gt=0, description="Mean time per output token after the first at most this, seconds.")


class ResponsesOptions(_Model):
    """The Responses API's stored responses (`store`, `previous_response_id`, GET/DELETE
    /v1/responses/{id}): kept in memory by one ResponseStore deployment on the head node, the least
    recently used dropped past either bound, and lost when it restarts (any change to `args`
    replaces it)."""
    store: bool = Field(True, description="Keep each response whose request does not say `store: false` (OpenAI's "
                        "default); false: none is kept and `previous_response_id` is a 400.")
    max_stored: int = Field(10_000, ge=1, description="Responses kept at most.")
    max_stored_bytes: int = Field(256 * 2**20, ge=2**20, description="Bytes of kept responses (their JSON: output "
                                  "and the conversation before it) at most.")
    background_lease_s: float = Field(
        30.0, ge=0.5, le=3600, description="A router running background responses tells the store it is alive "
        "every third of this; a background response whose router stayed silent this long (it failed or was "
        "replaced) is stored failed at its next read, rather than in_progress for good.")


class EmbeddingOptions(_Model):
    """How /v1/embeddings pools a prompt's final hidden states into its vector (engine/pooling.py)."""
    pooling: Literal["auto", "last", "mean", "cls"] = Field(
        "auto", description="last: the last token's hidden state; mean: the mean over every token's; cls: the "
        "first token's. auto: what the model's sentence-transformers files say (modules.json, its Pooling "
        "module's config), else last (decoder embedding models: Qwen3-Embedding, gte-Qwen2, e5-mistral).")
    normalize: bool | None = Field(
        None, description="Scale each vector to length 1; null: where the model's sentence-transformers modules "
        "end with Normalize, or the model has none (as vLLM's embedding pooler).")


class ScoreOptions(_Model):
    """How /v1/score and /v1/rerank score a pair (router/score_api.py)."""
    method: Literal["auto", "labels", "cosine"] = Field(
        "auto", description="labels: the label tokens' probability after the pair's joined texts (a causal LM as a "
        "cross-encoder: Qwen3-Reranker); cosine: the cosine similarity of the two texts' embeddings "
        "(/v1/embeddings' pooling: an embedding model, as vLLM scores with one); auto: cosine for a model with "
        "sentence-transformers files (modules.json), else labels.")
    label_tokens: list[str] = Field(
        ["no", "yes"], min_length=1, max_length=16, description="Tokens whose probability as the next token after "
        "a query and a document scores them, each one token of the model's vocabulary: the score is the last one's "
        "share of their probability (one token: its probability). The default is Qwen3-Reranker's (vLLM's "
        "classifier_from_token).")


class CorsOptions(_Model):
    """Cross-origin calls from web pages (CORS; router/cors.py)."""
    allowed_origins: list[str] = Field(
        default_factory=list, description="Origins whose pages may call the API, as a browser sends them "
        "('https://app.example.com', 'http://localhost:3000'; no path), or ['*'] for any; empty (the default): "
        "none, browsers refuse cross-origin calls.")
    allow_credentials: bool = Field(False, description="Let those pages send cookies or HTTP authentication "
                                    "(not needed for an `Authorization: Bearer` header).")
    max_age_s: int = Field(600, ge=0, le=86400, description="How long a browser may reuse a preflight's answer.")

    @field_validator("allowed_origins")
    @classmethod
    def _origins(cls, origins: list[str]) -> list[str]:
        for origin in origins:     # a browser's Origin header is compared as a string: no path, no slash
            if origin != "*" and not re.fullmatch(r"[a-z][a-z0-9+.-]*://[^/\s]+", origin):
                raise ValueError(f"{origin!r} is not an origin: scheme://host[:port] with no path (e.g. "
                                 "'https://app.example.com'), or '*' for any")
        return origins


class AppConfig(_Model):
    mode: Literal["disaggregated", "colocated"] = Field(
        "disaggregated", description="Separate prefill/decode pools, or one engine pool doing both.")
    model: str = Field(
        DEFAULT_MODEL_ID, description="The default model's id, a local Hugging Face model directory, a .gguf file "
        "(converted once into model_cache) or a Hugging Face id ('org/name') in the local Hugging Face cache (never "
        "downloaded); each replica finds it on its own node. A path that exists where the config is validated is "
        "made absolute there.")
    served_model_name: str | list[str] | None = Field(
        None, description="Model id in the API, or several (aliases: a request may name any, its answer names "
                          "the one it asked for; the first is the default); default: the model's name.")
    model_cache: str | None = Field(
        None, description="Where the default model and GGUF files are converted and cached (default "
        "~/.cache/pdserve/models).")
    chat_template: str | None = Field(
        None, description="A Jinja chat template in place of the model's own (vLLM's --chat-template; e.g. one that "
        "writes tool calls for a model whose own template has none): the template's text, or the path of a file "
        "holding it (relative to the working directory), read when the config is validated where the app is built "
        "(`pdserve serve`, `pdserve deploy`), so the text travels in the config and the replicas need not see the "
        "file. Its tool-call syntax and reasoning tags are read from it as from the model's (README: Tools).")
    lora_modules: dict[str, str] = Field(
        default_factory=dict, description="LoRA adapters served beside the model (vLLM's --lora-modules): adapter name "
        "-> a PEFT LoRA adapter's directory (adapter_config.json and adapter_model.safetensors), found at that path on "
        "every node running a prefill, decode or colocated replica (relative paths are made absolute where the "
        "config is validated). A request runs an adapter by naming it as its `model`; /v1/models lists them. "
        "Adapters on the attention and MLP projections (engine/lora.py: what is supported).")
    runtime_lora_updating: bool = Field(
        False, description="Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's, which it turns on "
        "with VLLM_ALLOW_RUNTIME_LORA_UPDATING): adapters loaded while the app runs, remembered by the router (and "
        "kept in the ResponseStore where responses.store is on, so a router that fails and is replaced serves them "
        "still) and loaded by each replica at the first request that runs one. Whoever holds the API key may then "
        "make every replica read any adapter directory its nodes can see.")
    max_loras: int = Field(
        8, ge=1, description="LoRA adapters loaded at run time (runtime_lora_updating) each engine replica holds at "
        "once (as vLLM's --max-loras); the least recently used that no request runs makes room for the next, and a "
        "request whose adapter finds every one in use waits in the replica's queue until one is idle (in a decode "
        "replica, where its K/V has landed, parked with its KV blocks); the configuration's lora_modules are "
        "always held.")
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs", description="How each engine replica orders its requests (vLLM's --scheduling-policy): fcfs, first "
        "come first served; priority, by each request's `priority` (lower first, then arrival; the last in that "
        "order is preempted first). With fcfs a request's priority other than 0 is a 400.")
    engine: EngineOptions = Field(default_factory=EngineOptions, description="Engine options for every pool.")
    prefill: PoolConfig = Field(default_factory=PoolConfig, description="The prefill pool.")
    decode: PoolConfig = Field(default_factory=PoolConfig, description="The decode pool.")
    colocated: PoolConfig = Field(default_factory=PoolConfig, description="The pool used in colocated mode.")
    transfer: TransferOptions = Field(default_factory=TransferOptions, description="KV transfer timeouts.")
    routing: RoutingOptions = Field(default_factory=RoutingOptions, description="How the router picks replicas.")
    request_timeout_s: float = Field(600.0, gt=0, description="Deadline of one request end to end.")
    stream_interval_ms: float = Field(
        50.0, ge=0, le=1000, description="Least time between two messages of one stream from a decode (or "
        "colocated) replica: tokens made sooner go together in the next message (one SSE chunk). The first "
        "token and the last are never held. 0 = a message per engine step. Each message costs CPU in the "
        "replica, the router and Serve's proxy, whatever its tokens (docs/benchmarks.md: Serving overhead).")
    share_idle_cpus: bool = Field(
        True, description="CPU replicas on one machine lend their torch threads while their engine is idle: a "
        "busy engine steps on its own `num_threads` plus its share of the idle replicas' (serving/cpu_share.py). "
        "On one 2-core machine the decode replica then streams one request on both cores while no prompt is "
        "being prefilled (README: Configuration).")
    max_tokens_limit: int = Field(4096, ge=1, description="Largest max_tokens a request may ask for (400 above).")
    api_key: str = Field("", description="When set, every endpoint but /health needs 'Authorization: Bearer <key>' "
                         "(or 'x-api-key: <key>', as Anthropic's clients send it).")
    max_body_bytes: int = Field(4 * 2**20, gt=0, description="Largest accepted request body (413 above).")
    max_inflight_requests: int = Field(1024, gt=0, description="Requests the router holds at once (429 above).")
    cors: CorsOptions = Field(default_factory=CorsOptions, description="Which web pages' origins may call the "
                              "API from a browser; default: none.")
    route_prefix: str = Field("/", description="HTTP route prefix of the app.")
    autoscaling: SloAutoscalingOptions | None = Field(
        None, description="Application-level autoscaling of both pools (`policy: slo`); default: none, each "
                          "pool scales by its own `autoscaling` block or keeps its `num_replicas`.")
    responses: ResponsesOptions = Field(default_factory=ResponsesOptions,
                                        description="Stored responses of the Responses API.")
    embeddings: EmbeddingOptions = Field(default_factory=EmbeddingOptions,
                                         description="How /v1/embeddings pools a prompt into its vector.")
    score: ScoreOptions = Field(default_factory=ScoreOptions,
                                description="How /v1/score and /v1/rerank score a pair.")
    goodput: GoodputOptions | None = Field(
        None, description="SLO targets of the goodput counter; default: the SLO policy's ttft_slo/tpot_slo when "
                          "`autoscaling` is set, else 1 s TTFT and 0.1 s TPOT.")

    @model_validator(mode="after")
    def _slo_autoscaling(self):
        if self.autoscaling is not None:
            if self.mode != "disaggregated":
                raise ValueError("autoscaling.policy slo sizes a prefill and a decode pool: mode must be disaggregated")
            if self.prefill.autoscaling is not None or self.decode.autoscaling is not None:
                raise ValueError("with autoscaling.policy slo, set pool bounds under autoscaling.prefill / "
                                 "autoscaling.decode, not a pool's own autoscaling block")
        return self

    @model_validator(mode="after")
    def _pools_agree(self):
        p, d = self.engine_for("prefill"), self.engine_for("decode")
        # max_model_len too: it pins a length-dependent RoPE (engine.config.rope_pin), and the
        # router checks requests against the decode pool's
        for name in ("dtype", "block_size", "max_model_len"):
            if getattr(p, name) != getattr(d, name):
                raise ValueError(f"prefill and decode must use the same {name} "
                                 f"({getattr(p, name)!r} != {getattr(d, name)!r}): their KV blocks are exchanged")
        for pool in ("prefill", "decode", "colocated"):
            self.engine_for(pool).engine_config("<model>")   # EngineConfig validates the rest
        return self

    def engine_config(self, pool: str, model_dir: str) -> EngineConfig:
        """Pool `pool`'s EngineConfig for the model at `model_dir`."""
        return self.engine_for(pool).engine_config(model_dir, lora_modules=dict(self.lora_modules),
                                                   max_loras=self.max_loras, scheduling_policy=self.scheduling_policy)

    def engine_for(self, pool: str) -> EngineOptions:
        """Pool `pool`'s engine options: the shared ones, its overrides, `num_threads: auto` resolved
        to its `num_cpus` (at least 1)."""
        opts = EngineOptions.model_validate({**self.engine.model_dump(), **getattr(self, pool).engine})
        if opts.num_threads == "auto":
            opts = opts.model_copy(update={"num_threads": max(1, int(getattr(self, pool).num_cpus))})
        return opts

    @property
    def goodput_targets(self) -> tuple[float, float]:
        """(TTFT, TPOT) in seconds a request must meet to count as goodput."""
        if self.goodput is not None:
            return self.goodput.ttft_s, self.goodput.tpot_s
        if self.autoscaling is not None:
            return self.autoscaling.ttft_slo, self.autoscaling.tpot_slo
        g = GoodputOptions()
        return g.ttft_s, g.tpot_s

    @field_validator("chat_template")
    @classmethod
    def _chat_template(cls, value: str | None) -> str | None:
        return None if value is None else chat_template_text(value)

    @field_validator("model")
    @classmethod
    def _model(cls, spec: str) -> str:
        path = Path(spec).expanduser()
        return str(path.resolve()) if spec not in DEFAULT_ALIASES and path.exists() else spec

    @field_validator("lora_modules")
    @classmethod
    def _lora_modules(cls, modules: dict[str, str]) -> dict[str, str]:
        checked = {}
        for name, path in modules.items():
            if not re.fullmatch(NAME_PATTERN, name):
                raise ValueError(f"lora_modules: adapter name {name!r} must be non-empty, one line, without "
                                 "spaces around it")
            info = read_adapter(adapter_dir(path))
            if isinstance(info, str):
                raise ValueError(f"lora_modules.{name}: {info}")
            checked[name] = info.path
        return checked

    @model_validator(mode="after")
    def _lora_names_are_not_the_models(self):
        clash = sorted(set(self.lora_modules) & set(self.model_names))
        if clash:
            raise ValueError(f"lora_modules: {', '.join(map(repr, clash))} is also the model's name; a request names "
                             "one or the other")
        return self

    @field_validator("served_model_name")
    @classmethod
    def _names(cls, names):
        if isinstance(names, list) and (not names or any(not n.strip() for n in names) or len(set(names)) < len(names)):
            raise ValueError("a list of served model names must hold at least one, each non-empty and distinct")
        return names

    @property
    def model_names(self) -> tuple[str, ...]:
        """The names requests may use, the default first."""
        names = self.served_model_name
        return tuple(names) if isinstance(names, list) else (names or served_name(self.model),)

    @property
    def model_name(self) -> str:
        """The default name (answers to requests that name none; the KV transfer's fingerprint)."""
        return self.model_names[0]

    @classmethod
    def from_yaml(cls, path: str | Path) -> "AppConfig":
        data = yaml.safe_load(Path(path).read_text()) or {}
        # accept a Serve config file: applications[0].args
        if "applications" in data:
            data = data["applications"][0].get("args", {})
        return cls.model_validate(data)
