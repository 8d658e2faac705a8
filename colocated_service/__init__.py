"""The colocated pool: one engine does both phases (the baseline and the fallback mode);
see `colocated_service.server`."""
