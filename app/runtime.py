"""What the HTTP layer knows about the server: loading progress, the engine once loaded, and
the model facts the API needs (served name, sampling defaults). One instance per server.

The server starts answering before the model is loaded (so /health can report progress);
generation routes answer 503 until ``set_ready``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from app.engine import Engine


@dataclass
class LoadingProgress:
    phase: str = "starting"
    bytes_done: int = 0
    bytes_total: int = 0
    # byte-counting phases seen so far, in order -> their own totals (see advance)
    phase_totals: dict[str, int] = field(default_factory=dict)
    _phase_done: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def update(self, phase: str, bytes_done: int = 0, bytes_total: int = 0) -> None:
        with self._lock:
            # NOTE: total before done, so an unlocked reader (/health) never sees done > total.
            self.phase, self.bytes_total, self.bytes_done = phase, bytes_total, bytes_done

    def can_advance(self, phase: str, done: int, total: int) -> bool:
        if not 0 <= done <= total:
            return False
        if phase not in self.phase_totals:
            return True  # a new phase: the one before it is over
        current = next(reversed(self.phase_totals))
        return phase == current and total == self.phase_totals[phase] and done >= self._phase_done

    def advance(self, phase: str, done: int, total: int) -> None:
        """Fold one loader phase's own count (0..total, phases one after another) into a running
        count: finished phases count in full, so bytes_done never goes back when the next phase
        starts; bytes_total grows by each phase's total as it starts."""
        with self._lock:
            if not self.can_advance(phase, done, total):
                raise ValueError(f"load progress went back or out of order: {phase} {done}/{total} after "
                                 f"{self.phase} {self._phase_done}, phases {self.phase_totals}")
            if phase not in self.phase_totals:
                self.phase_totals[phase] = total
            earlier = sum(self.phase_totals.values()) - total
            self._phase_done = done
            self.phase, self.bytes_total, self.bytes_done = phase, earlier + total, earlier + done

    def check_valid(self) -> None:
        assert 0 <= self.bytes_done <= self.bytes_total, self
        current_total = self.phase_totals[next(reversed(self.phase_totals))] if self.phase_totals else 0
        assert 0 <= self._phase_done <= current_total, self


@dataclass
class ModelInfo:
    served_name: str
    model_dir: str = ""
    max_context: int = 262144
    # NOTE: request fields that are omitted fall back to these (from generation_config.json).
    default_temperature: float = 1.0
    default_top_p: float = 1.0
    default_top_k: int = 0
    tool_call_parser: str | None = None  # app.tool_parsers name; None: tools are refused
    reasoning_parser: str | None = None  # app.reasoning name; None: no reasoning split
    created: int = field(default_factory=lambda: int(time.time()))


class Runtime:
    def __init__(self, served_name: str, api_key: str | None = None) -> None:
        self.status = "loading"  # "loading" | "ok" | "error"
        self.progress = LoadingProgress()
        self.error: str | None = None
        self.engine: Engine | None = None
        self.model = ModelInfo(served_name=served_name)
        self.api_key = api_key or None
        self.started_at = time.monotonic()
        self._ready = threading.Event()

    def set_ready(self, engine: Engine, model: ModelInfo) -> None:
        self.engine = engine
        self.model = model
        self.status = "ok"
        self.progress.update("ready", self.progress.bytes_total, self.progress.bytes_total)
        self._ready.set()

    def set_error(self, message: str) -> None:
        self.error = message
        self.status = "error"
        self._ready.set()

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout) and self.status == "ok"

    def check_valid(self) -> None:
        assert self.status in ("loading", "ok", "error"), self.status
        if self.status == "ok":
            assert self.engine is not None, "ready without an engine"
        if self.status == "error":
            assert self.error, "failed without saying why"
        assert self.progress.bytes_done >= 0 and self.progress.bytes_total >= 0
        self.progress.check_valid()

    def max_context(self) -> int:
        """Longest prompt + completion a request may ask for right now (pools may have been resized)."""
        if self.engine is None:
            return self.model.max_context
        return min(self.model.max_context, self.engine.plan.kv_tokens)

    def context_limit(self) -> tuple[int, str]:
        """max_context() and the sentence that says which limit it is, for a context_length_exceeded
        message: the model's context, or the KV cache pool when a smaller pool (--kv-tokens, a live resize)
        is what bounds a request. NOTE: the sentence keeps "maximum context length", which clients match on."""
        limit = self.max_context()
        if limit >= self.model.max_context:
            return limit, f"This model's maximum context length is {limit} tokens."
        return limit, (f"This server's maximum context length is {limit} tokens: that is the size of its KV cache "
                       f"pool now (the model's own context is {self.model.max_context} tokens).")
