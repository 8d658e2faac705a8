"""`pdserve plan` and `pdserve simulate`: capacity planning tools (the replicas never import them;
pdserve/serve_config.py uses the planner to build the SLO policy's per-replica model).

  roofline      the prefill/decode roofline math, hardware and model presets, `plan()`
  model         model specs from a Hugging Face config (or a preset)
  calibrate     efficiencies measured by a `pdserve bench` report
  plot          intensity-vs-ridge and latency-bound plots
  cli           the `pdserve plan` subcommand
  sim_load      simulated load: Poisson (piecewise-constant rate) or a CSV trace
  sim_replicas  simulated prefill, decode and colocated replicas (engine step loops)
  simulator     the event loop: router, KV transfer, replica life cycle
  sim_scaling   per-pool and SLO autoscaling in the simulator
  sim_report    summaries (percentiles, goodput, replica-seconds) and the step model from a spec
  sim_study     colocated vs best split vs policies at each rate
  sim_validate  simulation against a measured bench report
  sim_plot      the comparison and timeline plots
  sim_cli       the `pdserve simulate` subcommand
"""
