"""One streamed prefill step of the device expert pool (docs/adr/0010-streamed-prefill.md): the experts a
layer routes to that are not resident are copied from the pinned host bank into staging rows (never into
the residency's slots), in rounds that alternate between two staging halves, and the MoE kernels read
resident experts in place and the others from staging. The residency is only read (one snapshot of its
table when the step starts): no stamp, no victim, no fill, so the decode working set stays as it was.

On CUDA the copies run on a side stream (`CopyLane`) and are ordered by events: a copy into a staging
half waits for the compute that last read that half (and, for a masked round, for its layer's routing);
a round's compute waits for its copy. On the CPU the same calls run inline, in issue order.

Shape legend: L layers, E experts per layer, T tokens, K top-k, G staging rows, g rows per round,
n rounds of the step; a flat key is layer * E + expert (the host bank's row).
"""

from __future__ import annotations

import torch

from adapters.kernels.expert_gather import gather_rows
from domain.streamed_prefill import StagingRound, plan_rounds, speculate_whole_layers, staging_buffers


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


class PrefillStream:
    """The staging state of one step whose chunk has `pairs` routed (token, top-k) pairs per layer."""

    def __init__(self, pool, lane: CopyLane, pairs: int):
        bank, dev = pool.bank, pool.device
        self.pool, self.lane, self.pairs = pool, lane, pairs
        layers, experts = bank.num_layers, bank.num_experts
        self.experts = experts
        # the residency's table as the step starts; nothing changes it until the step ends
        self.resident = pool.residency.slot_of_key[:layers * experts].view(layers, experts).clone()  # [L, E]
        resident_host = self.resident.tolist()  # NOTE: the step's one host sync
        shard = pool.shard  # expert parallelism: only this rank's experts are ever staged
        missing = [[e for e, s in enumerate(row) if s < 0 and (shard is None or shard.partition.owns(shard.rank, (l, e)))]
                   for l, row in enumerate(resident_host)]
        self.rounds: tuple[StagingRound, ...] = plan_rounds(missing, pool.staging_slots)
        self.buffers, self.per_round = staging_buffers(pool.staging_slots)
        self.speculate = speculate_whole_layers(pairs, experts)
        self.of_layer: list[list[int]] = [[] for _ in range(layers)]
        keys = torch.full((len(self.rounds), self.per_round), -1, dtype=torch.int64)  # [n, g]
        dst = torch.full((len(self.rounds), self.per_round), -1, dtype=torch.int64)  # [n, g]
        maps = torch.full((len(self.rounds), experts + 1), -1, dtype=torch.int32)  # [n, E + 1]
        base = pool.staging_base
        for r, rnd in enumerate(self.rounds):
            self.of_layer[rnd.layer].append(r)
            n = len(rnd.experts)
            if n:
                ids = torch.tensor(rnd.experts, dtype=torch.int64)
                rows = base + rnd.buffer * self.per_round + torch.arange(n, dtype=torch.int64)
                keys[r, :n] = rnd.layer * experts + ids
                dst[r, :n] = rows
                maps[r, ids] = rows.to(torch.int32)
        self.keys, self.dst, self.maps = keys.to(dev), dst.to(dev), maps.to(dev)
        self.rows = pool.bank_rows(self.keys.view(-1)).view(self.keys.shape)  # [n, g] host bank rows
        self.ready = lane.mark()  # the tables above are on the device
        self.holds = [-1] * self.buffers  # the round each staging half holds (or is loading)
        self.free = [None] * self.buffers  # event: the last compute that read each half
        self.copied: dict[int, object] = {}  # round -> event of its copy
        self.staged_rows = 0  # rows copied by unmasked rounds (host-known)
        self.masked = torch.zeros((), dtype=torch.int64, device=dev)  # rows copied by masked rounds
        self.needed = torch.zeros((), dtype=torch.int64, device=dev)  # routed (layer, expert)s not resident

    # ---- copies ----------------------------------------------------------------------------------
    def _issue(self, r: int, routed: torch.Tensor | None) -> None:
        """Copy round r into its staging half unless that half already holds it. routed: bool [E + 1] of
        the round's layer when its router has run (then a later round copies only routed experts, unless
        the step speculates). The copy waits for the step's tables, for the compute that last read the
        half and, when masked, for the masked keys."""
        rnd = self.rounds[r]
        if self.holds[rnd.buffer] == r:
            return
        keys, waits, keep = self.keys[r], [self.ready, self.free[rnd.buffer]], ()
        src = self.rows[r]  # [g] the bank rows of keys (-1 where none)
        if routed is not None and not rnd.first and not self.speculate:
            index = torch.where(keys >= 0, keys - rnd.layer * self.experts, self.experts)  # [g]
            keys = torch.where(routed[index], keys, -1)  # [g]
            src = torch.where(keys >= 0, src, -1)  # [g]
            self.masked += (keys >= 0).sum()
            waits.append(self.lane.mark())  # NOTE: after the masked keys exist, not just the routing
            keep = (src,)
        else:
            self.staged_rows += len(rnd.experts)
        if rnd.experts:
            bank, slots, dst = self.pool.bank.rows, self.pool.all_slots, self.dst[r]
            self.copied[r] = self.lane.copy(lambda: gather_rows(bank, slots, src, dst), waits, keep)
        else:
            self.copied[r] = None
        self.holds[rnd.buffer] = r

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
        routed[safe.reshape(-1)] = True  # [E + 1], a scatter: no host sync
        routed[experts] = False
        resident = self.resident[layer]  # [E]
        self.needed += (routed[:experts] & (resident < 0)).sum()
        mine = self.of_layer[layer]
        for j, r in enumerate(mine):
            self._issue(r, routed)
            if self.buffers > 1 and r + 1 < len(self.rounds):  # the next round copies while this one computes
                same_layer = j + 1 < len(mine)
                self._issue(r + 1, routed if same_layer else None)
            self.lane.wait(self.copied[r])
            rnd = self.rounds[r]
            col = self.maps[r][safe]  # [T, K] staging rows of this round's experts, else -1
            if rnd.first:
                slot = resident[safe.clamp(max=experts - 1)].to(torch.int32)  # [T, K]
                col = torch.where((slot >= 0) & (safe < experts), slot, col)
            if shared:
                column = pool.shared_slot(layer) if rnd.first else -1
                col = torch.cat((col, torch.full_like(col[:, :1], column)), 1)  # [T, K+1]
            pool._experts(ids.numel(), x, col.contiguous(), weights, partials)
            self.free[rnd.buffer] = self.lane.mark()

    def finish(self) -> None:
        """End of the step: the compute stream waits for any copy still in flight (a prefetched round
        no layer computed), so the next step finds staging quiet."""
        self.lane.drain()
