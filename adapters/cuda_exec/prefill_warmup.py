"""Start-up warm-up of the Triton prefill: every autotune key and every JIT specialization a request can
produce is tuned and compiled before the server takes requests, on scratch memory.

Why: on CUDA the prefill GEMMs are `triton.autotune`d per key (dense_gemm: M bucket x weight shape; the
grouped MoE GEMMs: BLOCK_M x expert layout; the GEMVs: weight shape) and every Triton kernel compiles once
per specialization of its integer arguments (== 1, % 16 == 0, other). Done on a request's path this cost
the first 16.5k-token prompt after start 21.9 s to its first token instead of 2.9 s, and turn-2 requests
whose length opened a new M bucket or BLOCK_M 1.8-3.3 s instead of 0.3 s (H200, HTTP, 2026-12-01).

What runs (`plan_warmup` lists it, `WarmupPlan.keys` names each (kernel, key) pair):
  dense_gemm  each distinct quantized weight (shape, format, dtypes) x each M bucket a step can send to it:
              the projections (stacked where they are: a step projects all its tokens at once, decode rows
              included) and the unpacked shared expert for 1..max_tokens rows, the LM head for
              1..max_decode_rows; tuned at the bucket's largest row count (buckets of 2..SPLITK_MAX_ROWS rows
              tune the split-K GEMM, which prefill_linear sends them to). The parts of a stacked weight are
              never multiplied alone on this path and are left out
  dense_gemv  each such weight that some row count sends to the GEMV (one key per weight)
  dequant_weight  each such weight a step of prefill_linear.DEQUANT_MIN_ROWS rows or more can reach (when that is
              on): the kernel compiles per weight shape; dense_gemm's buckets then stop below that row count
              (unless the e4m3 GEMM takes the weight: --prefill-fp8-activations)
  moe_grouped each BLOCK_M that choose_block_m returns for a chunk of more than GEMV_MAX_PAIRS pairs up to
              max_tokens tokens, tuned at the largest chunk that picks it, routing spread like a router's;
              the alignment kernels (moe_align) built at that BLOCK_M over E + 1 groups as well
  moe_fused   the per-pair GEMVs once with partials (the variant the grouped-by-S and streamed paths launch)
  forward     small scratch steps through the model's own forward (prefill spans of 1, 17, 18, 20, 24, 32
              tokens, two spans in one step, one of them after a cached prefix, mixed steps with 1, 2, 4, 8,
              16 decode rows and with the most a step can carry): every other
              kernel (norms, router, GDN chunk kernels, conv, attention's rope, the residency lookup, the
              MoE sum) once per specialization class of the token counts it sees; the prefill attention
              (paged_prefill_attention) once: it takes no integer that varies by step and its tables are
              16-byte aligned views (step_plan.attention_tables), so one binary serves every step; and,
              where max_tokens allows, a 725-token span from position 0 and one after a 1-token prefix: the
              two SDPA dispatches of a span past PAGED_PREFILL_MAX_PAIRS, whose first calls in a process load
              their kernels (prefill_spans.span_sdpa; ~1.4-2 s each on the H200 when a request paid them)
  gdn_prefill a 1-token GDN prefill piece (what a prefix-cache snapshot 1 token into a span leaves), through
              prefill_spans.gdn_spans as a step runs it
  moe_block   every layer's MoE block for chunks small enough for the one-launch residency lookup (on a
              scratch residency), one per BLOCK_N and class of T*K; and once, the
              prefill's set lookup of bigger chunks (residency_set_hits / _fills), on that scratch residency
Scratch: a 2-slot state pool, a KV cache of a few pages, a residency table of the pool's size (for the
decode-style lookup kernel) and the activations; the expert pool's slots are only read (routed expert e
reads slot e mod S, nothing is gathered, the pool's residency is not consulted). Peak extra memory is
what a max_tokens-token prefill step allocates anyway (the grouped MoE's fp32 partials dominate:
4*T*K*H bytes, ~1.2 GiB at 16k tokens of Qwen3.6), returned to the driver afterwards.

Shape legend: T tokens, K top-k columns (K+1 with a packed shared expert), H hidden, E experts per layer,
S slots, M rows of a projection, N/K_in its out/in features.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import triton

from adapters.checkpoint.quant import QTensor
from adapters.cuda_exec import expert_pool as pool_mod
from adapters.cuda_exec import prefill_linear, step_plan
from adapters.cuda_exec.device_residency import DeviceResidency
from adapters.cuda_exec.prefill_linear import a8_weight, use_gemv, use_splitk
from adapters.cuda_exec.prefill_spans import gdn_spans
from adapters.cuda_exec.step_plan import upload_groups
from adapters.kernels import dense_gemm as gemm
from adapters.kernels import dense_gemm_splitk as splitk
from adapters.kernels import dense_gemv as gemv
from adapters.kernels.act_quant_fp8 import act_quant_fp8
from adapters.kernels.dequant_weight import dequant_weight
from adapters.kernels.fused_moe import fused_moe
from adapters.kernels.moe_align import align_by_slot, choose_block_m
from adapters.kernels.residency_lookup import MAX_KEYS
from adapters.torch_exec.gated_deltanet import LinearStatePool
from adapters.torch_exec.paged_attention import PagedKVCache
from adapters.torch_exec.step_inputs import SeqSpan, StepInputs
from domain.ports import SequenceWork
from domain.request import SamplingParams

log = logging.getLogger(__name__)

# Token counts of the scratch steps: gcd(T, 16) takes every value 1, 2, 4, 8, 16, and T == 1 (Triton
# specializes an int argument on == 1 and on % 16 == 0; an argument c*T falls in a class set by gcd(T, 16)).
SPAN_TOKENS = (1, 17, 18, 20, 24, 32)
# a span after a cached prefix (lower-right causal attention), in one step with a span from 0 (the attention of
# every span of a step in one launch, over a block table of both)
PREFIX_TOKENS, PREFIX_SPAN = 32, 17
MIXED_PREFILL = 16  # the prefill span of a mixed step; its decode rows take the gcd classes
DECODE_ROWS = (1, 2, 4, 8, 16)


def long_span() -> int:
    """The fewest tokens of a span from position 0 whose attention leaves paged_prefill_attention for SDPA
    (n * n > step_plan.PAGED_PREFILL_MAX_PAIRS: 725 at 2^19)."""
    return math.isqrt(step_plan.PAGED_PREFILL_MAX_PAIRS) + 1


@dataclass(frozen=True)
class GemmItem:
    weight: QTensor
    rows: int

    @property
    def key(self) -> tuple:
        """dense_gemm's autotune key (M_BUCKET, N, K, FMT) with the format's name."""
        return (gemm.m_bucket(self.rows), *self.weight.shape, self.weight.fmt.value)


@dataclass(frozen=True)
class GemvItem:
    weight: QTensor

    @property
    def key(self) -> tuple:
        """dense_gemv's autotune key (N, K, format)."""
        return (*self.weight.shape, self.weight.fmt.value)


@dataclass(frozen=True)
class DequantItem(GemvItem):
    """dequant_weight's compile: one per weight shape and format (its N and K are compile-time), GemvItem's key."""


@dataclass(frozen=True)
class GroupedItem:
    block_m: int
    tokens: int
    columns: int  # top-k columns of the slot ids (K, or K+1 with the packed shared expert)

    @property
    def key(self) -> tuple:
        """The grouped GEMMs' varying key part (BLOCK_M, top-k columns); the layout is fixed per pool."""
        return (self.block_m, self.columns)


@dataclass(frozen=True)
class FusedItem:
    columns: int

    @property
    def key(self) -> tuple:
        return (self.columns, "partials")


@dataclass(frozen=True)
class ForwardItem:
    spans: tuple[tuple[int, int], ...]  # (tokens, start position) of each prefill span
    decodes: int  # single-token rows after them

    @property
    def key(self) -> tuple:
        return (self.spans, self.decodes)


@dataclass(frozen=True)
class MoeBlockItem:
    tokens: int
    top_k: int

    @property
    def key(self) -> tuple:
        """The one-launch residency lookup's BLOCK_N and the specialization class of its T*K keys."""
        n = self.tokens * self.top_k
        return (max(16, triton.next_power_of_2(n)), spec_class(n))


@dataclass(frozen=True)
class GdnPieceItem:
    tokens: int  # a span piece run alone (a prefix-cache snapshot can cut a 1-token piece)

    @property
    def key(self) -> tuple:
        return (self.tokens,)


@dataclass(frozen=True)
class WarmupPlan:
    gemm: tuple[GemmItem, ...]
    gemv: tuple[GemvItem, ...]
    grouped: tuple[GroupedItem, ...]
    fused: tuple[FusedItem, ...]
    forwards: tuple[ForwardItem, ...]
    gdn_pieces: tuple[GdnPieceItem, ...] = ()
    moe_blocks: tuple[MoeBlockItem, ...] = ()
    dequants: tuple[DequantItem, ...] = ()

    def items(self) -> list[tuple[str, object]]:
        """(kernel, item) in the order they run: the tuned GEMMs first, at their representative sizes, so
        the scratch forwards find their keys tuned."""
        return ([("dense_gemm", i) for i in self.gemm] + [("dense_gemv", i) for i in self.gemv]
                + [("dequant_weight", i) for i in self.dequants] + [("moe_grouped", i) for i in self.grouped]
                + [("moe_fused", i) for i in self.fused]
                + [("forward", i) for i in self.forwards] + [("gdn_prefill", i) for i in self.gdn_pieces]
                + [("moe_block", i) for i in self.moe_blocks])

    def keys(self) -> set[tuple[str, tuple]]:
        return {(kernel, item.key) for kernel, item in self.items()}


def spec_class(n: int):
    """How Triton specializes an int argument n: 'one' for n == 1, else gcd(n, 16) (16: divisible by 16;
    an argument c*n falls in a class set by this)."""
    return "one" if n == 1 else math.gcd(n, 16)


def lookup_tokens(max_tokens: int, top_k: int, max_keys: int) -> tuple[int, ...]:
    """Chunk sizes (tokens) that take the one-launch residency lookup (T*top_k <= max_keys), one per
    (BLOCK_N, specialization class of T*top_k): the kernel compiles once per pair."""
    found: dict[tuple, int] = {}
    for t in range(1, min(max_tokens, max_keys // top_k) + 1):
        found[MoeBlockItem(t, top_k).key] = t
    return tuple(sorted(found.values()))


def gemm_rows(bound: int, in_features: int, gemv_ok: bool) -> tuple[int, ...]:
    """Row counts that tune dense_gemm for a weight with in_features columns seen with 1..bound rows: per
    M bucket the largest row count that reaches the GEMM (prefill_linear sends few rows to the GEMV when
    gemv_ok), at most the bucket itself (bigger M shares the top bucket's key)."""
    best: dict[int, int] = {}
    for m in range(1, min(bound, gemm.m_bucket(bound)) + 1):
        if not (gemv_ok and use_gemv(m, in_features)):
            best[gemm.m_bucket(m)] = m
    return tuple(sorted(best.values()))


def grouped_tokens(max_tokens: int, top_k: int, columns: int, groups: int, min_pairs: int) -> dict[int, int]:
    """{BLOCK_M: the largest chunk (tokens) that picks it} over chunks of 1..max_tokens tokens whose
    T*top_k routed pairs exceed min_pairs (the grouped GEMMs' threshold); BLOCK_M as grouped_moe picks it
    from T*columns pairs over at most `groups` slots."""
    best: dict[int, int] = {}
    for t in range(1, max_tokens + 1):
        if t * top_k > min_pairs:
            best[choose_block_m(t * columns, groups)] = t
    return best


def _weight_key(w: QTensor) -> tuple:
    gs = None if w.global_scale is None else w.global_scale.dtype
    return (tuple(w.shape), w.fmt, w.data.dtype, w.scale.dtype, gs)


def dense_weights(model, max_tokens: int, max_decode_rows: int) -> list[tuple[QTensor, int]]:
    """(weight, the most rows a step multiplies it by) for each distinct quantized weight the prefill path
    sends to dense_gemm/dense_gemv: the projections (stacked where they are) and an unpacked shared expert
    up to max_tokens rows (prefill_spans.py projects a step's tokens together); the LM head up to
    max_decode_rows (mixed steps' decode rows, the decode buckets). The parts of a stacked weight (views
    into it) are not listed: every projection of theirs goes through the stack."""
    found: dict[tuple, tuple[QTensor, int]] = {}
    stacked = getattr(model, "stacked", {})
    skip = {id(part) for part in getattr(model, "stacked_parts", ())}

    def add(w, bound: int) -> None:
        if not isinstance(w, QTensor) or not gemm.supports(w) or id(w) in skip:
            return
        key = _weight_key(w)
        bound = min(bound, max_tokens)
        if key not in found or found[key][1] < bound:
            found[key] = (w, bound)

    for w in model.w.values():
        add(w, max_decode_rows if w is model.lm_head else max_tokens)
    add(model.lm_head, max_decode_rows)
    for weight, _ in stacked.values():
        add(weight, max_tokens)
    return list(found.values())


def plan_warmup(model, experts, max_tokens: int, max_decode_rows: int) -> WarmupPlan:
    """What a step of up to max_tokens tokens (and up to max_decode_rows decode rows) can make Triton tune
    or compile, for `model` (a FastDecoder) on `experts` (a DeviceExpertPool). Pure host arithmetic."""
    if max_tokens < 1 or max_decode_rows < 1:
        raise ValueError(f"max_tokens and max_decode_rows must be >= 1, got {max_tokens}, {max_decode_rows}")
    gemms, gemvs, dequants = [], [], []
    cut = prefill_linear.DEQUANT_MIN_ROWS  # read at call time: chunks of this many rows go to cuBLAS (0: none)
    for w, bound in dense_weights(model, max_tokens, max_decode_rows):
        gemv_ok = gemv.supports(w)
        if 0 < cut <= bound:
            dequants.append(DequantItem(w))
            if not (model.fp8_activations and a8_weight(w)):  # the e4m3 GEMM takes every row count
                bound = cut - 1
        gemms += [GemmItem(w, m) for m in gemm_rows(bound, w.shape[1], gemv_ok)]
        if gemv_ok:
            gemvs.append(GemvItem(w))
    top_k = model.opts.top_k
    columns = top_k + int(experts.has_shared and model.opts.shared_expert)
    grouped = []
    if experts.grouped:
        found = grouped_tokens(max_tokens, top_k, columns, experts.bank.num_experts + 1, pool_mod.GEMV_MAX_PAIRS)
        grouped = [GroupedItem(bm, t, columns) for bm, t in sorted(found.items())]
    # NOTE: and the most decode rows a step carries: prefill_spans.attention_tables takes the split count of
    # paged_decode_attention (a compile-time constant) from the rows rounded up to a power of two
    rows = tuple(n for n in sorted({*DECODE_ROWS, max_decode_rows})
                 if n <= max_decode_rows and MIXED_PREFILL + n <= max_tokens)
    forwards = [ForwardItem(((t, 0),), 0) for t in SPAN_TOKENS if t <= max_tokens]
    if 2 * PREFIX_SPAN <= max_tokens:
        forwards.append(ForwardItem(((PREFIX_SPAN, PREFIX_TOKENS), (PREFIX_SPAN, 0)), 0))
    elif PREFIX_SPAN <= max_tokens:
        forwards.append(ForwardItem(((PREFIX_SPAN, PREFIX_TOKENS),), 0))
    forwards += [ForwardItem(((MIXED_PREFILL, 0),), n) for n in rows]
    # NOTE: a span past PAGED_PREFILL_MAX_PAIRS attends through SDPA, whose first call of each kind in the process
    # loads its kernels (seconds on the H200): a span from position 0 and one after a cached prefix (the flash
    # kernel's lower-right dispatch), each once, as the first long prompt and its second chunk would
    if model.full_layers and long_span() <= max_tokens:
        forwards += [ForwardItem(((long_span(), 0),), 0), ForwardItem(((long_span(), 1),), 0)]
    pieces = (GdnPieceItem(1),) if model.linear_layers else ()  # forward's spans of 1 token are decode rows
    blocks = tuple(MoeBlockItem(t, top_k) for t in lookup_tokens(max_tokens, top_k, min(experts.num_slots, MAX_KEYS)))
    return WarmupPlan(tuple(gemms), tuple(gemvs), tuple(grouped), (FusedItem(columns),), tuple(forwards), pieces,
                      blocks, tuple(dequants))


class ReadOnlyExperts:
    """The expert pool as a forward pass calls it (`routed`, `has_shared`), reading its slots only: a step
    that fits the one-launch lookup runs that kernel on a scratch residency of the pool's size (its slot
    ids are slots of the pool), a bigger one reads expert e from slot e mod S. Nothing is gathered and the
    pool's residency, counters and slot bytes are not written."""

    def __init__(self, pool):
        self.pool, self.has_shared = pool, pool.has_shared
        owner = pool.residency.owner
        self.residency = DeviceResidency(pool.num_slots, pool.bank.num_layers, pool.bank.num_experts, pool.device,
                                         owner=None if owner is None else owner[:-1].cpu(), rank=pool.residency.rank)

    def warm_set_lookup(self) -> None:
        """Compile the prefill's set lookup (DeviceResidency.lookup_set: every chunk above the one-launch
        lookup takes it when the layer's experts fit the pool) on the scratch tables: one binary per pool
        (its integer arguments are not specialized; the owner table of an expert-parallel pool is)."""
        if self.residency.can_lookup_set():
            present = torch.ones(self.pool.bank.num_experts, dtype=torch.bool, device=self.pool.device)
            self.residency.lookup_set(0, present, self.pool.num_slots if self.has_shared else -1)

    def slot_ids(self, layer: int, ids: torch.Tensor, shared: bool) -> torch.Tensor:
        """int32 [T, K(+1)] slots of the pool for expert ids [T, K]: e mod min(E, S), the layer's shared
        row in column K when `shared`."""
        pool = self.pool
        slots = (ids.to(torch.int64) % min(pool.bank.num_experts, pool.num_slots)).to(torch.int32)
        return pool._with_shared(layer, slots, shared)

    def routed(self, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
               valid: torch.Tensor | None = None, shared: bool = False) -> torch.Tensor:
        pool = self.pool
        if ids.numel() <= min(pool.num_slots, MAX_KEYS):  # as DeviceExpertPool.routed's decode branch
            if valid is None:
                valid = torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device)
            _, _, slot_ids = self.residency.lookup_layer(layer, ids, valid, pool.num_slots + layer if shared else None)
        else:
            slot_ids = self.slot_ids(layer, ids, shared)
        return pool._experts(ids.numel(), x, slot_ids, weights)


@dataclass
class WarmupReport:
    plan: WarmupPlan
    seconds: float = 0.0
    skipped: list[str] = field(default_factory=list)  # items that ran out of memory (logged; a request that size would too)


def warm_prefill_kernels(model, experts, plan: WarmupPlan, *, page_size: int, dtype: torch.dtype,
                         device: torch.device, seed: int = 0,
                         on_item: Callable[[str, object], None] | None = None) -> WarmupReport:
    """Run `plan` (plan_warmup's, for this model and pool) on scratch inputs (see the module docstring) in
    the model's dtype, with a KV cache of page_size pages; returns the plan, the seconds it took (device
    work included) and the items skipped for lack of device memory. on_item(kernel, item): told before
    each item runs. Raises whatever a kernel raises other than running out of memory (a kernel that
    cannot build for this model would fail every request that reaches it)."""
    start = time.perf_counter()
    context = max((pos + n for item in plan.forwards for n, pos in item.spans), default=1)  # the longest KV a span needs
    scratch = _Scratch(model, experts, page_size, dtype, device, seed, context)
    skipped: list[str] = []
    with torch.inference_mode():
        scratch.read_only.warm_set_lookup()
        for kernel, item in plan.items():
            if on_item is not None:
                on_item(kernel, item)
            try:
                scratch.run(kernel, item)
            except torch.cuda.OutOfMemoryError as err:  # NOTE: confined: the server can still serve smaller steps
                skipped.append(f"{kernel} {item.key}")
                log.warning("prefill warm-up: %s %s ran out of device memory (%s); a step that size will too",
                            kernel, item.key, str(err).splitlines()[0])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # the scratch (up to a max_tokens step's activations) goes back to the driver
    return WarmupReport(plan, time.perf_counter() - start, skipped)


class _Scratch:
    """Inputs of each warm-up item, on scratch memory (never the executor's KV, state or slot bytes)."""

    def __init__(self, model, experts, page_size: int, dtype: torch.dtype, device: torch.device, seed: int,
                 context: int = 1):
        self.model, self.experts, self.dtype, self.device = model, experts, dtype, device
        # NOTE: inputs drawn on the device (a 16k x 2048 draw on the host takes longer than its GEMM's tuning)
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.host_gen = torch.Generator().manual_seed(seed)  # token ids (host lists)
        self.page_size = page_size
        self.read_only = ReadOnlyExperts(experts)
        longest = max(PREFIX_TOKENS + PREFIX_SPAN, max(SPAN_TOKENS), MIXED_PREFILL, context)
        self.span_pages = -(-longest // page_size)
        attn = model.opts.attention
        self.kv = PagedKVCache(len(model.full_layers), self.span_pages + 1, page_size, attn.num_kv_heads,
                               attn.head_dim, dtype, device) if model.full_layers else None
        self.state = LinearStatePool(len(model.linear_layers), 2, model.opts.gdn, dtype, device) \
            if model.linear_layers else None

    def _randn(self, *shape) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen, device=self.device, dtype=self.dtype).mul_(0.1)

    def run(self, kernel: str, item) -> None:
        getattr(self, "_" + kernel)(item)

    def _dense_gemm(self, item: GemmItem) -> None:
        """The item's M bucket as the prefill sends it: with --prefill-fp8-activations, rows past the decode
        buckets take the e4m3 GEMM (FastDecoder._linear) and fewer rows the bf16 one, so a bucket that holds
        both is tuned both ways."""
        x = self._randn(item.rows, item.weight.shape[1])
        decode_rows = self.model.decode_gemm_rows
        a8 = self.model.fp8_activations and a8_weight(item.weight)
        if a8 and item.rows > decode_rows:
            gemm.dense_gemm(act_quant_fp8(x), item.weight, out_dtype=x.dtype)
        if not a8 or gemm.m_bucket(item.rows) // 2 < decode_rows:
            # the bf16 rows of this bucket: the split-K GEMM's rows tune it (prefill_linear.use_splitk)
            if use_splitk(item.rows, item.weight):
                splitk.dense_gemm_splitk(x, item.weight)
            else:
                gemm.dense_gemm(x, item.weight)

    def _dequant_weight(self, item: DequantItem) -> None:
        dequant_weight(item.weight, torch.empty(item.weight.shape, dtype=self.dtype, device=self.device))

    def _dense_gemv(self, item: GemvItem) -> None:
        gemv.dense_gemv(self._randn(1, item.weight.shape[1]), item.weight)

    def _routing(self, tokens: int, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot ids int32 [T, columns], weights fp32 [T, columns]): K distinct experts per token drawn
        uniformly (a router's spread), as slots of the pool; the shared row in the last column if packed."""
        top_k, pool = self.model.opts.top_k, self.experts
        scores = torch.rand(tokens, pool.bank.num_experts, generator=self.gen, device=self.device)  # [T, E]
        ids = scores.topk(top_k, dim=1).indices  # [T, K]
        slot_ids = self.read_only.slot_ids(0, ids, columns > top_k)
        weights = torch.full((tokens, columns), 1.0 / top_k, dtype=torch.float32, device=self.device)
        return slot_ids, weights

    def _moe_grouped(self, item: GroupedItem) -> None:
        slot_ids, weights = self._routing(item.tokens, item.columns)
        x = self._randn(item.tokens, self.model.opts.hidden)
        self.experts._experts(item.tokens * self.model.opts.top_k, x, slot_ids, weights)
        # NOTE: the streamed path aligns by expert (align_by_expert: S = E + 1 groups, the Triton alignment),
        # while _experts aligns by pool slot (torch above MAX_TRITON_SLOTS slots): build that BLOCK_M here too
        groups = self.experts.bank.num_experts + 1
        align_by_slot(torch.where(slot_ids < groups, slot_ids, -1), groups, item.block_m, groups)

    def _moe_fused(self, item: FusedItem) -> None:
        slot_ids, weights = self._routing(1, item.columns)
        partials = torch.zeros((1, item.columns, self.model.opts.hidden), dtype=torch.float32, device=self.device)
        fused_moe(self._randn(1, self.model.opts.hidden), slot_ids, weights, self.experts.all_slots,
                  self.experts.layout, partials=partials)

    def _moe_block(self, item: MoeBlockItem) -> None:
        """Every layer's MoE block (router, lookup, experts) on `tokens` rows: the lookup's integer
        arguments (the layer's key base, its shared slot) differ by layer."""
        h = self._randn(item.tokens, self.model.opts.hidden)
        for i in range(len(self.model.mixers)):
            self.model._moe(i, h, self.read_only)

    def _gdn_prefill(self, item: GdnPieceItem) -> None:
        """One GDN layer on a piece of item.tokens alone, as prefill_spans runs a piece of a span cut by a
        snapshot (its state walk specializes on the piece's tokens)."""
        model = self.model
        i = model.linear_layers[0]  # every GDN layer has the same shapes
        mixer = model.mixers[i]
        group = upload_groups([([(slice(0, item.tokens), 0)], None)], self.device)
        gdn_spans(mixer, self._randn(item.tokens, model.opts.hidden), group, self.state, 0,
                  qkvz_fn=lambda x: model._projections(i, mixer, x, "qkvz", ("in_proj_qkv", "in_proj_z")),
                  ab_fn=lambda x: model._projections(i, mixer, x, "ab", ("in_proj_b", "in_proj_a")),
                  linear_fn=model._linear)

    def _forward(self, item: ForwardItem) -> None:
        """One scratch step through the model's forward and logits: prefill span i in state slot i % 2 and the
        first pages, every decode row in slot 1 and the last page (rows sharing a slot or a page only mix
        scratch values; the plan's two-span step has no decode rows, so its spans' states stay apart)."""
        vocab = self.model.embed.shape[0]
        spans, tokens, positions, offset = [], [], [], 0
        works = [(length, start, i % 2, tuple(range(self.span_pages))) for i, (length, start) in enumerate(item.spans)]
        works += [(1, 0, 1, (self.span_pages,))] * item.decodes
        for i, (length, start, slot, pages) in enumerate(works):
            work = SequenceWork(f"warmup-{i}", tuple(torch.randint(vocab, (length,), generator=self.host_gen).tolist()),
                                start, pages, slot, True, SamplingParams(), int(length == 1))
            spans.append(SeqSpan(work, offset, length, torch.tensor(pages, dtype=torch.long, device=self.device)))
            tokens += work.token_ids
            positions += range(start, start + length)
            offset += length
        inp = StepInputs(torch.tensor(tokens, dtype=torch.long, device=self.device),
                         torch.tensor(positions, dtype=torch.long, device=self.device), tuple(spans))
        hidden = self.model.forward(inp, self.kv, self.state, self.read_only)  # [T, H]
        last = torch.tensor([s.offset + s.length - 1 for s in spans], device=self.device)
        self.model.logits(hidden[last])
