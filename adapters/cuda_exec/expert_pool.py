"""The device expert pool of the fast path: slot bytes, the device-side residency that decides what
sits in them, the miss gather from the pinned host bank and the fused MoE kernels, with no host round
trip per layer (so a whole decode step can be captured in a CUDA graph). Optionally G staging rows for
the streamed prefill (prefill_stream.py), which reads the residency without changing it.

Shape legend: T tokens, K top-k, H hidden, S slots, R row bytes, L layers, E experts per layer,
G staging rows.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from adapters.checkpoint.host_bank import HostExpertBank
from adapters.cuda_exec.device_residency import DeviceResidency
from adapters.cuda_exec.expert_shard import ExpertShard
from adapters.cuda_exec.prefill_stream import (
    COPY_ENGINE,
    GATHER_KERNEL,
    CopyLane,
    PrefillStream,
    ResidencySnapshot,
)
from adapters.kernels.dedup_gemv import MAX_DEDUP_PAIRS
from adapters.kernels.expert_gather import gather_rows
from adapters.kernels.fused_moe import fused_moe
from adapters.kernels.grouped_moe import grouped_gemms, grouped_moe
from adapters.kernels.moe_align import Alignment, align_by_slot, choose_block_m, narrow_keys
from adapters.kernels.moe_route_lookup import fits as route_lookup_fits
from adapters.kernels.moe_route_lookup import pays as route_lookup_pays
from adapters.kernels.moe_sum import moe_sum
from adapters.kernels.packed_gemv import PAIRS_BUCKETS, pairs_bucket
from adapters.kernels.residency_lookup import MAX_KEYS
from adapters.torch_exec.expert_cache import ExpertPreload
from domain.residency import host_key_count

if TYPE_CHECKING:
    from adapters.host_kernels.host_lane import HostLane

# Above this many (token, top-k) pairs a layer's experts run as grouped tensor-core GEMMs (grouped_moe),
# at or below it as per-pair GEMVs (fused_moe). NOTE: the choice depends on T*K only, never on the pool
# size, so a chunk gives the same bits at any slot count. Measured on the H200 (Qwen3.6 block FP8, 8
# routed + shared, docs/bench/2026-12-01-bench-kernels-h200.json): 288 pairs GEMV 248 us vs grouped 334 us,
# 576 pairs 472 vs 418 us. Decode steps (at most MAX_KEYS pairs) always stay on the GEMVs.
GEMV_MAX_PAIRS = 512
assert GEMV_MAX_PAIRS >= MAX_KEYS
# Calls of DEDUP_MIN_PAIRS..MAX_KEYS routed pairs (the decode buckets) take the expert-deduplicated GEMVs
# (fused_moe dedup=True: each distinct slot's weights streamed once for up to 4 of the pairs routed to it,
# bitwise the per-pair result); None: never. NOTE: None (off) until the H200 measures it against the
# per-pair GEMVs (scripts/bench_kernels.py --only dedup); like GEMV_MAX_PAIRS the choice depends on the
# pair count only, never on the pool size.
DEDUP_MIN_PAIRS: int | None = None
# Calls of GROUPED_DECODE_MIN_PAIRS..MAX_KEYS routed pairs that take the one-launch lookup (the decode buckets)
# run the grouped tensor-core GEMMs over their pairs aligned by expert key (`_grouped_by_expert`: each distinct
# expert streamed once per BLOCK_M of its pairs) instead of the per-pair GEMVs; None: never. NOTE: None (off)
# until the H200 measures the two (scripts/bench_kernels.py --only grouped, docs/gpu-validation.md item 1): at
# bs16 the GEMVs stream ~144 experts a layer where ~102 are distinct (gate/up + down: 4.8 of the 8.5 ms step).
# Like GEMV_MAX_PAIRS the choice depends on the pair count only, never on the pool size.
GROUPED_DECODE_MIN_PAIRS: int | None = None
# An eager step's call (inside `streamed_step`) of more keys than this, e.g. a 17..32-token prompt at top-8,
# takes the set lookup (`_routed_set`) where the layer's experts fit the slots, not the one-program kernel:
# the kernel compares every key with every other in [n, n] register tiles, which spill past 128 lanes.
# Measured on the H200 (2026-12-02, scripts/diag/bench_prefill_spans.py's profile of one 20-token prompt,
# 160 keys): _layer_lookup_kernel 154 us a layer, against 8 us at 128 keys (bench_decode bs16). Decode
# steps (graph buckets, outside a streamed step) keep the kernel; both make the domain LRU's decisions.
ONE_LAUNCH_EAGER_KEYS = 128
assert MAX_DEDUP_PAIRS >= MAX_KEYS * 2  # the shared expert's column adds at most one pair per routed top-k
_POOL_DEFAULT = object()


def _min_pairs(name: str, value, default: int | None) -> int | None:
    """A pool's pair-count threshold: `default` (the module constant, read now) when not given, else a positive
    int or None (off); raises ValueError otherwise."""
    value = default if value is _POOL_DEFAULT else value
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    return value


class DeviceExpertPool:
    """uint8 [S, R] expert slots on the device, filled from the pinned host bank by the gather kernel
    on the decisions of a DeviceResidency (the domain LRU, decision for decision)."""

    def __init__(self, bank: HostExpertBank, num_slots: int, device: torch.device | str,
                 shared_rows: torch.Tensor | None = None, grouped: bool = True, staging_slots: int = 0,
                 shard: ExpertShard | None = None, dedup_min_pairs: int | None | object = _POOL_DEFAULT,
                 staging_copy: str = COPY_ENGINE, fp8_activations: bool = False,
                 grouped_decode_min_pairs: int | None | object = _POOL_DEFAULT):
        """shared_rows: uint8 [L, R], each layer's shared expert packed in the routed experts' layout; kept
        resident after the S routed slots (slot S + layer) so the fused kernels compute it as one more
        expert per token. None: the caller computes the shared expert itself.
        grouped: chunks of more than GEMV_MAX_PAIRS pairs take the grouped tensor-core GEMMs (False: the
        per-pair GEMVs at every size, as before they existed).
        staging_slots: G rows after those (rows S + L .. S + L + G - 1) that a streamed prefill step
        (`streamed_step`) copies non-resident experts into; 0: prefill goes through the residency.
        shard: expert parallelism (ADR 0008): only the shard's rank's keys are looked up, copied and computed
        (every other pair gets slot -1, the shared expert is rank 0's), and every layer's fp32 partials are
        all-reduced over the shard's group before the ordered sum; None: one GPU, every key.
        dedup_min_pairs: calls of this many routed pairs up to MAX_KEYS take the expert-deduplicated GEMVs
        (None: never; default DEDUP_MIN_PAIRS, read when the pool is built).
        staging_copy: how a streamed round whose experts the host knows is copied: "engine" (copy-engine
        memcpys, no SM; the default) or "kernel" (the UVA gather kernel, as rounds masked by routing always
        are); an attribute a benchmark may change between steps.
        fp8_activations: the grouped GEMMs take e4m3 activations per 128 columns when the layout is FP8
        (grouped_moe.grouped_gemms; ADR 0018); also an attribute read at every call.
        grouped_decode_min_pairs: one-launch lookups of this many routed pairs up to MAX_KEYS run the grouped
        GEMMs over their pairs aligned by expert (None: never; default GROUPED_DECODE_MIN_PAIRS, read when the
        pool is built)."""
        if num_slots <= 0:
            raise ValueError(f"the expert pool needs at least one slot, got {num_slots}")
        if not isinstance(staging_slots, int) or isinstance(staging_slots, bool) or staging_slots < 0:
            raise ValueError(f"staging_slots must be a non-negative int, got {staging_slots!r}")
        if staging_copy not in (COPY_ENGINE, GATHER_KERNEL):
            raise ValueError(f"staging_copy must be {COPY_ENGINE!r} or {GATHER_KERNEL!r}, got {staging_copy!r}")
        if bank.rows is None:
            raise ValueError("the fast path gathers misses from the host bank's rows; a memory-mapped bank "
                             "(--mmap-experts) has none: use the reference executor")
        self.bank, self.layout = bank, bank.layout
        self.device = torch.device(device)
        if self.device.type == "cuda" and not bank.rows.is_pinned():
            raise ValueError("the fast path reads misses over PCIe from pinned host memory; the bank is pageable")
        extra = 0 if shared_rows is None else shared_rows.shape[0]
        if shared_rows is not None and tuple(shared_rows.shape) != (bank.num_layers, self.layout.row_bytes):
            raise ValueError(f"shared rows must be uint8 [{bank.num_layers}, {self.layout.row_bytes}], "
                             f"got {tuple(shared_rows.shape)}")
        # NOTE: one allocation for slots, shared rows and staging, so the kernels index all three through
        # one base pointer: a staged expert is just a slot id past the residency's.
        self.all_slots = torch.empty((num_slots + extra + staging_slots, self.layout.row_bytes), dtype=torch.uint8,
                                     device=self.device)  # [S + L + G, R]
        self.slots = self.all_slots[:num_slots]  # [S, R] the routed slots the residency manages
        self.has_shared = shared_rows is not None
        self.grouped = grouped
        self.fp8_activations = fp8_activations
        self.dedup_min_pairs = _min_pairs("dedup_min_pairs", dedup_min_pairs, DEDUP_MIN_PAIRS)
        self.grouped_decode_min_pairs = _min_pairs("grouped_decode_min_pairs", grouped_decode_min_pairs,
                                                   GROUPED_DECODE_MIN_PAIRS)
        if shared_rows is not None:
            self.all_slots[num_slots:num_slots + extra].copy_(shared_rows)
        self.staging_slots, self.staging_base = staging_slots, num_slots + extra
        if shard is not None and num_slots > shard.partition.keys_of(shard.rank):
            raise ValueError(f"rank {shard.rank}: {num_slots} expert slots for the "
                             f"{shard.partition.keys_of(shard.rank)} keys it owns")
        self.shard = shard
        # a partial bank (an expert-parallel rank's own keys): flat key -> bank row, the sink entry -1
        self._bank_row = None
        if bank.row_of_key is not None:
            self._bank_row = torch.tensor((*bank.row_of_key, -1), dtype=torch.int64, device=self.device)
            if shard is None or not bool((self._bank_row[:-1][shard.owner_of_key.to(self.device) == shard.rank]
                                          >= 0).all()):
                raise ValueError("a partial host bank needs a shard whose every key it holds")
        # the most keys one layer can bring to a lookup: its E experts, or (a shard) those its rank owns
        self._layer_keys = bank.num_experts if shard is None else max(
            len(shard.partition.experts_of(shard.rank, layer)) for layer in range(bank.num_layers))
        self.residency = DeviceResidency(num_slots, bank.num_layers, bank.num_experts, self.device,
                                         owner=None if shard is None else shard.owner_of_key,
                                         rank=0 if shard is None else shard.rank)
        self._lane = CopyLane(self.device) if staging_slots else None
        self.staging_copy = staging_copy
        self._step_open = False
        self._stream_layers: tuple[int, int] | None = None  # the open streamed step's layer group (None: all)
        self._stream: PrefillStream | None = None
        self._snapshot: ResidencySnapshot | None = None
        self._snapshot_host: torch.Tensor | None = None  # pinned int64 [L*E], reused by every step
        # streamed-prefill totals: routed (layer, expert)s not resident, rows copied by masked rounds (device);
        # rows copied by unmasked rounds, streamed steps and layer calls (host)
        self._streamed = torch.zeros(2, dtype=torch.int64, device=self.device)
        self._staged_unmasked = self._streamed_steps = self._streamed_layers = 0
        # ADR 0030: the host lane that computes a share of the decode lookups' misses (use_host_lane; off: None)
        self.host_lane: HostLane | None = None

    @property
    def num_slots(self) -> int:
        return int(self.slots.shape[0])

    @property
    def num_keys(self) -> int:
        """Keys this pool may ever hold: the bank's L*E, or (a shard) those its rank owns."""
        if self.shard is None:
            return self.bank.num_layers * self.bank.num_experts
        return self.shard.partition.keys_of(self.shard.rank)

    def holds_every_key(self) -> bool:
        return self.num_slots >= self.num_keys

    def preload(self) -> ExpertPreload | None:
        """When the slots hold every key (`holds_every_key`): fill them from the host bank before serving,
        through the machinery of a miss: one residency lookup of every flat key, ascending (another rank's
        keys are padding), then the gather kernel from the pinned bank. The device tables and stamps end as
        the domain LRU fed those keys in that order; the hit/miss counters and bytes_copied do not count
        it (DeviceResidency.preload; ExpertPreload says what it moved). Synchronises: it is timed with its
        copies landed (start-up or a resize, never a step). None, and nothing done, for a partial pool: it
        fills by use."""
        if not self.holds_every_key():
            return None
        self._sync()
        start = time.perf_counter()
        keys = torch.arange(self.bank.num_layers * self.bank.num_experts, dtype=torch.int64, device=self.device)
        found = self.residency.preload(keys)
        self._snapshot = None  # the residency moved (as after any lookup)
        self._gather(found.fill_keys, found.fill_slots)
        copied, resident = torch.stack(((found.fill_keys >= 0).sum(),
                                        (self.residency.slot_of_key[:-1] >= 0).sum())).tolist()  # the one sync
        if self.shard is None and resident == self.num_keys:
            self.residency.mark_every_key_resident()  # the prefill's set lookups then skip their victim choice
        self._sync()
        return ExpertPreload(copied, resident, self.num_keys, copied * self.layout.row_bytes,
                             time.perf_counter() - start)

    def gather_rate(self, rows: int = 64) -> dict:
        """How fast misses can land in this pool from its host bank, measured on the bank itself: `rows` experts
        spread over the bank copied into the first slots by the gather kernel (how a decode step's misses land,
        inside its graph), then the same rows one by one through the copy engine; each timed with its copies
        landed, after a one-row warm-up (the kernel's compile, the first touch of the mapping). The two differ
        where the bank's memory is slow for the GPU's own loads but not for its DMA (session 30: an H100 host
        whose start-up fill ran at 9.8 GB/s and whose 24 GiB decode step took 58 ms, 36 ms on another).
        Returns {"rows", "bytes", "kernel_gb_s", "copy_engine_gb_s"} (GB/s = 1e9 bytes/s).
        Only for a pool that holds nothing yet (start-up, a rebuilt pool): it writes slot memory that the
        residency then treats as empty. ValueError where a key is resident."""
        if bool((self.residency.slot_of_key[:-1] >= 0).any()):
            raise ValueError("gather_rate writes slots: only for a pool that holds nothing yet")
        bank = self.bank.rows  # uint8 [N, R], pinned on a CUDA host
        n = max(1, min(rows, self.num_slots, bank.shape[0]))
        src = torch.arange(n, dtype=torch.int64, device=self.device) * max(1, bank.shape[0] // n)  # [n] bank rows
        dst = torch.arange(n, dtype=torch.int64, device=self.device)  # [n] slots

        def timed(copy) -> float:
            self._sync()
            start = time.perf_counter()
            copy()
            self._sync()
            return time.perf_counter() - start

        timed(lambda: gather_rows(bank, self.slots, src[:1], dst[:1]))
        kernel_s = timed(lambda: gather_rows(bank, self.slots, src, dst))
        pairs = list(zip(dst.tolist(), src.tolist(), strict=True))

        def one_by_one() -> None:
            for slot, row in pairs:
                self.slots[slot].copy_(bank[row], non_blocking=True)

        timed(lambda: self.slots[0].copy_(bank[pairs[0][1]], non_blocking=True))
        engine_s = timed(one_by_one)
        nbytes = n * self.layout.row_bytes
        return {"rows": n, "bytes": nbytes, "kernel_gb_s": float(f"{nbytes / max(kernel_s, 1e-9) / 1e9:.4g}"),
                "copy_engine_gb_s": float(f"{nbytes / max(engine_s, 1e-9) / 1e9:.4g}")}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def nbytes(self) -> int:
        return self.all_slots.nbytes + self.residency.nbytes()

    def _flat_keys(self, layer: int, ids: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        flat = ids.to(torch.int64) + layer * self.bank.num_experts  # [T, K]
        if valid is not None:
            flat = torch.where(valid[:, None], flat, -1)
        return self.residency.owned_only(flat.reshape(-1))  # [T*K], other ranks' keys -1

    def bank_rows(self, keys: torch.Tensor) -> torch.Tensor:
        """Flat keys int64 [n] (-1 = none) -> rows of the host bank (the same on a whole bank)."""
        if self._bank_row is None:
            return keys
        return self._bank_row[torch.where(keys < 0, self._bank_row.shape[0] - 1, keys)]

    def _gather(self, fill_keys: torch.Tensor, fill_slots: torch.Tensor) -> None:
        if self.residency.every_key_resident:
            # NOTE: no lookup can miss once every key is resident (until a resize rebuilds the pool and its
            # graphs), so the fill lists are all -1: the launch (~4.5 us a decode layer at bs16) is skipped
            return
        gather_rows(self.bank.rows, self.slots, self.bank_rows(fill_keys), fill_slots)

    def _fetch(self, keys: torch.Tensor, presorted: bool = False) -> None:
        """Look up flat keys of one layer (request order, -1 = padding) and gather the misses into their slots.
        NOTE: the lookup lists its fills first, and a layer has at most `_layer_keys` distinct keys, so only
        that many entries can be fills: the gather launches over those, not over all T*K keys (48 programs
        per entry; at 4k tokens 1.57 M programs a layer that read -1 and exit, ~1 ms a layer on the H200)."""
        found = self.residency.lookup_flat(keys, pin=False, presorted=presorted)
        bound = min(found.fill_keys.shape[0], self._layer_keys)
        self._gather(found.fill_keys[:bound], found.fill_slots[:bound])

    def _slot_ids(self, flat: torch.Tensor, shape) -> torch.Tensor:
        sink = self.residency.slot_of_key.shape[0] - 1
        slots = self.residency.slot_of_key[torch.where(flat < 0, sink, flat)]
        return torch.where(flat < 0, -1, slots).to(torch.int32).reshape(shape)  # [T, K]

    def shared_slot(self, layer: int) -> int:
        """The slot the layer's resident shared expert is computed from on this rank (-1: another rank's)."""
        slot = self.num_slots + layer
        return slot if self.shard is None else self.shard.shared_slot(slot)

    def _with_shared(self, layer: int, slot_ids: torch.Tensor, shared: bool) -> torch.Tensor:
        """slot_ids [T, K] with the layer's resident shared expert appended as top-k position K."""
        if not shared:
            return slot_ids
        return torch.cat((slot_ids, torch.full_like(slot_ids[:, :1], self.shared_slot(layer))), 1)  # [T, K+1]

    def _moe_out(self, pairs: int, x: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The MoE output [T, H] of one call covering every pair: the fused kernels as they are on one GPU;
        with a shard, this rank's partials exchanged and summed (bitwise the one-GPU sum)."""
        if self.shard is None:
            return self._experts(pairs, x, slot_ids, weights)
        partials = self.shard.partials(x, weights.shape[1])  # [T, K(+1), H] zeroed
        self._experts(pairs, x, slot_ids, weights, partials)
        return self._reduce(partials, x)

    def _unzeroed_partials(self, x: torch.Tensor, columns: int) -> torch.Tensor:
        """fp32 [T, columns, H] partials for one call that writes every pair it hands `_reduce` as written:
        uninitialized on one GPU (no memset); with a shard, the shard's zeroed buffer (the all-reduce adds
        every rank's, so the pairs a rank skips must hold 0)."""
        if self.shard is not None:
            return self.shard.partials(x, columns)
        return torch.empty((x.shape[0], columns, x.shape[1]), dtype=torch.float32, device=x.device)

    def _reduce(self, partials: torch.Tensor, x: torch.Tensor, written: torch.Tensor | None = None) -> torch.Tensor:
        """partials fp32 [T, K(+1), H] -> [T, H] in x.dtype: all-reduced over the shard's group first.
        written: int32 [T, K(+1)], negative for the pairs no expert call wrote (moe_sum skips them as +0.0);
        ignored with a shard, whose partials are zeroed and summed whole."""
        if self.shard is not None:
            self.shard.all_reduce(partials)
            written = None
        return moe_sum(partials, torch.empty_like(x), written)

    def tune(self, x: torch.Tensor, top_k: int, rows: Sequence[int] = (1,)) -> None:
        """Run the fused kernels once on real slots, so the per-pair GEMVs' tiles are measured on real work before
        any capture: the graph warm-ups run padded rows, which skip every expert, and a capture cannot measure.
        x [1, H]: the activation row, repeated. With pair buckets (packed_gemv.pairs_bucket) each bucket is tuned by
        the first count that falls inside it: `rows` largest first (a decode bucket's own count: bs16's 144 pairs
        tunes bucket 256), then each bucket at the most tokens it holds; a count past the largest bucket shares the
        first bucket's key and never tunes it. Without buckets (one key): at the fewest rows, bs1's tile."""
        columns = top_k + self.has_shared
        first: dict[int, int] = {}  # pair bucket -> the row count that tunes it
        for n in [*sorted(set(rows), reverse=True), *(max(1, b // columns) for b in PAIRS_BUCKETS)]:
            bucket = pairs_bucket(n * columns)
            if n * columns <= bucket:
                first.setdefault(bucket, n)
        for n in first.values() or [min(rows)]:
            self._tune_rows(x[:1].expand(n, -1).contiguous(), top_k)
        if self.grouped_decode_min_pairs is not None:
            self._tune_grouped_decode(x[:1], top_k)

    def _tune_rows(self, x: torch.Tensor, top_k: int) -> None:
        rows = x.shape[0]
        slot_ids = (torch.arange(rows * top_k, device=self.device) % self.num_slots).view(rows, top_k)
        weights = torch.full((rows, top_k + self.has_shared), 1.0 / top_k, device=self.device)
        slot_ids = self._with_shared(0, slot_ids.to(torch.int32), self.has_shared)
        fused_moe(x, slot_ids, weights, self.all_slots, self.layout)
        if self.dedups(rows * top_k):  # reads the per-pair tiles just tuned; compiles before any capture
            fused_moe(x, slot_ids, weights, self.all_slots, self.layout, dedup=True)

    def _tune_grouped_decode(self, x: torch.Tensor, top_k: int) -> None:
        # NOTE: the largest decode call's rows over distinct real slots, with the BLOCK_M its alignment by
        # expert takes: the autotune key does not hold the row count, so the first call to tune it decides
        big = MAX_KEYS // top_k
        ids = (torch.arange(big * top_k, device=self.device) % self.num_slots).view(big, top_k).to(torch.int32)
        ids = self._with_shared(0, ids, self.has_shared)
        grouped_moe(x.expand(big, -1).contiguous(), ids, torch.full(ids.shape, 1.0 / top_k, device=self.device),
                    self.all_slots, self.layout, block_m=choose_block_m(ids.numel(), self.bank.num_experts + 1))

    def groups_decode(self, pairs: int) -> bool:
        """Whether a one-launch lookup of `pairs` routed (token, top-k) pairs runs the grouped GEMMs over its
        pairs aligned by expert (`_grouped_by_expert`) instead of the per-pair GEMVs."""
        return self.grouped_decode_min_pairs is not None and self.grouped_decode_min_pairs <= pairs <= MAX_KEYS

    def _grouped_by_expert(self, x: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor, slot_ids: torch.Tensor,
                           weights: torch.Tensor, shared: bool) -> torch.Tensor:
        """The MoE output [T, H] of a one-launch lookup's pairs on the grouped GEMMs: the pairs aligned by expert
        key (`align_by_expert`: E + 1 groups, the Triton alignment), each block's key mapped to the slot the lookup
        gave it (slot_ids int32 [T, K(+1)], the shared column included), bf16 activations as the per-pair
        decode path. Graph-capturable: every size comes from T, K and E. Padded rows (valid False) compute
        nothing, the shared expert included."""
        experts = self.bank.num_experts
        skip = ~valid[:, None]  # [T, 1]
        keys = self.expert_keys(ids, skip, shared)  # int32 [T, K(+1)]
        if shared:
            keys[:, -1:].masked_fill_(skip, -1)  # the per-pair path's shared column is -1 on padded rows too
        # NOTE: every pair of a key has the same slot, so the scatter's duplicate writes agree; key -1 lands on
        # entry E + 1 with slot -1 (the lookup gives skipped pairs -1), which block key -1 then reads
        slot_map = torch.full((experts + 2,), -1, dtype=torch.int32, device=x.device)
        slot_map.scatter_(0, torch.remainder(keys, experts + 2).reshape(-1).to(torch.int64), slot_ids.reshape(-1))
        align = self.align_by_expert(keys)
        align = align._replace(block_slots=slot_map[align.block_slots])  # [B]: -1 for unused blocks
        # NOTE: on one GPU the lookup gives every valid pair a slot (T*K <= S), so each key >= 0 maps to one and
        # its pairs' block is computed: the GEMMs write exactly the pairs whose key is >= 0, the rest (padded
        # rows, the shared column included) moe_sum skips: no zero-fill, the same bits
        partials = self._unzeroed_partials(x, weights.shape[1])
        grouped_gemms(x, align, weights, self.all_slots, self.layout, partials)  # bf16 activations: a decode call
        return self._reduce(partials, x, keys)

    def dedups(self, pairs: int) -> bool:
        """Whether a call of `pairs` routed (token, top-k) pairs takes the expert-deduplicated GEMVs."""
        return self.dedup_min_pairs is not None and self.dedup_min_pairs <= pairs <= MAX_KEYS

    def _experts(self, pairs: int, x: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor,
                 partials: torch.Tensor | None = None) -> torch.Tensor:
        """The fused MoE over all_slots: per-pair GEMVs for `pairs` (= T*K routed pairs) up to
        GEMV_MAX_PAIRS, grouped GEMMs above (bounding the distinct slots of a call by the layer's experts
        plus the shared one, which keeps their block size, and so their bits, the same in every call); the
        decode-sized calls `dedups` picks take the expert-deduplicated GEMVs (the per-pair GEMVs' bits)."""
        if self.groups_decode(pairs):
            # NOTE: a decode-sized call off the one-launch lookup (a pool smaller than its keys, a streamed round):
            # grouped by slot with the bound and BLOCK_M of `_grouped_by_expert`, so the same blocks of pairs and
            # the same bits at any pool size; bf16 activations, as there
            return grouped_moe(x, slot_ids, weights, self.all_slots, self.layout, partials=partials,
                               max_groups=self.bank.num_experts + 1)
        if pairs <= GEMV_MAX_PAIRS or not self.grouped:
            return fused_moe(x, slot_ids, weights, self.all_slots, self.layout, partials=partials,
                             dedup=self.dedups(pairs))
        return grouped_moe(x, slot_ids, weights, self.all_slots, self.layout, partials=partials,
                           max_groups=self.bank.num_experts + 1, a8=self.fp8_activations)

    def takes_grouped(self, pairs: int) -> bool:
        """Whether a call of `pairs` (= T*K routed pairs) runs the grouped GEMMs (else the per-pair GEMVs)."""
        return pairs > GEMV_MAX_PAIRS and self.grouped

    def expert_keys(self, ids: torch.Tensor, skip: torch.Tensor | None, shared: bool) -> torch.Tensor:
        """One layer's pairs as expert keys, int32 [T, K(+1)]: ids [T, K] as they are, -1 where skip (bool,
        broadcastable to [T, K]; None: nowhere), and with `shared` a column K of key E (the shared expert, on
        every row). Built in place: a few launches instead of a where/cat/cast chain. The keys index a slot map
        of E + 2 entries whose last is -1 (key -1 reads it) and feed `align_by_expert`."""
        tokens, top_k = ids.shape
        keys = torch.empty((tokens, top_k + shared), dtype=torch.int32, device=ids.device)
        keys[:, :top_k].copy_(ids)
        if skip is not None:
            keys[:, :top_k].masked_fill_(skip, -1)
        if shared:
            keys[:, top_k].fill_(self.bank.num_experts)
        return keys

    def align_by_expert(self, keys: torch.Tensor) -> Alignment:
        """The grouped GEMMs' alignment of one layer's pairs by expert: keys int32 [T, K'] in -1..E from
        `expert_keys` (E: the shared expert, -1: skipped). Its block_slots hold expert keys; a caller maps them
        to slots (-1: skip the block) before grouped_round. Same BLOCK_M and bound as `_experts` (T*K', E + 1
        groups), so each pair lands in a block of the same rows as there: the same bits."""
        groups = self.bank.num_experts + 1
        return align_by_slot(keys, groups, choose_block_m(keys.numel(), groups), groups)

    def grouped_round(self, x: torch.Tensor, align: Alignment, weights: torch.Tensor, partials: torch.Tensor,
                      h: torch.Tensor | None = None, a8: bool | None = None) -> torch.Tensor:
        """The grouped GEMMs over all_slots for the blocks of `align` whose slot is not -1, into partials fp32
        [T, K', H] (weights fp32 [T, K']); h: the gate/up scratch [P, I] of an earlier call with the same
        pairs (reused; only live blocks' rows are written and read). Returns h. With `fp8_activations` (a8
        None) and an FP8 layout, x and h enter the GEMMs as e4m3 per 128 columns (act_quant_fp8, ADR 0018)."""
        a8 = self.fp8_activations if a8 is None else a8
        return grouped_gemms(x, align, weights, self.all_slots, self.layout, partials, h, a8=a8)

    def routed(self, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
               valid: torch.Tensor | None = None, shared: bool = False) -> torch.Tensor:
        """sum_k weights[t,k] * expert_{ids[t,k]}(x[t]) for x [T, H], weights fp32 [T, K(+1)], ids [T, K];
        rows with valid False route nowhere (no lookup, no miss, zeros out). shared: weights' last column
        weighs the layer's resident shared expert (the router's output as it is; needs shared rows).

        Graph-capturable when T * K <= S (always so for the decode buckets): the keys are looked up in
        ascending (layer, expert) order, the order the reference executor uses, so both make the same
        residency decisions (inside `streamed_step`, more than ONE_LAUNCH_EAGER_KEYS of them take the set
        lookup below instead, which makes the same decisions). Otherwise, inside `streamed_step` with staging rows, the streamed prefill:
        resident experts read in place, the others staged, the residency untouched. Otherwise, when S >= E,
        the lookup of the set of experts the chunk routes to (`_routed_set`: 3 kernels, pairs aligned by
        expert); else one sync-free lookup of the chunk's keys when they fit (T*K <= S, or a shard's keys),
        else (a pool smaller than one layer's experts) the layer's experts go in groups of S with a host
        sync per group.
        More than GEMV_MAX_PAIRS pairs (prefill chunks) run on the grouped tensor-core GEMMs, fewer on the
        per-pair GEMVs; every path is bitwise the same at any S and G.
        """
        if weights.shape != (ids.shape[0], ids.shape[1] + shared):
            raise ValueError(f"weights {tuple(weights.shape)} do not fit ids {tuple(ids.shape)} (shared={shared})")
        if shared and not self.has_shared:
            raise ValueError("this pool holds no shared experts")
        if self._step_open and ids.numel() > ONE_LAUNCH_EAGER_KEYS and self.residency.can_lookup_set() \
                and ids.numel() <= min(self.num_slots, MAX_KEYS):  # a short prompt: ONE_LAUNCH_EAGER_KEYS
            return self._routed_set(layer, x, weights, ids, valid, shared)
        if ids.numel() <= min(self.num_slots, MAX_KEYS):  # decode: one launch does the whole lookup
            if valid is None:
                valid = torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device)
            lane = self._host_lane_for(ids.shape[0], ids.numel())
            # the shared expert's column comes from the lookup launch itself (-1 on padded rows)
            fill_keys, fill_slots, slot_ids, *host_pairs = self.residency.lookup_layer(
                layer, ids, valid, self.shared_slot(layer) if shared else None, self._share_of(lane))
            self._snapshot = None  # the residency moved: a later streamed call of the step snapshots it again
            if lane is not None:  # before the gather: the host computes its pairs while the link copies
                lane.publish(x, host_pairs[0], weights)
            self._gather(fill_keys, fill_slots)
            if self.groups_decode(ids.numel()):
                return self._grouped_by_expert(x, ids, valid, slot_ids, weights, shared)
            return self._with_host_partial(lane, self._moe_out(ids.numel(), x, slot_ids, weights))
        if self._step_open and self.staging_slots:
            return self._routed_streamed(layer, x, weights, ids, valid, shared)
        if self.residency.can_lookup_set():
            return self._routed_set(layer, x, weights, ids, valid, shared)
        flat = self._flat_keys(layer, ids, valid)  # [T*K]
        # NOTE: a layer's keys are at most its E experts (a shard's: those it owns), so a pool of at least
        # that many slots (every pool but a tiny one) takes any chunk in one lookup: tensor ops, no host
        # sync. The sync of the grouped path below stalled the launch queue once per layer (~40 syncs per prefill step, measured as host
        # time in bench_prefill's profile).
        if flat.numel() <= self.num_slots or self._layer_keys <= self.num_slots:
            sink = self.residency.slot_of_key.shape[0] - 1  # L*E: above every key
            ordered = torch.sort(narrow_keys(torch.where(flat < 0, sink, flat), sink)).values.to(torch.int64)
            # ascending, as the reference asks; equal keys adjacent, so the lookup need not sort again
            self._fetch(torch.where(ordered == sink, -1, ordered), presorted=True)
            slot_ids = self._with_shared(layer, self._slot_ids(flat, ids.shape), shared)
            return self._moe_out(ids.numel(), x, slot_ids, weights)
        distinct = torch.unique(flat[flat >= 0])  # ascending; one host sync below
        # NOTE: each group fills its (token, k) partials; one ordered sum at the end makes the result
        # bitwise the same as the one-launch path, whatever the pool size. A pair whose slot is -1 in
        # a call is skipped there (its weight unused), so every call takes the same weights.
        partials = torch.zeros((x.shape[0], weights.shape[1], x.shape[1]), dtype=torch.float32, device=x.device)
        skip = torch.full_like(ids[:, :1], -1, dtype=torch.int32)  # [T, 1]
        for start in range(0, distinct.numel(), self.num_slots):
            group = distinct[start:start + self.num_slots]
            self._fetch(group)
            slot_ids = self._slot_ids(torch.where(torch.isin(flat, group), flat, -1), ids.shape)
            if shared:  # the shared column is filled once, below
                slot_ids = torch.cat((slot_ids, skip), 1)
            self._experts(ids.numel(), x, slot_ids, weights, partials)
        if shared:
            none = self._with_shared(layer, skip.expand(-1, ids.shape[1]).contiguous(), True)
            self._experts(ids.numel(), x, none, weights, partials)
        return self._reduce(partials, x)

    def _routed_set(self, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    valid: torch.Tensor | None, shared: bool) -> torch.Tensor:
        """`routed` for a chunk when the layer's E experts fit the slots: the lookup takes the set of experts
        the chunk routes to (DeviceResidency.lookup_set, 3 launches) instead of its T*K keys (~100 small torch
        ops), and the grouped GEMMs' pairs are aligned by expert, their blocks mapped to slots through the
        lookup's slot map (as the streamed prefill does), so no [T, K] slot table is built on that path.
        NOTE: why: a 4k prefill step on the H200 was host-bound (181 ms of GPU work in a 312 ms step, 7,900
        launches, ~190 of them between each MoE layer's router and its GEMMs)."""
        experts = self.bank.num_experts
        index = ids.reshape(-1) if valid is None else torch.where(valid[:, None], ids, experts).reshape(-1)
        present = torch.zeros(experts + 1, dtype=torch.bool, device=self.device)
        present.index_fill_(0, index.to(torch.int64), True)  # [E + 1]: index E collects padding rows
        fill_keys, fill_slots, slot_map = self.residency.lookup_set(
            layer, present[:experts], self.shared_slot(layer) if shared else -1)
        self._snapshot = None  # the residency moved: a later streamed call of the step snapshots it again
        self._gather(fill_keys, fill_slots)
        # the shared key E on every row, padding included, as _with_shared
        keys = self.expert_keys(ids, None if valid is None else ~valid[:, None], shared)  # int32 [T, K(+1)]
        # NOTE: slot_map[-1] is entry E + 1, which is -1: indexing by a key or block key of -1 gives slot -1
        decode_sized = self.groups_decode(ids.numel())  # the grouped GEMMs as the one-launch lookup's call takes them
        if not self.takes_grouped(ids.numel()) and not decode_sized:
            return self._moe_out(ids.numel(), x, slot_map[keys], weights)
        align = self.align_by_expert(keys)
        slots = slot_map[align.block_slots]  # [B] int32: each block's slot, -1 for unused blocks
        # NOTE: no zero-fill on one GPU (at an 8k chunk a 604 MB memset a layer, 2.2% of the resident prefill):
        # lookup_set gives every routed expert a slot (E <= S; only another rank's key gets -1) and entry E the
        # shared slot, so every key >= 0 (padded rows' shared column included) is in a computed block and the
        # GEMMs write exactly those pairs; moe_sum skips the key -1 pairs as the +0.0 a zeroed buffer held
        partials = self._unzeroed_partials(x, weights.shape[1])
        self.grouped_round(x, align._replace(block_slots=slots), weights, partials, a8=False if decode_sized else None)
        return self._reduce(partials, x, keys)

    def routes_resident(self, pairs: int) -> bool:
        """Whether a decode step's layer of `pairs` routed pairs takes `routed_resident`: every key is resident
        (one GPU: a shard is never marked so) and the bucket stays on the per-pair GEMVs (the grouped decode
        GEMMs align the router's expert ids, which routed_resident does not keep)."""
        return self.residency.every_key_resident and pairs <= MAX_KEYS and not self.groups_decode(pairs)

    def routed_resident(self, layer: int, x: torch.Tensor, logits: torch.Tensor, router: torch.Tensor, top_k: int,
                        renormalize: bool, gate_weight: torch.Tensor | None = None,
                        valid: torch.Tensor | None = None) -> torch.Tensor:
        """`routed_logits` for a pool that holds every key (routes_resident; ADR 0027): the router kernel reads
        each pair's slot from the residency's table and marks the keys; no lookup or gather launch. The same
        weights (moe_router's bits) and experts as routed_logits, so the same output; the layer's hits and
        stamps wait for `settle_step`, which the caller runs once after the step's last layer.
        logits fp32 [T, E], x [T, H], router [E, H], gate_weight [1, H] or None (needs shared rows). [T, H]."""
        if not self.routes_resident(x.shape[0] * top_k):
            raise ValueError("routed_resident needs a pool that holds every key (and a bucket on the GEMVs)")
        if gate_weight is not None and not self.has_shared:
            raise ValueError("this pool holds no shared experts")
        if valid is None:
            valid = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
        weights, slot_ids = self.residency.route_resident(
            layer, logits, x, router, top_k, renormalize, gate_weight, valid,
            None if gate_weight is None else self.shared_slot(layer))
        return self._moe_out(x.shape[0] * top_k, x, slot_ids, weights)

    def settle_step(self) -> None:
        """The hits of the step's routed_resident layers, in one launch (DeviceResidency.settle_resident)."""
        self.residency.settle_resident()

    def can_route(self, rows: int, top_k: int) -> bool:
        """Whether `routed_logits` takes `rows` rows: the one-launch router + lookup fits (decode buckets)."""
        return route_lookup_fits(rows, self.bank.num_experts, top_k, self.num_slots)

    def fuses_routing(self, rows: int, top_k: int) -> bool:
        """Whether the decode step should take `routed_logits` for `rows` rows: it can (can_route) and the
        one-program kernel is the faster side at this tile (moe_route_lookup.pays: small buckets; above, the
        step runs moe_router then `routed`, whose lookup makes the same decisions)."""
        # NOTE: a bucket on the grouped decode GEMMs needs the router's ids (`_grouped_by_expert` aligns by expert);
        # the fused launch gives slot ids only, and grouping those by pool slot takes the torch alignment
        return (self.can_route(rows, top_k) and route_lookup_pays(rows, self.bank.num_experts)
                and not self.groups_decode(rows * top_k))

    def routed_logits(self, layer: int, x: torch.Tensor, logits: torch.Tensor, top_k: int, renormalize: bool,
                      gate_weight: torch.Tensor | None = None, valid: torch.Tensor | None = None) -> torch.Tensor:
        """`routed` for the decode step, straight from the router's logits fp32 [T, E]: softmax, top-k,
        renormalisation, the shared gate (gate_weight [1, H]: the layer's resident shared expert, weighed
        by sigmoid(x . g)) and the layer's residency decision in one launch (moe_route_lookup), then the
        miss gather and the fused experts. Same routing as moe_router, same decisions as `routed`'s
        one-launch lookup. Needs can_route(T, K); gate_weight needs shared rows. Returns [T, H]."""
        if not self.can_route(x.shape[0], top_k):
            raise ValueError(f"{x.shape[0]} rows x top-{top_k} do not fit one routing launch over "
                             f"{self.num_slots} slots")
        if gate_weight is not None and not self.has_shared:
            raise ValueError("this pool holds no shared experts")
        if valid is None:
            valid = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
        self._snapshot = None  # as in routed: the lookup below changes the residency
        lane = self._host_lane_for(x.shape[0], x.shape[0] * top_k)
        weights, slot_ids, fill_keys, fill_slots, *host_pairs = self.residency.route_layer(
            layer, logits, x, top_k, renormalize, gate_weight, valid,
            None if gate_weight is None else self.shared_slot(layer), self._share_of(lane))
        if lane is not None:  # before the gather, as in routed
            lane.publish(x, host_pairs[0], weights)
        self._gather(fill_keys, fill_slots)
        return self._with_host_partial(lane, self._moe_out(x.shape[0] * top_k, x, slot_ids, weights))

    # ---- the host lane (docs/adr/0030-host-expert-compute.md) ----------------------------------------
    def use_host_lane(self, lane: HostLane | None) -> None:
        """Compute lane.share (per mille) of each one-launch decode lookup's misses on the host CPU through
        `lane` (adapters/host_kernels/host_lane.py, started by its owner); None: every miss is copied (the
        default). Takes effect for the graphs captured after it. Raises ValueError for a lane over another
        top-k or hidden size, or with an expert shard (ADR 0030 is one GPU)."""
        if lane is not None:
            if self.shard is not None:
                raise ValueError("the host lane computes one GPU's misses; an expert shard has none of its own")
            if lane.hidden != self.layout.hidden:
                raise ValueError(f"a host lane for hidden size {lane.hidden}, the experts' is {self.layout.hidden}")
            host_key_count(0, lane.share)
        self.host_lane = lane

    def _host_lane_for(self, rows: int, pairs: int) -> HostLane | None:
        """The lane a one-launch decode call of `rows` rows and `pairs` routed pairs sends its host share to,
        or None: no lane, a zero share, more rows than its mailbox, another top-k, or a call on the grouped
        decode GEMMs (they read every valid pair's slot: a host pair has none)."""
        lane = self.host_lane
        if lane is None or not lane.share or rows > lane.max_rows or pairs != rows * lane.top_k \
                or self.groups_decode(pairs):
            return None
        return lane

    @staticmethod
    def _share_of(lane: HostLane | None) -> int:
        return 0 if lane is None else lane.share

    @staticmethod
    def _with_host_partial(lane: HostLane | None, out: torch.Tensor) -> torch.Tensor:
        """out [T, H] plus the host's partial sum of its pairs (waits for it on the device, bounded)."""
        return out if lane is None else lane.wait_add(out)

    # ---- streamed prefill (docs/adr/0010-streamed-prefill.md) ------------------------------------------
    @contextmanager
    def streamed_step(self, layers: tuple[int, int] | None = None):
        """Open one step whose prefill-sized layer calls (those that do not take the one-launch decode
        lookup) stream their non-resident experts through the staging rows; a no-op without staging.
        Layers must come in ascending order with the same rows (as a forward pass calls them). The
        residency's table is snapshotted as the step opens (copied to the host asynchronously); a one-launch
        lookup inside the step (the only thing that changes the residency) makes the next streamed call
        snapshot it again. layers: (first, end), the only layers the step computes (a layered prefill's group,
        ADR 0024): rounds are planned for those alone, so none is prefetched for a layer the step never runs;
        None: every layer."""
        if self._step_open:
            raise RuntimeError("a streamed step is already open")
        self._step_open = True
        self._stream_layers = layers
        if self.staging_slots:
            self._snapshot = self._take_snapshot()
        try:
            yield self
        finally:
            self._step_open = False
            self._snapshot = None
            stream, self._stream = self._stream, None
            if stream is not None:
                stream.finish()
                self._streamed += torch.stack((stream.needed, stream.masked))
                self._staged_unmasked += stream.staged_rows
                self._streamed_steps += 1

    def _take_snapshot(self) -> ResidencySnapshot:
        """The residency's table as the step opens, copied to the host without a host sync (pinned memory,
        an event): the first streamed layer waits only for this copy, which the device reaches before the
        step's own kernels, instead of for every kernel queued up to that layer (the old `.tolist()`)."""
        keys = self.bank.num_layers * self.bank.num_experts
        table = self.residency.slot_of_key[:keys].clone()  # [L*E] on the device
        if self.device.type != "cuda":
            return ResidencySnapshot(table, table, None, None)
        if self._snapshot_host is None:
            self._snapshot_host = torch.empty(keys, dtype=table.dtype, pin_memory=True)
        self._snapshot_host.copy_(table, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return ResidencySnapshot(table, self._snapshot_host, copied, copied)

    def _routed_streamed(self, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                         valid: torch.Tensor | None, shared: bool) -> torch.Tensor:
        if self._stream is None:
            if self._snapshot is None:
                self._snapshot = self._take_snapshot()
            self._stream = PrefillStream(self, self._lane, ids.numel(), self._snapshot, self._stream_layers)
        # NOTE: as the grouped path, every call fills its pairs' partials and one ordered sum ends the
        # layer, so staging in rounds gives the bits of the one-launch path at any S and G
        partials = torch.zeros((x.shape[0], weights.shape[1], x.shape[1]), dtype=torch.float32, device=x.device)
        self._stream.layer(layer, x, weights, ids, valid, shared, partials)
        self._streamed_layers += 1
        return self._reduce(partials, x)

    def streaming_stats(self) -> dict[str, int]:
        """Cumulative streamed-prefill counts (one device read): steps and layer calls streamed, the
        routed (layer, expert)s that were not resident (`experts_not_resident`, each once per step) and
        the rows copied into staging (`experts_staged`: those plus speculative copies never routed),
        with their bytes."""
        needed, masked = self._streamed.tolist()
        staged = masked + self._staged_unmasked
        row = self.layout.row_bytes
        return {"staging_experts": self.staging_slots, "steps": self._streamed_steps,
                "layers": self._streamed_layers, "experts_not_resident": needed, "experts_staged": staged,
                "bytes_not_resident": needed * row, "bytes_staged": staged * row}

    def counters(self) -> tuple[int, int]:
        """(hits, misses) with one device read."""
        hits, misses, _ = self.residency.counters()
        return hits, misses

    @property
    def hits(self) -> int:
        return self.residency.hits

    @property
    def misses(self) -> int:
        return self.residency.misses

    @property
    def bytes_copied(self) -> int:
        return self.residency.misses * self.layout.row_bytes

    def check_valid(self) -> None:
        self.residency.check_valid()  # with a shard: every resident key is the rank's
        assert self.residency.num_slots == self.num_slots, "residency and slot pool disagree on size"
        assert self.slots.dtype == torch.uint8 and self.slots.shape[1] == self.layout.row_bytes
        assert self.all_slots.shape[0] == self.staging_base + self.staging_slots, "staging rows != plan"
