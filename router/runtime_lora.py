"""LoRA adapters loaded and unloaded while the app runs: vLLM's POST /v1/load_lora_adapter and
/v1/unload_lora_adapter (served with `runtime_lora_updating`).

Life cycle of an adapter loaded at run time
  1. load     the router checks the directory (engine/lora_config.py `check_adapter`: its
              configuration, and its tensors' names and shapes against the model from the
              safetensors header, torch-free) and remembers it under its name with a new load id
  2. serve    a request naming it carries its path and load id to every pool
              (SamplingParams.lora_path, lora_id); each replica loads it at the first such
              request and keeps it while its `max_loras` allow; a request finding them all in
              use waits in the replica's queue (engine/lora.py `LoraSet.use`)
  3. unload   the router forgets the name: new requests naming it are 404s; those running keep
              it to their end, and the replicas drop it when it is their least recently used
              and another needs the room. Loaded again, even from the same directory, it is a new
              adapter (a new load id): no replica's copy or cached K/V of the old one is used.
Who calls: the Router's endpoints (router/runtime_lora_api.py) and checks (router/request_checks.py),
on its event loop; the directory check on a worker thread.
The router is one replica (pdserve/app_builder.py), so this memory is the app's. It is also kept
in the ResponseStore deployment (`registry`, after every change), so a router that fails and is
replaced restores it (`restore`: the same load ids, the replicas' copies stay good); where the store
is off (`responses.store: false`) or replaced with it (a redeploy with new `args`), a new router
forgets the adapters (as a restarted vLLM server does) and the replicas' copies go idle.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Annotated

from pydantic import Field

from engine.lora_config import NAME_PATTERN, AdapterInfo, adapter_dir, check_adapter
from engine.model_dims import Dims
from router.protocol_types import Strict
from serving.messages import RuntimeLoraRegistry

Name = Annotated[str, Field(min_length=1, max_length=256, pattern=NAME_PATTERN,
                            description="The adapter's name: a request runs it by naming it as its `model`.")]


class LoadLoraAdapterRequest(Strict):
    """vLLM's: load the PEFT LoRA adapter at `lora_path` as `lora_name`."""
    lora_name: Name
    lora_path: Annotated[str, Field(min_length=1, max_length=4096, description=(
        "The adapter's directory (adapter_config.json and adapter_model.safetensors or .bin), at that path on "
        "every node running a replica; `~` is expanded and a relative path made absolute on the router's node."))]
    load_inplace: bool = Field(False, description="Replace an adapter already loaded under this name (vLLM's).")


class UnloadLoraAdapterRequest(Strict):
    """vLLM's: forget the adapter loaded as `lora_name`."""
    lora_name: Name


@dataclass(frozen=True)
class Loaded:
    path: str
    lora_id: int


class RuntimeLoras:
    """The adapters loaded at run time, by name. `dims`: the model's (the adapters' tensors must
    fit it); `taken`: names a load may not use (the model's, the configuration's adapters)."""

    def __init__(self, dims: Dims, taken: tuple[str, ...]):
        self.dims, self.taken = dims, frozenset(taken)
        self.loaded: dict[str, Loaded] = {}

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.loaded)

    def name_problem(self, name: str, inplace: bool) -> str | None:
        """Why `name` cannot be loaded now (a 400), or None."""
        if name in self.taken:
            return f"{name!r} is served already: the model's name or an adapter of the configuration (lora_modules)"
        if name in self.loaded and not inplace:
            return f"the LoRA adapter {name!r} has already been loaded (load_inplace: true replaces it)"
        return None

    def check_path(self, path: str) -> AdapterInfo | str:
        """Any thread: the adapter at `path` (`~` expanded, made absolute) when the model can serve
        it, or why not (a 400)."""
        return check_adapter(adapter_dir(path), self.dims)

    def add(self, name: str, path: str) -> None:
        """Serve the checked adapter at `path` as `name` (replacing one of that name) under a new
        load id."""
        # random rather than counted: the replicas outlive a restarted router, whose count would
        # start again and give a new adapter an old one's id (and K/V)
        self.loaded[name] = Loaded(path, secrets.randbits(62) + 1)

    def registry(self) -> RuntimeLoraRegistry:
        """What a restarted router restores (`restore`): every adapter loaded, with its load id."""
        return RuntimeLoraRegistry(tuple(self.loaded), tuple(x.path for x in self.loaded.values()),
                                   tuple(x.lora_id for x in self.loaded.values()))

    def restore(self, registry: RuntimeLoraRegistry) -> None:
        """A new router's memory from its predecessor's: the same adapters under the same load ids
        (the replicas' copies and cached K/V stay theirs), but for names it serves otherwise now."""
        for name, path, lora_id in zip(registry.names, registry.paths, registry.lora_ids):
            if name not in self.taken:
                self.loaded.setdefault(name, Loaded(path, lora_id))

    def remove(self, name: str) -> tuple[int, str] | None:
        """Forget `name`; why not, with the HTTP status: 400 for the model's name or an adapter of
        the configuration, 404 for a name not loaded."""
        if name in self.taken:
            return 400, f"{name!r} was not loaded at run time (the configuration's adapters stay while it serves them)"
        if self.loaded.pop(name, None) is None:
            loaded = ", ".join(map(repr, self.loaded)) or "none"
            return 404, f"the LoRA adapter {name!r} cannot be found (loaded at run time: {loaded})"
        return None
