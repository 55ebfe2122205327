"""A StepBatch flattened into the tensors one forward pass needs.

Shape legend: T tokens of the whole step (all sequences, prefill chunks first), B sequences.
"""

from dataclasses import dataclass

import torch

from adapters.torch_exec.host_staging import staging
from domain.ports import SequenceWork, StepBatch, layer_group_problem


@dataclass(frozen=True)
class SeqSpan:
    work: SequenceWork
    offset: int  # first row of this sequence in the flat [T] token axis
    length: int
    page_ids: torch.Tensor  # [pages] long, on the compute device

    @property
    def start_position(self) -> int:
        return self.work.start_position

    @property
    def end_position(self) -> int:
        return self.work.start_position + self.length

    @property
    def rows(self) -> slice:
        return slice(self.offset, self.offset + self.length)


@dataclass(frozen=True)
class StepInputs:
    token_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long, absolute position of each token in its sequence
    spans: tuple[SeqSpan, ...]

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


def check_batch(batch: StepBatch, page_size: int, num_pages: int, num_state_slots: int | None,
                num_snapshot_slots: int = 0, checked_pages: dict | None = None,
                num_layers: int | None = None) -> str | None:
    """None when the executor can run `batch` on pools of this size, else the reason (read-only probe).
    Snapshot slots (prefix cache) are checked only where there is linear-attention state.

    num_layers: the model's layer count L, against which a layered work's group (SequenceWork.layers) is
    checked: 0 <= first < end <= L, one such work per step, no sample before the last layer, no restore
    after the first group. None: the caller runs no layered works (any is refused).

    checked_pages: the caller's memo (request id -> (num_pages, page ids) of its work in the last batch
    that passed). A page table that starts with the one found in range last time has only its new tail
    range-checked (a decode step adds at most a page, and checking every page of a 32k context in Python
    cost ~75 us per sequence and step); it is replaced by this batch's tables when the batch passes."""
    ids, slots, written = set(), set(), set()
    restored = {w.restore_from for w in batch.works if w.restore_from is not None}
    layered = [w for w in batch.works if w.layers is not None]
    if layered:
        reason = _check_layers(layered, num_layers)
        if reason is not None:
            return reason
    for w in batch.works:
        if not w.token_ids:
            return f"{w.request_id}: no tokens to compute"
        if w.request_id in ids:
            return f"{w.request_id}: appears twice in one step"
        ids.add(w.request_id)
        end = w.start_position + len(w.token_ids)
        if w.start_position < 0 or len(w.page_ids) * page_size < end:
            return f"{w.request_id}: {len(w.page_ids)} pages of {page_size} do not cover {end} positions"
        pages = w.page_ids
        known = checked_pages.get(w.request_id) if checked_pages is not None else None
        if known is not None and known[0] == num_pages and pages[: len(known[1])] == known[1]:
            pages = pages[len(known[1]):]  # NOTE: equal ids were in range of this same pool size
        if any(not 0 <= p < num_pages for p in pages):
            return f"{w.request_id}: page id outside the pool of {num_pages}"
        if num_state_slots is not None:
            if not 0 <= w.state_slot < num_state_slots:
                return f"{w.request_id}: state slot {w.state_slot} outside the pool of {num_state_slots}"
            if w.state_slot in slots:
                return f"{w.request_id}: state slot {w.state_slot} used twice in one step"
            slots.add(w.state_slot)
            if w.restore_from is not None and not (0 <= w.restore_from < num_snapshot_slots and w.start_position > 0):
                return f"{w.request_id}: restore from snapshot {w.restore_from} (pool of {num_snapshot_slots}) at " \
                       f"position {w.start_position}"
            positions = [p for p, _ in w.snapshots]
            if positions != sorted(set(positions)) or any(not w.start_position < p <= end for p in positions):
                return f"{w.request_id}: snapshot positions {positions} outside ({w.start_position}, {end}]"
            for _, s in w.snapshots:
                if not 0 <= s < num_snapshot_slots or s in written or s in restored:
                    return f"{w.request_id}: snapshot slot {s} out of the pool of {num_snapshot_slots}, written " \
                           "twice or restored from in one step"
                written.add(s)
    if checked_pages is not None:
        checked_pages.clear()  # only this batch's requests: finished ones do not linger
        checked_pages.update((w.request_id, (num_pages, w.page_ids)) for w in batch.works)
    return None


def _check_layers(layered: list[SequenceWork], num_layers: int | None) -> str | None:
    """The reason the layered works of one step break SequenceWork's layer-group contract, or None."""
    if num_layers is None:
        return f"{layered[0].request_id}: layer group {layered[0].layers} on an executor that runs no layered works"
    return layer_group_problem(layered, num_layers)


def upload(t: torch.Tensor, device) -> torch.Tensor:
    """The host tensor t on `device`: to a CUDA device through a reused pinned staging buffer without blocking
    the host (a copy from pageable memory waits for every kernel queued before it: a stream sync), else a plain
    copy. NOTE: not t.pin_memory(): its pinned-block lookup and pointer query cost 2.5-15 ms of host time per
    upload in a mixed step's trace on the H100 (host_staging.py)."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return staging(device).upload([t])[0]


def flatten(batch: StepBatch, device) -> StepInputs:
    """The step's token ids, positions and each work's page ids on `device`, in one host->device copy (views of
    one int64 buffer, `upload`). NOTE: a tensor per work made N prompts cost N blocking copies at every step's
    start (one stream sync each: 21 in a 16-prompt step on the H200, 2026-12-02); the staging pool
    (host_staging.py) reuses the pinned buffer only once the asynchronous copy is done."""
    tokens: list[int] = []
    positions: list[int] = []
    for w in batch.works:
        tokens.extend(w.token_ids)
        positions.extend(range(w.start_position, w.start_position + len(w.token_ids)))
    n = len(tokens)
    flat = upload(torch.tensor(tokens + positions + [p for w in batch.works for p in w.page_ids], dtype=torch.long),
                  device)
    spans, offset, at = [], 0, 2 * n
    for w in batch.works:
        spans.append(SeqSpan(w, offset, len(w.token_ids), flat[at:at + len(w.page_ids)]))
        offset += len(w.token_ids)
        at += len(w.page_ids)
    return StepInputs(flat[:n], flat[n:2 * n], tuple(spans))
