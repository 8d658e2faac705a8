"""LoRA adapters over HTTP through both pools (the tiny model, disaggregated): a request naming an
adapter as its `model` runs it in the prefill replica (whose K/V is the adapter's) and in the decode
replica, and gets what a local engine with the adapter gives; the base model's answer is its own;
/v1/models lists the adapter with its parent; each of `n` choices runs it; an unknown name is a 404
naming what is served; every block is free after; /metrics counts the adapter's
requests. An adapter loaded at run time (/v1/load_lora_adapter) runs the same way in both pools,
and replaced under its name it runs its new weights (none of the old one's cached K/V; with
`max_loras` 1 the old one is evicted for it in both pools); a router that restarts serves it
still (the ResponseStore kept the registry; same load id: no replica reads it again); unloaded,
its name is a 404. The configuration refuses adapters it cannot serve before anything starts."""

import json

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from lora_adapters import write_adapter
from serving.config import AppConfig
from service_util import TINY_ENGINE, http, kill_replica, metrics, pools_all_free, sse_events, tiny_app, wait_until

pytestmark = pytest.mark.slow
PROMPT = [1, 504, 3127, 314, 4110, 30, 2, 198, 25, 1029, 17, 88, 1944, 6000]


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, tiny_llama_dir):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    return write_adapter(tmp_path_factory.mktemp("sql"), hf, seed=4, scale=0.5)


@pytest.fixture(scope="module")
def other_adapter(tmp_path_factory, tiny_llama_dir):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    return write_adapter(tmp_path_factory.mktemp("chat"), hf, seed=9, scale=0.5)


def test_a_request_naming_an_adapter_runs_it_in_both_pools(ray_serve, tiny_llama_dir, adapter, other_adapter):
    local = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu", kv_cache_memory="16MiB",
                                   lora_modules={"sql": str(adapter), "chat": str(other_adapter)}))
    greedy = dict(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = {name: local.generate([PROMPT], SamplingParams(**greedy, lora=name))[0].text
                for name in (None, "sql", "chat")}
    assert len(set(expected.values())) == 3
    with tiny_app(ray_serve, tiny_llama_dir, "lora", lora_modules={"sql": str(adapter)},
                  runtime_lora_updating=True, max_loras=1) as base:
        status, body = http(base, "/v1/models")
        cards = {c["id"]: c for c in json.loads(body)["data"]}
        assert status == 200 and cards["sql"]["parent"] == "tiny" and "parent" not in cards["tiny"]
        for name, model in ((None, "tiny"), ("sql", "sql"), ("sql", "sql")):     # the second: a prefix hit
            status, body = http(base, "/v1/completions", {"model": model, "prompt": PROMPT, **greedy})
            out = json.loads(body)
            assert status == 200 and out["model"] == model and out["choices"][0]["text"] == expected[name], body
        status, body = http(base, "/v1/completions", {"model": "sql", "prompt": PROMPT, **greedy, "n": 2})
        assert status == 200 and [c["text"] for c in json.loads(body)["choices"]] == [expected["sql"]] * 2, body
        status, body = http(base, "/v1/completions", {"model": "sql", "prompt": PROMPT, **greedy, "stream": True})
        events = sse_events(body)
        assert status == 200 and "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == \
            expected["sql"]
        status, body = http(base, "/v1/chat/completions", {"model": "sql", "max_tokens": 4,
                                                            "messages": [{"role": "user", "content": "hi"}]})
        assert status == 200, body
        chat_tokens = json.loads(body)["usage"]["completion_tokens"]
        status, body = http(base, "/v1/completions", {"model": "nope", "prompt": "x"})
        assert status == 404 and "'tiny', 'sql'" in body and "model_not_found" in body
        assert pools_all_free(base, {"prefill", "decode"})
        status, text = http(base, "/metrics")
        assert 'pdserve_lora_requests_total{adapter="sql"} 5' in text        # 2 + n=2 + streamed + chat
        assert f'pdserve_lora_output_tokens_total{{adapter="sql"}} {5 * 12 + chat_tokens}' in text, text
        _load_at_run_time(base, adapter, other_adapter, greedy, expected)


def _load_at_run_time(base, adapter, other_adapter, greedy, expected):
    def complete(model):
        status, body = http(base, "/v1/completions", {"model": model, "prompt": PROMPT, **greedy})
        return status, json.loads(body)["choices"][0]["text"] if status == 200 else body

    status, body = http(base, "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": str(other_adapter)})
    assert (status, body) == (200, "Success: LoRA adapter 'chat' added successfully.")
    status, body = http(base, "/v1/models")
    assert status == 200 and {"id": "chat", "parent": "tiny"}.items() <= \
        next(c for c in json.loads(body)["data"] if c["id"] == "chat").items()
    assert complete("chat") == (200, expected["chat"])
    for request, param, reason in (({"lora_name": "chat", "lora_path": str(adapter)}, "lora_name",
                                    "already been loaded"),
                                   ({"lora_name": "sql", "lora_path": str(adapter)}, "lora_name", "served already"),
                                   ({"lora_name": "x", "lora_path": "/nowhere"}, "lora_path", "no adapter_config.json"),
                                   ({"lora_name": "x"}, "lora_path", "Field required")):
        status, body = http(base, "/v1/load_lora_adapter", request)
        error = json.loads(body)["error"]
        assert status == 400 and error["param"] == param and reason in error["message"], body
    # replaced under its name: the new weights, not the old adapter's prefix blocks (a new load id)
    status, _ = http(base, "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": str(adapter),
                                                     "load_inplace": True})
    assert status == 200 and complete("chat") == (200, expected["sql"])
    kill_replica("Router", app_name="lora")       # its successor serves what it loaded (the store kept it)
    assert wait_until(lambda: http(base, "/health")[0] == 200, timeout=60)
    assert complete("chat") == (200, expected["sql"]) and "chat" in http(base, "/v1/models")[1]
    status, body = http(base, "/v1/unload_lora_adapter", {"lora_name": "chat"})
    assert (status, body) == (200, "Success: LoRA adapter 'chat' removed successfully.")
    status, body = complete("chat")
    assert status == 404 and "model_not_found" in body
    assert http(base, "/v1/unload_lora_adapter", {"lora_name": "chat"})[0] == 404
    assert http(base, "/v1/unload_lora_adapter", {"lora_name": "sql"})[0] == 400
    assert complete("sql") == (200, expected["sql"]) and pools_all_free(base, {"prefill", "decode"})
    expected = {(pool, name): value for pool in ("prefill", "decode")       # chat, then chat replaced (max_loras 1)
                for name, value in (("pdserve_lora_loads", 2), ("pdserve_lora_evictions", 1))}
    loads = []       # the replicas push their counters every 0.5-2 s: wait for the last requests' push
    assert wait_until(lambda: loads.append({(pool, name): value for (name, pool, _), value in metrics(base).items()
                                            if name in ("pdserve_lora_loads", "pdserve_lora_evictions")})
                      or loads[-1] == expected, timeout=15), loads[-1]


def test_the_config_refuses_adapters_it_cannot_serve(tmp_path, tiny_llama_dir, adapter):
    fields = dict(model=str(tiny_llama_dir), served_model_name="tiny", engine=TINY_ENGINE)
    with pytest.raises(ValidationError, match="lora_modules.x: .*no adapter_config.json"):
        AppConfig(**fields, lora_modules={"x": str(tmp_path)})
    with pytest.raises(ValidationError, match="'tiny' is also the model's name"):
        AppConfig(**fields, lora_modules={"tiny": str(adapter)})
    config = AppConfig(**fields, lora_modules={"sql": str(adapter)})
    assert config.lora_modules == {"sql": str(adapter.absolute())}


def test_the_cli_flag_sets_lora_modules_and_a_deploy_keeps_them(tmp_path, tiny_llama_dir, adapter, capsys):
    """`--lora-modules NAME=PATH ...` (vLLM's flag); `--runtime-lora-updating`, `--max-loras N`; a
    deploy that names none keeps the running ones; a directory that is no adapter is two lines on
    stderr and exit 2."""
    from pdserve import cli
    path = tmp_path / "s.yaml"
    path.write_text(f"model: {tiny_llama_dir}\n")
    cfg = cli._app_config(cli.build_parser().parse_args(
        ["serve", "--config", str(path), "--lora-modules", f"sql={adapter}", f"sql2={adapter}"]))
    assert cfg.lora_modules == {"sql": str(adapter), "sql2": str(adapter)}
    assert (cfg.runtime_lora_updating, cfg.max_loras) == (False, 8)
    runtime = cli._app_config(cli.build_parser().parse_args(
        ["serve", "--config", str(path), "--runtime-lora-updating", "--max-loras", "2"]))
    assert (runtime.runtime_lora_updating, runtime.max_loras) == (True, 2)
    assert runtime.engine_config("decode", str(tiny_llama_dir)).max_loras == 2
    kept = cli._app_config(cli.build_parser().parse_args(["deploy", "--config", str(path), "--dry-run"]),
                           {"lora_modules": cfg.lora_modules})
    assert kept.lora_modules == cfg.lora_modules
    with pytest.raises(SystemExit) as exited:
        cli.main(["serve", "--config", str(path), "--lora-modules", f"x={tmp_path}"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "no adapter_config.json" in err, err
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--lora-modules", "no-equals-sign"])
    assert "is not NAME=PATH" in capsys.readouterr().err


def test_generate_runs_the_prompt_with_an_adapter(tmp_path, tiny_llama_dir, adapter, capsys):
    """`pdserve generate --lora DIR`: the local engine with the adapter (other text than without);
    a directory that is no adapter is one line and exit 1."""
    from pdserve import cli
    outs = []
    for extra in ([], ["--lora", str(adapter)]):
        assert cli.main(["generate", "hi", "--model", str(tiny_llama_dir), "--max-tokens", "8", *extra]) == 0
        outs.append(json.loads(capsys.readouterr().out.splitlines()[-1])["text"])
    assert outs[0] != outs[1]
    with pytest.raises(SystemExit, match="pdserve generate: LoRA adapter 'lora': .*no adapter_config.json"):
        cli.main(["generate", "hi", "--model", str(tiny_llama_dir), "--lora", str(tmp_path)])
