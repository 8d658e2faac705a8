"""`pdserve plan --plot PNG`: the roofline picture for one model on one machine.

Left panel: arithmetic intensity (FLOP/byte, log) against sequence length S (log) for prefill and for
decode at a few batch sizes, with the hardware's ridge point as a horizontal line: a phase above the
line is compute-bound, below it memory-bound. Right panel: the TTFT and TPOT lower bounds against S
(dashed: divided by calibrated efficiencies, when given). matplotlib is imported lazily (Agg backend),
so the planner itself stays import-light.
"""

from __future__ import annotations

from pdserve.plan.roofline import Hardware, ModelSpec, decode_intensity, prefill_intensity, tpot_bound, ttft_bound


def lengths(lo: int = 16, hi: int = 32768, per_octave: int = 4) -> list[float]:
    """Geometric grid of sequence lengths from lo to hi inclusive."""
    out, s = [], float(lo)
    while s <= hi * 1.0001:
        out.append(s)
        s *= 2 ** (1 / per_octave)
    return out


def plot(path: str, m: ModelSpec, hw: Hardware, batches=(1, 8, 64, 256),
         prefill_eff: float | None = None, decode_eff: float | None = None) -> None:
    """Write the two-panel PNG to `path` (overwrites). Side effects: the file only."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = lengths()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax.plot(xs, [prefill_intensity(m, s) for s in xs], lw=2, color="C0", label="prefill")
    for i, b in enumerate(batches):
        ax.plot(xs, [decode_intensity(m, s, b) for s in xs], color=f"C{i + 1}", label=f"decode B={b}")
    ax.axhline(hw.ridge, color="k", ls="--", lw=1)
    ax.text(xs[0], hw.ridge * 1.15, f"ridge {hw.ridge:.0f} FLOP/B (above: compute-bound)", fontsize=8)
    ax.set(xscale="log", yscale="log", xlabel="sequence length S (tokens)", ylabel="arithmetic intensity (FLOP/byte)",
           title=f"{m.name} on {hw.name}")
    bx.plot(xs, [ttft_bound(m, hw, s) * 1e3 for s in xs], lw=2, color="C0", label="TTFT bound (prefill S)")
    for i, b in enumerate(batches):
        bx.plot(xs, [tpot_bound(m, hw, s, b) * 1e3 for s in xs], color=f"C{i + 1}", label=f"TPOT bound B={b}")
    if prefill_eff and decode_eff:
        bx.plot(xs, [ttft_bound(m, hw, s) / prefill_eff * 1e3 for s in xs], color="C0", ls="--",
                label=f"TTFT calibrated (eff {prefill_eff:.2g})")
        bx.plot(xs, [tpot_bound(m, hw, s, 1) / decode_eff * 1e3 for s in xs], color="C1", ls="--",
                label=f"TPOT B=1 calibrated (eff {decode_eff:.2g})")
    bx.set(xscale="log", yscale="log", xlabel="sequence length S (tokens)", ylabel="lower bound (ms)",
           title="roofline latency bounds")
    for a in (ax, bx):
        a.grid(alpha=0.3, which="both")
        a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
