"""The executors' side of `ft serve --routing-replay`: each step's replacement expert ids, from a domain
RoutingSource (the simulator's locality model or a recorded trace, wired in app/containers.py).

Shape legend: T tokens of a step (works in the step's row order), L routed layers, K top-k.

Both executors ask `step_table(works)` for an int32 [T, L, K] table and hand it to the decoder: the
reference route() takes its layer's [T, K] slice instead of top-k; the fast path's routing_replace kernel
overwrites moe_router's output in place (adapters/cuda_exec/routing_replay.py, graph-safe).

Weights: the router's own softmax probabilities at the replacement ids, renormalised exactly as the model
renormalises its top-k. Replaying a trace recorded from natural routing then reproduces the natural run
(same ids, same weights, same tokens), and the router's numerics stay the model's; uniform 1/K weights
would change every expert's contribution even where the ids agree.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np

from domain.ports import RoutingSource, SequenceWork
from domain.routing_streams import StreamKeys

WEIGHTS = "router probabilities at the replayed ids, renormalised as the model's top-k"


class RoutingReplayer:
    """Implements domain.ports.RoutingReplayControl. The engine thread calls step_table; any thread may
    call set_active/describe."""

    def __init__(self, source: RoutingSource, num_layers: int, num_experts: int, top_k: int) -> None:
        if (source.num_layers, source.top_k) != (num_layers, top_k) or source.num_experts > num_experts:
            raise ValueError(f"routing replay {source.describe().get('spec')}: L={source.num_layers} "
                             f"E={source.num_experts} K={source.top_k} does not fit the model "
                             f"(L={num_layers} E={num_experts} K={top_k})")
        self.source = source
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.keys = StreamKeys()
        self._active = True
        self._lock = threading.Lock()  # describe() reads counters the engine thread writes
        self.tokens_replaced = 0
        self.host_seconds = 0.0

    @property
    def active(self) -> bool:
        return self._active

    def set_active(self, on: bool) -> None:
        self._active = bool(on)  # NOTE: a bool store is atomic; executors read it once per step

    def step_table(self, works: Sequence[SequenceWork]) -> np.ndarray | None:
        """int32 [T, L, K]: the replacement ids of every token of `works` (rows in works order), or None
        while inactive (natural routing). Raises ValueError if the source breaks its contract."""
        if not self._active:
            return None
        start = time.perf_counter()
        rows = []
        for w in works:
            rows.extend(self.source.tokens(self.keys.key_for(w), w.start_position, len(w.token_ids)))
        table = np.asarray(rows, dtype=np.int32)  # [T, L, K]
        want = (sum(len(w.token_ids) for w in works), self.num_layers, self.top_k)
        if table.shape != want or (table.size and not (0 <= table.min() and table.max() < self.num_experts)):
            raise ValueError(f"routing replay gave ids of shape {table.shape} in "
                             f"{table.min() if table.size else '-'}..{table.max() if table.size else '-'}; "
                             f"the step needs {want} ids in 0..{self.num_experts - 1}")
        with self._lock:
            self.tokens_replaced += want[0]
            self.host_seconds += time.perf_counter() - start
        return table

    def describe(self) -> dict:
        with self._lock:
            counters = {"tokens_replaced": self.tokens_replaced, "host_seconds": round(self.host_seconds, 6)}
        return {**self.source.describe(), "active": self._active, "weights": WEIGHTS, **counters}

    def check_valid(self) -> None:
        self.keys.check_valid()
        assert self.tokens_replaced >= 0 and self.host_seconds >= 0, "negative counters"
        check = getattr(self.source, "check_valid", None)
        if check is not None:
            check()
