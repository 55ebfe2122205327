"""Streamed expert prefill (issue 9, docs/adr/0010-streamed-prefill.md): the policy, free of any tensor.

A prefill chunk that streams experts reads resident experts where they are and copies the others from
the pinned host bank into a staging area of `staging` expert rows, in rounds of `per_round` experts
that alternate between `buffers` halves (double buffering: while one round computes, the next copies).
The expert residency (the decode streams' LRU) is neither read for victims nor changed.

This module plans the rounds of a step, says when copies may run ahead of the router, sizes the
default staging area from the geometry, and gives the PCIe bound a streamed prefill is measured against.
Units: bytes, seconds, bytes per second; experts are indices within a layer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# The link rate for the PCIe bound (pinned host -> H200, copy engine or the UVA gather kernel:
# 47-52 GB/s measured, docs/fast-decode.md). Benchmarks pass the rate they measure instead.
LINK_BYTES_PER_S = 51e9
# Device time the two halves in flight must cover at a layer boundary: the next layer's token mixer and
# router, during which the copies of that layer cannot yet be masked by its routing (a 4k-8k chunk's mixer
# measured at ~3.6 ms of device time and 6-12 ms of wall time). 8 ms: session 25 measured 132 rows against
# the 4 ms default's 66 on an H100 at --gpu-budget-gib 24, the streamed 8k prompt 0.455 -> 0.391 s and 32k
# 2.025 -> 1.631 s (docs/bench/2026-12-05-h100-prefill-24gib-staging{66,132}.json; docs/adr/0010-streamed-prefill.md).
STAGING_COVER_S = 0.008
# A chunk with at least this many (token, top-k) pairs per expert of a layer touches practically every
# expert (uniform routing leaves a fraction exp(-8) = 0.03 % untouched), so every round of a layer is
# copied before its router has run: no copy ever waits for routing. Shorter chunks copy only the
# first round of a layer speculatively and the later ones masked to the experts actually routed.
SPECULATE_PAIRS_PER_EXPERT = 8


@dataclass(frozen=True)
class StagingRound:
    """One round: `experts` (ascending, within `layer`) copied into staging half `buffer`.

    first: the layer's first round (it also computes the layer's resident experts and shared expert).
    An empty `experts` (a layer with nothing to stage) still makes one compute round.
    """

    layer: int
    experts: tuple[int, ...]
    buffer: int
    first: bool


def staging_buffers(staging: int) -> tuple[int, int]:
    """(buffers, experts per round) for a staging area of `staging` rows: two halves when it holds two
    experts or more (double buffering), else one (copy and compute of a round serialise).
    Raises ValueError for staging < 1."""
    if staging < 1:
        raise ValueError(f"a staging area needs at least one expert row, got {staging}")
    buffers = 2 if staging >= 2 else 1
    return buffers, staging // buffers


def plan_rounds(missing: Sequence[Sequence[int]], staging: int) -> tuple[StagingRound, ...]:
    """The rounds of one streamed step, in execution order, for missing[layer] = that layer's experts
    that are not resident (any order; duplicates are an error). Each layer gets ceil(len / per_round)
    rounds (at least one); round r of the step uses buffer r % buffers.
    Raises ValueError on a duplicate or negative expert."""
    buffers, per_round = staging_buffers(staging)
    rounds: list[StagingRound] = []
    for layer, experts in enumerate(missing):
        ordered = sorted(experts)
        if len(set(ordered)) != len(ordered) or (ordered and ordered[0] < 0):
            raise ValueError(f"layer {layer}: missing experts must be distinct and >= 0, got {list(experts)}")
        chunks = [tuple(ordered[i:i + per_round]) for i in range(0, len(ordered), per_round)] or [()]
        for j, chunk in enumerate(chunks):
            rounds.append(StagingRound(layer, chunk, len(rounds) % buffers, j == 0))
    return tuple(rounds)


def speculate_whole_layers(pairs: int, experts_per_layer: int) -> bool:
    """True when a chunk of `pairs` routed (token, top-k) pairs copies every round of a layer without
    waiting for the layer's router (see SPECULATE_PAIRS_PER_EXPERT)."""
    return pairs >= SPECULATE_PAIRS_PER_EXPERT * experts_per_layer


def default_staging_experts(expert_bytes: int, experts_per_layer: int,
                            link_bytes_per_s: float = LINK_BYTES_PER_S, cover_s: float = STAGING_COVER_S) -> int:
    """Staging rows when the operator does not choose: enough that the two rounds in flight at a layer
    boundary keep the link busy for `cover_s` (the next layer's mixer and router), i.e.
    ceil(cover_s * link / expert_bytes) rounded up to even, at least 2, at most two whole layers.
    Qwen3.6 block FP8 (3.0 MiB experts, 256 per layer): 130 rows, 390 MiB.
    Raises ValueError on non-positive sizes."""
    if expert_bytes <= 0 or experts_per_layer <= 0 or link_bytes_per_s <= 0 or cover_s < 0:
        raise ValueError(f"bad staging geometry: {expert_bytes} bytes, {experts_per_layer} experts, "
                         f"{link_bytes_per_s} B/s, {cover_s} s")
    rows = math.ceil(cover_s * link_bytes_per_s / expert_bytes)
    rows += rows % 2
    return max(2, min(rows, 2 * experts_per_layer))


def pcie_bound_s(bytes_not_resident: int, link_bytes_per_s: float = LINK_BYTES_PER_S) -> float:
    """The PCIe bound of a prefill: seconds to move the bytes of the experts it routes to that are not
    resident (each (layer, expert) once per chunk) over the link. Raises ValueError on bad inputs."""
    if bytes_not_resident < 0 or link_bytes_per_s <= 0:
        raise ValueError(f"bytes {bytes_not_resident} must be >= 0 and link rate {link_bytes_per_s} > 0")
    return bytes_not_resident / link_bytes_per_s


def copy_runs(src_rows: Sequence[int], dst_rows: Sequence[int]) -> tuple[tuple[int, int, int], ...]:
    """The copies of one staging round as (first source row, first destination row, rows) runs: each run
    moves consecutive source rows to consecutive destination rows, so a round costs one copy-engine call per
    run instead of one per expert (a layer's missing experts are often consecutive bank rows). The pairs are
    taken in order; a run breaks wherever either side is not the previous row + 1.
    Raises ValueError when the sequences differ in length or hold a negative row."""
    if len(src_rows) != len(dst_rows):
        raise ValueError(f"{len(src_rows)} source rows for {len(dst_rows)} destination rows")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_rows, dst_rows, strict=True):
        if s < 0 or d < 0:
            raise ValueError(f"rows must be >= 0, got source {s}, destination {d}")
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return tuple(runs)
