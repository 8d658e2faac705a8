"""`--model` beyond a directory: a GGUF file (converted once, cached) and a Hugging Face id found in
the local Hugging Face cache (never fetched). serving.models, serving.gguf_models."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pdserve import cli
from serving import gguf_models
from serving.config import AppConfig
from serving.models import ModelError, resolve_model
from tiny_models import tiny_gguf, tiny_model_dir

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A tiny llama (the built-in byte-level tokenizer, ChatML) and, beside it, itself as a GGUF file."""
    root = tmp_path_factory.mktemp("gguf")
    src = tiny_model_dir(root / "src", "llama", seed=5)
    tiny_gguf(src, root / "Tiny-Llama.F32.gguf")
    return src


def test_a_gguf_file_is_converted_once_into_the_model_it_was_written_from(source, tmp_path, monkeypatch, capsys):
    gguf = source.parent / "Tiny-Llama.F32.gguf"
    cache = tmp_path / "cache"
    path = resolve_model(str(gguf), cache, progress=False)
    key = hashlib.sha256(str(gguf.resolve()).encode()).hexdigest()[:10]
    assert path == (cache / "gguf" / f"Tiny-Llama.F32-{key}").resolve()
    # the weights exactly (Q and K un-permuted), the tokenizer and its template as they were
    ours, theirs = _weights(path), _weights(source)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    from transformers import AutoTokenizer
    mine, original = AutoTokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(source)
    text = "Déjà vu? <|im_start|>user\n1234 ok<|im_end|>"
    assert mine(text).input_ids == original(text).input_ids
    assert mine.chat_template == original.chat_template and mine.eos_token == "<|im_end|>"
    # the engine answers as from the source directory, and the API names it after the file
    answers = []
    for model in (gguf, source):
        assert cli.main(["generate", "Say hi", "--model", str(model), "--model-cache", str(cache),
                         "--max-tokens", "12"]) == 0
        answers.append(json.loads(capsys.readouterr().out.splitlines()[-1]))
    assert answers[0] == answers[1] and answers[0]["completion_tokens"] > 0
    assert AppConfig(model=str(gguf)).model_name == "Tiny-Llama.F32"

    # ready: later resolutions read the marker, not the file
    def convert(*_a, **_k):
        raise RuntimeError("converted again")
    monkeypatch.setattr(gguf_models, "convert_gguf", convert)
    assert resolve_model(str(gguf), cache, progress=False) == path
    # a changed file (its modification time) is converted again; a failed conversion leaves the
    # entry as it was and nothing beside it
    stat = gguf.stat()
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    with pytest.raises(RuntimeError, match="converted again"):
        resolve_model(str(gguf), cache, progress=False)
    assert _weights(path).keys() == _weights(source).keys()
    assert sorted(p.name for p in path.parent.iterdir()) == [f".{path.name}.lock", path.name]
    monkeypatch.undo()
    assert resolve_model(str(gguf), cache, progress=False) == path
    assert json.loads((path / ".pdserve-ready").read_text())["mtime_ns"] == stat.st_mtime_ns + 10**9


def test_a_quantized_gguf_streams_into_shards_holding_what_transformers_loads_from_it(source, tmp_path):
    """The conversion dequantizes one tensor at a time (in row chunks) into shards of a bounded size;
    the sharded directory loads (Hugging Face's index) into exactly the weights transformers' own
    GGUF loading gives the file, and the tokenizer and config come through."""
    import gguf
    from transformers import AutoModelForCausalLM

    path = tiny_gguf(source, tmp_path / "Tiny-Llama.Q8_0.gguf", quantize="Q8_0")
    kinds = {t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert kinds == {"Q8_0", "F32"}, kinds
    out = tmp_path / "converted"
    gguf_models.convert_gguf(path, out, name="tiny-q8", shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 3 and sorted(set(index["weight_map"].values())) == [p.name for p in shards]
    for shard in map(load_file, shards):        # within the bound, or one tensor larger than it (the embedding)
        assert sum(t.numel() * 4 for t in shard.values()) <= 40_000 or len(shard) == 1
    ours = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    theirs = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    source_weights = _weights(source)      # quantized: close to the source, not equal
    assert all(torch.allclose(ours[k], source_weights[k], atol=0.02) for k in source_weights)
    assert not all(torch.equal(ours[k], source_weights[k]) for k in source_weights)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert gguf_models.converted_problems(out) == []
    # a weight the file has no tensor for is refused, not left random (here: an untied LM head)
    from transformers import AutoConfig
    untied = AutoConfig.from_pretrained(out)
    untied.tie_word_embeddings = False
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(untied)
    with pytest.raises(ModelError, match=r"has no tensor for 1 of the model's weights \(lm_head.weight\)"):
        gguf_models._write_weights(path, gguf.GGUFReader(str(path)), skeleton, tmp_path / "untied",
                                   gguf_models.SHARD_BYTES)
    # dequantized in chunks of a few rows: the same values as at once
    for tensor in gguf.GGUFReader(str(path)).tensors:
        whole = gguf.dequantize(tensor.data, tensor.tensor_type)
        assert (gguf_models._dequantized(tensor, chunk_bytes=1000) == whole).all(), tensor.name


def test_a_relative_gguf_path_is_made_absolute_where_the_config_is_validated(source, monkeypatch):
    monkeypatch.chdir(source.parent)
    cfg = AppConfig(model="Tiny-Llama.F32.gguf")
    assert cfg.model == str(source.parent / "Tiny-Llama.F32.gguf") and cfg.model_name == "Tiny-Llama.F32"


def test_a_gguf_the_engine_cannot_run_is_refused_before_it_is_converted(source, tmp_path, monkeypatch):
    def convert(*_a, **_k):
        raise AssertionError("converted")
    monkeypatch.setattr(gguf_models, "convert_gguf", convert)
    gpt2 = tiny_gguf(source, tmp_path / "other.gguf", arch="gpt2")
    with pytest.raises(ModelError, match="model type 'gpt2' is not supported; pdserve runs llama"):
        resolve_model(str(gpt2), tmp_path / "cache", progress=False)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a GGUF at all")
    with pytest.raises(ModelError, match="junk.gguf is not a GGUF model transformers can read"):
        resolve_model(str(junk), tmp_path / "cache", progress=False)
    assert not any((tmp_path / "cache" / "gguf").glob("*/config.json"))


def test_a_hugging_face_id_is_served_from_the_local_cache_and_never_fetched(source, tmp_path):
    """`--model org/name` as vLLM reads it offline: the snapshot the Hugging Face cache holds
    (blobs linked from snapshots/<commit>/, refs/main naming the commit), found through
    HF_HUB_CACHE; an id it does not hold is one clear line and exit 2, with nothing fetched."""
    hub = tmp_path / "hub"
    snapshot = _in_hub_cache(hub, "acme/tiny-chat", source)
    env = {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "0"}
    run = subprocess.run([sys.executable, "-m", "serving.models", "--model", "acme/tiny-chat", "--quiet"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == str(snapshot), run.stderr
    run = subprocess.run([sys.executable, "-m", "serving.models", "--model", "acme/absent", "--quiet"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 2 and run.stdout == ""
    assert f"not (wholly) in the local Hugging Face cache ({hub}" in run.stderr
    assert "`hf download acme/absent`" in run.stderr and "Traceback" not in run.stderr
    assert sorted(p.name for p in hub.iterdir()) == ["models--acme--tiny-chat"]     # nothing written for it
    # served under the id as given, as vLLM does (a directory or a file: its name)
    assert AppConfig(model="acme/tiny-chat").model_names == ("acme/tiny-chat",)
    assert AppConfig(model=str(source)).model_name == "src"


def _in_hub_cache(hub: Path, repo: str, model_dir: Path) -> Path:
    """`model_dir` laid out as huggingface_hub caches `repo` at COMMIT; returns the snapshot directory."""
    entry = hub / f"models--{repo.replace('/', '--')}"
    snapshot = entry / "snapshots" / COMMIT
    (entry / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(COMMIT)
    for file in model_dir.iterdir():
        data = file.read_bytes()
        blob = entry / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(model_dir / "model.safetensors")


def test_the_planner_reads_a_gguf_file_and_a_cached_id_as_serve_does(source, tmp_path, monkeypatch):
    """`pdserve plan --model` takes what `pdserve serve --model` takes: a GGUF file's config from its
    metadata (nothing converted), a cached id's from its snapshot."""
    import dataclasses

    from huggingface_hub import constants

    from pdserve.plan.model import resolve_spec
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    _in_hub_cache(tmp_path / "hub", "acme/tiny-chat", source)
    from_dir = resolve_spec(str(source), dtype="bf16")
    assert from_dir.params > 0 and from_dir.layers == 2
    for spec, name in ((resolve_spec(str(source.parent / "Tiny-Llama.F32.gguf"), dtype="bf16"), "Tiny-Llama.F32"),
                       (resolve_spec("acme/tiny-chat", dtype="bf16"), "acme/tiny-chat")):
        assert spec == dataclasses.replace(from_dir, name=name)
    with pytest.raises(ValueError, match="nor a Hugging Face id in the local Hugging Face cache"):
        resolve_spec("acme/absent")
