"""The host lane (docs/adr/0030-host-expert-compute.md, the customer's "hybrid" mode): a share of each decode lookup's
misses is computed on the host CPU while the PCIe link copies the rest.

The split is the domain's (ExpertResidency.lookup(keys, host_permille=p)): of a lookup's m distinct misses the last
ones whose weight passes fit host_key_count(m, p) (m × p / 1000 rounded half up) are host keys (host_split: a pass a
key up to ROWS_PER_PASS rows, so where a batch routes alike the host takes fewer); they take no slot and are never
copied. The host reads a host key's expert bytes once per weight pass at CostParams.host_expert_gb_s (a pass of n rows
alike costing 1 + host_row_factor x (n - 1) one-row passes: it multiplies and sums every row), after a fixed round trip
(host_call_s) per lookup with any host keys (the GPU hands the layer's rows to the host and waits for its partial sum).
The host kernel groups a lookup's (token, expert) pairs by expert and converts each expert's weights once for up to
ROWS_PER_PASS of its rows at a time, so a host key routed by n rows costs ceil(n / ROWS_PER_PASS) passes
(`weight_passes`), not n: rows that route alike (one prompt to every request) share the reads. The GPU runs only the
GEMMs of its hits and fills, after both lanes.
"""

from __future__ import annotations

import math

from domain.residency import (
    HOST_ROWS_PER_PASS,
    balanced_host_permille,  # noqa: F401 - predict's auto share, as ft serve's
    host_key_count,
    host_split,
    host_weight_passes,
)

# the rows one weight pass of the host kernel serves, and a host key's passes: the domain's (its split weighs keys by
# them), which names the kernel's MAX_VECTORS in adapters/host_kernels/fp8_block_experts.cpp
ROWS_PER_PASS = HOST_ROWS_PER_PASS
weight_passes = host_weight_passes


def passes_per_key(pairs_per_key: float) -> float:
    """The step model's weight passes a host key on average, for host keys routed `pairs_per_key` pairs on average
    (decode_step: routed pairs / distinct experts, the same for every key as the GPU's per-pair reads assume).
    Assumes the pairs spread as evenly over the keys as their average allows: every key is routed by the integer
    below the average or the one above, weighted by nearness (as miss_points), and costs weight_passes of it. So rows
    that never share a key (an average of 1, or below) cost a pass a pair, as before passes were counted; lockstep rows
    (one prompt: n rows on every key) cost ceil(n / ROWS_PER_PASS) a key; and distinct rows on uniform routing, which
    put a few pairs on a few keys (1 to 2 on average), cost a pass a key. A routing that piles more than
    ROWS_PER_PASS rows on some keys and one on the rest costs more than this says: the simulated executor, which
    counts each key's rows, is the one to trust there."""
    if pairs_per_key < 0:
        raise ValueError(f"negative pairs per key {pairs_per_key}")
    low = math.floor(pairs_per_key)
    upper = pairs_per_key - low  # weight of low + 1
    return (1 - upper) * weight_passes(low) + upper * weight_passes(low + 1)


def host_seconds(passes: float, pairs: float, calls: float, expert_bytes: int, call_s: float, gb_s: float,
                 row_factor: float) -> float:
    """Seconds the host lane takes for `passes` weight passes serving `pairs` routed pairs, handed over in `calls`
    lookups: calls x call_s + (passes + row_factor x (pairs - passes)) x expert_bytes / (gb_s x 1e9), a pass of n
    rows costing 1 + row_factor x (n - 1) one-row passes (CostParams' host_call_s, host_expert_gb_s and
    host_row_factor; CostModel.host_compute checks its arguments and calls this)."""
    return calls * call_s + (passes + row_factor * (pairs - passes)) * expert_bytes / (gb_s * 1e9)


def host_keys_at(misses: int, permille: int, passes_per_key: float) -> int:
    """The step model's host keys of a layer with `misses` (whole) misses whose keys weigh `passes_per_key` weight
    passes on average (the domain's host_split with every key alike): as many as fit host_key_count(misses,
    permille) passes, never more than that count. 0 without a share."""
    budget = host_key_count(misses, permille)
    if not budget or passes_per_key <= 1:
        return budget
    return min(budget, math.floor(budget / passes_per_key + 1e-9))


def miss_points(misses: float, permille: int) -> list[tuple[float, float]]:
    """(weight, misses) points a layer with `misses` misses on average is costed at (decode_step). Without a host share,
    the average itself. With one, whole counts, since a lookup sends the host its last misses within host_key_count(m,
    permille) weight passes (host_keys_at) and a layer takes the longer of its two lanes: the two integers around the
    average, weighted by nearness (the least spread an average allows; one point where it is whole). Where a layer's
    misses spread wider (bs1 on uniform routing: 0 to 8), the simulated executor, which looks each layer up, is the one
    to trust."""
    if misses < 0:
        raise ValueError(f"negative misses {misses}")
    if not permille:
        return [(1.0, misses)]
    low = math.floor(misses)
    upper = misses - low  # weight of low + 1
    return [(1.0, low)] if not upper else [(1 - upper, low), (upper, low + 1)]


def _finite_non_negative(value) -> bool:
    """A real number (not a bool) in [0, inf)."""
    return not isinstance(value, bool) and isinstance(value, int | float) and 0 <= value < math.inf


def check_host_params(params) -> None:
    """CostParams' host fields (ValueError): host_expert_gb_s a finite number >= 0 (0: no host lane), host_permille an
    integer in 0..1000, host_call_s >= 0, host_row_factor and host_wait_row_s finite numbers >= 0; a host share needs
    a host rate."""
    name = type(params).__name__
    rate, permille, call = params.host_expert_gb_s, params.host_permille, params.host_call_s
    rows, wait, cap = params.host_row_factor, params.host_wait_row_s, params.host_max_rows
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
        raise ValueError(f"{name}.host_max_rows must be an integer >= 0 (the largest decode call, in rows, the host "
                         f"lane serves; 0: every call), got {cap!r}")
    if not _finite_non_negative(wait):
        raise ValueError(f"{name}.host_wait_row_s must be a finite number >= 0 (GPU seconds a routed row of a lookup "
                         f"with host keys waits past both lanes), got {wait!r}")
    if not _finite_non_negative(rows):
        raise ValueError(f"{name}.host_row_factor must be a finite number >= 0 (a pass of n rows costs 1 + factor x "
                         f"(n - 1) 1-row passes), got {rows!r}")
    if not _finite_non_negative(rate):
        raise ValueError(f"{name}.host_expert_gb_s must be a finite number >= 0 (GB/s of expert bytes; 0: off), "
                         f"got {rate!r}")
    if isinstance(permille, bool) or not isinstance(permille, int) or not 0 <= permille <= 1000:
        raise ValueError(f"{name}.host_permille must be an integer in 0..1000 (the share of each lookup's misses "
                         f"computed on the host), got {permille!r}")
    if not _finite_non_negative(call):
        raise ValueError(f"{name}.host_call_s must be a finite number >= 0 (seconds a lookup with host keys), "
                         f"got {call!r}")
    if permille and not rate:
        raise ValueError(f"{name}.host_permille = {permille} needs host_expert_gb_s > 0 (the host's rate)")


def with_host_lane(cost, hardware, host_gb_s: float | None, permille: int | str | None,
                   call_us: float | None = None, row_factor: float | None = None, wait_row_us: float | None = None,
                   max_rows: int | None = None):
    """`cost` (CostParams) with predict's --host-experts-gb-s and --host-permille N|auto: auto (also the default
    when only a rate is given) is balanced_host_permille of the host rate and the link's, the profile's pinned
    host->device bandwidth at the calibration's h2d_efficiency; --host-call-us (µs), --host-row-factor and
    --host-wait-row-us (µs) set host_call_s, host_row_factor and host_wait_row_s, --host-lane-rows host_max_rows
    (None: `cost`'s). Neither rate nor share given: `cost` itself (ValueError if any of those four is, as they price
    a lane there is not). ValueError for a share without a rate (CostParams' own check)."""
    if host_gb_s is None and permille is None:
        if call_us is not None or row_factor is not None or wait_row_us is not None or max_rows is not None:
            raise ValueError("--host-call-us, --host-row-factor, --host-wait-row-us and --host-lane-rows price the "
                             "host lane: give --host-experts-gb-s too")
        return cost
    if max_rows is not None:
        cost = cost.replace(host_max_rows=max_rows)
    if call_us is not None:
        cost = cost.replace(host_call_s=call_us * 1e-6)
    if row_factor is not None:
        cost = cost.replace(host_row_factor=row_factor)
    if wait_row_us is not None:
        cost = cost.replace(host_wait_row_s=wait_row_us * 1e-6)
    rate = cost.host_expert_gb_s if host_gb_s is None else host_gb_s
    if permille is None or permille == "auto":
        if not rate:
            raise ValueError("--host-permille auto needs --host-experts-gb-s (the host's rate in GB/s)")
        permille = balanced_host_permille(rate, hardware.h2d_bytes_per_s * cost.h2d_efficiency / 1e9)
    return cost.replace(host_expert_gb_s=float(rate), host_permille=permille)


# The host request's cost fitted on session 41's host-kernel file
# (docs/bench/2026-12-07-s41-h100-host-experts-lane.json, the spin team at 15 threads; fit_host_request): a request is host_call_s + its weight passes at host_expert_gb_s, a
# pass of n rows routed alike costing (1 + host_row_factor x (n - 1)) 1-row passes. Not a calibration's: pass it to
# CostParams.replace with a lane's share (docs/simulator.md, "The host lane's request cost refit on the host-kernel file
# (session 42)").
H100_HOST_REQUEST_S41 = {"host_call_s": 66.4e-6, "host_expert_gb_s": 64.1, "host_row_factor": 0.191}


def fit_host_request(results: dict, expert_bytes: int, threads: int = 15, team: str = "spin") -> dict:
    """host_call_s, host_expert_gb_s and host_row_factor fitted on a host-kernel record's `results`
    (scripts/bench_host_experts.py: "lane_{team}_{k}@{threads}" for k experts of one row, us_per_request, and
    "lane_{team}_{k}@{threads}x{n}rows" for k experts of n rows routed alike; an entry without "rows" is one row): the
    fixed part and the per-expert cost by least squares over the 1-row requests, then the row factor as host_compute
    prices a request (k keys of n rows: k x (p + factor x (n - p)) one-row passes, p = weight_passes(n)), the mean over
    the many-row requests of ((us - fixed) / (k x per expert) - p) / (n - p). ValueError with fewer than two 1-row
    sizes or no many-row one."""
    one, many = [], []
    for key, r in results.items():
        if not key.startswith(f"lane_{team}_") or r.get("threads") != threads or r.get("team") != team:
            continue
        rows = r.get("rows", 1)
        (one if rows == 1 else many).append((r["experts_per_call"], rows, r["us_per_request"]))
    if len({k for k, _, _ in one}) < 2 or not many:
        raise ValueError(f"need 1-row requests of two sizes and a many-row one at {threads} threads ({team})")
    n = len(one)
    mx, my = sum(k for k, _, _ in one) / n, sum(us for _, _, us in one) / n
    per = sum((k - mx) * (us - my) for k, _, us in one) / sum((k - mx) ** 2 for k, _, _ in one)
    fixed = my - per * mx
    factor = sum(((us - fixed) / (k * per) - weight_passes(rows)) / (rows - weight_passes(rows))
                 for k, rows, us in many) / len(many)
    return {"host_call_s": fixed * 1e-6, "host_expert_gb_s": expert_bytes / (per * 1e-6) / 1e9,
            "host_row_factor": factor}


# The hand-off's GPU side fitted on bench_decode's per-kernel profiles of the lane (fit_host_wait over
# docs/bench/2026-12-07-s41-h100-bench-decode-{h423,same-prompt-h423}.json and
# ...-s42-h100-bench-decode-same-prompt-hauto.json, with H100_HOST_REQUEST_S41's request cost): GPU seconds a routed
# row of a lookup with host keys waits past the host's imbalance with the GPU's own work. Not a calibration's: pass it
# to CostParams.replace with the request cost (docs/simulator.md, "The host lane's hand-off on the GPU (session 43)").
H100_HOST_WAIT_S43 = {"host_wait_row_s": 17.3e-6}
# The same refitted on session 44's profiles, after the wait kernel went to one poller a row
# (docs/bench/2026-12-07-s44-h100-bench-decode-{same-prompt-hauto-rows4,same-prompt-hauto-rows8,hauto-rows4}.json, with
# H100_HOST_REQUEST_S41's request cost): the engine's since then (docs/simulator.md, "Session 44: one poller a row").
H100_HOST_WAIT_S44 = {"host_wait_row_s": 3.05e-6}


def _kernel_us(profile: dict | None, name: str) -> tuple[float, int]:
    """(µs a step, launches a step) of one kernel in a bench_decode profile's top_kernels; (0, 0) where absent."""
    for k in (profile or {}).get("top_kernels", ()):
        if k["kernel"] == name:
            return k["us_per_step"], k["launches_per_step"]
    return 0.0, 0


def host_wait_point(point: dict, share: int, same_prompt: bool, geometry: dict, expert_bytes: int,
                    request: dict) -> dict:
    """One bench_decode batch point of the host lane (`point`: scenarios[..].batches[rows], with its miss_profile of
    graph replays that miss) split into what its wait kernel (_wait_add_kernel, after the layer's expert GEMMs) spent.
    Per layer, on uniform routing as the simulator's: the layer looks up D distinct keys (top-k for one prompt, whose
    rows route alike; E x (1 - (1 - K/E)^T) for distinct rows) of which m ~ Binomial(D, misses a layer / D) miss,
    measured misses from miss_bytes_per_step; the domain's split (host_split) sends k(m) of them to the host. The host
    takes `request`'s cost (host_call_s, host_expert_gb_s, host_row_factor: fit_host_request's keys) for its k keys;
    the GPU's own work after the publish is the other m - k copies, at the profile's gather time a copied miss, plus
    the profile's expert GEMMs and sum a layer. Returns, in µs: `wait` (a layer), `empty` (a launch without host keys:
    the point's all-hit profile, where nothing is sent), `host_layers` (the share of layers with host keys),
    `host`, `gpu` (their means over those layers), `imbalance` (E[max(0, host - gpu)] a layer) and `residual` (a
    layer with host keys: the wait less the empty launches and the imbalance), with `rows`. ValueError for a point
    without a miss profile or a share, or with more misses than keys."""
    profile = point.get("miss_profile")
    if not profile or not share:
        raise ValueError("a host lane point needs a miss_profile and a share")
    layers, experts, top_k = geometry["num_hidden_layers"], geometry["num_experts"], geometry["num_experts_per_tok"]
    if "rows" not in point:
        raise ValueError("the point must carry its rows")
    rows = max(1, round(point["rows"]))
    distinct = top_k if same_prompt else round(experts * (1 - (1 - top_k / experts) ** rows))
    key_rows = rows if same_prompt else rows * top_k / distinct
    misses = point["miss_bytes_per_step"] / expert_bytes / layers
    q = misses / distinct
    if not 0 < q <= 1:
        raise ValueError(f"{misses:.2f} misses a layer do not fit {distinct} keys")
    probs = [math.comb(distinct, m) * q ** m * (1 - q) ** (distinct - m) for m in range(distinct + 1)]
    whole = max(1, round(key_rows))

    def on_host(m: int) -> int:
        return host_split([whole] * m, share) if m else 0

    host_keys = sum(pm * on_host(m) for m, pm in enumerate(probs))
    copy_us = _kernel_us(profile, "_gather_rows_kernel")[0] / layers / (misses - host_keys)
    gemms_us = sum(_kernel_us(profile, k)[0] for k in ("_moe_gate_up_kernel", "_moe_down_kernel",
                                                       "_moe_sum_kernel")) / layers
    passes = passes_per_key(key_rows)

    def host_us(k: int) -> float:  # CostModel.host_compute of k keys of key_rows rows each, one call
        return 1e6 * host_seconds(k * passes, k * key_rows, 1, expert_bytes, request["host_call_s"],
                                  request["host_expert_gb_s"], request["host_row_factor"])

    host_layers = imbalance = host_sum = gpu_sum = 0.0
    for m, pm in enumerate(probs):
        k = on_host(m)
        if not k:
            continue
        h, g = host_us(k), (m - k) * copy_us + gemms_us
        host_layers += pm
        host_sum += pm * h
        gpu_sum += pm * g
        imbalance += pm * max(0.0, h - g)
    us, launches = _kernel_us(point.get("profile"), "_wait_add_kernel")
    empty = us / launches if launches else 0.0
    wait = _kernel_us(profile, "_wait_add_kernel")[0] / layers
    if not host_layers:
        raise ValueError("no layer of this point sends the host a key")
    return {"rows": rows, "wait": wait, "empty": empty, "host_layers": host_layers, "host": host_sum / host_layers,
            "gpu": gpu_sum / host_layers, "imbalance": imbalance,
            "residual": (wait - (1 - host_layers) * empty - imbalance) / host_layers}


def host_wait_points(record: dict, expert_bytes: int, request: dict) -> list[dict]:
    """host_wait_point of every batch point of a bench_decode record (scripts/bench_decode.py) whose lane was on and
    that carries a miss_profile, each with its `scenario` and `record` path keys left to the caller."""
    out = []
    for name, scenario in record["scenarios"].items():
        lane = scenario.get("host_experts") or {}
        share, max_rows = lane.get("share") or 0, lane.get("max_rows")  # max_rows: records from session 44 on
        if not share:
            continue
        buckets = sorted(scenario.get("graph_buckets") or ())
        for rows, point in scenario["batches"].items():
            # the engine caps the lane by the graph a batch runs in (its padded bucket), not by the batch itself
            graph = next((b for b in buckets if b >= int(rows)), int(rows))
            if not point.get("miss_profile") or (max_rows and graph > max_rows):  # past the lane: all copied
                continue
            got = host_wait_point({**point, "rows": int(rows)}, share, bool(record["args"].get("same_prompt")),
                                  record["geometry"], expert_bytes, request)
            out.append({"scenario": name, "share": share, "same_prompt": bool(record["args"].get("same_prompt")),
                        **got})
    return out


def fit_host_wait(records: list[dict], expert_bytes: int, request: dict) -> dict:
    """host_wait_row_s fitted on bench_decode records of the lane (host_wait_points): the GPU seconds a routed row
    of a lookup with host keys waits past the host's imbalance with the GPU's own work, by least squares through
    the origin of each point's residual (µs a layer with host keys) against its rows, every point weighing alike.
    Returns {"host_wait_row_s": s, "points": [...]}. ValueError without a lane point."""
    points = [p for record in records for p in host_wait_points(record, expert_bytes, request)]
    if not points:
        raise ValueError("no bench_decode point of the host lane with a miss_profile")
    per_row = sum(p["rows"] * p["residual"] for p in points) / sum(p["rows"] ** 2 for p in points)
    return {"host_wait_row_s": per_row * 1e-6, "points": points}
