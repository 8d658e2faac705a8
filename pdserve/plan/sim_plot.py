"""`pdserve simulate --plot PNG`: goodput per replica and replicas against the offered rate (a
comparison), and replicas over time under a load schedule (autoscaled runs). matplotlib is imported
lazily with the Agg backend, as in pdserve/plan/plot.py."""

from __future__ import annotations


def plot(path: str, rows: list[dict], timelines: dict[str, tuple] | None = None, title: str = "") -> None:
    """rows: `sim_study.compare` output; timelines: {label: (Result, schedule)}. Writes the PNG only."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (2 if rows else 0) + (1 if timelines else 0)
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.2), squeeze=False)
    axes = list(axes[0])
    if rows:
        ax, bx = axes[0], axes[1]
        rates = [r["rate"] for r in rows]
        series = [("colocated (least N)", "colocated_gpr", lambda r: r["colocated"] or float("nan")),
                  ("best P:D split", "split_gpr", lambda r: sum(r["split"]) if r["split"] else float("nan")),
                  ("SLO policy", "slo_gpr", lambda r: r["slo_mean_replicas"]),
                  ("per-pool policies", "perpool_gpr", lambda r: r["perpool_mean_replicas"])]
        for i, (label, key, count) in enumerate(series):
            ax.plot(rates, [r[key] for r in rows], marker="o", color=f"C{i}", label=label)
            bx.plot(rates, [count(r) for r in rows], marker="o", color=f"C{i}", label=label)
        ax.set(xscale="log", xlabel="offered rate (req/s)", ylabel="goodput per replica (req/s)",
               title=title or "goodput under SLOs per replica")
        bx.set(xscale="log", yscale="log", xlabel="offered rate (req/s)", ylabel="replicas (autoscaled: mean)",
               title="replicas")
        for a in (ax, bx):
            a.grid(alpha=0.3, which="both")
            a.legend(fontsize=7)
    if timelines:
        cx = axes[-1]
        rate_axis = cx.twinx()
        for i, (label, (res, schedule)) in enumerate(timelines.items()):
            ts = [t for t, _, _ in res.timeline]
            cx.plot(ts, [p for _, p, _ in res.timeline], color=f"C{i}", ls="-", label=f"{label}: prefill")
            cx.plot(ts, [d for _, _, d in res.timeline], color=f"C{i}", ls="--", label=f"{label}: decode")
            if i == 0:
                xs = [t for t, _ in schedule] + [res.duration]
                ys = [r for _, r in schedule] + [schedule[-1][1]]
                rate_axis.step(xs, ys, where="post", color="grey", alpha=0.5, label="offered rate")
        cx.set(xlabel="time (s)", ylabel="replicas", title="autoscaling under the load schedule")
        rate_axis.set_ylabel("offered rate (req/s)")
        cx.grid(alpha=0.3)
        cx.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
