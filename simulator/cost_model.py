"""Per-operation cost model: seconds for each piece of one step, from geometry and hardware.

Shape legend: T tokens in a step, B sequences in a step, L layers, H hidden, I expert
intermediate, E experts per layer, V vocab.

Every GPU operation is costed with a roofline, max(bytes / bandwidth, flops / throughput),
so small batches are weight-read bound (GEMV) and large prefill chunks compute bound (GEMM).
What the roofline cannot know (Python dispatch, kernel launches or graph replay, sampling,
per-expert copy set-up) lives in CostParams, which a calibration fits per machine and engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from domain.model_spec import LayerKind, ModelSpec
from simulator.hardware import HardwareProfile
from simulator.params import StrictParams, require_positive


@dataclass(frozen=True)
class CostParams(StrictParams):
    """Engine-and-machine parameters. Defaults are uncalibrated physics-only guesses."""

    step_overhead_s: float = 0.0  # per step: launches / graph replay, sampling, host work
    sequence_overhead_s: float = 0.0  # per sequence in the step (per-request host work)
    transfer_latency_s: float = 0.0  # per expert copy, on top of bytes / bandwidth
    # Per copy call (one gather launch per layer group with misses), on top of the per-expert
    # cost: the fast path gathers a layer's misses in one UVA kernel whose start-up is measured.
    transfer_setup_s: float = 0.0
    # Eager kernel launches per layer and step; 0 when the step is graph-captured (the replay
    # cost is then part of step_overhead_s). Not fitted by the v1 calibration.
    layer_overhead_s: float = 0.0
    memory_efficiency: float = 0.8  # share of memory bandwidth a weight/KV read achieves
    compute_efficiency: float = 0.5  # share of dense bf16 throughput a GEMM achieves
    h2d_efficiency: float = 1.0  # share of the profile's pinned H2D bandwidth per copy
    overlap_copy_compute: bool = False  # hit-expert GEMMs run while misses are copied
    kv_dtype_bytes: int = 2

    def check_valid(self) -> None:
        require_positive(self, "step_overhead_s", "sequence_overhead_s", "transfer_latency_s", "transfer_setup_s",
                         "layer_overhead_s", allow_zero=True)
        require_positive(self, "memory_efficiency", "compute_efficiency", "h2d_efficiency", "kv_dtype_bytes")
        for name in ("memory_efficiency", "compute_efficiency", "h2d_efficiency"):
            if getattr(self, name) > 1:
                raise ValueError(f"CostParams.{name} must be <= 1, got {getattr(self, name)}")
        if not isinstance(self.overlap_copy_compute, bool):
            raise ValueError("CostParams.overlap_copy_compute must be a bool")


@dataclass(frozen=True)
class SequenceLoad:
    """What one sequence contributes to a step: tokens computed and context they attend over."""

    num_tokens: int
    context_end: int  # positions in the KV cache after this step


class CostModel:
    def __init__(self, spec: ModelSpec, hardware: HardwareProfile, params: CostParams) -> None:
        params.check_valid()
        self.spec, self.hardware, self.params = spec, hardware, params
        h = spec.hidden_size
        self.head_bytes = spec.vocab_size * h * 2  # lm_head stays bf16
        embed_bytes = spec.vocab_size * h * 2
        # NOTE: the embedding table is only gathered from (T rows), never streamed whole.
        self.layer_dense_bytes = (spec.dense_weight_bytes() - self.head_bytes - embed_bytes) / spec.num_layers
        self.expert_bytes = spec.expert_bytes()
        self.kv_bytes_per_token_layer = spec.num_kv_heads * spec.head_dim * 2 * params.kv_dtype_bytes
        n_lin = spec.num_linear_attention_layers
        self.state_bytes_layer = spec.linear_state_bytes_per_sequence() / n_lin if n_lin else 0.0
        # Parameters one token multiplies through in a layer outside the routed experts.
        self.layer_dense_params = self.layer_dense_bytes / _bytes_per_param(spec)
        self.expert_flops_per_token = 2 * 3 * h * spec.expert_intermediate
        self._mem = hardware.memory_bytes_per_s * params.memory_efficiency
        self._flops = hardware.bf16_flops * params.compute_efficiency
        self._h2d = hardware.h2d_bytes_per_s * params.h2d_efficiency

    def _roofline(self, nbytes: float, flops: float) -> float:
        return max(nbytes / self._mem, flops / self._flops)

    def step_overhead(self, num_sequences: int) -> float:
        return self.params.step_overhead_s + self.params.sequence_overhead_s * num_sequences

    def layer_pre_expert(self, layer: int, loads: Sequence[SequenceLoad]) -> float:
        """Attention or GDN, shared expert and router of one layer, for every sequence."""
        spec = self.spec
        tokens = sum(s.num_tokens for s in loads)
        launch = self.params.layer_overhead_s
        nbytes = self.layer_dense_bytes
        flops = 2.0 * self.layer_dense_params * tokens
        if spec.layer_kinds[layer] is LayerKind.FULL_ATTENTION:
            # Each new token reads K,V of every earlier position (and writes its own).
            nbytes += sum(s.context_end for s in loads) * self.kv_bytes_per_token_layer
            q_dim = spec.num_attention_heads * spec.head_dim
            flops += sum(4.0 * q_dim * s.num_tokens * (s.context_end - s.num_tokens / 2) for s in loads)
        else:
            nbytes += 2 * self.state_bytes_layer * len(loads)  # read and write the recurrent state
        return launch + self._roofline(nbytes, flops)

    def expert_gemms(self, tokens_per_expert: Sequence[int]) -> float:
        """Grouped GEMMs of the given experts (each reads its weights once)."""
        if not tokens_per_expert:
            return 0.0
        return self.expert_read(len(tokens_per_expert), sum(tokens_per_expert))

    def expert_read(self, distinct_experts: float, routed_tokens: float) -> float:
        """Seconds for the grouped GEMMs of `distinct_experts` experts (each read once) over
        `routed_tokens` (token, expert) pairs; fractional counts allowed (expected values)."""
        if distinct_experts < 0 or routed_tokens < 0:
            raise ValueError(f"negative expert counts: {distinct_experts}, {routed_tokens}")
        return self._roofline(distinct_experts * self.expert_bytes, self.expert_flops_per_token * routed_tokens)

    def transfer(self, num_experts: float, calls: float = 1.0) -> float:
        """Host->device copy of num_experts expert rows on the copy engine, issued as `calls`
        copy calls (0 experts cost nothing)."""
        if num_experts <= 0:
            return 0.0
        return calls * self.params.transfer_setup_s + num_experts * (
            self.params.transfer_latency_s + self.expert_bytes / self._h2d)

    def head(self, num_samples: int) -> float:
        """Final norm + lm_head for the sampled positions, then sampling."""
        if num_samples == 0:
            return 0.0
        return self._roofline(self.head_bytes, 2.0 * self.head_bytes / 2 * num_samples)


def _bytes_per_param(spec: ModelSpec) -> float:
    # Dense projections in FP8/INT8 formats are ~1 byte a parameter, bf16 2, 4-bit ~0.56.
    from domain.model_spec import matrix_bytes

    return matrix_bytes(spec.dense_format, 1024, 1024) / (1024 * 1024)
