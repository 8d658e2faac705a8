"""pdserve: disaggregated prefill/decode LLM serving. Submodules are imported on demand (no torch here)."""
