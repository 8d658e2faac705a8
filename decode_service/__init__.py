"""The decode pool: receives a prompt's KV from a prefill replica, then decodes with
continuous batching and streams tokens back (see `decode_service.server`)."""
