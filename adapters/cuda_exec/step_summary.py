"""The summary of one step profile (step_profiler.py): figures from the chrome trace torch.profiler exports, so a
later session reads where a step's time went without opening the trace: the device's kernel sum, busy time and
largest idle gaps (with when the host launched the work that ended each), the top kernels and host operators, the
launch calls and every host synchronisation. Pure functions of the trace's events: tested on hand-made traces.

Times in the trace are µs; the summary's are ms, offsets from the step's start (the STEP_LABEL annotation).
"""

from __future__ import annotations

STEP_LABEL = "fluxtide.step"  # the record_function around the step: the summary's time window
TOP = 25
GAPS = 10
SLOW_OP_US = 1000.0  # a host operator this long is a stall worth naming: in session 27's tail step (H100) a cat and a
# pin_memory of <= 51 KB took 3.8-14.8 ms each, found only by reading the trace
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cuStreamSynchronize",
              "cuCtxSynchronize", "cuEventSynchronize")
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch",
                "cuGraphLaunch")
HOST_CATS = ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver", "python_function")
RUNTIME_CATS = ("cuda_runtime", "cuda_driver")
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def ms(us: float) -> float:
    """µs -> ms, rounded to 0.1 µs."""
    return round(us / 1e3, 4)


def summarise(events: list[dict], device_traced: bool = True, slow_op_us: float = SLOW_OP_US) -> dict:
    """The summary's figures from a chrome trace's events (times in µs; offsets from the step's start); without
    device_traced (a CPU step) no idle gaps (the device's timeline is not in the trace). host.slow_ops: the step
    thread's outermost operators of at least slow_op_us each (their children inside), longest first, each with
    the Python frame around it when the trace has stacks."""
    xs = [e for e in events if e.get("ph") == "X" and "ts" in e]
    for e in xs:
        e["_t0"] = float(e["ts"])
        e["_t1"] = e["_t0"] + float(e.get("dur", 0.0))
    step = next((e for e in xs if e.get("name") == STEP_LABEL and e.get("cat") in ("user_annotation", "cpu_op")),
                None)
    t0 = step["_t0"] if step else min((e["_t0"] for e in xs), default=0.0)
    t1 = step["_t1"] if step else max((e["_t1"] for e in xs), default=0.0)
    in_window = [e for e in xs if e.get("cat") in HOST_CATS and t0 <= e["_t0"] <= t1]
    # the host figures are the step's thread's (the engine's); other threads' ops only summed (GIL contention)
    thread = (step.get("pid"), step.get("tid")) if step else None
    host = [e for e in in_window if thread is None or (e.get("pid"), e.get("tid")) == thread]
    others = [e for e in in_window if thread is not None and (e.get("pid"), e.get("tid")) != thread]
    others_parents = _nest(others)
    parents = _nest(host)  # for the op or Python frame around a call
    ops_parents = _nest([e for e in host if e.get("cat") != "python_function"])  # for self times
    device = sorted((e for e in xs if e.get("cat") in DEVICE_CATS and e["_t1"] >= t0), key=lambda e: e["_t0"])
    kernels = [e for e in device if e.get("cat") == "kernel"]
    runtime = [e for e in host if e.get("cat") in RUNTIME_CATS]
    by_corr = {e.get("args", {}).get("correlation"): e for e in runtime}
    busy = union([(e["_t0"], e["_t1"]) for e in device])
    out: dict = {"device_time": {
        "kernels": len(kernels), "kernel_sum_ms": ms(sum(e["_t1"] - e["_t0"] for e in kernels)),
        "busy_union_ms": ms(sum(b - a for a, b in busy)),
        "span_ms": ms(busy[-1][1] - busy[0][0]) if busy else 0.0,
        "first_start_offset_ms": ms(busy[0][0] - t0) if busy else None,
        "last_end_offset_ms": ms(busy[-1][1] - t0) if busy else None,
        "memcpy": _table([e for e in device if e.get("cat") == "gpu_memcpy"], lambda e: e["_t1"] - e["_t0"]),
        "memset": _table([e for e in device if e.get("cat") == "gpu_memset"], lambda e: e["_t1"] - e["_t0"])},
        "top_kernels": _table(kernels, lambda e: e["_t1"] - e["_t0"])[:TOP]}
    selfs = {id(e): e["_t1"] - e["_t0"] for e in host}
    for e in host:
        p = ops_parents.get(id(e))
        if p is not None:
            selfs[id(p)] -= e["_t1"] - e["_t0"]
    ops = [e for e in host if e.get("cat") in ("cpu_op", "user_annotation") and e.get("name") != STEP_LABEL]
    in_ops = [e for e in host if e.get("cat") in ("cpu_op", "user_annotation", *RUNTIME_CATS)
              and e.get("name") != STEP_LABEL]
    out["host"] = {
        "step_ms": ms(t1 - t0),
        "in_ops_ms": ms(sum(selfs[id(e)] for e in in_ops)),
        "outside_ops_ms": ms(selfs[id(step)]) if step else None,  # Python between the ops: interpreter time
        "runtime_ms": ms(sum(e["_t1"] - e["_t0"] for e in runtime)),
        "other_threads_ops_ms": ms(sum(e["_t1"] - e["_t0"] for e in others
                                        if e.get("cat") == "cpu_op" and id(e) not in others_parents)),
        "top_cpu_ops": _table(ops, lambda e: selfs[id(e)], "self_ms", total=lambda e: e["_t1"] - e["_t0"])[:TOP],
        "runtime_calls": _table(runtime, lambda e: e["_t1"] - e["_t0"])[:TOP],
        "slow_ops": _slow_ops(ops, ops_parents, parents, selfs, step, t0, slow_op_us)}
    launches = _table([e for e in runtime if e.get("name") in LAUNCH_CALLS], lambda e: e["_t1"] - e["_t0"])
    out["launches"] = {r["name"]: {"count": r["count"], "total_ms": r["total_ms"]} for r in launches}
    corr_device = {e.get("args", {}).get("correlation"): e for e in device if e.get("cat") == "gpu_memcpy"}
    syncs, sync_us = [], 0.0
    for e in runtime:
        name = e.get("name", "")
        copy = corr_device.get(e.get("args", {}).get("correlation"))
        copy_name = copy.get("name", "") if copy else ""
        if name in SYNC_CALLS or ("emcpy" in name and ("DtoH" in copy_name or "Pageable" in copy_name
                                                       or "Async" not in name)):
            sync_us += e["_t1"] - e["_t0"]
            syncs.append({"name": name, "offset_ms": ms(e["_t0"] - t0), "dur_ms": ms(e["_t1"] - e["_t0"]),
                          "op": _ancestor(e, parents, ("cpu_op",)), "py": _ancestor(e, parents, ("python_function",)),
                          **({"copy": copy_name} if copy_name else {})})
    out["host_syncs"] = {"count": len(syncs), "total_ms": ms(sync_us), "calls": syncs[:50]}
    out["idle_gaps"] = _gaps(device, busy, t0, t1, by_corr, parents) if device_traced else None
    return out


def _slow_ops(ops: list[dict], ops_parents: dict, parents: dict, selfs: dict, step: dict | None, t0: float,
              slow_op_us: float) -> dict:
    """The outermost operators (no operator around them but the step's annotation) of at least slow_op_us."""
    slow = sorted((e for e in ops if e["_t1"] - e["_t0"] >= slow_op_us
                   and ops_parents.get(id(e)) in (None, step)), key=lambda e: e["_t0"] - e["_t1"])
    return {"threshold_ms": ms(slow_op_us), "count": len(slow), "total_ms": ms(sum(e["_t1"] - e["_t0"] for e in slow)),
            "ops": [{"name": e.get("name"), "offset_ms": ms(e["_t0"] - t0), "dur_ms": ms(e["_t1"] - e["_t0"]),
                     "self_ms": ms(selfs[id(e)]), "py": _ancestor(e, parents, ("python_function",))}
                    for e in slow[:GAPS]]}


def _nest(host: list[dict]) -> dict[int, dict]:
    """id(event) -> its innermost enclosing host event on the same thread."""
    parents, threads = {}, {}
    for e in host:
        threads.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    for evs in threads.values():
        stack: list[dict] = []
        for e in sorted(evs, key=lambda e: (e["_t0"], -(e["_t1"] - e["_t0"]))):
            while stack and stack[-1]["_t1"] <= e["_t0"]:
                stack.pop()
            if stack:
                parents[id(e)] = stack[-1]
            stack.append(e)
    return parents


def _ancestor(e: dict, parents: dict, cats: tuple[str, ...]) -> str | None:
    p = parents.get(id(e))
    while p is not None and p.get("cat") not in cats:
        p = parents.get(id(p))
    return p.get("name", "")[:200] if p is not None else None


def _table(evs: list[dict], value, key: str = "total_ms", total=None) -> list[dict]:
    """Events grouped by name, the largest summed `value` (µs) first: name, count, `key` in ms (and with_children_ms:
    the summed `total`)."""
    rows: dict[str, list[float]] = {}
    for e in evs:
        row = rows.setdefault(e.get("name", "")[:200], [0, 0.0, 0.0])
        row[0] += 1
        row[1] += value(e)
        row[2] += total(e) if total else 0.0
    ranked = sorted(rows.items(), key=lambda kv: -kv[1][1])
    return [{"name": k, "count": int(n), key: ms(v), **({"with_children_ms": ms(w)} if total else {})}
            for k, (n, v, w) in ranked]


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The intervals (start, end) merged where they overlap or touch, sorted: the time at least one covers."""
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _gaps(device: list[dict], busy: list[tuple[float, float]], t0: float, t1: float, by_corr: dict,
          parents: dict) -> dict:
    """The device's idle stretches from the step's start to the later of its end and the last device work: each
    with the device work either side and when the host launched the work after it (a launch inside the gap: the
    device waited for the host)."""
    first_at, last_at = {}, {}
    for e in device:
        first_at.setdefault(e["_t0"], e)
        last_at[e["_t1"]] = e
    gaps, idle_from = [], t0
    for a, b in busy:
        if a > idle_from:
            gaps.append((idle_from, a, first_at.get(a)))
        idle_from = max(idle_from, b)
    if t1 > idle_from:
        gaps.append((idle_from, t1, None))
    rows, host_bound = [], 0.0
    for a, b, after in gaps:
        before = last_at.get(a)
        launch = by_corr.get(after.get("args", {}).get("correlation")) if after is not None else None
        if launch is not None and launch["_t0"] > a:
            host_bound += b - a
        rows.append({"start_offset_ms": ms(a - t0), "dur_ms": ms(b - a),
                     "prev_work": before.get("name", "")[:120] if before else None,
                     "next_work": after.get("name", "")[:120] if after else None,
                     "next_launch_offset_ms": ms(launch["_t0"] - t0) if launch else None,
                     "next_launch_op": _ancestor(launch, parents, ("cpu_op", "user_annotation")) if launch else None})
    rows.sort(key=lambda r: -r["dur_ms"])
    return {"count": len(gaps), "total_ms": ms(sum(b - a for a, b, _ in gaps)),
            "host_launch_bound_ms": ms(host_bound), "largest": rows[:GAPS]}
