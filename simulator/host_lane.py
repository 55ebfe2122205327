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
    integer in 0..1000, host_call_s >= 0, host_row_factor a finite number >= 0; a host share needs a host rate."""
    name = type(params).__name__
    rate, permille, call = params.host_expert_gb_s, params.host_permille, params.host_call_s
    rows = params.host_row_factor
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
                   call_us: float | None = None, row_factor: float | None = None):
    """`cost` (CostParams) with predict's --host-experts-gb-s and --host-permille N|auto: auto (also the default
    when only a rate is given) is balanced_host_permille of the host rate and the link's, the profile's pinned
    host->device bandwidth at the calibration's h2d_efficiency; --host-call-us (µs) and --host-row-factor set
    host_call_s and host_row_factor. Neither rate nor share given: `cost` itself (ValueError if a call cost or a
    row factor is, as they price a lane there is not). ValueError for a share without a rate (CostParams' own check)."""
    if host_gb_s is None and permille is None:
        if call_us is not None or row_factor is not None:
            raise ValueError("--host-call-us and --host-row-factor price the host lane: give --host-experts-gb-s too")
        return cost
    if call_us is not None:
        cost = cost.replace(host_call_s=call_us * 1e-6)
    if row_factor is not None:
        cost = cost.replace(host_row_factor=row_factor)
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
