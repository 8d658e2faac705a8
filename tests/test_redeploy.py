"""Redeploying a config (`pdserve deploy`, pdserve/serve_config.py `application_config`): what Serve
changes in place and what makes it replace every replica, decided by Serve's own code version of the
application config (serving/ray_compat.py `app_code_version`); no Ray cluster needed."""

import json

import pytest
from ray.serve.config import AutoscalingConfig
from ray.serve.schema import ServeApplicationSchema

from pdserve.serve_config import application_config, deploy_app, deployed_app_configs, update_summary, without_scaling
from serving.config import AppConfig
from serving.scaling_config import PoolBounds, ScalingTargets
from serving.engine_host import EngineReplica
from serving.ray_compat import app_code_version

SCALING = {"min_replicas": 1, "max_replicas": 2, "upscale_delay_s": 1}


def app(**fields) -> dict:
    return application_config(AppConfig.model_validate(fields), "x", "/")


def test_scaling_goes_to_the_deployment_overrides_and_nothing_else_does():
    a = app(prefill={"num_replicas": 3, "num_cpus": 2}, decode={"autoscaling": {**SCALING, "target_running": 8}})
    ServeApplicationSchema(**a)                                         # Serve accepts it
    assert a["args"]["prefill"]["num_replicas"] == 1 and a["args"]["decode"]["autoscaling"] is None
    assert a["args"]["prefill"]["num_cpus"] == 2                        # resources stay in args
    prefill, decode = a["deployments"]
    assert prefill == {"name": "PrefillServer", "num_replicas": 3, "user_config": ScalingTargets().model_dump()}
    assert decode["name"] == "DecodeServer" and "num_replicas" not in decode
    assert decode["user_config"] == ScalingTargets(target_running=8).model_dump()
    assert decode["autoscaling_config"]["policy"]["policy_kwargs"] == {"hysteresis": 0.2, "warmup_s": 10.0}
    AutoscalingConfig(**decode["autoscaling_config"])
    colocated = app(mode="colocated", colocated={"num_replicas": 2})
    assert [(d["name"], d["num_replicas"]) for d in colocated["deployments"]] == [("ColocatedServer", 2)]
    # stripped args validate back to the same config but for scaling
    cfg = AppConfig.model_validate({"decode": {"autoscaling": SCALING}, "stream_interval_ms": 10})
    assert AppConfig.model_validate(application_config(cfg)["args"]) == without_scaling(cfg)


@pytest.mark.parametrize("change", [
    {"prefill": {"num_replicas": 2}},                                                   # a fixed count
    {"decode": {"autoscaling": {**SCALING, "max_replicas": 5, "min_replicas": 2}}},     # bounds
    {"decode": {"autoscaling": {**SCALING, "upscale_delay_s": 9, "downscale_delay_s": 60}}},   # delays
    {"decode": {"autoscaling": {**SCALING, "target_running": 4, "target_kv_utilization": 0.5}}},   # targets
])
def test_a_scaling_change_is_applied_in_place(change):
    base = {"decode": {"autoscaling": SCALING}}
    old, new = app(**base), app(**{**base, **change})
    assert old != new and app_code_version(old) == app_code_version(new)
    assert update_summary(old, new).startswith("in place, no replica restarted (")
    assert update_summary(old, old) == "no change"


@pytest.mark.parametrize("change, named", [
    ({"stream_interval_ms": 10}, "args.stream_interval_ms"),
    ({"decode": {"autoscaling": SCALING, "engine": {"max_num_seqs": 8}}}, "args.decode"),
    ({"decode": {"autoscaling": {**SCALING, "hysteresis": 0.5}}}, "DecodeServer autoscaling policy"),
    ({"decode": {"num_replicas": 2}}, "DecodeServer autoscaling policy"),     # autoscaled -> fixed
])
def test_any_other_change_replaces_every_replica_and_says_what_changed(change, named):
    old, new = app(decode={"autoscaling": SCALING}), app(**change)
    assert app_code_version(old) != app_code_version(new)
    summary = update_summary(old, new)
    assert summary.startswith("Serve replaces every replica (changed: ") and named in summary, summary
    assert update_summary(None, new) == "a new application"


def test_slo_policy_bounds_in_place_its_targets_not_and_a_running_policy_is_kept(monkeypatch):
    monkeypatch.setattr("pdserve.serve_config.resolve_model", lambda *a, **k: "qwen2.5-7b")
    slo = {"ttft_slo": 1, "tpot_slo": 0.1, "hardware": "h100", "prefill_eff": 0.5, "decode_eff": 0.5}
    old = app(autoscaling={**slo, "decode": {"max_replicas": 4}})
    bounds = app(autoscaling={**slo, "decode": {"max_replicas": 8}})
    assert old["args"]["autoscaling"]["decode"] == PoolBounds().model_dump()      # the bounds are not in args
    assert app_code_version(old) == app_code_version(bounds)
    assert bounds["deployments"][1]["autoscaling_config"]["max_replicas"] == 8
    assert app_code_version(old) != app_code_version(app(autoscaling={**slo, "ttft_slo": 2}))
    # `hardware: cpu` measures the CPU at each deploy: the running application's policy is kept
    # while the args are the same, so a bounds change stays in place
    measured = {**old, "autoscaling_policy": {**old["autoscaling_policy"], "measured": "earlier"}}
    cfg = AppConfig.model_validate({"route_prefix": "/", "autoscaling": {**slo, "decode": {"max_replicas": 8}}})
    kept = application_config(cfg, "x", "/", running=measured)
    assert kept["autoscaling_policy"] == measured["autoscaling_policy"]
    assert app_code_version(kept) == app_code_version(measured)
    other = AppConfig.model_validate({"route_prefix": "/", "stream_interval_ms": 1, "autoscaling": slo})
    assert application_config(other, "x", "/", running=measured)["autoscaling_policy"] == old["autoscaling_policy"]


class _Host:
    pool, replica_id, targets = "decode", "r0", ScalingTargets()


def test_a_replica_takes_its_targets_from_the_user_config():
    replica = EngineReplica()
    replica.host = _Host()
    replica.reconfigure({"target_running": 4})
    assert replica.host.targets == ScalingTargets(target_running=4)
    with pytest.raises(ValueError, match="target_running"):
        replica.reconfigure({"target_running": 0})
    with pytest.raises(ValueError):
        replica.reconfigure({"target_bogus": 1})
    replica._shut_down = True                    # nothing to close at collection


class _Client:
    """Serve's client as `deploy_app` uses it: the applications' details, and what was deployed."""

    def __init__(self, details: dict):
        self.details, self.deployed = details, None

    def get_serve_details(self) -> dict:
        return {"applications": self.details}

    def deploy_apps(self, config) -> None:
        self.deployed = config


def test_a_deploy_keeps_the_other_applications_deployed_from_a_config(monkeypatch):
    """A Serve config deploy removes the config-deployed applications it does not list: `deploy_app`
    lists them again, as deployed; imperatively deployed ones (`serve.run`) are not Serve's to remove."""
    other = {"name": "other", "route_prefix": "/other", "import_path": "mod:app", "args": {"k": 1}}
    old = app(stream_interval_ms=10)
    client = _Client({"other": {"source": "declarative", "deployed_app_config": other},
                      "x": {"source": "declarative", "deployed_app_config": old},
                      "run": {"source": "imperative", "deployed_app_config": None}})
    monkeypatch.setattr("ray.serve.context._get_global_client", lambda: client)
    new = app()
    deploy_app(new, deployed_app_configs())
    deployed = {a.name: a for a in client.deployed.applications}
    assert set(deployed) == {"other", "x"}
    assert deployed["other"].args == {"k": 1} and deployed["x"].args == new["args"]


def test_deploy_keeps_the_running_services_flag_settings_the_file_leaves_out(tmp_path, tiny_llama_dir):
    """`pdserve serve --model M --api-key K --model-cache C` then `pdserve deploy --config FILE`
    without them: the service keeps its model, API key and cache (a deploy would otherwise replace
    every replica with the default model and no key); what the file or a flag sets wins, an explicit
    `api_key: ""` included."""
    import types

    import yaml

    from pdserve import cli

    def config(path, args: dict, **flags):
        path.write_text(yaml.safe_dump({"applications": [{"name": "pdserve", "args": args}]}))
        return types.SimpleNamespace(**{"config": str(path), "model": None, "mode": None, "model_cache": None,
                                        "api_key": None, "prefill_replicas": None, "decode_replicas": None,
                                        "dry_run": False, **flags})
    running = {"model": str(tiny_llama_dir), "mode": "colocated", "model_cache": str(tmp_path / "cache"),
               "api_key": "K"}
    cfg = cli._app_config(config(tmp_path / "a.yaml", {"stream_interval_ms": 10}), running)
    assert (cfg.model, cfg.mode, cfg.model_cache, cfg.api_key, cfg.stream_interval_ms) == (
        str(tiny_llama_dir), "colocated", str(tmp_path / "cache"), "K", 10.0)
    cfg = cli._app_config(config(tmp_path / "b.yaml", {"api_key": "", "mode": "disaggregated"},
                                 model=str(tiny_llama_dir), api_key=None), running)
    assert (cfg.api_key, cfg.mode, cfg.model_cache) == ("", "disaggregated", str(tmp_path / "cache"))
    flagged = config(tmp_path / "c.yaml", {}, model=str(tiny_llama_dir), api_key="L")
    assert cli._app_config(flagged, running).api_key == "L"


def test_served_model_name_flag_takes_one_name_or_aliases_and_a_deploy_keeps_it(tmp_path, tiny_llama_dir):
    """`--served-model-name NAME [NAME ...]` (vLLM's flag): one name is the name, more are aliases; a
    later `pdserve deploy` that names none keeps the running service's (its clients' model names)."""
    from pdserve import cli
    path = tmp_path / "s.yaml"
    path.write_text(f"model: {tiny_llama_dir}\n")
    assert cli._app_config(cli.build_parser().parse_args(["serve", "--config", str(path),
                                                          "--served-model-name", "m1"])).served_model_name == "m1"
    both = cli._app_config(cli.build_parser().parse_args(["serve", "--config", str(path),
                                                          "--served-model-name", "m1", "gpt-4o"]))
    assert both.model_names == ("m1", "gpt-4o")
    kept = cli._app_config(cli.build_parser().parse_args(["deploy", "--config", str(path), "--dry-run"]),
                           {"served_model_name": ["m1", "gpt-4o"]})
    assert kept.served_model_name == ["m1", "gpt-4o"]


def test_allowed_origin_flags_set_the_cors_origins(tmp_path, tiny_llama_dir):
    """`pdserve serve --allowed-origin A --allowed-origin B` is `cors.allowed_origins: [A, B]`, over the
    file's; a malformed origin is refused before anything starts."""
    import types

    import yaml

    from pdserve import cli
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"applications": [{"name": "pdserve", "args": {
        "model": str(tiny_llama_dir), "cors": {"allowed_origins": ["https://old.example"], "max_age_s": 5}}}]}))
    args = lambda *origins: types.SimpleNamespace(config=str(path), allowed_origin=list(origins) or None)
    assert cli._app_config(args()).cors.allowed_origins == ["https://old.example"]
    cfg = cli._app_config(args("http://localhost:3000", "https://app.example"))
    assert (cfg.cors.allowed_origins, cfg.cors.max_age_s) == (["http://localhost:3000", "https://app.example"], 5)
    with pytest.raises(SystemExit):             # (the message: the next test)
        cli._app_config(args("https://app.example/path"))


def test_an_invalid_configuration_is_a_few_lines_and_exit_2_before_anything_starts(tmp_path, capsys):
    from pdserve import cli
    bad = tmp_path / "bad.yaml"
    bad.write_text("mode: nonsense\n")
    for argv, problem in ((["serve", "--config", str(bad)], "mode: Input should be 'disaggregated' or 'colocated'"),
                          (["deploy", "--config", str(bad), "--dry-run"], "mode: Input should be"),
                          (["serve", "--allowed-origin", "https://x.example/"], "is not an origin"),
                          (["serve", "--config", str(tmp_path / "missing.yaml")], "No such file")):
        with pytest.raises(SystemExit) as exited:
            cli.main(argv)
        err = capsys.readouterr().err
        assert exited.value.code == 2 and "pdserve: invalid configuration in" in err and problem in err, err
        assert "Traceback" not in err and len(err.splitlines()) == 2


def test_chat_template_comes_from_a_file_or_the_text_and_travels_in_the_config(tmp_path, tiny_llama_dir, capsys):
    """`--chat-template FILE` (vLLM's flag) or `chat_template:` in the file: the template's text is
    read where the config is validated and goes to the replicas in the app's args; a deploy that
    names none keeps the running one; a template that does not parse, or a file that is not there,
    is two lines on stderr and exit 2."""
    from pdserve import cli
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    path = tmp_path / "s.yaml"
    path.write_text(f"model: {tiny_llama_dir}\n")
    cfg = cli._app_config(cli.build_parser().parse_args(
        ["serve", "--config", str(path), "--chat-template", str(tmp_path / "t.jinja")]))
    assert cfg.chat_template == template and application_config(cfg)["args"]["chat_template"] == template
    assert AppConfig(chat_template=template).chat_template == template        # the text itself
    kept = cli._app_config(cli.build_parser().parse_args(["deploy", "--config", str(path), "--dry-run"]),
                           {"chat_template": template})
    assert kept.chat_template == template
    # `pdserve generate --chat-template FILE` renders its prompt with it
    capsys.readouterr()
    assert cli.main(["generate", "hi", "--model", str(tiny_llama_dir), "--chat-template", str(tmp_path / "t.jinja"),
                     "--max-tokens", "2"]) == 0
    from transformers import AutoTokenizer
    rendered = AutoTokenizer.from_pretrained(tiny_llama_dir)("<user>hi", add_special_tokens=False)["input_ids"]
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["prompt_tokens"] == len(rendered)
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}{{ m.content }}")
    for given, problem in ((str(tmp_path / "bad.jinja"), "the template does not parse: line 1: Unexpected end"),
                           (str(tmp_path / "missing.jinja"), "nor a file that reads")):
        with pytest.raises(SystemExit) as exited:
            cli.main(["serve", "--config", str(path), "--chat-template", given])
        err = capsys.readouterr().err
        assert exited.value.code == 2 and "chat_template: Value error, " not in err and problem in err, err
        assert len(err.splitlines()) == 2
