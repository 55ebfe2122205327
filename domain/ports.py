"""Ports: what the domain core needs from the outside world, each contract in its docstring.

Shape legend: T tokens, B batch (sequences in a step), P KV pages, S expert slots, V vocab.
Adapters (torch executors), the simulator and the fakes in domain/fakes.py implement these.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from domain.request import SamplingParams

if TYPE_CHECKING:
    from domain.budget import PoolPlan

ExpertKey = tuple[int, int]  # (layer, expert); same alias as domain.residency.ExpertKey


@dataclass(frozen=True)
class SequenceWork:
    """One sequence's share of a step.

    Contract (the scheduler promises, executors may assert):
    - token_ids are positions [start_position, start_position + len(token_ids)) of the
      sequence; len(token_ids) >= 1.
    - start_position == 0 means a fresh sequence: reset the linear-attention state in
      state_slot. With restore_from set (start_position > 0, a prefix-cache hit) copy that
      snapshot slot into state_slot first: it holds the state after exactly start_position
      tokens of this sequence. Otherwise start_position equals the end of the previous work
      with this state_slot (no gaps, no repeats; the layer groups of one chunk, below, share theirs).
    - snapshots: (position, snapshot slot) pairs, positions strictly increasing in
      (start_position, end_position]: once the tokens before `position` are computed, copy the
      linear-attention state (recurrent + conv, every layer) of state_slot into that slot.
      Executors without linear-attention layers ignore restore_from and snapshots.
    - layers (layered prefill, docs/adr/0024-layered-prefill.md): None = every layer of the model,
      as always. (first, end) with 0 <= first < end <= L (the model's layer count) = one *layer
      group* of a prefill chunk: compute only layers [first, end) of this work's tokens. The groups
      of one chunk come in consecutive steps of that request, in layer order, with no gap: the same
      token_ids, start_position, page_ids, state_slot and snapshots each time; the executor keeps
      the chunk's residual stream [T, H] after layer end - 1 until the next group continues from it
      (one chunk at a time: a group with first == 0 starts a new chunk and drops any kept one; a
      chunk abandoned mid-way, its request preempted or aborted, is simply never continued). Only the
      group with first == 0 resets or restores the state (restore_from is None in the others).
      Snapshots strictly inside the chunk are taken layer by layer as each group computes its
      layers; snapshots at end_position after the last group (end == L). Only the last group may
      sample (sample is False while end < L). At most one work of a StepBatch carries layers.
    - page_ids cover positions [0, start_position + len(token_ids)): position p lives in
      page_ids[p // page_size] at offset p % page_size. Pages holding positions
      < start_position keep what earlier steps wrote there.
    - Within one StepBatch no two works share a state_slot or a page they write to, no two
      works write the same snapshot slot, and no work writes a slot another one restores from.
      Pages holding positions < start_position may be shared with other works (a cached
      prefix); nobody writes them.
    """

    request_id: str
    token_ids: tuple[int, ...]  # [T_i] tokens computed this step: a prefill chunk or one decode token
    start_position: int  # tokens of this sequence already in the KV cache / state
    page_ids: tuple[int, ...]  # KV pages covering positions [0, start_position + len(token_ids))
    state_slot: int  # linear-attention state slot; start_position == 0 => reset it
    sample: bool  # True: sample a token after the last one (decode, or last prefill chunk)
    sampling: SamplingParams
    output_index: int  # tokens generated so far (seeded sampling uses (seed, output_index))
    restore_from: int | None = None  # snapshot slot to load into state_slot first (prefix-cache hit)
    snapshots: tuple[tuple[int, int], ...] = ()  # (position, snapshot slot) to take in this work
    layers: tuple[int, int] | None = None  # (first, end) layer group of a layered prefill chunk; None: all

    @property
    def starts_chunk(self) -> bool:
        """True when this work begins its computation (every work but a layered chunk's later groups):
        where the state is reset or restored."""
        return self.layers is None or self.layers[0] == 0

    def ends_chunk(self, num_layers: int) -> bool:
        """True when this work completes its tokens (every work but a layered chunk's groups before the
        last): where the end snapshots are taken and a token may be sampled."""
        return self.layers is None or self.layers[1] == num_layers

    @property
    def end_position(self) -> int:
        return self.start_position + len(self.token_ids)


@dataclass(frozen=True)
class StepBatch:
    works: tuple[SequenceWork, ...]  # [B] prefill chunks first, then decodes

    @property
    def num_tokens(self) -> int:
        return sum(len(w.token_ids) for w in self.works)

    @property
    def num_prefill_tokens(self) -> int:
        """Prefill tokens this step computes; a layered chunk's count once, in its first group."""
        return sum(len(w.token_ids) for w in self.works if not _is_decode(w) and w.starts_chunk)

    @property
    def layered(self) -> SequenceWork | None:
        """The work that carries a layer group (at most one), or None."""
        return next((w for w in self.works if w.layers is not None), None)

    @property
    def num_decode_tokens(self) -> int:
        return sum(1 for w in self.works if _is_decode(w))


def layer_group_problem(works: Sequence[SequenceWork], num_layers: int) -> str | None:
    """Why the layered works among `works` (one step's) break SequenceWork's stateless layer-group contract, or
    None: at most one, 0 <= first < end <= num_layers, no sample before the last layer, no restore after the first
    group. Whether a later group continues the chunk an executor keeps is the executor's to check."""
    layered = [w for w in works if w.layers is not None]
    if not layered:
        return None
    if len(layered) > 1:
        return f"{', '.join(w.request_id for w in layered)}: {len(layered)} layered works in one step (at most one)"
    w = layered[0]
    first, end = w.layers
    if not 0 <= first < end <= num_layers:
        return f"{w.request_id}: layer group {w.layers} outside 0 <= first < end <= {num_layers}"
    if w.sample and end < num_layers:
        return f"{w.request_id}: layer group {w.layers} samples before the last layer ({num_layers})"
    if w.restore_from is not None and first > 0:
        return f"{w.request_id}: layer group {w.layers} restores a snapshot (only the first group may)"
    return None


def _is_decode(work: SequenceWork) -> bool:
    # A decode feeds back the last sampled token: one token, after at least one output.
    # NOTE: a preempted request's one-token final re-prefill chunk also counts (same cost).
    return work.output_index > 0 and len(work.token_ids) == 1 and work.sample


@dataclass(frozen=True)
class SampledToken:
    request_id: str
    token_id: int
    logprob: float | None = None  # set when sampling.logprobs
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), best first, len <= top_logprobs
    # Set when sampling THIS sequence failed (a fault confined to it, e.g. non-finite logits):
    # token_id is then meaningless and the engine aborts this request alone, not the batch.
    error: str | None = None


@runtime_checkable
class ModelExecutor(Protocol):
    """Runs one scheduled step on a model.

    execute(batch): computes every work's tokens (writing KV into its pages and updating its
    state slot) and returns exactly one SampledToken per work with sample=True, keyed by
    request_id; works with sample=False yield nothing. A fault confined to one sequence (its
    sampling failed) comes back as that sequence's SampledToken with ``error`` set, never as an
    exception that would fail every sequence of the step. Works are independent: the result for
    one sequence must not depend on which other sequences share the batch (up to
    floating-point batching effects). It may reorder works internally. It must not keep
    references to page ids beyond the call: the scheduler reuses freed pages in the next step.

    resize_pools(plan): called only while no step is in flight and no request is live.
    Frees the old pools before allocating the new ones (old and new never coexist), so the
    peak stays inside the plan's budget. After it returns, page ids < plan.kv_pages,
    state slots < plan.state_slots and snapshot slots < plan.snapshot_slots are valid; state
    contents are undefined, the expert slots may be cold, and KV pages and snapshots keep their
    contents exactly when their pool kept its size (the prefix cache relies on it: the engine keeps
    the cache only then). If it raises, calling it again with the previous plan must
    restore working pools (the rollback), whatever the failed call had already freed.

    check_valid() (optional): asserts every pool exists at the size of the plan last applied;
    the engine calls it after any failed step or resize to decide whether it can still serve.

    release(request_id) (optional): the engine ended the request before its tokens were done (its
    client went away, its step or its sampling failed, the engine failed every request): drop now
    whatever the executor keeps for it between steps (a layered prefill chunk part-way: its
    residual stream [T, H] and inputs), instead of when a new chunk starts or another work takes
    its request id or state slot. Called on the engine thread between steps, never inside
    execute(), after the scheduler freed the request's pages and slot; idempotent, and a no-op
    for a request the executor keeps nothing of. It does not follow preemption (the engine does
    not see it): a preempted request's chunk goes when its request or state slot runs again.
    It must not raise for an unknown request; an executor that keeps nothing between steps need
    not offer it.

    on_launched (optional attribute; an executor that offers it declares it, None by default): the
    engine sets it to a zero-argument callable that does not raise. execute() then calls it once,
    on the calling thread, where the host would start waiting for the device: after a captured
    step is launched and before its result is read back; before an eager step that launches and
    waits as it goes (not at all when it fails before that point). The engine does the previous
    step's text work there (detokenization, stream events, statistics) and hands the events to the
    HTTP side, so that Python (and the GIL it holds) runs while the device computes instead of
    between two steps. An executor without the attribute gets that work done just before execute()
    is called.
    """

    def execute(self, batch: StepBatch) -> dict[str, SampledToken]: ...

    def resize_pools(self, plan: PoolPlan) -> None: ...


TokenRouting = tuple[tuple[int, ...], ...]  # [L][K] expert ids of one token


@runtime_checkable
class RoutingSource(Protocol):
    """Expert choices that replace the routers' (benchmark-only routing replay, `ft serve --routing-replay`).

    A source hands out *streams*: the routing of one token sequence, position p being the [L][K] expert
    ids of the sequence's p-th token (prompt first, then generated tokens). Stream keys come from
    domain.routing_streams.stream_key.
    - num_layers L, num_experts E, top_k K: the geometry it serves; every row it returns holds exactly
      K distinct ids in 0..E-1.
    - tokens(key, start, count): [count][L][K] for positions start..start+count-1 of stream `key`.
      Asking again for the same (key, position) returns the same ids (a preempted request re-prefills
      with the routing it had). Deterministic for a given seed: a function of (seed, key, position),
      except that trace replay hands recorded streams to keys in the order keys first appear.
      Memory is bounded by the source, not by how long it serves. Raises ValueError on start < 0.
    - describe(): a JSON-able dict: "mode" (e.g. "locality", "trace"), "spec" (the canonical text that
      rebuilds it), and the mode's parameters.
    """

    num_layers: int
    num_experts: int
    top_k: int

    def tokens(self, key: str, start: int, count: int) -> Sequence[TokenRouting]: ...

    def describe(self) -> dict: ...


@runtime_checkable
class RoutingReplayControl(Protocol):
    """What the server sees of an executor's routing replay.

    describe(): the source's description plus "active" (bool: replacing the routers' choice now) and
    counters ("tokens_replaced", "host_seconds": host time spent producing replacement ids).
    set_active(on): from the next step on, replace the routers' choice (True) or let them route
    naturally (False; `ft bench` measures the natural routing beside the replay this way). Safe from
    any thread: an executor reads the flag once per step.
    """

    def describe(self) -> dict: ...

    def set_active(self, on: bool) -> None: ...


@runtime_checkable
class ExpertTransfer(Protocol):
    """Copies routed experts from the host bank into device expert slots.

    copy_experts(fills): for each (key, slot), copy expert key = (layer, expert) from the host
    bank into slot. `fills` is Lookup.fills from domain.residency: each slot appears at most
    once per call. The copy may be asynchronous (copy engine, gather kernel), but it must be
    complete before any later read of that slot by the executor: an implementation either
    orders it on the stream that reads the slot or makes the reader wait on an event. A slot
    named in a call must not be read with its old contents afterwards (the residency policy
    already evicted them).

    wait(): blocks the host until every copy issued so far is complete (used before timing,
    resizing, or freeing the host bank).
    """

    def copy_experts(self, fills: Sequence[tuple[ExpertKey, int]]) -> None: ...

    def wait(self) -> None: ...


@runtime_checkable
class Clock(Protocol):
    """Monotonic time in seconds. Never goes backwards; the origin is arbitrary."""

    def now(self) -> float: ...


@runtime_checkable
class Tokenizer(Protocol):
    """Text <-> token ids for one model.

    decode(encode(text)) == text for text the vocabulary covers. decode skips special
    tokens. eos_token_ids lists every id that ends generation (may be several, never empty
    for a real model). apply_chat_template renders OpenAI-style messages
    ([{"role": ..., "content": ..., "tool_calls": ..., "tool_call_id": ...}]) and OpenAI function
    ``tools`` to the prompt text, ending with the generation prompt when add_generation_prompt;
    extra keywords (``enable_thinking`` ...) reach the template like Hugging Face's
    ``chat_template_kwargs``. It raises ChatTemplateError when the model has no chat template
    or its template refuses the messages.

    Optional ``max_chars_per_token`` (int): no token covers more input characters than this,
    so a text of N characters encodes to at least N / max_chars_per_token tokens. It lets a
    server refuse a prompt that cannot fit the context by its size, before tokenizing it.
    Optional ``token_bytes(token_id) -> bytes``: the token's own bytes (a byte-fallback token
    is one byte of a character, which decode can only show as U+FFFD).

    NOTE: a model's vocabulary may be larger than its tokenizer's (Qwen3.5/3.6 have 248,320 output
    rows for fewer tokenizer ids: padding for the GEMM tiles), and a model can sample or rank such a
    row. decode skips an id the tokenizer has no token for (its text is "") and token_bytes gives b""
    for it; neither raises for an id in [0, the model's vocab_size).
    """

    eos_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(
        self, messages: list[dict], *, tools: list[dict] | None = None, add_generation_prompt: bool = True,
        **template_kwargs: object,
    ) -> str: ...


class ChatTemplateError(ValueError):
    """The chat template is missing (``missing=True``) or refused / could not render the request."""

    def __init__(self, message: str, *, missing: bool = False) -> None:
        super().__init__(message)
        self.missing = missing


@runtime_checkable
class MetricsSink(Protocol):
    """Receives one record per executed step. Must be cheap and must not raise:
    the engine loop calls it on the hot path."""

    def record_step(
        self,
        *,
        prefill_tokens: int,
        decode_tokens: int,
        seconds: float,
        expert_hits: int,
        expert_misses: int,
        host_seconds: float | None = None,
        prefill_work: bool | None = None,
    ) -> None:
        """host_seconds: the engine thread's time since the previous step's model call returned (finishing
        that step, turning its tokens into stream events, scheduling this one); None after an idle pause.
        prefill_work: the step computed prefill, tokens or a layered chunk's later layer group (which counts no
        prefill tokens: StepBatch.num_prefill_tokens); None = prefill_tokens > 0."""
        ...
