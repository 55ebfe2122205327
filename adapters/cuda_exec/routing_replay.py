"""Routing replay on the fast path (`ft serve --routing-replay`, benchmark-only): the replacement ids reach
the captured decode graph through a static device table staged before every replay, and FastDecoder._moe's
hook overwrites moe_router's output with them in one launch per layer (adapters/kernels/routing_replace.py).

Shape legend: B decode rows (the largest bucket), T tokens of an eager step, L routed layers, K top-k.

How the replay advances inside graph replays: it does not have to. The source's state (the locality model's
history, a trace's position) lives on the host, per stream, keyed by each row's sequence position; before a
replay the executor asks it for this step's rows and copies them into the static table with the decode
inputs (one more pinned host -> device copy of B*L*K int32, no sync). The graph reads whatever the table
holds: rows staged -1 (padded rows, or the replay switched off for `ft bench`'s natural pass) keep the
router's choice, so one captured graph serves both modes.
"""

from __future__ import annotations

import numpy as np
import torch

from adapters.kernels.routing_replace import routing_replace
from adapters.torch_exec.linear import linear

KEEP = -1  # a table row starting with it keeps the router's own choice


class DeviceRoutingTable:
    """int32 [B, L, K] on the device, staged from a pinned host mirror."""

    def __init__(self, rows: int, num_layers: int, top_k: int, device) -> None:
        self.device = torch.device(device)
        pin = self.device.type == "cuda"
        self.host = torch.full((rows, num_layers, top_k), KEEP, dtype=torch.int32, pin_memory=pin)  # [B, L, K]
        self._np = self.host.numpy()
        self.table = torch.full((rows, num_layers, top_k), KEEP, dtype=torch.int32, device=self.device)
        self._all_keep = True  # the device table holds KEEP everywhere (no copy needed to stay natural)
        # NOTE: the host block is rewritten each step; wait for the previous step's copy to have left it
        self._copied = torch.cuda.Event() if pin else None

    @property
    def rows(self) -> int:
        return int(self.table.shape[0])

    def view(self, n: int) -> torch.Tensor:
        """The first n rows [n, L, K] (what decode_step reads; a graph captures this storage)."""
        return self.table[:n]

    def stage(self, ids: np.ndarray | None, n: int) -> None:
        """Rows 0..n-1 from ids int32 [n, L, K] (None: the router's own choice), the rest KEEP; one
        non-blocking copy on the current stream, none when the table already keeps every row."""
        if n > self.rows:
            raise ValueError(f"{n} decode rows exceed the {self.rows} the routing table holds")
        if ids is None and self._all_keep:
            return
        if ids is not None and ids.shape != (n, *self._np.shape[1:]):
            raise ValueError(f"replacement ids of shape {ids.shape} for {n} rows of {self._np.shape[1:]}")
        if self._copied is not None:
            self._copied.synchronize()
        self._np[:] = KEEP
        if ids is not None:
            self._np[:n] = ids
        self.table.copy_(self.host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        self._all_keep = ids is None


def replace_routing(table: torch.Tensor, h: torch.Tensor, router, weights: torch.Tensor, ids: torch.Tensor,
                    logits: torch.Tensor | None, renormalize: bool) -> None:
    """FastDecoder._moe's hook, in place: weights [T, KO] and ids [T, K] of the rows whose table [T, K] row
    is not KEEP become the replacement ids and the router's probabilities at them. logits: fp32 [T, E] when
    the caller has them (a float router), else recomputed here (a quantized router, the reference route)."""
    if logits is None:
        logits = linear(h, router)
    routing_replace(logits.float(), table, weights, ids, renormalize)
