"""matplotlib plot of predicted tok/s against KV pool size, one line per batch size."""

from __future__ import annotations

from simulator.predict import PointResult


def plot_sweep(results: list[PointResult], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # NOTE: headless machines; never needs a display
    import matplotlib.pyplot as plt

    fig, (agg, per) = plt.subplots(1, 2, figsize=(11, 4.2), sharex=True)
    for batch in sorted({r.batch for r in results}):
        pts = sorted((r for r in results if r.batch == batch and r.fits), key=lambda r: r.kv_tokens)
        if not pts:
            continue
        kv = [r.kv_tokens / 1000 for r in pts]
        agg.plot(kv, [r.decode_tok_s for r in pts], marker="o", label=f"bs{batch}")
        per.plot(kv, [r.decode_tok_s_per_request for r in pts], marker="o", label=f"bs{batch}")
    first = results[0] if results else None
    title = f"{first.model} on {first.hardware}" if first else ""
    agg.set(title=f"aggregate decode tok/s  {title}", xlabel="KV pool (k tokens)", ylabel="tok/s")
    per.set(title="mean per-request decode tok/s", xlabel="KV pool (k tokens)", ylabel="tok/s")
    for ax in (agg, per):
        ax.grid(alpha=0.3)
        ax.legend()
        ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
