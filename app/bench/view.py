"""rich progress bars (stderr) and result tables (stdout) for `ft bench`."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

# columns of each kind's table: (title, point key); missing values print as "-"
COLUMNS = {
    "sweep": [("KV", "kv_tokens_requested"), ("slots", "expert_slots"), ("resid.", "residency"), ("bs", "batch_size"),
              ("agg tok/s", "aggregate_tok_s"), ("per-req tok/s", "per_request_tok_s"),
              ("steady p50", "steady_decode_tok_s_median"), ("TTFT p50 s", "ttft_s_median"),
              ("hit rate", "hit_rate"), ("PCIe MiB", "pcie_mib"), ("failed", "failed_requests")],
    "ladder": [("c", "concurrency"), ("agg tok/s", "aggregate_tok_s"), ("steady p50", "steady_decode_tok_s_median"),
               ("TTFT p50 s", "ttft_s_median"), ("admitted", "admitted"), ("queued", "queued"),
               ("failed", "failed_requests")],
    "probe": [("tokens", "max_tokens"), ("steady p50", "steady_decode_tok_s_median"),
              ("e2e p50", "e2e_tok_s_median"), ("TTFT p50 s", "ttft_s_median"), ("failed", "failed_requests")],
    "prefill": [("target", "prompt_tokens_target"), ("prompt tokens", "prompt_tokens"),
                ("first TTFT s", "first_ttft_s"), ("TTFT p50 s", "ttft_s_median"),
                ("prefill tok/s p50", "prefill_tok_s_median"), ("failed", "failed_requests")],
    "mixed": [("repeat", "repeat"), ("prompt tokens", "prompt_tokens"), ("TTFT s", "ttft_s"),
              ("gaps", "gaps_in_window"), ("gap p50 ms", "gap_p50_ms"), ("gap p99 ms", "gap_p99_ms"),
              ("gap max ms", "gap_max_ms"), ("baseline p99 ms", "baseline_gap_p99_ms"), ("ok", "ok")],
    "turns": [("repeat", "repeat"), ("turn 1 tokens", "turn1.prompt_tokens"), ("turn 1 TTFT s", "turn1.ttft_s"),
              ("turn 2 tokens", "turn2.prompt_tokens"), ("cached", "turn2.cached_tokens"),
              ("turn 2 TTFT s", "turn2.ttft_s"), ("ratio", "ratio"), ("ok", "ok")],
    "cold-start": [("milestone", "milestone"), ("seconds", "seconds"), ("source", "source")],
    "smoke": [("prompt", "prompt"), ("expected", "expected"), ("answer", "answer"), ("passed", "passed")],
}


def progress(quiet: bool) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=Console(stderr=True), disable=quiet, transient=False)


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _value(point: dict, key: str):
    """point[key]; a dotted key ("turn1.ttft_s") reads a nested figure (None where a level is missing)."""
    for part in key.split("."):
        point = point.get(part) if isinstance(point, dict) else None
    return point


def table(record: dict) -> Table:
    kind = record["kind"]
    t = Table(title=f"ft bench {kind}: {(record.get('target') or {}).get('model') or ''}")
    for title, _ in COLUMNS[kind]:
        t.add_column(title, justify="right" if title not in ("answer", "prompt", "milestone") else "left")
    for point in record["points"]:
        # NOTE: a point that never ran (refused rebuild) shows "failed" in place of its figures
        cells = [_cell(_value(point, key)) for _, key in COLUMNS[kind]]
        if point.get("admitted_note"):  # NOTE: the load was not observed: "n/a", never a figure
            cells = ["n/a" if key in ("admitted", "queued") else cell for (_, key), cell in zip(COLUMNS[kind], cells,
                                                                                               strict=True)]
        if point.get("ok") is False and point.get("failed_requests") is None:
            # NOTE: a point refused before any request (prefill: a size past the context) says so, not "failed"
            cells[-1] = f"not sent: {point['not_sent']}" if point.get("not_sent") else "failed"
        t.add_row(*cells)
    return t


def wide_console() -> Console:
    """The console tables print to: the terminal's width, or 200 columns when stdout is a file or a pipe (rich's
    default of 80 there cut figures to `163…` in CI logs)."""
    return Console() if sys.stdout.isatty() else Console(width=200)


def hardware_line(hw: dict | None, skipped: bool = False) -> str:
    """The client host's GPUs and pinned host->device bandwidth, as the summary's first clause ("; " ended), or ""
    when the run never profiled the host (it failed first). NOTE: a CPU box printed "no GPU; pinned H2D - GB/s"."""
    if not hw:
        return ""
    gpus = ", ".join(g.get("name", "?") for g in hw.get("gpus") or [])
    rate = hw.get("pinned_h2d_gb_s")
    if not gpus:
        why = f" ({hw['gpu_probe_error']})" if hw.get("gpu_probe_error") else ""
        return f"no CUDA device{why}: pinned host->device bandwidth not measured; "
    if rate is None:
        return f"{gpus}; pinned host->device bandwidth not measured{' (--no-bandwidth)' if skipped else ''}; "
    return f"{gpus}; pinned host->device {_cell(rate)} GB/s; "


def show_failures(record: dict, path, quiet: bool = False) -> None:
    """Each failure of the run, on stderr, with or without --quiet (which silences progress and tables, never a
    failure: `ft bench smoke --quiet` against no server exited 1 without a word), then the record's path: after a
    failure, and on a quiet run always (it says where the record is, its only output)."""
    failures = record["failures"]
    if not failures and not quiet:
        return
    err = Console(stderr=True, width=None if sys.stderr.isatty() else 200)
    for failure in failures:
        err.print(f"[red]ft bench {escape(record['kind'])}: failed {escape(str(failure['where']))}: "
                  f"{escape(str(failure['error']))}[/red]", soft_wrap=True)
    err.print(f"[dim]record: {escape(str(path))}[/dim]", soft_wrap=True)


def turns_line(summary: dict) -> str:
    """`ft bench turns`' verdict: the median ratio against --max-ratio and the two medians it comes from."""
    met = summary["meets_max_ratio"]
    judged = "not judged, no repeat measured" if met is None else ("met" if met else "missed")
    hit = "yes" if summary["every_turn2_hit_the_cache"] else "no"
    return (f"turn 2 TTFT / turn 1 TTFT: median {_cell(summary['ratio_median'])} (<= {_cell(summary['max_ratio'])}: "
            f"{judged}); TTFT p50 turn 1 {_cell(summary['turn1_ttft_s_median'])} s, turn 2 "
            f"{_cell(summary['turn2_ttft_s_median'])} s; every turn 2 hit the prefix cache: {hit}")


def restored_line(restored: dict) -> str:
    """`ft bench sweep`'s last word on the server it resized: the pools it found, rebuilt (or why not)."""
    sizes = (f"KV {restored['kv_tokens']} tokens, {restored['expert_slots']} expert slots, "
             f"{restored['state_slots']} state slots")
    if restored["ok"]:
        return f"server restored to the pools it had before the sweep: {sizes}"
    return f"server NOT restored to the pools it had before the sweep ({sizes}): {restored['error']}"


def show(record: dict, path, quiet: bool) -> None:
    show_failures(record, path, quiet)
    if quiet:
        return
    console = wide_console()
    # NOTE: a run that measured nothing (an unreachable server) printed an empty table titled "ft bench probe:" under
    # the failure line that said it all (show_failures, with the record's path)
    if record["points"] or not record["failures"]:
        console.print(table(record))
        hardware = hardware_line(record.get("hardware"), (record.get("settings") or {}).get("no_bandwidth", False))
        console.print(f"[dim]{escape(hardware)}{len(record['failures'])} failure(s); record: {path}[/dim]")
    if restored := record.get("restored"):
        console.print(escape(restored_line(restored)))
    summary = record.get("summary") or {}
    if record["kind"] == "turns" and summary:
        console.print(escape(turns_line(summary)))
    if record["kind"] == "mixed" and summary.get("window"):
        window, target = summary["window"], summary["target"]["gap_p99_ms"]
        met = summary["meets_target"]
        differ = summary.get("target_conditions_differ")
        judged = ("met" if met else "missed") if met is not None else (
            "not judged, the run differs in " + ", ".join(differ) if differ else "not judged, no gap measured")
        console.print(f"gaps while the prompt prefilled: p99 {_cell(window['p99_ms'])} ms over {window['count']} "
                      f"gaps (issue 9's target <= {_cell(target)} ms: {judged}); "
                      f"TTFT p50 {_cell(summary['ttft_s_median'])} s; step budgets "
                      f"{summary.get('server_step_budgets') or 'unknown'}")
        if largest := summary.get("largest_window_step"):
            console.print(f"largest step in window: {largest['ms']:.1f} ms ({largest['label']}; repeat "
                          f"{largest['repeat']})")


# the figure each kind compares side by side, and what identifies a point across records
HEADLINE = {
    "sweep": ("aggregate_tok_s", ("kv_tokens_requested", "batch_size")),
    "ladder": ("aggregate_tok_s", ("concurrency",)),
    "probe": ("steady_decode_tok_s_median", ("max_tokens",)),
    "prefill": ("prefill_tok_s_median", ("prompt_tokens_target",)),
    "smoke": ("passed", ("prompt",)),
    "mixed": ("gap_p99_ms", ("repeat",)),
    "turns": ("ratio", ("repeat",)),
}


def side_by_side(records: list[dict]) -> Table:
    """The kind's headline figure for every target at each point, and its ratio to the first
    target's (the records themselves keep every figure)."""
    kind = records[0]["kind"]
    figure, keys = HEADLINE[kind]
    t = Table(title=f"side by side: {figure} (ratio to the first server)")
    t.add_column(", ".join(keys))
    # NOTE: a run that failed before /v1/models answered has no target and routing None (not learnt): it is
    # labelled by the URL it was given (its settings) and does not make the table look routed ("None [-]")
    routed = any((r.get("routing") or "natural") != "natural" for r in records)
    for r in records:
        label = str((r.get("settings") or {}).get("base_url") or (r.get("target") or {}).get("base_url"))
        # NOTE: escaped: rich read " [natural]" (and an IPv6 host's brackets) as markup and dropped it
        t.add_column(escape(label + (f" [{_cell(r.get('routing'))[:32]}]" if routed else "")), justify="right")
    points = [{tuple(p.get(k) for k in keys): p.get(figure) for p in r["points"]} for r in records]
    for key in points[0]:
        base = points[0][key]
        cells = []
        for i, pts in enumerate(points):
            value = pts.get(key)
            ratio = value / base if i and isinstance(value, float) and isinstance(base, float) and base else None
            cells.append(_cell(value) + (f" ({ratio:.2f}x)" if ratio is not None else ""))
        t.add_row(", ".join(_cell(k) for k in key), *cells)
    return t
