"""One streamed prefill step of the device expert pool (docs/adr/0010-streamed-prefill.md): the experts a
layer routes to that are not resident are copied from the pinned host bank into staging rows (never into
the residency's slots), in rounds that alternate between two staging halves, and the MoE kernels read
resident experts in place and the others from staging. The residency is only read (one snapshot of its
table, taken when the step opens): no stamp, no victim, no fill, so the decode working set stays as it was.

On CUDA the copies run on a side stream (`CopyLane`) and are ordered by events: a copy into a staging
half waits for the compute that last read that half (and, for a masked round, for its layer's routing);
a round's compute waits for its copy. On the CPU the same calls run inline, in issue order.

How a round is copied (docs/prefill-kernels.md, "Overlap of copies and compute"): a round whose experts
are known on the host (a layer's first round, or every round of a long chunk) goes through the copy engine
(`copy_engine_runs`: one cudaMemcpyAsync per run of consecutive rows), which uses no SM, so the MoE
GEMMs and the next layer's mixer run at full speed beside it. A round masked by its layer's routing
(short chunks) keeps the UVA gather kernel, which reads its keys on the device (no host sync). The
gather kernel occupies most of the GPU's thread slots for the whole copy (a 33-expert round launches
1,584 programs that each wait on PCIe reads); with it for every round the streamed 4k prefill on the H200
took copy time + compute time (docs/bench/2026-12-01-bench-prefill-h200-run2.json), its compute-stream
kernels stretched by about the copy time: our reading is that they starved for SMs (to be confirmed by
the copy-engine run's timeline).

Shape legend: L layers, E experts per layer, T tokens, K top-k, G staging rows, g rows per round,
n rounds of the step; a flat key is layer * E + expert (the host bank's row).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from adapters.cuda_exec.device_residency import fill_sink
from adapters.kernels.expert_gather import gather_rows
from domain.streamed_prefill import (
    StagingRound,
    copy_runs,
    plan_rounds,
    speculate_whole_layers,
    staging_buffers,
)

COPY_ENGINE, GATHER_KERNEL = "engine", "kernel"  # how rounds known on the host are copied (pool.staging_copy)


def copy_engine_runs(bank_rows: torch.Tensor, slots: torch.Tensor, runs) -> None:
    """slots[d:d+n] = bank_rows[s:s+n] for each run (s, d, n), as copy-engine copies on the current stream
    (asynchronous from pinned host memory on CUDA; a plain copy on the CPU). bank_rows uint8 [N, R],
    slots uint8 [S + L + G, R]."""
    for s, d, n in runs:
        slots[d:d + n].copy_(bank_rows[s:s + n], non_blocking=True)


class ResidencySnapshot(NamedTuple):
    """The residency's (layer, expert) -> slot table as a step opens: on the device for the kernels, and
    its host copy (pinned on CUDA, in flight until `copied` completes) for planning the rounds; opened: an
    event after every earlier kernel of the compute stream (the previous step's last read of staging)."""

    table: torch.Tensor  # int64 [L*E] on the device
    host: torch.Tensor  # int64 [L*E] on the host
    copied: object  # torch.cuda.Event or None (CPU)
    opened: object  # torch.cuda.Event or None (CPU)

    def host_rows(self, layers: int, experts: int) -> list[list[int]]:
        """The host table as lists [L][E]; waits for its copy only (not for the compute stream)."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.host.view(layers, experts).tolist()


class RoundCopy:
    """One round's copy as the lane runs it: `round` (its index in the step) and `engine` (copy engine or
    gather kernel) let a recording lane in the tests tell the copies apart."""

    def __init__(self, round_index: int, engine: bool, fn):
        self.round, self.engine, self._fn = round_index, engine, fn

    def __call__(self) -> None:
        self._fn()


class CopyLane:
    """Where staging copies run: a side stream with events on CUDA, inline on the CPU (events None)."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def mark(self):
        """An event after the work queued so far on the current (compute) stream; None on the CPU."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def copy(self, fn, waits, keep=()):
        """Run fn() on the lane after the events `waits`; returns the event of its completion. keep:
        tensors allocated on the compute stream that fn reads (their memory is held until the lane
        is done with them)."""
        if self.stream is None:
            fn()
            return None
        with torch.cuda.stream(self.stream):
            for event in waits:
                if event is not None:
                    self.stream.wait_event(event)
            for t in keep:
                t.record_stream(self.stream)
            fn()
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def wait(self, event) -> None:
        """The compute stream waits for `event` (a copy's completion)."""
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def drain(self) -> None:
        """The compute stream waits for everything queued on the lane (end of a step)."""
        if self.stream is not None:
            torch.cuda.current_stream().wait_stream(self.stream)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host table on the device without a host sync: a blocking host->device copy synchronises the
    compute stream (torch waits for it), which would stall the host at the first streamed layer until the
    device had run everything queued before it. Through pinned memory the copy is asynchronous (the
    pinned allocator keeps the block until the copy is done)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class PrefillStream:
    """The staging state of one step whose chunk has `pairs` routed (token, top-k) pairs per layer."""

    def __init__(self, pool, lane: CopyLane, pairs: int, snapshot: ResidencySnapshot,
                 computed: tuple[int, int] | None = None):
        """computed: (first, end), the only layers the step runs (a layered prefill's group); the other layers
        get no copies (their one empty round each), so nothing is prefetched past the group. None: every layer."""
        bank, dev = pool.bank, pool.device
        self.pool, self.lane, self.pairs = pool, lane, pairs
        layers, experts = bank.num_layers, bank.num_experts
        self.experts = experts
        # the residency's table as the step opened; nothing changes it until the step ends
        self.resident = snapshot.table.view(layers, experts)  # [L, E]
        resident_host = snapshot.host_rows(layers, experts)  # NOTE: waits for the snapshot's copy only
        shard = pool.shard  # expert parallelism: only this rank's experts are ever staged
        missing = [[e for e, s in enumerate(row) if s < 0 and (shard is None or shard.partition.owns(shard.rank, (l, e)))]
                   if computed is None or computed[0] <= l < computed[1] else []
                   for l, row in enumerate(resident_host)]
        self.rounds: tuple[StagingRound, ...] = plan_rounds(missing, pool.staging_slots)
        self.buffers, self.per_round = staging_buffers(pool.staging_slots)
        self.speculate = speculate_whole_layers(pairs, experts)
        self.engine = pool.staging_copy == COPY_ENGINE
        self.of_layer: list[list[int]] = [[] for _ in range(layers)]
        base = pool.staging_base
        # NOTE: the tables are filled from flat lists in a few tensor ops, not per round: this runs on the
        # host at the first streamed layer while the link waits for its first copy (~280 rounds at 20 %)
        at_round, at_col, expert_of, key_of, row_to = [], [], [], [], []
        for r, rnd in enumerate(self.rounds):
            self.of_layer[rnd.layer].append(r)
            n, first_row = len(rnd.experts), base + rnd.buffer * self.per_round
            flat = [rnd.layer * experts + e for e in rnd.experts]
            at_round += [r] * n
            at_col += range(n)
            expert_of += rnd.experts
            key_of += flat
            row_to += range(first_row, first_row + n)
        keys = torch.full((len(self.rounds), self.per_round), -1, dtype=torch.int64)  # [n, g] flat keys
        dst = torch.full((len(self.rounds), self.per_round), -1, dtype=torch.int64)  # [n, g] staging rows
        # per round, the slot each key of its layer is computed from in that round: experts 0..E-1 (a staging
        # row if the round copies it; in the layer's first round also a resident slot), key E the shared
        # expert (first round only), key E + 1 nothing (padding, another rank's pair); -1: not this round
        maps = torch.full((len(self.rounds), experts + 2), -1, dtype=torch.int32)  # [n, E + 2]
        if at_round:
            r_at, c_at = torch.tensor(at_round), torch.tensor(at_col)
            keys[r_at, c_at] = torch.tensor(key_of)
            dst[r_at, c_at] = torch.tensor(row_to)
            maps[r_at, torch.tensor(expert_of)] = torch.tensor(row_to, dtype=torch.int32)
        firsts = [r for r, rnd in enumerate(self.rounds) if rnd.first]  # one per layer, in layer order
        first_layers = [self.rounds[r].layer for r in firsts]
        slot = snapshot.host.view(layers, experts)[first_layers].to(torch.int32)  # [L, E] (host_rows waited for it)
        at = torch.tensor(firsts)
        maps[at, :experts] = torch.where(slot >= 0, slot, maps[at, :experts])
        maps[at, experts] = torch.tensor([pool.shared_slot(l) if pool.has_shared else -1 for l in first_layers],
                                         dtype=torch.int32)
        self.keys, self.dst, self.maps = _to_device(keys, dev), _to_device(dst, dev), _to_device(maps, dev)
        self.rows = pool.bank_rows(self.keys.view(-1)).view(self.keys.shape)  # [n, g] host bank rows
        self.ready = lane.mark()  # the tables above are on the device (what the gather kernel reads)
        self.holds = [-1] * self.buffers  # the round each staging half holds (or is loading)
        # event: the last compute that read each half; first the step's opening (the previous step's reads)
        self.free = [snapshot.opened] * self.buffers
        self.copied: dict[int, object] = {}  # round -> event of its copy
        self.staged_rows = 0  # rows copied by unmasked rounds (host-known)
        self.masked = torch.zeros((), dtype=torch.int64, device=dev)  # rows copied by masked rounds
        self.needed = torch.zeros((), dtype=torch.int64, device=dev)  # routed (layer, expert)s not resident

    # ---- copies ----------------------------------------------------------------------------------
    def _issue(self, r: int, routed: torch.Tensor | None) -> None:
        """Copy round r into its staging half unless that half already holds it. routed: bool [E + 1] of
        the round's layer when its router has run (then a later round copies only routed experts, unless
        the step speculates). An unmasked round goes through the copy engine (pool.staging_copy "engine")
        and waits only for the compute that last read its half; the gather kernel also waits for the
        step's device tables and, when masked, for the masked keys."""
        rnd = self.rounds[r]
        if self.holds[rnd.buffer] == r:
            return
        keys, waits, keep = self.keys[r], [self.free[rnd.buffer]], ()
        src = self.rows[r]  # [g] the bank rows of keys (-1 where none)
        masked = routed is not None and not rnd.first and not self.speculate
        if masked:
            index = torch.where(keys >= 0, keys - rnd.layer * self.experts, self.experts)  # [g]
            keys = torch.where(routed[index], keys, -1)  # [g]
            src = torch.where(keys >= 0, src, -1)  # [g]
            self.masked += (keys >= 0).sum()
            waits.append(self.lane.mark())  # NOTE: after the masked keys exist, not just the routing
            keep = (src,)
        else:
            self.staged_rows += len(rnd.experts)
        if not rnd.experts:
            self.copied[r] = None
        elif self.engine and not masked:
            bank, slots, runs = self.pool.bank.rows, self.pool.all_slots, self._runs(r)
            self.copied[r] = self.lane.copy(RoundCopy(r, True, lambda: copy_engine_runs(bank, slots, runs)), waits)
        else:
            bank, slots, dst = self.pool.bank.rows, self.pool.all_slots, self.dst[r]
            waits.append(self.ready)
            self.copied[r] = self.lane.copy(RoundCopy(r, False, lambda: gather_rows(bank, slots, src, dst)), waits,
                                            keep)
        self.holds[rnd.buffer] = r

    def _runs(self, r: int) -> tuple[tuple[int, int, int], ...]:
        """Round r's copy-engine runs (first bank row, first staging row, rows); computed when the round is
        issued, so the host spends it while the device is busy rather than at the step's first layer."""
        rnd, row_of_key = self.rounds[r], self.pool.bank.row_of_key  # None: a whole bank, row = flat key
        flat = [rnd.layer * self.experts + e for e in rnd.experts]
        first = self.pool.staging_base + rnd.buffer * self.per_round
        return copy_runs(flat if row_of_key is None else [row_of_key[k] for k in flat],
                         range(first, first + len(flat)))

    def _issue_ahead(self, r: int, layer: int, routed: torch.Tensor) -> None:
        """After round r's compute freed its half: queue the round that next uses that half (r + buffers)
        now if it needs no routing that does not exist yet (its layer's, or none: a first round or a
        speculating step). NOTE: so the lane holds two rounds across a layer boundary without waiting for
        the host to reach the next layer's MoE (its copy still waits, on the device, for round r's compute)."""
        ahead = r + self.buffers
        if self.buffers < 2 or ahead >= len(self.rounds):
            return
        nxt = self.rounds[ahead]
        if nxt.layer == layer:
            self._issue(ahead, routed)
        elif nxt.first or self.speculate:
            self._issue(ahead, None)

    # ---- one layer -------------------------------------------------------------------------------
    def layer(self, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
              valid: torch.Tensor | None, shared: bool, partials: torch.Tensor) -> None:
        """Fill partials fp32 [T, K(+1), H] for layer `layer`: its resident experts (in place), its staged
        ones round by round, and (shared) its resident shared expert in column K."""
        if ids.numel() != self.pairs:
            raise ValueError(f"a streamed step routes {self.pairs} pairs in every layer, got {ids.numel()}")
        pool, experts = self.pool, self.experts
        safe = ids.to(torch.int64) if valid is None else torch.where(valid[:, None], ids.to(torch.int64), experts)
        if pool.shard is not None:  # pairs another rank owns route nowhere here (as padding does)
            flat = torch.where(safe < experts, safe + layer * experts, -1).reshape(-1)
            safe = torch.where(pool.residency.owned_only(flat).view(safe.shape) >= 0, safe, experts)
        routed = torch.zeros(experts + 1, dtype=torch.bool, device=ids.device)
        routed.index_fill_(0, safe.reshape(-1), True)  # [E + 1], a scatter: no host sync
        fill_sink(routed, False)  # index E: padding and other ranks' pairs
        self.needed += (routed[:experts] & (self.resident[layer] < 0)).sum()
        # int32 [T, K(+1)] map keys: -1 routes nowhere (padding, another rank's pair), column K key E: shared
        keys = pool.expert_keys(safe, safe >= experts, shared)
        # NOTE: the grouped GEMMs' pairs are aligned once per layer, by expert; a round only maps the
        # blocks' experts to its slots (-1: skipped), instead of re-sorting every pair per round. A pair's
        # rows in its block are the same either way, so the bits are those of the one-launch path.
        align = pool.align_by_expert(keys) if pool.takes_grouped(ids.numel()) else None
        h = None
        mine = self.of_layer[layer]
        for j, r in enumerate(mine):
            self._issue(r, routed)
            if self.buffers > 1 and r + 1 < len(self.rounds):  # the next round copies while this one computes
                same_layer = j + 1 < len(mine)
                self._issue(r + 1, routed if same_layer else None)
            self.lane.wait(self.copied[r])
            rnd = self.rounds[r]
            if align is None:  # per-pair GEMVs: the slot of every pair, -1 where not this round
                pool._experts(ids.numel(), x, self.maps[r][keys], weights, partials)  # slots [T, K(+1)]
            else:
                # [B] this round's slot of each block; an unused block's key -1 reads entry E + 1, which is -1
                slots = self.maps[r][align.block_slots]
                h = pool.grouped_round(x, align._replace(block_slots=slots), weights, partials, h)
            self.free[rnd.buffer] = self.lane.mark()
            self._issue_ahead(r, layer, routed)

    def finish(self) -> None:
        """End of the step: the compute stream waits for any copy still in flight (a prefetched round
        no layer computed), so the next step finds staging quiet."""
        self.lane.drain()
