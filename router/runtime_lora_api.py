"""The router's endpoints for LoRA adapters loaded at run time (router/runtime_lora.py keeps what
is loaded): vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter, and the registry kept
in the ResponseStore so that a router that restarts serves the same adapters.

Life cycle of a load (an unload is steps 1, 3 and 4 with `RuntimeLoras.remove`)
  1. restore  before a router answers its first request naming models, the registry its
              predecessor kept (`restore`; tried once: with the store unavailable it is forgotten)
  2. check    the name (not served already, unless `load_inplace`) and the directory (on a worker
              thread), then the name again: another load may have taken it meanwhile
  3. add      under a new load id
  4. keep     the registry to the ResponseStore, one write at a time (the last kept is the last
              change); a store that does not answer is logged, the load stands
Who calls: the Router (router/app.py), on its event loop; `restore` before every endpoint that
reads the served names.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi.responses import JSONResponse, PlainTextResponse

from router.openai_responses import error_response
from router.response_store import StoredResponses, StoreUnavailable
from router.runtime_lora import LoadLoraAdapterRequest, RuntimeLoras, UnloadLoraAdapterRequest

log = logging.getLogger(__name__)


class RuntimeLoraApi:
    """`loras`: the router's adapters loaded at run time; `stored`: the ResponseStore's client, or
    None where the store is off; `enabled`: the app's `runtime_lora_updating`."""

    def __init__(self, loras: RuntimeLoras, stored: StoredResponses | None, enabled: bool):
        self.loras, self.stored, self.enabled = loras, stored, enabled
        self._restored = not enabled or stored is None
        self._restoring, self._keeping = asyncio.Lock(), asyncio.Lock()

    async def restore(self) -> None:
        """Step 1: the adapters loaded at run time before this router, under the same load ids (the
        replicas' copies stay good). Once; every later call returns at once."""
        if self._restored:
            return
        async with self._restoring:
            if self._restored:
                return
            try:
                if (registry := await self.stored.runtime_loras()) is not None:
                    self.loras.restore(registry)
                    log.info("LoRA adapters loaded at run time, restored: %s", ", ".join(registry.names) or "none")
            except StoreUnavailable as exc:
                log.warning("the LoRA adapters loaded at run time before this router are forgotten: %s", exc)
            finally:
                self._restored = True

    async def load(self, body: LoadLoraAdapterRequest) -> PlainTextResponse | JSONResponse:
        """POST /v1/load_lora_adapter: serve the PEFT adapter at `lora_path` as `lora_name`."""
        if not self.enabled:
            return _off()
        await self.restore()
        if problem := self.loras.name_problem(body.lora_name, body.load_inplace):
            return error_response(400, problem, param="lora_name")
        info = await asyncio.to_thread(self.loras.check_path, body.lora_path)
        if isinstance(info, str):
            return error_response(400, info, param="lora_path")
        if problem := self.loras.name_problem(body.lora_name, body.load_inplace):      # loaded meanwhile
            return error_response(400, problem, param="lora_name")
        self.loras.add(body.lora_name, info.path)
        await self._keep()
        log.info("LoRA adapter %r loaded from %s", body.lora_name, info.path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload(self, body: UnloadLoraAdapterRequest) -> PlainTextResponse | JSONResponse:
        """POST /v1/unload_lora_adapter: stop serving the adapter loaded as `lora_name`."""
        if not self.enabled:
            return _off()
        await self.restore()
        if refused := self.loras.remove(body.lora_name):
            return error_response(refused[0], refused[1], param="lora_name")
        await self._keep()
        log.info("LoRA adapter %r unloaded", body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    async def _keep(self) -> None:
        """Step 4: the registry to the ResponseStore, for a router that restarts."""
        if self.stored is None:
            return
        async with self._keeping:
            try:
                await self.stored.keep_runtime_loras(self.loras.registry())
            except StoreUnavailable as exc:
                log.warning("the LoRA adapters loaded at run time are not kept for a router restart: %s", exc)


def _off() -> JSONResponse:
    return error_response(404, "loading LoRA adapters at run time is off on this server (runtime_lora_updating)")
