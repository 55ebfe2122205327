"""The decoder stack shared by the Qwen3 MoE family: per layer a token mixer (full attention or Gated
DeltaNet), then a sparse MoE block; final RMSNorm and LM head. Architecture files only choose options.

Shape legend: T tokens of the step, H hidden, V vocab, K top-k, L layers, n rows whose logits are wanted.
"""

from dataclasses import dataclass

import torch

from adapters.checkpoint.loader import EMBEDDING, hosts_embedding, pinned
from adapters.checkpoint.quant import QTensor
from adapters.torch_exec.expert_cache import ExpertSlotCache
from adapters.torch_exec.full_attention import AttentionGeometry, FullAttention
from adapters.torch_exec.gated_deltanet import GatedDeltaNet, GdnGeometry, LinearStatePool
from adapters.torch_exec.linear import linear, to_compute_dtype
from adapters.torch_exec.moe import route, routed_experts, shared_expert
from adapters.torch_exec.norms import rms_norm
from adapters.torch_exec.paged_attention import PagedKVCache
from adapters.torch_exec.rotary import Rotary
from adapters.torch_exec.step_inputs import StepInputs, upload

FULL, LINEAR = "full_attention", "linear_attention"


@dataclass(frozen=True)
class DecoderOptions:
    layer_kinds: tuple[str, ...]
    hidden: int
    num_experts: int
    top_k: int
    renormalize: bool  # renormalise the top-k router weights to sum to 1
    shared_expert: bool
    unit_offset_norm: bool  # (1 + w) RMSNorm everywhere (Qwen3.5) vs w * x (Qwen3)
    eps: float
    attention: AttentionGeometry
    rope_theta: float
    partial_rotary: float
    gdn: GdnGeometry | None  # None: no linear-attention layers


class MoeDecoder:
    # Callable(layer, ids [T, K]) told every layer's router choice (the routing-trace recorder); None: off.
    on_route = None
    # The routed experts of one layer: (x [T, H], weights [T, K], ids [T, K], layer, cache) -> [T, H].
    # NOTE: an instance may replace it (expert parallelism computes its own experts and exchanges partials).
    routed = staticmethod(routed_experts)
    # int [T, L, K] expert ids replacing the routers' top-k for the pass being run (--routing-replay; the
    # executor sets it around a pass); None: natural routing.
    replay_ids: torch.Tensor | None = None

    def __init__(self, dense: dict, opts: DecoderOptions, dtype: torch.dtype, device):
        self.opts, self.dtype, self.device = opts, dtype, torch.device(device)
        # NOTE: an embedding the loader left in host memory on a CUDA deployment (hosts_embedding) stays there
        table = dense[EMBEDDING]
        if isinstance(table, QTensor):
            raise ValueError("quantized embed_tokens are not supported")
        host_embed = table.device.type == "cpu" and table.dim() == 2 and hosts_embedding(self.device, dense,
                                                                                         table.shape[1])
        self.w = {name: to_compute_dtype(t, dtype, device) for name, t in dense.items()
                  if not (host_embed and name == EMBEDDING)}
        # NOTE: the GDN decay parameters stay fp32: exp(A_log) of a bf16 A_log loses the decay's precision.
        # The routers too: top-k is a discontinuous choice, and bf16 router logits flip near-tied experts
        # (a whole expert swapped) far more often than the bf16-rounded activations alone do.
        for name, t in dense.items():
            if name.endswith(("A_log", "dt_bias", "mlp.gate.weight")) and not isinstance(t, QTensor):
                self.w[name] = t.to(device=device, dtype=torch.float32)
        # [V, H] in the compute dtype: on the device, or in pinned host memory (hosts_embedding), read by embed_rows
        self.embed = pinned(table, dtype) if host_embed else self.w[EMBEDDING]
        self.embed_hosted = host_embed
        self.lm_head = self.w.get("lm_head.weight", self.embed)  # tied when the checkpoint has no lm_head
        self.full_layers = [i for i, k in enumerate(opts.layer_kinds) if k == FULL]
        self.linear_layers = [i for i, k in enumerate(opts.layer_kinds) if k == LINEAR]
        if len(self.full_layers) + len(self.linear_layers) != len(opts.layer_kinds):
            raise ValueError(f"unknown layer kinds in {sorted(set(opts.layer_kinds))}")
        if self.linear_layers and opts.gdn is None:
            raise ValueError("linear_attention layers need GDN geometry")
        head_dim = opts.attention.head_dim
        rotary = Rotary(head_dim, opts.rope_theta, opts.partial_rotary, device)
        self.mixers: list = []
        for i, kind in enumerate(opts.layer_kinds):
            if kind == FULL:
                self.mixers.append(FullAttention(self._layer(i, "self_attn."), opts.attention, rotary,
                                                 self.full_layers.index(i)))
            else:
                self.mixers.append(GatedDeltaNet(self._layer(i, "linear_attn."), opts.gdn, opts.eps))

    def embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The input embedding of token ids int [T] (on the decoder's device): [T, H] in the compute dtype on that
        device. A table in host memory (hosts_embedding) is read by one gather launch through unified virtual
        addressing, which a CUDA graph captures like any kernel."""
        if not self.embed_hosted:
            return self.embed[ids]
        if ids.device.type != "cuda":  # NOTE: indexing the host table would hand back host rows
            raise ValueError(f"embed_rows: ids must be on the decoder's device ({self.device}), got {ids.device}")
        # NOTE: imported here: Triton is needed only where a table is hosted (CUDA)
        from adapters.kernels.embedding_gather import gather_embedding_rows

        return gather_embedding_rows(self.embed, ids)

    def _layer(self, i: int, sub: str = "") -> dict:
        prefix = f"layers.{i}.{sub}"
        found = {name[len(prefix):]: t for name, t in self.w.items() if name.startswith(prefix)}
        if not found:
            raise KeyError(f"checkpoint has no tensors under {prefix!r}")
        return found

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.opts.eps, unit_offset=self.opts.unit_offset_norm)

    def forward(self, inp: StepInputs, kv: PagedKVCache, state: LinearStatePool | None,
                experts: ExpertSlotCache, snapshots: LinearStatePool | None = None,
                layers: tuple[int, int] | None = None, x: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [T, H] after the last layer run (before the final norm). Snapshots a work asks for
        strictly inside its prefill chunk are copied into `snapshots` here, layer by layer (the
        executor takes the ones at a work's end, and restores, around this call).

        layers (first, end): run only layers [first, end) (a layered prefill's group, SequenceWork.layers);
        None: every layer. x [T, H]: the residual stream after layer first - 1, as the call that ran that
        layer returned it; required when first > 0, refused at 0 (layer 0 starts from the embedding)."""
        first, end = layers if layers is not None else (0, len(self.mixers))
        if not 0 <= first < end <= len(self.mixers):
            raise ValueError(f"layers {layers} outside 0 <= first < end <= {len(self.mixers)}")
        if (x is None) != (first == 0):
            raise ValueError(f"layers {layers}: the residual stream x is needed exactly when first > 0")
        if x is None:
            x = self.embed_rows(inp.token_ids)  # [T, H]
        return self._layers(x, first, end, inp, kv, state, self._decode_rows(inp), snapshots, experts)

    def _layers(self, x: torch.Tensor, first: int, end: int, inp: StepInputs, kv: PagedKVCache,
                state: LinearStatePool | None, rows: tuple, snapshots: LinearStatePool | None,
                experts) -> torch.Tensor:
        """Layers [first, end) on the residual stream x [T, H]: each adds its token mixer of the normed stream,
        then its MoE of the normed stream. Returns the stream after layer end - 1."""
        w = self.w
        for i in range(first, end):
            h = self._norm(x, w[f"layers.{i}.input_layernorm.weight"])  # [T, H]
            x = x + self._mix(i, self.mixers[i], h, inp, kv, state, rows, snapshots)
            h = self._norm(x, w[f"layers.{i}.post_attention_layernorm.weight"])
            x = x + self._moe(i, h, experts)
        return x

    def _decode_rows(self, inp: StepInputs) -> tuple:
        """The step's one-token spans, their rows of the step and their state slots (int64 [B] each, one upload)."""
        decode_spans = [s for s in inp.spans if s.length == 1]
        decode_rows, decode_slots = upload(torch.tensor([[s.offset for s in decode_spans],
                                                         [s.work.state_slot for s in decode_spans]],
                                                        dtype=torch.long).reshape(2, -1), self.device)  # [B] x2
        return decode_spans, decode_rows, decode_slots

    def _mix(self, i: int, mixer, h: torch.Tensor, inp: StepInputs, kv: PagedKVCache, state: LinearStatePool | None,
             rows: tuple, snapshots: LinearStatePool | None) -> torch.Tensor:
        """Layer i's token mixer over the step: [T, H] for its normed input h [T, H]; rows: `_decode_rows`."""
        if isinstance(mixer, FullAttention):
            return self._attention(mixer, h, inp, kv)
        return self._linear_attention(mixer, h, inp, state, self.linear_layers.index(i), *rows, snapshots)

    def _linear_attention(self, mixer: GatedDeltaNet, h, inp, state, layer, decode_spans, decode_rows, decode_slots,
                          snapshots=None):
        out = torch.empty_like(h)  # [T, H]
        for span in inp.spans:
            if span.length > 1:  # prefill chunk: chunked delta rule from the slot's state
                slot = span.work.state_slot
                # NOTE: a snapshot inside the chunk splits it there: the state after exactly that many
                # tokens exists only between the two parts (the delta rule's own chunks are relative).
                start = span.offset
                inner = [(p - span.start_position, s) for p, s in span.work.snapshots if p < span.end_position]
                for cut, snap in inner if snapshots is not None else ():
                    out[start:span.offset + cut] = self._gdn_sequence(mixer, h[start:span.offset + cut], state, layer,
                                                                      slot)
                    state.copy_slot(slot, snapshots, snap, layer)
                    start = span.offset + cut
                out[start:span.offset + span.length] = self._gdn_sequence(
                    mixer, h[start:span.offset + span.length], state, layer, slot)
        if decode_spans:  # every single-token sequence in one recurrent step
            out[decode_rows] = self._gdn_decode_rows(mixer, h[decode_rows], state, layer, decode_slots)
        return out

    # The token mixers' kernels; the fast path overrides these three with its own (same contracts).
    def _attention(self, mixer: FullAttention, h: torch.Tensor, inp: StepInputs, kv: PagedKVCache) -> torch.Tensor:
        """[T, H] attention output of every span of the step (FullAttention.forward's contract)."""
        return mixer.forward(h, inp, kv)

    def _gdn_sequence(self, mixer: GatedDeltaNet, h: torch.Tensor, state: LinearStatePool, layer: int,
                      slot: int) -> torch.Tensor:
        """[T, H] for one prefill chunk h [T, H] continuing state slot `slot` (forward_sequence's contract)."""
        return mixer.forward_sequence(h, state, layer, slot)

    def _gdn_decode_rows(self, mixer: GatedDeltaNet, h: torch.Tensor, state: LinearStatePool, layer: int,
                         slots: torch.Tensor) -> torch.Tensor:
        """[n, H] for n single-token sequences h [n, H] in state slots `slots` long [n] (forward_decode's)."""
        return mixer.forward_decode(h, state, layer, slots)

    def _moe(self, i: int, h: torch.Tensor, experts: ExpertSlotCache) -> torch.Tensor:
        prefix = f"layers.{i}.mlp."
        replace = self.replay_ids[:, i] if self.replay_ids is not None else None  # [T, K]
        weights, ids = route(h, self.w[prefix + "gate.weight"], self.opts.top_k, self.opts.renormalize, replace)
        if self.on_route is not None:
            self.on_route(i, ids)
        out = self.routed(h, weights, ids, i, experts)  # [T, H]
        if self.opts.shared_expert:
            out = out + shared_expert(h, self.w, prefix)
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head on the rows whose logits are wanted: [n, H] -> fp32 [n, V]."""
        return linear(self._norm(hidden, self.w["norm.weight"]), self.lm_head).float()
