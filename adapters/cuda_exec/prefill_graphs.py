"""CUDA graphs for the MoE half of short prefill steps: per token bucket and layer, the part of a layer between
two token mixers (residual add, post-attention norm, router, expert lookup and miss gather, fused experts,
residual add, the next layer's input norm) replays from one graph; the token mixers, whose launches depend on
the step's spans, stay eager between them.

Shape legend: T tokens of the step, Tb its bucket (rows padded to it), H hidden, L layers.

Why: a one-prompt prefill step is bound by the host's Python, not the GPU (H200, session 15: 16.5 ms wall for
2.9 ms of device work over 8 layers, `docs/bench/2026-12-03-prefill-spans-h200-no-syncs.json`); the MoE block
was ~1.06 ms of host time a layer there (router GEMM, moe_router, the set lookup's launches, the per-pair GEMVs
and their launchers), about 40 % of the step.

Which steps: at most `max_tokens` tokens (the largest bucket) whose T * K keys the one-launch or set lookup
takes without streaming (T * K <= min(S, MAX_KEYS)); on those paths the lookup makes the domain LRU's decisions
on the device with no host state touched, which is what makes a replay equal to running the code. Padded rows
(valid False) route nowhere and compute zeros, as the decode graphs' padded rows do.
Off a CUDA device (tests) the same padded buffers run the same code eagerly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from adapters.kernels.residency_lookup import MAX_KEYS

if TYPE_CHECKING:
    from adapters.cuda_exec.expert_pool import DeviceExpertPool
    from adapters.cuda_exec.fast_decoder import FastDecoder

BUCKETS = (8, 16, 32)  # token buckets; 32 tokens x top-8 = MAX_KEYS, the largest lookup without streaming


class SegmentBuffers(NamedTuple):
    """One bucket's static rows; the graphs read and write only these (and the pools)."""

    x: torch.Tensor  # [Tb, H] the residual stream
    mix: torch.Tensor  # [Tb, H] the layer's token-mixer output (rows >= T zero)
    h: torch.Tensor  # [Tb, H] the next layer's normed input (the segment's output)
    valid: torch.Tensor  # [Tb] bool: rows < T


class MoeSegments:
    """The graphs (or, off CUDA, the eager runs) of every layer's MoE segment per bucket."""

    def __init__(self, model: FastDecoder, experts: DeviceExpertPool, buckets: tuple[int, ...] = BUCKETS,
                 use_graphs: bool = True):
        top_k = model.opts.top_k
        # NOTE: a bucket whose keys the pool cannot look up in one call would stream: it is not a segment bucket
        self.buckets = tuple(b for b in sorted(buckets) if b * top_k <= min(experts.num_slots, MAX_KEYS))
        self.model, self.experts, self.use_graphs = model, experts, use_graphs
        hidden, dtype, device = model.opts.hidden, model.dtype, model.device
        self.buffers = {b: SegmentBuffers(torch.zeros(b, hidden, dtype=dtype, device=device),
                                          torch.zeros(b, hidden, dtype=dtype, device=device),
                                          torch.zeros(b, hidden, dtype=dtype, device=device),
                                          torch.zeros(b, dtype=torch.bool, device=device)) for b in self.buckets}
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1] if self.buckets else 0

    def bucket(self, tokens: int) -> int | None:
        """The smallest bucket that holds `tokens` rows, or None (the step runs as before)."""
        return next((b for b in self.buckets if b >= tokens), None)

    def segment(self, i: int, buf: SegmentBuffers) -> None:
        """Layer i's MoE half on the bucket's rows, in place: x += mix; x += moe(norm(x)); h = next norm(x).
        The same operations as MoeDecoder.forward's, on Tb rows of which the padded ones route nowhere."""
        m, w = self.model, self.model.w
        buf.x.add_(buf.mix)
        h = m._norm(buf.x, w[f"layers.{i}.post_attention_layernorm.weight"])  # [Tb, H]
        buf.x.add_(m._moe(i, h, self.experts, buf.valid))
        if i + 1 < len(m.mixers):
            buf.h.copy_(m._norm(buf.x, w[f"layers.{i + 1}.input_layernorm.weight"]))

    def capture(self, stream: torch.cuda.Stream) -> None:
        """Record every (bucket, layer) segment on all-padded rows (nothing routes, no pool is written), inside a
        streamed step as a real step runs them (so `routed` takes the same branch). Largest bucket first: the
        smaller graphs reuse its memory pool. Kernels must be tuned before (the prefill warm-up): a capture
        cannot autotune. Without graphs (use_graphs False) there is nothing to record. stream: the side stream
        of the eager warm-up (the executor's one reused stream: see CudaGraphExecutor._warmup_stream)."""
        self.graphs = {}
        if not self.use_graphs or not self.buckets:
            return
        device = self.model.device
        for buf in self.buffers.values():
            buf.x.zero_()
            buf.mix.zero_()
            buf.valid.zero_()
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream), torch.inference_mode(), self.experts.streamed_step():
            for b in self.buckets:  # warm-up: compiles what is not compiled yet, creates cuBLAS handles
                for i in range(len(self.model.mixers)):
                    self.segment(i, self.buffers[b])
        torch.cuda.current_stream(device).wait_stream(stream)
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode(), self.experts.streamed_step():
            # NOTE: the step's residency snapshot (staging pools) is dropped here, not by the first captured lookup:
            # no segment streams, and its CUDA event must not be destroyed inside a capture
            self.experts._snapshot = None
            for b in sorted(self.buckets, reverse=True):
                for i in range(len(self.model.mixers)):
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        self.segment(i, self.buffers[b])
                    self.graphs[(b, i)] = graph
        torch.cuda.synchronize(device)

    def start(self, x: torch.Tensor) -> SegmentBuffers:
        """Stage a step's embedded rows x [T, H] into its bucket's buffers (padded rows zeroed)."""
        tokens = x.shape[0]
        buf = self.buffers[self.bucket(tokens)]
        buf.x[:tokens].copy_(x)
        buf.x[tokens:].zero_()
        buf.mix[tokens:].zero_()
        buf.valid[:tokens].fill_(True)
        buf.valid[tokens:].fill_(False)
        return buf

    def run(self, i: int, buf: SegmentBuffers) -> None:
        """Layer i's segment on buf (its mix rows written by the caller): a replay, or the eager code."""
        graph = self.graphs.get((buf.valid.shape[0], i))
        if graph is not None:
            graph.replay()
        else:
            self.segment(i, buf)
