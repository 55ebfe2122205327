"""Reusable pinned host buffers for a step's small host->device uploads (step_inputs.upload,
step_plan.upload_aligned): the parts' bytes are written straight into a persistent pinned buffer at 16-byte
aligned offsets, copied to a fresh device buffer in one asynchronous copy, and handed back as views of it.

NOTE: why not t.pin_memory() and torch.cat per upload: in the trace of a short mixed step on the H100
(2026-12), pin_memory cost 2.5-15 ms of host time per upload (is_pinned's pointer query alone 2.4-2.9 ms for
4 KB) and upload_aligned's cat 3.8-6.3 ms for ~51 KB, at ~5 uploads a step, against 14 ms of GPU work. A
warm pool allocates nothing on the host; vLLM and SGLang keep persistent pinned step-input buffers for the
same reason. The device side stays a fresh torch.empty per upload (the CUDA caching allocator makes that
cheap, and the caller may keep the tensors as long as it likes).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

ALIGN = 16  # NOTE: Triton specializes pointer arguments on 16-byte alignment (step_plan.AttentionTables)
MIN_BYTES = 64 << 10  # a buffer's smallest capacity: a mixed step's tables are ~51 KB
MAX_IN_FLIGHT = 16  # buffers with a copy possibly pending before the host waits for the oldest


def layout(parts: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    """(each part's byte offset in one buffer, the buffer's used bytes): parts one after another, each starting
    at a multiple of ALIGN bytes (the last one's bytes are not padded)."""
    offsets, at = [], 0
    for t in parts:
        at += -at % ALIGN
        offsets.append(at)
        at += t.numel() * t.element_size()
    return offsets, at


def pack(parts: Sequence[torch.Tensor], offsets: Sequence[int], buf: torch.Tensor) -> None:
    """Write each part's elements (any layout: a non-contiguous part is copied element by element, no temporary)
    into the uint8 host buffer buf at its byte offset (`layout`). The padding between parts is left as it is."""
    for t, at in zip(parts, offsets, strict=True):
        n = t.numel() * t.element_size()
        buf[at:at + n].view(t.dtype).view(t.shape).copy_(t)


def views(buf: torch.Tensor, parts: Sequence[torch.Tensor], offsets: Sequence[int]) -> list[torch.Tensor]:
    """Views of the uint8 buffer buf with each part's dtype and shape at its byte offset (`layout`)."""
    return [buf[at:at + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            for t, at in zip(parts, offsets, strict=True)]


def pinned_bytes(n: int) -> torch.Tensor:
    """A pinned uint8 [n] host buffer (the default allocator of PinnedStaging)."""
    return torch.empty(n, dtype=torch.uint8, pin_memory=True)


def cuda_event():
    """A CUDA event without timing (cheaper to record and query): the default event factory of PinnedStaging."""
    return torch.cuda.Event()


@dataclass(eq=False)
class _Buffer:
    host: torch.Tensor  # uint8 [capacity], pinned
    event: object  # recorded after the buffer's last copy was queued: done, its bytes may be overwritten


class PinnedStaging:
    """Pinned host buffers for the uploads to one device, reused once their last copy is done.

    A buffer is taken by one upload at a time (under a lock: the model warms up in one thread and the engine
    steps in another), filled, copied, and given back with an event recorded after its copy. Taking one prefers
    an idle buffer whose event is done (never blocks on the device); else a new one, up to max_in_flight idle
    buffers, past which the oldest one's event is synchronized. A done buffer too small for an upload is
    replaced by one of the next power of two (at least min_bytes).

    alloc(n) -> uint8 [n] host tensor and make_event() -> an object with record(stream), query(), synchronize()
    are injectable so the bookkeeping runs on the CPU with plain memory and fake events (tests); the defaults
    are pinned memory and CUDA events.
    """

    def __init__(self, device, alloc: Callable[[int], torch.Tensor] = pinned_bytes,
                 make_event: Callable[[], object] = cuda_event, max_in_flight: int = MAX_IN_FLIGHT,
                 min_bytes: int = MIN_BYTES):
        if max_in_flight < 1 or min_bytes < ALIGN:
            raise ValueError(f"max_in_flight {max_in_flight} must be >= 1 and min_bytes {min_bytes} >= {ALIGN}")
        self.device = torch.device(device)
        self.max_in_flight = max_in_flight
        self.min_bytes = min_bytes
        self._alloc = alloc
        self._make_event = make_event
        self._lock = threading.Lock()
        self._idle: deque[_Buffer] = deque()  # given back, oldest copy first
        self._taken = 0  # buffers an upload is filling now
        self.allocations = 0  # host buffers allocated so far (warm: stays put)
        self.syncs = 0  # uploads that waited for the oldest copy (the host ran max_in_flight copies ahead)

    def upload(self, parts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The host tensors `parts` (any dtypes, shapes and layouts) on the device in one asynchronous copy:
        views of one fresh device buffer, each starting at a multiple of ALIGN bytes, with its part's dtype and
        shape. The host does not wait for the device (except past max_in_flight pending copies). Raises
        RuntimeError inside a CUDA graph capture: the graph would replay a copy from a buffer later uploads
        overwrite."""
        cuda = self.device.type == "cuda"
        if cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("PinnedStaging.upload inside a CUDA graph capture: the graph would keep reading a "
                               "reused host buffer; use the graph's own static input buffers")
        offsets, total = layout(parts)
        try:
            buf = self._take(total)
            pack(parts, offsets, buf.host)
            dev = torch.empty(total, dtype=torch.uint8, device=self.device)
            dev.copy_(buf.host[:total], non_blocking=True)
            buf.event.record(torch.cuda.current_stream(self.device) if cuda else None)
        except BaseException:
            with self._lock:  # NOTE: dropped, not given back: a copy may be queued with no event after it (torch's
                self._taken -= 1  # pinned allocator frees the memory only after the copies it saw queued)
            raise
        with self._lock:
            self._taken -= 1
            self._idle.append(buf)
        return views(dev, parts, offsets)

    def _take(self, nbytes: int) -> _Buffer:
        """A buffer of at least nbytes that no pending copy reads, owned by the caller until given back. Counts it
        as taken first: `upload` undoes that when this raises."""
        oldest = event = None
        with self._lock:
            self._taken += 1
            short = None
            for i, b in enumerate(self._idle):  # oldest first: on one stream, copies finish in order
                if b.event.query():
                    if b.host.numel() >= nbytes:
                        del self._idle[i]
                        return b
                    short = i if short is None else short
            if short is not None:  # done but too small: a bigger buffer takes its place (and its event)
                event = self._idle[short].event
                del self._idle[short]
            elif len(self._idle) >= self.max_in_flight:
                oldest = self._idle.popleft()
                self.syncs += 1
        if oldest is not None:  # NOTE: outside the lock, as the allocation below: the other thread goes on
            oldest.event.synchronize()
            if oldest.host.numel() >= nbytes:
                return oldest
            event = oldest.event
        if event is None:
            event = self._make_event()
        host = self._alloc(self._capacity(nbytes))
        with self._lock:
            self.allocations += 1
        return _Buffer(host, event)

    def _capacity(self, nbytes: int) -> int:
        return max(self.min_bytes, 1 << max(nbytes - 1, 0).bit_length())

    def buffers(self) -> int:
        """Host buffers held now (idle and being filled)."""
        with self._lock:
            return len(self._idle) + self._taken

    def check_valid(self) -> None:
        """Raises AssertionError when the pool's bookkeeping is broken: a buffer idle twice, a negative taken
        count, a capacity under min_bytes or not a power of two."""
        with self._lock:
            assert self._taken >= 0, self._taken
            assert len({id(b) for b in self._idle}) == len(self._idle), "a buffer is idle twice"
            assert len({id(b.host) for b in self._idle}) == len(self._idle), "two idle buffers share host memory"
            for b in self._idle:
                cap = b.host.numel()
                assert cap >= self.min_bytes and cap & (cap - 1) == 0, cap


_pools: dict[torch.device, PinnedStaging] = {}
_pools_lock = threading.Lock()


def staging(device) -> PinnedStaging:
    """The process's PinnedStaging for `device` (made on first use; "cuda" means the current CUDA device)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    pool = _pools.get(device)
    if pool is None:
        with _pools_lock:
            pool = _pools.setdefault(device, PinnedStaging(device))
    return pool
