"""pdserve: disaggregated prefill/decode LLM serving. This top package assembles the Serve
application (`app_builder.build_app`) and holds the command line and the tools (`plan/`, `bench`);
the serving runtime (`serving/`, the pools, `router/`) never imports it. Submodules are imported
on demand (no torch here)."""
