"""The per-pair expert GEMVs' two terms (CostParams.pair_call_s, pair_read_efficiency) from a bench_decode kernel
profile (issue 10; docs/simulator.md, "Held out on an H100: session 33, refitted").

Why: a decode step's routed experts run as per-pair GEMVs (`_moe_gate_up_kernel`, `_moe_down_kernel`: one program per
(row, top-k) pair), which the model costed as every pair's expert bytes at the one fitted memory_efficiency. On the
H100 that over-scales with the batch: session 25's resident profile took 16.9 us a layer for bs1's 8 routed pairs
and 140.7 us for bs16's 128, 8.3x for 16x the pairs, while the model's 11.4 us a one-row call grows 16x (182 us at
bs16). A shared expert is re-read from L2 and more pairs keep more loads in flight, so the kernels stream a pair
~1.4x faster than the one efficiency says. The terms, solved exactly on the profile's bs1 and bs16 steps:

- `pair_read_efficiency` (share of memory bandwidth): an expert's bytes over the kernels' time per routed pair, the
  growth of the two kernels' time per step from bs1 to bs16 over the (16 - 1) x top-k x layers pairs it added.
- `pair_call_s` (s, once a layer call): the base profile's one-row call (top-k pairs at its memory_efficiency) less
  top-k pairs at that rate. The base was fitted on whole one-row steps, its step_overhead_s holding the rest of the
  kernels' fixed time, so its one-row step stays what it fitted; only the growth per pair becomes the kernels'.

The fused kernels run the shared expert as a ninth pair a row: its reads beyond the one the model's dense bytes hold
are in the per-routed-pair rate. Fitted on session 25's control record (before the fit set of session 32); session
33's profiles are held out (scripts/sim_heldout_h100_s33.py).

With a re-read cost (`reread_s`, CostParams.pair_reread_s; h100_records_v3, simulator/fit_resident_h100.py) the bs16
step's pairs are its expected distinct experts a layer (bench_decode's rows decode different tokens and route near
uniformly: records.expected_distinct) read at the rate, the rest re-reads at `reread_s`, so the rate is solved from
the growth less those re-reads. The one-row call is unchanged (a row's top-k experts are distinct).
"""

from __future__ import annotations

import json
from pathlib import Path

from domain.model_spec import ModelSpec
from simulator.cost_model import CostModel, CostParams
from simulator.hardware import HardwareProfile
from simulator.records import _get, _number, expected_distinct

RECORD = "docs/bench/2026-12-05-h100-decode-control.json"  # session 25, resident block FP8, bs1/4/16 profiled
KERNELS = ("_moe_gate_up_kernel", "_moe_down_kernel")  # adapters/kernels/moe_gate_up.py, moe_down.py
SCENARIO = "resident"
ROWS = (1, 16)


def pair_kernels_s(record: dict, rows: int, where: str, kernels: tuple[str, ...] = KERNELS) -> float:
    """Seconds a step of `rows` rows spent in `kernels` (default the per-pair expert kernels, KERNELS) of the
    record's profile."""
    batch = _get(record, f"scenarios.{SCENARIO}.batches.{rows}", where)
    if _number(batch, "hit_rate", where) != 1.0:
        raise ValueError(f"{where}: bs{rows} has misses; the profile must be of a resident step")
    found = {k["kernel"]: k["us_per_step"] for k in _get(batch, "profile.top_kernels", where)}
    missing = [k for k in kernels if k not in found]
    if missing:
        raise ValueError(f"{where}: bs{rows}'s profile lists no {missing}")
    return sum(found[k] for k in kernels) * 1e-6


def pair_terms(base: CostParams, spec: ModelSpec, hardware: HardwareProfile, record: dict,
               where: str = RECORD, reread_s: float = 0.0) -> dict:
    """{"pair_call_s", "pair_read_efficiency", and what they were solved from} (module docstring), the bs16 step's
    re-read pairs at `reread_s` each (0: none, every pair at the rate). ValueError where the base does not read per
    pair, the rate passes the card's bandwidth or the call would be negative."""
    if base.expert_reads != "pairs":
        raise ValueError(f"the base reads experts {base.expert_reads!r}, not per pair")
    low, high = (pair_kernels_s(record, rows, where) for rows in ROWS)
    k, layers = spec.top_k, spec.num_layers
    if reread_s:  # NOTE: bs1's top-k pairs are distinct; bs16's beyond its distinct experts re-read at reread_s
        distinct = expected_distinct(spec.num_experts, k, ROWS[1])
        rereads = ROWS[1] * k - distinct
        per_pair_s = ((high - low) / layers - rereads * reread_s) / (distinct - k)
    else:
        distinct, rereads = float(ROWS[1] * k), 0.0
        per_pair_s = (high - low) / ((ROWS[1] - ROWS[0]) * k * layers)
    if per_pair_s <= 0:
        raise ValueError(f"{where}: the re-reads ({reread_s * 1e6:.3f} us each) take all of the kernels' growth")
    model = CostModel(spec, hardware, base.replace(pair_call_s=0.0, pair_read_efficiency=0.0, pair_reread_s=0.0))
    efficiency = model.expert_bytes / per_pair_s / hardware.memory_bytes_per_s
    if not 0 < efficiency <= 1:
        raise ValueError(f"{where}: the kernels stream a pair at {efficiency:.3f} of the card's bandwidth")
    one_row = model.expert_read(spec.top_k, spec.top_k, per_pair=True)  # the base's one-row call, a layer
    call = one_row - spec.top_k * per_pair_s
    if call < 0:
        raise ValueError(f"{where}: the base's one-row call ({one_row * 1e6:.2f} us) is shorter than its pairs at "
                         f"the kernels' rate")
    out = {"pair_call_s": call, "pair_read_efficiency": efficiency, "kernel_s": {f"bs{r}": s for r, s in
           zip(ROWS, (low, high), strict=True)}, "per_pair_s": per_pair_s, "base_one_row_call_s": one_row}
    return out | ({"reread_s": reread_s, "bs16_distinct_per_layer": distinct, "bs16_rereads_per_layer": rereads}
                  if reread_s else {})


def load(repo: Path, path: str = RECORD) -> dict:
    return json.loads((repo / path).read_text())
