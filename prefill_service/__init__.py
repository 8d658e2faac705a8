"""The prefill pool: runs prompts (chunked, under a token budget), samples the first token
and pushes the prompt's KV to the decode replica chosen by the router."""
