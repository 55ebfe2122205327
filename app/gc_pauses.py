"""The garbage collector on a serving process: freeze what start-up built, and time every full collection.

Why: CPython's full (generation 2) collection walks every tracked object. After start-up a server holds a few
hundred thousand (torch, triton, the app, the checkpoint's metadata): on the 2-core CPU host one full collection of
the demo server took 106-137 ms (213k objects), and it runs on whichever thread allocates at the time, the engine
thread included, so every stream waits it out (issue 9's p99 gap target is 150 ms). `gc.freeze()` moves everything
alive at the end of start-up to a permanent generation that no collection visits: the same collection then took
< 0.1 ms. Objects made later (requests, pages, events) are collected as before. vLLM and SGLang freeze after
start-up for the same reason.
"""

from __future__ import annotations

import gc
import threading
import time


def freeze_startup_heap() -> int:
    """Collect once, then freeze every object still alive (start-up's modules, weights' metadata, graphs): later
    full collections skip them. Returns the number of frozen objects (also what GC_PAUSES.snapshot() shows)."""
    gc.collect()
    gc.freeze()
    # NOTE: counted here, once: gc.get_freeze_count() walks the whole permanent generation holding the GIL (~20 ms
    # for 220k-330k objects), and when /v1/stats called it on every poll each poll stalled the engine thread that
    # long (a 20 Hz poll cut bs1 decode from 280 to 176 tok/s on an H100; docs/gpu-validation.md, session 31)
    GC_PAUSES.frozen_objects = gc.get_freeze_count()
    return GC_PAUSES.frozen_objects


def unfreeze_heap() -> None:
    """Give the frozen objects back to the collector (a stopped server's cycles would otherwise never be freed:
    tests start many servers in one process). NOTE: process-wide, as the freeze: another server of the process
    then runs unfrozen, slower collections only."""
    gc.unfreeze()
    GC_PAUSES.frozen_objects = 0


class GcPauses:
    """Counts and times full (generation 2) collections through gc.callbacks, from any thread.

    snapshot(): {"full_collections", "full_pause_s_total", "full_pause_s_max", "frozen_objects"} since install();
    frozen_objects is the count at the last freeze_startup_heap() (0 before it and after unfreeze_heap()). Cheap
    enough for any poll rate: it reads counters only."""

    def __init__(self, clock=time.perf_counter) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._started: float | None = None
        self.full_collections = 0
        self.total_s = 0.0
        self.max_s = 0.0
        self.frozen_objects = 0

    def install(self) -> GcPauses:
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)
        return self

    def uninstall(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if info.get("generation") != 2:
            return
        now = self._clock()
        with self._lock:
            if phase == "start":
                self._started = now
            elif self._started is not None:  # "stop"
                pause, self._started = now - self._started, None
                self.full_collections += 1
                self.total_s += pause
                self.max_s = max(self.max_s, pause)

    def snapshot(self) -> dict:
        """What /v1/stats shows under `gc`."""
        with self._lock:
            return {"full_collections": self.full_collections, "full_pause_s_total": round(self.total_s, 6),
                    "full_pause_s_max": round(self.max_s, 6), "frozen_objects": self.frozen_objects}


# NOTE: one per process: gc.callbacks are process-wide, and a test process starts many servers
GC_PAUSES = GcPauses()
