"""The fast path's decoder: the reference MoeDecoder's weights and prefill, plus a decode step over
static, padded buffers built only from graph-capturable kernels (fused MoE over the device expert pool,
paged decode attention, the Gated DeltaNet step, quantized GEMVs).

Shape legend: B padded decode rows, H hidden, N query heads, M kv heads, D head dim, W pages per row,
K top-k, V vocab, C conv channels, Nv value heads, Dv value head dim.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from adapters.checkpoint.quant import QTensor, as_linear_weight, qlinear
from adapters.cuda_exec.decode_inputs import KV_ROW, POSITION, SEQ_LEN, STATE_SLOT, TOKEN, VALID, DecodeView
from adapters.cuda_exec.expert_pool import DeviceExpertPool
from adapters.cuda_exec.fused_weights import concat_rows
from adapters.cuda_exec.prefill_graphs import MoeSegments
from adapters.cuda_exec.prefill_linear import prefill_linear
from adapters.cuda_exec.prefill_spans import attention_spans, gdn_spans
from adapters.cuda_exec.routing_replay import replace_routing
from adapters.cuda_exec.step_plan import StepPlan
from adapters.kernels import dense_gemv as gemv
from adapters.kernels.gated_rms_norm import gated_rms_norm as fused_gated_norm
from adapters.kernels.gdn_decode import gdn_decode_step
from adapters.kernels.moe_router import moe_router
from adapters.kernels.paged_decode_attention import paged_decode_attention
from adapters.kernels.paged_prefill_attention import block_tokens
from adapters.kernels.qk_norm_rope import qk_norm_rope
from adapters.kernels.rms_norm import rms_norm as fused_norm
from adapters.kernels.rms_norm_router import rms_norm_router as norm_router
from adapters.torch_exec.decoder import MoeDecoder
from adapters.torch_exec.full_attention import FullAttention
from adapters.torch_exec.gated_deltanet import GatedDeltaNet, LinearStatePool
from adapters.torch_exec.moe import route
from adapters.torch_exec.paged_attention import PagedKVCache
from adapters.torch_exec.step_inputs import StepInputs


def fast_linear(x: torch.Tensor, w: torch.Tensor | QTensor) -> torch.Tensor:
    """x [B, I] @ w^T for the GPU-verified kernels: float weights through cuBLAS, FP8/INT8 through the
    Triton GEMV (dequantized in the K loop, one weight pass per row), other formats through the reference
    qlinear (still capturable, more kernels)."""
    if not isinstance(w, QTensor):
        return F.linear(x, w)
    if gemv.supports(w):
        return gemv.dense_gemv(x, w)
    return qlinear(x, w)


class FastDecoder(MoeDecoder):
    """MoeDecoder whose experts come from a DeviceExpertPool (prefill too) and which adds decode_step.
    Prefill and mixed steps run the shared forward with the prefill kernels, every token mixer over the
    whole step at once (adapters/cuda_exec/prefill_spans.py: the Gated DeltaNet chunk kernels per span, flash
    attention per span over the gathered pages, everything else once per step)."""

    prefill_kernels = False  # the executor turns the Triton prefill on (--prefill-kernels triton, or auto's pick)
    # NOTE: steps of up to this many rows (the decode buckets: the executor sets its largest captured one on
    # CUDA) take prefill_linear's GEMV/GEMM choice even under the reference prefill. Measured on the H200
    # (docs/bench/2026-12-01-bench-decode-h200-run6-fusions*.json): at 16 rows the GEMV re-reads the dense
    # weights per row, 4.97 ms a step, the tensor-core GEMM 1.25 ms (1,165 -> 1,566 tok/s); the GEMM's
    # autotune keys for these rows are all tuned by the graph warm-up, so no request pays for tuning.
    decode_gemm_rows = 0
    # --prefill-fp8-activations (ADR 0018): the Triton prefill's FP8 projections take e4m3 activations; steps
    # of at most decode_gemm_rows rows keep bf16 ones, as the captured decode step does
    fp8_activations = False
    # the decode graphs' page-table width (the executor sets it): a mixed step's one-token rows use it too, so
    # paged_decode_attention (W is one of its compile-time constants) runs binaries already built
    decode_pages = 0
    _step: StepPlan | None = None  # the step forward() is running: what its layers share (step_plan.py)
    _chunk_plan: StepPlan | None = None  # a layered chunk's plan between its groups (forward with layers)
    # the MoE segments of short steps (prefill_graphs.py, --prefill-graphs; the executor sets them); None: off
    segments: MoeSegments | None = None

    def _linear(self, x: torch.Tensor, w: torch.Tensor | QTensor) -> torch.Tensor:
        """The step's projections: with the Triton prefill on, or for a step of at most decode_gemm_rows
        rows, prefill_linear (the GEMV for the few rows where it is faster, the tensor-core GEMM above);
        otherwise the GPU-verified GEMV path (fast_linear)."""
        if self.prefill_kernels or x.shape[0] <= self.decode_gemm_rows:
            a8 = self.fp8_activations and self.prefill_kernels and x.shape[0] > self.decode_gemm_rows
            return prefill_linear(x, w, a8=a8)
        return fast_linear(x, w)

    def _moe(self, i: int, h: torch.Tensor, experts: DeviceExpertPool, valid: torch.Tensor | None = None,
             h32: torch.Tensor | None = None, logits: torch.Tensor | None = None):
        """The MoE block's output [T, H] for h [T, H]; h32: h.float() when the caller has it already (the
        decode step's norm writes it), for the fp32 router; logits: the fp32 router's h @ router^T [T, E]
        when the caller has them already (rms_norm_router), so no router GEMV runs here."""
        prefix, k = f"layers.{i}.mlp.", self.opts.top_k
        router = self.w[prefix + "gate.weight"]
        gate_w = self.w[prefix + "shared_expert_gate.weight"] if self.opts.shared_expert else None
        if isinstance(router, QTensor):  # a quantized router: the reference route (rare; not fused)
            weights, ids = route(h, router, k, self.opts.renormalize)  # [T, K]
            logits = None
            if gate_w is not None:
                gate = torch.sigmoid(self._linear(h, gate_w)).float()  # [T, 1]
                weights = torch.cat((weights, gate), 1)  # [T, K+1], as moe_router lays it out
        else:
            # NOTE: the router GEMV through cuBLAS at full bandwidth; softmax, top-k, renormalisation and
            # the shared expert's sigmoid gate (column K) in one launch
            if logits is None:
                logits = F.linear(h32 if h32 is not None else h.to(router.dtype), router)  # [T, E] fp32
            weights, ids = moe_router(h, router, k, self.opts.renormalize, gate_w, logits=logits)  # [T, K(+1)]
            ids = ids[:, :k]
        if self.replay_ids is not None:  # --routing-replay (benchmark-only): in place, graph-safe
            replace_routing(self.replay_ids[:, i], h, router, weights, ids, logits, self.opts.renormalize)
        if gate_w is None:
            return experts.routed(i, h, weights, ids, valid)  # [T, H]
        if experts.has_shared:  # the shared expert is one more resident expert of the fused kernels
            return experts.routed(i, h, weights, ids, valid, shared=True)
        w = self.w
        out = experts.routed(i, h, weights[:, :k], ids, valid)
        up = self._linear(h, w[prefix + "shared_expert.up_proj.weight"])
        act = F.silu(self._linear(h, w[prefix + "shared_expert.gate_proj.weight"])) * up
        return out + weights[:, k:].to(h.dtype) * self._linear(act, w[prefix + "shared_expert.down_proj.weight"])

    def _fused_routing(self, i: int, rows: int, experts: DeviceExpertPool) -> bool:
        """Whether layer i's decode MoE enters through the fused kernels (rms_norm_router, then
        routed_logits's moe_route_lookup where it pays, else moe_router + the lookup kernel from the same
        logits): an fp32 router, no routing replay (it rewrites the ids between the router and the lookup),
        the shared expert resident in the pool or absent, and a bucket whose lookup fits one launch (the
        buckets measured: the entry stays as it was for larger ones). Otherwise the unfused path (_moe from
        the norm's fp32 copy) runs, with the same decisions."""
        router = self.w[f"layers.{i}.mlp.gate.weight"]
        return (not isinstance(router, QTensor) and router.dtype == torch.float32 and self.replay_ids is None
                and (experts.has_shared or not self.opts.shared_expert)
                and experts.can_route(rows, self.opts.top_k))

    def _add_post_norm(self, i: int, x: torch.Tensor, mix: torch.Tensor):
        """(x + mix, the MoE's input norm of it, its fp32 copy or None) for layer i in one launch: the norm also writes
        h.float() where the fp32 router reads it (no cast launch a layer). mix: the token mixer's output, x's dtype."""
        norm_w, eps, unit = (self.w[f"layers.{i}.post_attention_layernorm.weight"], self.opts.eps,
                             self.opts.unit_offset_norm)
        if self._router_reads_fp32(i, x):
            return fused_norm(x, norm_w, eps, unit_offset=unit, residual=mix, fp32_copy=True)
        return (*fused_norm(x, norm_w, eps, unit_offset=unit, residual=mix), None)

    def _router_reads_fp32(self, i: int, h: torch.Tensor) -> bool:
        router = self.w[f"layers.{i}.mlp.gate.weight"]
        return not isinstance(router, QTensor) and router.dtype == torch.float32 and h.dtype != torch.float32

    def pack_shared_experts(self, layout) -> torch.Tensor | None:
        """uint8 [L, R]: every layer's shared expert packed like a routed expert, or None when its format
        or shape differs from the routed experts'. On success the dense copies are dropped (the packed
        rows replace them, so the device holds the same bytes)."""
        if not self.opts.shared_expert:
            return None
        names = [[f"layers.{i}.mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")]
                 for i in range(len(self.mixers))]
        mats = [[as_linear_weight(self.w[n]).to("cpu") for n in layer] for layer in names]
        if any(layout.can_pack(*m) is not None for m in mats):
            return None
        rows = torch.stack([layout.pack(*m) for m in mats])  # [L, R]
        for layer in names:
            for n in layer:
                del self.w[n]
        return rows

    def decode_step(self, view: DecodeView, kv: PagedKVCache, state: LinearStatePool | None,
                    experts: DeviceExpertPool) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp32 logits [B, V], greedy tokens [B]) for one token per row; padded rows compute garbage that
        touches no pool (their K/V go to the scratch page, their state slot is -1, they route nowhere)."""
        st = view.staging  # int64 [6, B]; the typed views below are part of the captured graph
        buf = _Rows(st[TOKEN], st[POSITION], st[VALID] != 0, view.page_table, st[SEQ_LEN].to(torch.int32),
                    st[KV_ROW], st[STATE_SLOT].to(torch.int32))
        w, eps, unit = self.w, self.opts.eps, self.opts.unit_offset_norm
        x = self.embed_rows(buf.token_ids)  # [B, H]
        # NOTE: the residual add is fused into the next norm: (x + delta, norm(x + delta)) in one launch
        x, h = fused_norm(x, w["layers.0.input_layernorm.weight"], eps, unit_offset=unit)  # [B, H]
        cos_sin = self._rotary.cos_sin(buf.positions, x.dtype) if self.full_layers else None  # [B, R] x2
        settle = False  # a layer took routed_resident: the step's hits are settled after the last layer
        for i, mixer in enumerate(self.mixers):
            if isinstance(mixer, FullAttention):
                h = self._attention_decode(i, mixer, h, buf, kv, cos_sin)
            else:
                h = self._gdn_decode(i, mixer, h, buf.state_slots, state, self.linear_layers.index(i))
            norm_w = w[f"layers.{i}.post_attention_layernorm.weight"]
            if self._fused_routing(i, h.shape[0], experts):
                # its tile is autotuned per bucket on CUDA, by the executor's eager warm-up step (bs1 wants
                # smaller e-blocks than bs16: adapters/kernels/rms_norm_router.py)
                router = w[f"layers.{i}.mlp.gate.weight"]
                x, h, logits = norm_router(x, h, norm_w, router, eps, unit_offset=unit)
                gate_w = w[f"layers.{i}.mlp.shared_expert_gate.weight"] if self.opts.shared_expert else None
                if experts.fuses_routing(h.shape[0], self.opts.top_k):
                    # NOTE: two launches from the mixer's output to the slot ids: norm + router GEMV, then
                    # softmax/top-k/shared gate + the layer's residency decision, for small buckets only
                    # (moe_route_lookup.pays; docs/fast-decode.md)
                    delta = experts.routed_logits(i, h, logits, self.opts.top_k, self.opts.renormalize, gate_w,
                                                  buf.valid)
                elif experts.routes_resident(h.shape[0] * self.opts.top_k):
                    # NOTE: every key resident: the router (moe_router, as the branch below) reads the slots from
                    # the table, no lookup or gather launch; the hits are settled once per step below (ADR 0027).
                    # Not for the fused buckets above: moe_route_lookup's weights are moe_router's within 1e-6,
                    # not bit for bit, and the bits must not depend on the pool size
                    delta = experts.routed_resident(i, h, logits, router, self.opts.top_k, self.opts.renormalize,
                                                    gate_w, buf.valid)
                    settle = True
                else:  # larger buckets: moe_router (grid (T,)) from the same logits, then the lookup kernel
                    delta = self._moe(i, h, experts, buf.valid, logits=logits)
            else:
                x, h, h32 = self._add_post_norm(i, x, h)
                delta = self._moe(i, h, experts, buf.valid, h32)
            after = f"layers.{i + 1}.input_layernorm.weight" if i + 1 < len(self.mixers) else "norm.weight"
            x, h = fused_norm(x, w[after], eps, unit_offset=unit, residual=delta)
        if settle:
            experts.settle_step()
        logits = self._linear(h, self.lm_head).float()  # [B, V]
        return logits, logits.argmax(dim=-1)

    def _attention_decode(self, i: int, mixer: FullAttention, x: torch.Tensor, buf: _Rows,
                          kv: PagedKVCache, cos_sin) -> torch.Tensor:
        geo, rows = mixer.geo, x.shape[0]
        q, k, v = (_biased(y, mixer.bias[n]) for y, n in zip(
            self._projections(i, mixer, x, "qkv", ("q_proj", "k_proj", "v_proj")), ("q_proj", "k_proj", "v_proj"),
            strict=True))
        gate = None
        if geo.output_gate:  # the gate stays a strided view: the attention's combine step applies it
            q, gate = torch.chunk(q.reshape(rows, geo.num_heads, 2 * geo.head_dim), 2, dim=-1)  # [B, N, D] x2
        q = q.reshape(rows, geo.num_heads, geo.head_dim)
        k = k.reshape(rows, geo.num_kv_heads, geo.head_dim)  # [B, M, D]
        v = v.reshape(rows, geo.num_kv_heads, geo.head_dim)  # [B, M, D]
        layer = mixer.kv_layer
        # q/k norms, rotary, and this token's K/V written into its page, in one launch
        q = qk_norm_rope(q, k, v, mixer.w["q_norm.weight"], mixer.w["k_norm.weight"], geo.eps,
                         geo.unit_offset_norm, *cos_sin, kv.k[layer], kv.v[layer], buf.kv_rows)  # [B, N, D]
        out = paged_decode_attention(q, kv.k[layer], kv.v[layer], buf.page_table, buf.seq_lens,
                                     geo.head_dim ** -0.5, gate=gate)  # [B, N, D], gated
        out = out.reshape(rows, -1)
        return _biased(self._linear(out, mixer.w["o_proj.weight"]), mixer.bias["o_proj"])  # [B, H]

    # ---- prefill and mixed steps (eager): the prefill kernels, every span of the step at once --------------
    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return fused_norm(x, weight, self.opts.eps, unit_offset=self.opts.unit_offset_norm)[1]

    def forward(self, inp: StepInputs, kv: PagedKVCache, state: LinearStatePool | None, experts,
                snapshots: LinearStatePool | None = None, layers: tuple[int, int] | None = None,
                x: torch.Tensor | None = None) -> torch.Tensor:
        """MoeDecoder.forward (layers, x: a layered prefill's group, from the residual stream x [T, H]); with
        the prefill kernels, the step's shared tables (flat KV rows, rotary tables, the one-token rows' page
        table, the GDN launch groups) are built once for all layers (step_plan.py), and once for all the groups
        of a layered chunk (kept while its groups come with the same `inp`). A layer group never takes the
        MoE segments (they start from the embedding and run every layer)."""
        if not self.prefill_kernels:
            return super().forward(inp, kv, state, experts, snapshots, layers, x)
        if layers is None:
            self._step = StepPlan(inp)
        else:  # NOTE: a group continuing its chunk (the executor hands it the same inputs) reuses the chunk's plan
            chunk = self._chunk_plan
            self._step = chunk if layers[0] > 0 and chunk is not None and chunk.inp is inp else StepPlan(inp)
            self._chunk_plan = self._step if layers[1] < len(self.mixers) else None
        try:
            segments = self.segments
            if layers is None and segments is not None and self.replay_ids is None and segments.experts is experts \
                    and segments.bucket(inp.token_ids.shape[0]) is not None:
                return self._forward_segments(inp, kv, state, snapshots, segments)
            return super().forward(inp, kv, state, experts, snapshots, layers, x)
        finally:
            self._step = None

    def _layers(self, x: torch.Tensor, first: int, end: int, inp: StepInputs, kv: PagedKVCache,
                state: LinearStatePool | None, rows: tuple, snapshots: LinearStatePool | None,
                experts) -> torch.Tensor:
        """MoeDecoder._layers with each residual add fused into the norm after it, as the decode step does
        (rms_norm's residual: the sum rounded to the stream's dtype as a torch add rounds it, so the same bits),
        and the MoE's norm also writing h.float() for an fp32 router (no cast launch). Two launches fewer a
        layer: on the H100's 8k resident prefill the adds took 2.4 ms and the router's casts 2.2 ms (80 and 40
        launches; session 28's profile), and a short step's host launches them one by one."""
        if not self.prefill_kernels:
            return super()._layers(x, first, end, inp, kv, state, rows, snapshots, experts)
        w, eps, unit = self.w, self.opts.eps, self.opts.unit_offset_norm

        h = self._norm(x, w[f"layers.{first}.input_layernorm.weight"])  # [T, H]
        for i in range(first, end):
            x, h, h32 = self._add_post_norm(i, x, self._mix(i, self.mixers[i], h, inp, kv, state, rows, snapshots))
            delta = self._moe(i, h, experts, h32=h32)
            if i + 1 < end:
                x, h = fused_norm(x, w[f"layers.{i + 1}.input_layernorm.weight"], eps, unit_offset=unit,
                                  residual=delta)
            else:  # the group's (or the step's) last layer: the stream goes back as it is, no norm after it
                x = x + delta
        return x

    def _forward_segments(self, inp: StepInputs, kv: PagedKVCache, state: LinearStatePool | None,
                          snapshots: LinearStatePool | None, segments: MoeSegments) -> torch.Tensor:
        """MoeDecoder.forward for a step of at most segments.max_tokens tokens: the token mixers eager, each
        layer's MoE half from its segment (a graph replay on CUDA) over the bucket's padded rows. Returns the
        hidden rows [T, H], a view of the bucket's buffer: valid until the next step."""
        tokens = inp.token_ids.shape[0]
        buf = segments.start(self.embed_rows(inp.token_ids))
        rows = self._decode_rows(inp)
        h = self._norm(buf.x[:tokens], self.w["layers.0.input_layernorm.weight"])  # [T, H]
        for i, mixer in enumerate(self.mixers):
            buf.mix[:tokens].copy_(self._mix(i, mixer, h, inp, kv, state, rows, snapshots))
            segments.run(i, buf)
            h = buf.h[:tokens]
        return buf.x[:tokens]

    def _plan(self, inp: StepInputs) -> StepPlan:
        if self._step is None or self._step.inp is not inp:  # a mixer called outside forward()
            self._step = StepPlan(inp)
        return self._step

    def _attention(self, mixer: FullAttention, h: torch.Tensor, inp: StepInputs, kv: PagedKVCache) -> torch.Tensor:
        if not self.prefill_kernels:
            return super()._attention(mixer, h, inp, kv)
        i, step = self.full_layers[mixer.kv_layer], self._plan(inp)
        names = ("q_proj", "k_proj", "v_proj")

        def qkv(x: torch.Tensor) -> list:
            return [_biased(y, mixer.bias[n]) for y, n in zip(self._projections(i, mixer, x, "qkv", names), names,
                                                              strict=True)]

        geo = mixer.geo
        tables = step.attention(kv.page_size, self.decode_pages, geo.num_kv_heads,
                                block_tokens(geo.num_heads // geo.num_kv_heads, geo.head_dim, h.dtype))
        return attention_spans(mixer, h, kv, tables, step.cos_sin(mixer.rotary, h.dtype), qkv_fn=qkv,
                               linear_fn=self._linear)

    def _linear_attention(self, mixer: GatedDeltaNet, h, inp, state, layer, decode_spans, decode_rows, decode_slots,
                          snapshots=None):
        # NOTE: a step of one-token rows only keeps the decode path (_gdn_decode_rows), as before
        if not self.prefill_kernels or len(decode_spans) == len(inp.spans):
            return super()._linear_attention(mixer, h, inp, state, layer, decode_spans, decode_rows, decode_slots,
                                             snapshots)
        i, step = self.linear_layers[layer], self._plan(inp)
        decode = (decode_rows, step.memo("slots32", lambda: decode_slots.to(torch.int32))) if decode_spans else None
        return gdn_spans(
            mixer, h, step.gdn_groups(snapshots is not None), state, layer, snapshots=snapshots, decode=decode,
            qkvz_fn=lambda x: self._projections(i, mixer, x, "qkvz", ("in_proj_qkv", "in_proj_z")),
            ab_fn=lambda x: self._projections(i, mixer, x, "ab", ("in_proj_b", "in_proj_a")), linear_fn=self._linear)

    def _gdn_decode_rows(self, mixer: GatedDeltaNet, h: torch.Tensor, state: LinearStatePool, layer: int,
                         slots: torch.Tensor) -> torch.Tensor:
        if not self.prefill_kernels:
            return super()._gdn_decode_rows(mixer, h, state, layer, slots)
        return self._gdn_decode(self.linear_layers[layer], mixer, h, slots.to(torch.int32), state, layer)

    def _gdn_decode(self, i: int, mixer: GatedDeltaNet, x: torch.Tensor, state_slots: torch.Tensor,
                    state: LinearStatePool, layer: int) -> torch.Tensor:
        """[B, H] for one token per row of x [B, H] in state slots int32 [B] (-1: a padded row)."""
        geo, w = mixer.geo, mixer.w
        qkv, z = self._projections(i, mixer, x, "qkvz", ("in_proj_qkv", "in_proj_z"))  # [B, C], [B, Nv*Dv]
        z = z.reshape(-1, geo.num_v_heads, geo.v_head_dim)  # [B, Nv, Dv]
        ab = ({"project_ab": (x, w["in_proj_a.weight"], w["in_proj_b.weight"])} if _projects_ab(mixer, x.dtype)
              else None)
        if ab is None:  # quantized a/b: their GEMV (stacked), then the recurrence
            b, a = self._projections(i, mixer, x, "ab", ("in_proj_b", "in_proj_a"))  # [B, Nv] each
        else:  # NOTE: float a/b (the FP8 checkpoints keep them bf16): the recurrence projects them, no GEMV
            a = b = None
        core = gdn_decode_step(qkv, a, b, state.conv[layer], state.recurrent[layer], state_slots,
                               mixer.conv_weight_2d, mixer.neg_a, mixer.dt_bias, geo, **(ab or {}))  # [B, Nv, Dv] fp32
        normed = fused_gated_norm(core, z, w["norm.weight"], mixer.eps, dtype=x.dtype)  # [B, Nv, Dv]
        return self._linear(normed.reshape(x.shape[0], -1), w["out_proj.weight"])  # [B, H]

    def prepare_fast_path(self) -> None:
        """One-time layouts the kernels want: stacked projections (views replace the parts, no extra
        bytes), the conv weight as [C, W]."""
        self._rotary = next((m.rotary for m in self.mixers if isinstance(m, FullAttention)), None)
        self.stacked: dict[tuple[int, str], tuple] = {}
        self.stacked_parts: list = []  # the views that replaced the stacked parts (prefill_warmup skips them)
        for i, mixer in enumerate(self.mixers):
            if isinstance(mixer, GatedDeltaNet):
                mixer.conv_weight_2d = mixer.w["conv1d.weight"][:, 0, :].contiguous()  # [C, W]
                groups = {"qkvz": ("in_proj_qkv", "in_proj_z")}
                if not _projects_ab(mixer, self.dtype):  # float a/b are projected inside the recurrence kernel
                    groups["ab"] = ("in_proj_b", "in_proj_a")
                prefix = f"layers.{i}.linear_attn."
            else:
                if any(b is not None for b in mixer.bias.values()):
                    continue
                groups = {"qkv": ("q_proj", "k_proj", "v_proj")}
                prefix = f"layers.{i}.self_attn."
            for group, names in groups.items():
                parts = [mixer.w[f"{n}.weight"] for n in names]
                done = concat_rows(parts)
                if done is None:
                    continue
                stacked, views = done
                for n, view in zip(names, views, strict=True):
                    mixer.w[f"{n}.weight"] = self.w[f"{prefix}{n}.weight"] = view
                self.stacked_parts += views
                self.stacked[(i, group)] = (stacked, [_rows(p) for p in parts])

    def _projections(self, i: int, mixer, x: torch.Tensor, group: str, names: tuple[str, ...]) -> list:
        """x @ W^T for each named projection: one GEMV over the stacked weight when there is one."""
        found = self.stacked.get((i, group))
        if found is None:
            return [self._linear(x, mixer.w[f"{n}.weight"]) for n in names]
        stacked, rows = found
        return list(torch.split(self._linear(x, stacked), rows, dim=-1))


class _Rows(NamedTuple):
    token_ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    valid: torch.Tensor  # [B] bool
    page_table: torch.Tensor  # [B, W] int32
    seq_lens: torch.Tensor  # [B] int32
    kv_rows: torch.Tensor  # [B] int64
    state_slots: torch.Tensor  # [B] int32


def _projects_ab(mixer: GatedDeltaNet, dtype: torch.dtype) -> bool:
    """Whether gdn_decode_step computes this layer's a/b itself: plain float weights with unit column
    stride, in the activations' dtype or fp32; quantized ones keep their (stacked) GEMV."""
    ws = [mixer.w["in_proj_a.weight"], mixer.w["in_proj_b.weight"]]
    return all(not isinstance(w, QTensor) and w.dtype in (dtype, torch.float32) and w.stride(-1) == 1 for w in ws)


def _rows(w: torch.Tensor | QTensor) -> int:
    return int(w.shape[0])


def _biased(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias
