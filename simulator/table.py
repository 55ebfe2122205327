"""A rich table of predicted points, laid out like SPEC.md's reference table."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table

from simulator.predict import PointResult


def _fmt(value, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def _count(value) -> str:
    return "-" if value is None else str(value)


def _notes(r: PointResult) -> str:
    """What a fitting point's row must say: requests that queue (batch above --max-running-requests),
    pools the server would drop, the LRU warning, a TTFT probe the pools cannot run."""
    notes = []
    if r.extra.get("queued"):
        notes.append(f"{r.extra['queued']} of {r.batch} requests queue (max running {r.state_slots})")
    notes += [f"[yellow]{n}[/yellow]" for n in (*r.extra.get("plan_notes", ()), r.extra.get("warning"),
                                                  r.extra.get("ttft_prompt_reason")) if n]
    lane = r.extra.get("host_lane")
    if lane:
        notes.append(f"host lane: {lane['host_experts']:,} misses ({lane['host_share_of_misses']:.0%}) computed on the "
                     f"host, host CPU busy {lane['cpu_utilisation']:.0%}")
    working_set = r.extra.get("working_set")
    if working_set and r.expert_slots >= working_set:
        notes.append(f"the pool holds the window's whole working set ({working_set:,} experts): its misses are "
                     "first touches")
    return "; ".join(notes)


def print_table(results: list[PointResult], title: str = "", console: Console | None = None) -> None:
    # NOTE: the three speeds are defined differently (PointResult); unlabelled, a batch-1 row whose per-request
    # figure tops its aggregate read as a bug
    table = Table(title=title, caption="aggregate: all measured tokens / all measured time; mean per request: "
                  "each request's tokens / its time from its round's send, averaged (never below aggregate / batch); "
                  "steady: tokens after the first / time after the first, median")
    for name in ("KV pool", "batch", "fits", "expert slots", "residency", "hit rate", "aggregate tok/s",
                 "mean tok/s/request", "steady tok/s/req", "PCIe util", "GPU util", "TTFT ms", "reason"):
        table.add_column(name, justify="left" if name == "reason" else "right")
    probe = next((r.extra["ttft_prompt_tokens"] for r in results if "ttft_prompt_tokens" in r.extra), None)
    if probe:
        table.add_column(f"TTFT {probe:,}-token prompt ms", justify="right")
    for r in sorted(results, key=lambda r: (r.batch, r.kv_tokens)):
        probe_cells = [_fmt(r.extra.get("ttft_prompt_s"), ".0f", 1e3)] if probe else []
        table.add_row(
            f"{r.kv_tokens:,}", str(r.batch), "yes" if r.fits else "[red]no[/red]",
            f"{r.expert_slots:,}" if r.fits else "-", _fmt(r.residency if r.fits else None, ".0%"),
            _fmt(r.hit_rate, ".1%"), _fmt(r.decode_tok_s, ".1f"), _fmt(r.decode_tok_s_per_request, ".1f"),
            _fmt(r.steady_decode_tok_s_per_request, ".1f"),
            _fmt(r.pcie_utilisation, ".0%"), _fmt(r.gpu_utilisation, ".0%"), _fmt(r.ttft_s, ".0f", 1e3),
            r.reason or _notes(r),
            *probe_cells,
        )
    # NOTE: piped output (files, CI logs) gets a wide fixed width instead of rich's 80 columns.
    console = console or (Console() if sys.stdout.isatty() else Console(width=200))
    console.print(table)


def print_mixed(results: list[dict], title: str = "", console: Console | None = None, steps: bool = False) -> None:
    """`python -m simulator mixed`: one row per prediction (layered prefill off / on), then what it leaves out."""
    from simulator.mixed import summary_row

    table = Table(title=title)
    for name in ("GPU budget", "KV pool", "layered", "expert slots", "residency", "gaps", "gap p50 ms", "gap p99 ms",
                 "gap max ms", "baseline p99 ms", "TTFT s", "steps to 1st token", "GB staged", "reason"):
        table.add_column(name, justify="left" if name == "reason" else "right")
    for r in results:
        row = summary_row(r)
        budget = r.get("gpu_budget_gib")
        notes = [row["reason"]] if row["reason"] else []
        notes += [f"[yellow]{f['error']}[/yellow]" for f in r.get("failures", ())]
        table.add_row(
            "card" if budget is None else f"{budget:g} GiB", f"{r['kv_tokens']:,}", row["layered"],
            _fmt(row["expert_slots"], ",.0f"), _fmt(row["residency"], ".0%"), _fmt(row["gaps"], ".0f"),
            _fmt(row["p50_ms"], ".1f"), _fmt(row["p99_ms"], ".1f"), _fmt(row["max_ms"], ".1f"),
            _fmt(row["baseline_p99_ms"], ".1f"), _fmt(row["ttft_s"], ".3f"), _fmt(row["steps"], ".0f"),
            _fmt(row["gb_staged"], ".1f"), "; ".join(notes),
        )
    console = console or (Console() if sys.stdout.isatty() else Console(width=160))
    console.print(table)
    for r in results:
        if "compare" in r:
            print_compare(r["compare"], "on" if r["layered_prefill"] else "off", console)
            print_steps(r["compare"].get("steps") or {}, console, rows=steps)
    scheduler = next((r["scheduler"] for r in results if "scheduler" in r), None)
    if scheduler:
        console.print(f"budgets: {scheduler['max_step_tokens']} tokens alone, {scheduler['mixed_step_tokens']} "
                      f"beside decodes; {scheduler['num_layers']} layers")
    notes = next((r["not_modelled"] for r in results if "not_modelled" in r), [])
    if notes:
        console.print("Not modelled (the figures lack these):")
        for note in notes:
            console.print(f"  - {note}")


def print_steps(steps: dict, console: Console, rows: bool = False) -> None:
    """`mixed --record`: the window steps by kind, measured vs predicted (mixed_record.step_comparison); with
    `rows`, every step too."""
    if steps.get("note"):
        console.print(f"steps: {steps['note']}")
    if rows and steps.get("rows"):
        table = Table(title="window steps, measured vs predicted")
        for name in ("repeat", "index", "kind", "layers", "decode rows", "prefill tokens", "measured ms", "host ms",
                     "predicted ms", "error %", "misses measured", "misses predicted"):
            table.add_column(name, justify="right")
        for r in steps["rows"]:
            layers = "" if r["layers"] is None else f"[{r['layers'][0]}, {r['layers'][1]})"
            table.add_row(str(r["repeat"]), _count(r["index"]), r["kind"], layers, _count(r["decode_rows"]),
                          _count(r["prefill_tokens"]), _fmt(r["measured_ms"], ".1f"), _fmt(r["host_ms"], ".2f"),
                          _fmt(r["predicted_ms"], ".1f"), _fmt(r["error_pct"], "+.1f"),
                          _count(r["measured_misses"]), _count(r["predicted_misses"]))
        console.print(table)
    if steps.get("by_kind"):
        table = Table(title="window steps by kind (aligned in order within each kind and layer group)")
        for name in ("kind", "steps", "measured median ms", "predicted median ms", "median error %",
                     "mean |error| %", "measured only", "predicted only"):
            table.add_column(name, justify="left" if name == "kind" else "right")
        for kind, k in steps["by_kind"].items():
            table.add_row(kind, str(k["steps"]), _fmt(k["measured_median_ms"], ".1f"),
                          _fmt(k["predicted_median_ms"], ".1f"), _fmt(k["median_error_pct"], "+.1f"),
                          _fmt(k["mean_abs_error_pct"], ".1f"), str(k["measured_only"]), str(k["predicted_only"]))
        console.print(table)


def print_compare(compare: dict, layered: str, console: Console) -> None:
    """`mixed --record`: one prediction beside the record it replays (mixed_record.MixedRecord.compare): each
    figure measured, predicted and its error, then the plan, the routing, the gaps and the overridden settings."""
    table = Table(title=f"measured vs predicted, layered {layered}", caption=f"record: {compare['record']}")
    for name in ("figure", "measured", "predicted", "error %"):
        table.add_column(name, justify="left" if name == "figure" else "right")
    for name, f in compare["figures"].items():
        spec = ".3f" if name.startswith("ttft") else ".1f"
        table.add_row(name, _fmt(f["measured"], spec), _fmt(f["predicted"], spec), _fmt(f["error_pct"], "+.1f"))
    console.print(table)
    differ = [f"{k} {v['record']} -> {v['predicted']}" for k, v in compare["plan"].items()
              if v["record"] != v["predicted"]]
    console.print("plan: " + ("the record's" if not differ else "differs from the record's: " + ", ".join(differ)))
    routing = compare["routing"]
    console.print(f"routing: the record's {routing['record']}, simulated {routing['simulated']}")
    for g in compare["gaps"]:
        line = f"repeat {g['repeat']}: {g['measured_gaps']} window gaps measured, {g['predicted_gaps']} predicted"
        if "index" in g:
            where = f"index {g['index']}" + ("" if g["stream"] is None else f" of stream {g['stream']}")
            line += (f"; largest difference at {where}: {g['measured_ms']:.1f} ms measured, "
                     f"{g['predicted_ms']:.1f} predicted ({g['difference_ms']:+.1f})")
        console.print(line)
    if compare["overridden"]:
        console.print("flags over the record: " + ", ".join(
            f"{k} {v['record']} -> {v['used']}" for k, v in compare["overridden"].items()))
