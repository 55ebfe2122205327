"""Hand-written fakes of every port (stdlib only), for tests, the simulator and a demo server.

FakeExecutor keeps a real paged "KV cache" of token ids, so it notices when the scheduler
hands a sequence's pages to someone else, skips positions, or reuses a state slot without a
reset: each breach of the SequenceWork contract raises ContractViolation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from domain.ports import (
    ChatTemplateError,
    ExpertKey,
    SampledToken,
    SequenceWork,
    StepBatch,
    layer_group_problem,
)

if TYPE_CHECKING:
    from domain.budget import PoolPlan


class ContractViolation(AssertionError):
    """A caller broke a port's contract (raised even under python -O)."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ContractViolation(message)


def sequence_hash(token_ids: Sequence[int]) -> int:
    """FNV-1a over the token ids: stable across processes (unlike hash() of str)."""
    h = 0xCBF29CE484222325
    for token in token_ids:
        h = ((h ^ token) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


class FakeExecutor:
    """Next token = sequence_hash(all tokens of the sequence so far) % vocab_size.

    The token depends only on the sequence, so a batched run must equal each request run alone.
    """

    def __init__(self, page_size: int, num_pages: int, num_state_slots: int, vocab_size: int = 64,
                 num_snapshot_slots: int = 0, linear_state: bool = True, num_layers: int = 1) -> None:
        """linear_state=False models a KV-only model: a sequence may resume at any position its
        pages cover, with no state to restore. num_layers: the model's layers, which layered prefill's
        groups divide (a chunk's tokens are computed when its last group runs)."""
        if min(page_size, vocab_size) < 1 or min(num_pages, num_state_slots, num_snapshot_slots) < 0:
            raise ValueError("FakeExecutor needs page_size, vocab_size >= 1 and pools >= 0")
        self.vocab_size = vocab_size
        self.linear_state = linear_state
        self.num_layers = num_layers
        self.num_layer_groups = 0
        self._kept: tuple[str, SequenceWork, int] | None = None  # layered chunk part-way: (id, chunk, layers done)
        self.num_steps = 0
        self.num_tokens = 0
        self.num_restores = 0
        self.num_snapshots = 0
        self.plans: list[PoolPlan] = []
        self._kv: dict[int, list[int | None]] = {}
        self._snapshots: dict[int, list[int]] = {}
        self._set_pools(page_size, num_pages, num_state_slots, num_snapshot_slots)

    def _set_pools(self, page_size: int, num_pages: int, num_state_slots: int, num_snapshot_slots: int,
                   keep_kv: bool = False, keep_snapshots: bool = False) -> None:
        self.page_size, self.num_pages, self.num_state_slots = page_size, num_pages, num_state_slots
        self.num_snapshot_slots = num_snapshot_slots
        if not keep_kv:
            self._kv = {}  # page -> [page_size] token written at each offset
        if not keep_snapshots:
            self._snapshots = {}  # snapshot slot -> tokens folded into the state it holds
        self._history: dict[int, list[int]] = {}  # state slot -> tokens folded into its state

    def resize_pools(self, plan: PoolPlan) -> None:
        """Like the real executors: a pool whose size is unchanged keeps its contents."""
        keep_kv = (plan.page_size, plan.kv_pages) == (self.page_size, self.num_pages)
        snapshot_slots = getattr(plan, "snapshot_slots", 0)
        keep_snapshots = snapshot_slots == self.num_snapshot_slots
        self.plans.append(plan)
        self._set_pools(plan.page_size, plan.kv_pages, plan.state_slots, snapshot_slots, keep_kv, keep_snapshots)

    def execute(self, batch: StepBatch) -> dict[str, SampledToken]:
        self._check_batch(batch)
        done = []  # works whose tokens are computed this step (a layered chunk in its last group)
        for work in batch.works:
            whole = self._layer_group(work) if work.layers is not None else work
            if whole is not None:
                done.append(whole)
        for work in done:  # write every work's tokens first, as one fused step would
            self._write(work)
        out = {}
        for work in done:
            seen = self._read(work)
            _require(seen == self._history[work.state_slot], f"{work.request_id}: KV pages lost its tokens")
            if work.sample:
                out[work.request_id] = self._sample(work, seen)
        self.num_steps += 1
        self.num_tokens += batch.num_tokens
        return out

    def _check_batch(self, batch: StepBatch) -> None:
        ids = [w.request_id for w in batch.works]
        slots = [w.state_slot for w in batch.works]
        _require(len(set(ids)) == len(ids), "a request appears twice in one batch")
        problem = layer_group_problem(batch.works, self.num_layers)
        _require(problem is None, str(problem))
        _require(len(set(slots)) == len(slots), "a state slot appears twice in one batch")
        written: dict[int, str] = {}
        snap_writes = [s for w in batch.works for _, s in w.snapshots]
        restores = {w.restore_from for w in batch.works if w.restore_from is not None}
        _require(len(snap_writes) == len(set(snap_writes)), "a snapshot slot is written twice in one batch")
        _require(not restores & set(snap_writes), "a snapshot slot is restored from and written in one batch")
        for w in batch.works:
            _require(len(w.token_ids) >= 1, f"{w.request_id}: empty work")
            _require(0 <= w.state_slot < self.num_state_slots, f"{w.request_id}: state slot out of range")
            _require(len(w.page_ids) == len(set(w.page_ids)), f"{w.request_id}: page listed twice")
            _require(all(0 <= p < self.num_pages for p in w.page_ids), f"{w.request_id}: page out of range")
            needed = -(-w.end_position // self.page_size)
            _require(len(w.page_ids) >= needed, f"{w.request_id}: pages cover < {w.end_position} positions")
            if w.restore_from is not None:
                _require(0 <= w.restore_from < self.num_snapshot_slots, f"{w.request_id}: restore slot out of range")
                _require(w.start_position > 0, f"{w.request_id}: restore at position 0")
                held = self._snapshots.get(w.restore_from)
                _require(held is not None and len(held) == w.start_position,
                         f"{w.request_id}: snapshot {w.restore_from} holds {None if held is None else len(held)} "
                         f"tokens, the work resumes at {w.start_position}")
                expected = w.start_position
            elif not self.linear_state:
                expected = w.start_position  # nothing but KV: the pages alone carry the prefix
            else:
                expected = 0 if w.start_position == 0 else len(self._history.get(w.state_slot, ()))
            positions = [p for p, _ in w.snapshots]
            _require(positions == sorted(set(positions)) and all(w.start_position < p <= w.end_position
                                                                 for p in positions),
                     f"{w.request_id}: snapshot positions {positions} outside ({w.start_position}, {w.end_position}]")
            _require(all(0 <= s < self.num_snapshot_slots for _, s in w.snapshots),
                     f"{w.request_id}: snapshot slot out of range")
            _require(
                w.start_position == expected,
                f"{w.request_id}: start_position {w.start_position} but slot {w.state_slot} holds {expected}",
            )
            for pos in range(w.start_position, w.end_position):
                page = w.page_ids[pos // self.page_size]
                _require(written.setdefault(page, w.request_id) == w.request_id, f"page {page} written twice")

    def _layer_group(self, work: SequenceWork) -> SequenceWork | None:
        """Checks one layer group against the SequenceWork contract; the chunk as a whole work once its last
        group runs, else None. The state is reset or restored by the first group."""
        first, end = work.layers
        rid = work.request_id
        chunk = replace(work, layers=None, restore_from=None, sample=False)
        if first == 0:
            self._prepare(work)
        else:
            kept = self._kept
            _require(kept is not None and kept[0] == rid and kept[2] == first and kept[1] == chunk,
                     f"{rid}: group {work.layers} does not continue the chunk kept ({kept and kept[0]}, "
                     f"layers done {kept and kept[2]})")
        self.num_layer_groups += 1
        if end < self.num_layers:
            self._kept = (rid, chunk, end)
            return None
        self._kept = None
        return replace(work, layers=None, restore_from=None)

    def _prepare(self, work: SequenceWork) -> None:
        """A work's state before its tokens: reset at 0, restored from a snapshot, or (KV only) its pages."""
        if work.start_position == 0:
            self._history[work.state_slot] = []
        elif work.restore_from is not None:
            self._history[work.state_slot] = list(self._snapshots[work.restore_from])
            self.num_restores += 1
        elif not self.linear_state:
            self._history[work.state_slot] = self._read(work)[: work.start_position]

    def _write(self, work: SequenceWork) -> None:
        if work.start_position == 0 or work.restore_from is not None or not self.linear_state:
            self._prepare(work)
        history = self._history[work.state_slot]
        for position, slot in work.snapshots:
            self._snapshots[slot] = history + list(work.token_ids[: position - work.start_position])
            self.num_snapshots += 1
        history.extend(work.token_ids)
        for offset, token in enumerate(work.token_ids):
            pos = work.start_position + offset
            page = self._kv.setdefault(work.page_ids[pos // self.page_size], [None] * self.page_size)
            page[pos % self.page_size] = token

    def _read(self, work: SequenceWork) -> list[int | None]:
        size = self.page_size
        return [
            self._kv.get(work.page_ids[p // size], [None] * size)[p % size] for p in range(work.end_position)
        ]

    def _sample(self, work: SequenceWork, seen: list[int]) -> SampledToken:
        h = sequence_hash(seen)
        token = h % self.vocab_size
        if not work.sampling.logprobs:
            return SampledToken(work.request_id, token)
        logprob = -((h >> 16) % 1000) / 100.0
        top = tuple(((token + i) % self.vocab_size, logprob - i) for i in range(work.sampling.top_logprobs))
        return SampledToken(work.request_id, token, logprob, top)

    def check_valid(self) -> None:
        assert all(0 <= s < self.num_state_slots for s in self._history), "history for a slot out of range"
        assert all(0 <= p < self.num_pages and len(v) == self.page_size for p, v in self._kv.items())
        assert all(0 <= s < self.num_snapshot_slots for s in self._snapshots), "snapshot slot out of range"


class FakeClock:
    """Time that moves only when a test says so."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock never goes backwards (advance by {seconds})")
        self._now += seconds

    def check_valid(self) -> None:
        assert self._now == self._now, "clock is NaN"


class FakeTokenizer:
    """Byte-level toy: ids 0..255 are UTF-8 bytes, then a few special tokens."""

    SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    eos_token_ids: tuple[int, ...] = (256, 258)  # <|endoftext|>, <|im_end|>
    vocab_size = 256 + len(SPECIALS)
    max_chars_per_token = 1  # encode gives one token per UTF-8 byte: at least one per character

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """Bytes 0..255 as UTF-8, specials skipped; ids past the vocabulary (a model's padded rows) skipped
        too (domain.ports.Tokenizer). ValueError for a negative id."""
        for i in ids:
            if i < 0:
                raise ValueError(f"token id {i} is negative")
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        if token_id < 0:
            raise ValueError(f"token id {token_id} is negative")
        if token_id >= self.vocab_size:
            return b""  # a model's padded row: no text
        return bytes([token_id]) if token_id < 256 else self.SPECIALS[token_id - 256].encode()

    def apply_chat_template(
        self, messages: list[dict], *, tools: list[dict] | None = None, add_generation_prompt: bool = True,
        **template_kwargs: object,
    ) -> str:
        """ChatML without tools or thinking: a request that needs them is refused, like a real template
        without them would be unable to express them (tests needing tools use a real template)."""
        if tools:
            raise ChatTemplateError("chat template: the fake tokenizer renders no tools")
        parts = []
        for message in messages:
            if "role" not in message or "content" not in message:
                raise ValueError(f"a chat message needs role and content, got {sorted(message)}")
            parts.append(f"<|im_start|>{message['role']}\n{message['content']}<|im_end|>\n")
        return "".join(parts) + ("<|im_start|>assistant\n" if add_generation_prompt else "")


@dataclass(frozen=True)
class StepRecord:
    prefill_tokens: int
    decode_tokens: int
    seconds: float
    expert_hits: int
    expert_misses: int


class ListMetricsSink:
    """Keeps every step record in a list."""

    def __init__(self) -> None:
        self.steps: list[StepRecord] = []

    def record_step(
        self, *, prefill_tokens: int, decode_tokens: int, seconds: float, expert_hits: int, expert_misses: int,
        host_seconds: float | None = None, prefill_work: bool | None = None,
    ) -> None:
        self.steps.append(StepRecord(prefill_tokens, decode_tokens, seconds, expert_hits, expert_misses))

    @property
    def total_tokens(self) -> int:
        return sum(s.prefill_tokens + s.decode_tokens for s in self.steps)

    def check_valid(self) -> None:
        assert all(
            min(s.prefill_tokens, s.decode_tokens, s.expert_hits, s.expert_misses) >= 0 for s in self.steps
        )
        assert all(s.seconds >= 0 for s in self.steps)


class FakeExpertTransfer:
    """Asynchronous copies modelled as pending until wait(); reading a pending slot is a breach."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.num_copies = 0
        self._contents: dict[int, ExpertKey] = {}
        self._pending: dict[int, ExpertKey] = {}

    def copy_experts(self, fills: Sequence[tuple[ExpertKey, int]]) -> None:
        slots = [slot for _, slot in fills]
        _require(len(slots) == len(set(slots)), "a slot is filled twice in one call")
        _require(all(0 <= s < self.num_slots for s in slots), "expert slot out of range")
        for key, slot in fills:
            self._pending[slot] = key
        self.num_copies += len(fills)

    def wait(self) -> None:
        self._contents.update(self._pending)
        self._pending.clear()

    def read(self, slot: int) -> ExpertKey | None:
        """What the executor would find in `slot`; the copy must have completed."""
        _require(slot not in self._pending, f"slot {slot} read before its copy completed")
        return self._contents.get(slot)

    def check_valid(self) -> None:
        assert all(0 <= s < self.num_slots for s in (*self._contents, *self._pending)), "slot out of range"
