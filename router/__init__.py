"""The HTTP ingress: OpenAI-compatible API, tokenization, and orchestration of the
prefill and decode pools (see `router.app` and `router.orchestrator`)."""
