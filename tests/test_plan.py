"""The planner reproduces the design note's Qwen2.5-7B figures and behaves like a roofline."""

import dataclasses

import pytest

from pdserve.plan.roofline import HARDWARE, MODELS, decode_intensity, plan, prefill_intensity, tpot_bound, ttft_bound

QWEN = MODELS["qwen2.5-7b"]


def test_design_note_figures():
    assert QWEN.kv_bytes_per_token == 57344
    assert prefill_intensity(QWEN, 1024) == pytest.approx(1020.1, abs=0.1)
    assert decode_intensity(QWEN, 1024) == pytest.approx(1.00, abs=0.005)


def test_prefill_compute_bound_and_decode_memory_bound_on_h200():
    h200 = HARDWARE["h200"]
    assert prefill_intensity(QWEN, 1024) > h200.ridge > decode_intensity(QWEN, 1024, batch=64)
    # batching raises decode intensity but TPOT grows far slower than the batch
    assert tpot_bound(QWEN, h200, 1024, 64) < 2 * tpot_bound(QWEN, h200, 1024, 1)
    assert ttft_bound(QWEN, h200, 4096) > ttft_bound(QWEN, h200, 1024)


def test_plan_scales_with_rate_and_respects_slos():
    h200 = HARDWARE["h200"]
    low = plan(QWEN, h200, 1024, 256, 2, ttft_slo=0.5, tpot_slo=0.05)
    high = plan(QWEN, h200, 1024, 256, 500, ttft_slo=0.5, tpot_slo=0.05)
    assert low.prefill_replicas >= 1 and low.decode_replicas >= 1 and low.tpot <= 0.05
    assert high.prefill_replicas > low.prefill_replicas and high.decode_replicas > low.decode_replicas
    assert plan(QWEN, HARDWARE["l40s"], 1024, 256, 10, ttft_slo=0.001, tpot_slo=0.05).decode_replicas == 0


def test_this_cpu_is_planned_in_the_dtype_pdserve_serves_in(capsys):
    """`--hardware cpu` without `--dtype`: the model's bytes and the measured matmul are those of the
    dtype the engine's `auto` picks here (bf16 with native bf16 or the AVX2 GEMVs), whatever the checkpoint's."""
    import argparse

    from engine.linear import cpu_has_native_bf16, cpu_serves_bf16
    from pdserve.plan import cli, roofline

    served = "bf16" if cpu_serves_bf16() else "fp32"
    assert roofline.served_dtype("cpu") == served and roofline.served_dtype("h200") == "bf16"
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    for flags, dtype in (([], served), (["--dtype", "fp32"], "fp32")):
        assert cli.run(parser.parse_args(["--model", "smollm2-135m", "--hardware", "cpu", *flags])) == 0
        out = capsys.readouterr().out
        # bf16 without native bf16 (AVX2): the engine's kernels multiply in fp32, so fp32's peak
        matmul = "fp32" if dtype == "bf16" and not cpu_has_native_bf16() else dtype
        how = f"{dtype} matmul" if matmul == dtype else f"{dtype} served, {matmul} matmul"
        assert f"this CPU (measured, {how})" in out
        assert f"{2 if dtype == 'bf16' else 4} B/param" in out


def test_a_cached_prefix_is_computed_once_and_held_once_per_decode_replica():
    h200 = HARDWARE["h200"]
    whole = plan(QWEN, h200, 4096, 256, 50, ttft_slo=0.5, tpot_slo=0.05)
    cached = plan(QWEN, h200, 4096, 256, 50, ttft_slo=0.5, tpot_slo=0.05, cached_len=3584)
    # prefill is compute-bound here: only the 512 new tokens are computed
    assert cached.ttft == pytest.approx(ttft_bound(QWEN, h200, 512), rel=1e-9)
    assert cached.ttft < whole.ttft / 7
    assert ttft_bound(QWEN, h200, 4096, cached=3584) == cached.ttft
    assert cached.prefill_replicas < whole.prefill_replicas
    # the decode KV holds the prefix once: more sequences fit (here the TPOT SLO then limits the batch)
    assert whole.reason.endswith("KV memory") and cached.decode_batch > 2 * whole.decode_batch
    assert cached.tpot <= 0.05
    with pytest.raises(ValueError, match="shorter than the prompt"):
        plan(QWEN, h200, 1024, 256, 1, 0.5, 0.05, cached_len=1024)


def test_a_short_tail_past_a_cached_prefix_is_planned_in_the_decode_steps():
    """routing.local_prefill_tokens: 48 tokens past a 4048-token prefix run in the decode replicas'
    steps (B x 48 / 256 prompt tokens a step), TTFT two such steps; the prefill pool keeps one."""
    h200, args = HARDWARE["h200"], (4096, 256, 400, 0.5, 0.05)
    handed = plan(QWEN, h200, *args, cached_len=4048)
    local = plan(QWEN, h200, *args, cached_len=4048, local_prefill_tokens=64)
    assert handed.prefill_replicas >= 2 and local.prefill_replicas == 1
    assert "prefilled in the decode replicas" in local.reason and "prefilled" not in handed.reason
    b, context = local.decode_batch, 4096 + 256 / 2
    assert local.tpot == pytest.approx(tpot_bound(QWEN, h200, context, b, b * 48 / 256))
    assert local.ttft == pytest.approx(local.tpot + tpot_bound(QWEN, h200, context, b, 48))
    assert local.decode_batch <= handed.decode_batch and local.tpot <= 0.05
    # more than the limit past the prefix, or no cached prefix: the prefill pool's, as before
    assert plan(QWEN, h200, *args, cached_len=4000, local_prefill_tokens=64) == plan(QWEN, h200, *args, cached_len=4000)
    short = (48, 256, 400, 0.5, 0.05)
    assert plan(QWEN, h200, *short, local_prefill_tokens=64) == plan(QWEN, h200, *short)


def test_the_cli_refuses_a_cached_prefix_as_long_as_the_prompt(capsys):
    from pdserve.cli import main
    assert main(["plan", "--input-len", "100", "--cached-len", "100"]) == 2
    assert "--cached-len 100" in capsys.readouterr().err


def test_a_sliding_window_prices_what_the_engine_reads_and_holds():
    """A decode step reads a windowed layer's last `window` keys; where every layer has a window a
    sequence holds about its window (the engine gives back the passed blocks), so more fit; where
    only some layers have one every block is kept. Prefill and the hand-off cover the whole prompt."""
    h100 = HARDWARE["h100"]
    every = dataclasses.replace(QWEN, window=4096, window_layers=QWEN.layers)
    half = dataclasses.replace(QWEN, window=4096, window_layers=QWEN.layers // 2)
    for spec in (every, half):
        assert tpot_bound(spec, h100, 4096, 8) == tpot_bound(QWEN, h100, 4096, 8)        # within the window
        assert ttft_bound(spec, h100, 32768) == ttft_bound(QWEN, h100, 32768)
    assert every.read_tokens(32768) == 4096 and half.read_tokens(32768) == (32768 + 4096) / 2
    kv = QWEN.kv_bytes_per_token
    assert tpot_bound(every, h100, 32768, 8) == pytest.approx((QWEN.weight_bytes + kv * 4096 * 8) / h100.mem_bw)
    assert decode_intensity(half, 32768, 8) > decode_intensity(QWEN, 32768, 8)
    assert (every.held_tokens(32768 + 512, 32768), every.held_tokens(1024 + 8192, 1024)) == (32768, 4096)
    assert half.held_tokens(1024 + 8192, 1024) == 1024 + 8192
    # 1k prompts, 8k outputs, a loose TPOT: the batch is bound by KV memory, which the window lifts
    plans = {name: plan(spec, h100, 1024, 8192, 1, ttft_slo=1.0, tpot_slo=1.0)
             for name, spec in (("full", QWEN), ("half", half), ("every", every))}
    assert all("KV memory" in p.reason for p in plans.values()), plans
    assert plans["every"].decode_batch > 2 * plans["full"].decode_batch
    assert plans["half"].decode_batch == plans["full"].decode_batch
    with pytest.raises(ValueError, match="window"):
        dataclasses.replace(QWEN, window=4096)
