"""pdserve's own log lines in a Serve replica, where Serve writes the replica's.

Serve configures one logger, "ray.serve", with the replica's log file (logs/serve/replica_<app>_<
deployment>_<id>.log, each line with the replica's name and, inside a request, its request id) and
the console; every other logger of the process falls to Python's default (WARNING and up on stderr,
INFO dropped), so the engines' and the router's INFO lines (the KV pool's size, the KV address, a
LoRA adapter loaded) went nowhere. `log_through_serve()`, called as a replica starts, hands the
records of pdserve's packages to Serve's logger instead.
"""

from __future__ import annotations

import logging

PACKAGES = ("engine", "kv_transfer", "serving", "router", "prefill_service", "decode_service", "pdserve")
SERVE_LOGGER = "ray.serve"        # Serve's documented logger for replicas' own lines


class _ToServe(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger(SERVE_LOGGER).handle(record)


def log_through_serve() -> bool:
    """Inside a Serve replica: pdserve's loggers at the level of Serve's logger (the deployment's
    `logging_config.log_level`, INFO by default), written by its handlers; elsewhere (an engine in
    a test or a script) nothing changes. Idempotent. Returns whether it applied."""
    from ray import serve
    try:
        serve.get_replica_context()
    except Exception:  # noqa: BLE001 - RayServeException outside a replica
        return False
    level = logging.getLogger(SERVE_LOGGER).getEffectiveLevel()
    for name in PACKAGES:
        logger = logging.getLogger(name)
        logger.setLevel(level)
        if not any(isinstance(h, _ToServe) for h in logger.handlers):
            logger.addHandler(_ToServe())
        logger.propagate = False
    return True
