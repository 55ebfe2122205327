"""`--plot`: the sweep (tok/s against KV size, one line per batch size) and the ladder
(aggregate and per-request tok/s against concurrency), drawn with matplotlib to a PNG/SVG/PDF."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def missing() -> str | None:
    """Why --plot cannot draw here (matplotlib not installed), or None: checked before a run, not after it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "--plot needs matplotlib, which is not installed (pip install -e \".[sim]\" brings it)"
    return None


def plot(record: dict, out: str | Path) -> Path:
    """Draw ``record`` (a sweep or ladder record) into ``out``; failed points are left out of
    the lines and listed in the title. Raises ValueError for other kinds."""
    kind = record["kind"]
    if kind not in ("sweep", "ladder"):
        raise ValueError(f"--plot draws sweep and ladder records, not {kind}")
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    ok = [p for p in record["points"] if p.get("aggregate_tok_s") is not None]
    failed = len(record["points"]) - len(ok)
    if kind == "sweep":
        for bs in sorted({p["batch_size"] for p in ok}):
            pts = sorted((p for p in ok if p["batch_size"] == bs), key=lambda p: p["kv_tokens"] or 0)
            xs = [p["kv_tokens"] for p in pts]
            axes[0].plot(xs, [p["aggregate_tok_s"] for p in pts], marker="o", label=f"bs{bs}")
            axes[1].plot(xs, [p["per_request_tok_s"] for p in pts], marker="o", label=f"bs{bs}")
        for ax in axes:
            ax.set_xlabel("KV pool (tokens)")
        axes[0].set_ylabel("aggregate decode tok/s")
        axes[1].set_ylabel("per-request decode tok/s")
    else:
        xs = [p["concurrency"] for p in ok]
        axes[0].plot(xs, [p["aggregate_tok_s"] for p in ok], marker="o", label="aggregate")
        axes[1].plot(xs, [p["steady_decode_tok_s_median"] for p in ok], marker="o", label="steady decode p50")
        for ax in axes:
            ax.set_xlabel("concurrent requests")
            ax.set_xscale("log", base=2)
        axes[0].set_ylabel("aggregate output tok/s")
        axes[1].set_ylabel("per-request tok/s")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    model = (record.get("target") or {}).get("model")
    fig.suptitle(f"ft bench {kind}: {model}" + (f" ({failed} failed point(s) not drawn)" if failed else ""))
    fig.tight_layout()
    path = Path(out)
    fig.savefig(path)
    plt.close(fig)
    return path
