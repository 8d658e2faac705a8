"""`pdserve plan`: a capacity planner (a tool; the serving runtime never imports it).

  roofline   the prefill/decode roofline math, hardware and model presets, `plan()`
  model      model specs from a Hugging Face config (or a preset)
  calibrate  efficiencies measured by a `pdserve bench` report
  plot       intensity-vs-ridge and latency-bound plots
  cli        the `pdserve plan` subcommand
"""
