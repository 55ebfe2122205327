"""Records the experts the routers select while the engine serves, as the simulator's routing trace.

Shape legend: T tokens of one forward pass, K top-k, L routed layers.

Format (docs/simulator.md, "Routing-trace format"): one JSON line per token,
{"stream": request id, "position": p, "layer_experts": [[ids] per layer]}, each stream's tokens in
position order, prompt tokens first. The simulator's load_trace reads it; adapters may not import the
simulator, so the lines are written here and tests/adapters/test_routing_trace.py proves the two agree.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import torch

MAX_TRACKED_STREAMS = 4096  # streams whose next position is remembered (oldest forgotten first)


class RoutingTraceRecorder:
    """Per forward pass: begin_pass(spans), record_layer(layer, ids) once per routed layer, end_pass().
    end_pass writes one line per token and flushes, so memory holds one pass at most.

    A token at a position the stream already recorded (a preempted request re-prefilling) is not
    written again; a token after a gap (positions never computed) cannot be placed, so that stream's
    tokens are dropped from then on and counted in `dropped_tokens`.
    """

    def __init__(self, path: str | Path, num_layers: int):
        if num_layers < 1:
            raise ValueError(f"a routing trace needs >= 1 routed layer, got {num_layers}")
        self.path = Path(path)
        self.num_layers = num_layers
        self._file = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 - open for the recorder's life
        self._lock = threading.Lock()
        self._spans: tuple[tuple[str, int, int], ...] | None = None  # (stream, start position, length)
        self._layers: list[torch.Tensor | None] = [None] * num_layers  # [T, K] per layer
        self._next: OrderedDict[str, int] = OrderedDict()  # stream -> next position to write (-1: broken)
        self.tokens_written = 0
        self.dropped_tokens = 0

    # ---- one forward pass --------------------------------------------------------------------------
    def can_begin_pass(self) -> str | None:
        """None when a pass may begin, else why not (read-only probe)."""
        if self._file.closed:
            return "the recorder is closed"
        if self._spans is not None:
            return "the previous pass has not ended"
        return None

    def begin_pass(self, spans: Sequence[tuple[str, int, int]]) -> None:
        """`spans`: (stream, start position, token count) of each sequence, in the pass's row order."""
        with self._lock:
            reason = self.can_begin_pass()
            if reason is not None:
                raise RuntimeError(f"routing recorder: {reason}")
            self._spans = tuple((str(s), int(p), int(n)) for s, p, n in spans)
            self._layers = [None] * self.num_layers

    def record_layer(self, layer: int, ids: torch.Tensor) -> None:
        """The router's top-k expert ids [T, K] of `layer` for every token of the pass."""
        with self._lock:
            if self._spans is None:
                raise RuntimeError("routing recorder: record_layer outside a pass")
            if not 0 <= layer < self.num_layers:
                raise ValueError(f"layer {layer} outside 0..{self.num_layers - 1}")
            tokens = sum(n for _, _, n in self._spans)
            if ids.dim() != 2 or ids.shape[0] != tokens:
                raise ValueError(f"layer {layer}: ids of shape {tuple(ids.shape)}, the pass has {tokens} tokens")
            # NOTE: a detached copy; stays on the device until end_pass moves all layers in one transfer.
            self._layers[layer] = ids.detach().clone()  # [T, K]

    def end_pass(self) -> None:
        with self._lock:
            spans, layers = self._spans, self._layers
            self._spans, self._layers = None, [None] * self.num_layers
            if spans is None:
                raise RuntimeError("routing recorder: end_pass without begin_pass")
            missing = [i for i, ids in enumerate(layers) if ids is None]
            if missing:
                raise RuntimeError(f"routing recorder: layers {missing} did not route this pass")
            table = torch.stack(layers, dim=1).cpu().tolist()  # [T, L, K]
            offset = 0
            for stream, start, length in spans:
                self._write_span(stream, start, table[offset:offset + length])
                offset += length
            self._file.flush()

    def abort_pass(self) -> None:
        """Forget a pass whose forward failed (nothing of it is written)."""
        with self._lock:
            self._spans, self._layers = None, [None] * self.num_layers

    def _write_span(self, stream: str, start: int, rows: list) -> None:
        expected = self._next.pop(stream, 0)
        for position, experts in enumerate(rows, start):
            if expected < 0 or position > expected:
                expected = -1  # a gap: this stream can no longer be written consistently
                self.dropped_tokens += 1
                continue
            if position < expected:
                continue  # recomputed after preemption: already recorded
            self._file.write(json.dumps({"stream": stream, "position": position, "layer_experts": experts}) + "\n")
            self.tokens_written += 1
            expected = position + 1
        self._next[stream] = expected  # most recently used last
        while len(self._next) > MAX_TRACKED_STREAMS:
            self._next.popitem(last=False)

    # ---- lifetime ----------------------------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.close()

    def check_valid(self) -> None:
        if len(self._layers) != self.num_layers:
            raise AssertionError("layer buffer does not match the layer count")
        if len(self._next) > MAX_TRACKED_STREAMS:
            raise AssertionError("tracked streams exceed the bound")
        if self._spans is None and any(ids is not None for ids in self._layers):
            raise AssertionError("layer ids held outside a pass")
        if self.tokens_written < 0 or self.dropped_tokens < 0:
            raise AssertionError("negative counters")
