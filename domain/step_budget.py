"""Step budgets (docs/adr/0011-mixed-step-budget.md): what a step of N tokens costs in time and in memory.

Time: t(step) = fixed_s + per_token_s * tokens, the line through two measured single-chunk prefills; it
sizes the two budgets of the scheduler (SchedulerConfig.max_step_tokens for a step alone,
mixed_step_tokens for a step that carries decodes, whose length is the gap every running stream sees).

Memory: the activations of the largest step, estimated from the geometry of the fast path's prefill
(adapters/cuda_exec/prefill.py, adapters/kernels/grouped_moe.py: the tensors one layer holds at once;
layers run one after another, so the peak is the largest layer's). The pools are planned beside that
reserve (GpuBudget.fixed_bytes), so a step size the card cannot hold is refused before anything loads.
Units: seconds, bytes, tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from domain.budget import GpuBudget, PlanRefusal, PoolPlan, format_bytes
from domain.model_spec import BF16_BYTES, ModelSpec, WeightFormat

FP32_BYTES = 4
# The fast prefill's Gated DeltaNet recurrence (adapters/cuda_exec/prefill.py, the split one) walks a span
# in windows of this many tokens and keeps the fp32 [Dk, Dv] state entering each 64-token chunk of one
# window: a per-step term, not a per-token one.
GDN_WINDOW_TOKENS = 2048
GDN_CHUNK_TOKENS = 64


@dataclass(frozen=True)
class StepCost:
    """t(step) = fixed_s + per_token_s * tokens (seconds), for steps of prefill tokens (decodes counted
    as tokens: one row each). Raises ValueError on negative terms or a zero line."""

    fixed_s: float
    per_token_s: float

    def __post_init__(self) -> None:
        if self.fixed_s < 0 or self.per_token_s < 0 or self.fixed_s + self.per_token_s <= 0:
            raise ValueError(f"a step cost needs fixed_s >= 0 and per_token_s >= 0, not both 0: {self}")

    @classmethod
    def through(cls, tokens_a: int, seconds_a: float, tokens_b: int, seconds_b: float) -> StepCost:
        """The line through two measured steps (tokens_a != tokens_b). Raises ValueError when the points
        give a negative slope or intercept (they are not one step cost)."""
        if tokens_a == tokens_b or min(tokens_a, tokens_b) < 1:
            raise ValueError(f"two distinct positive step sizes needed, got {tokens_a} and {tokens_b}")
        slope = (seconds_b - seconds_a) / (tokens_b - tokens_a)
        return cls(seconds_a - slope * tokens_a, slope)

    def step_s(self, tokens: int) -> float:
        """Seconds of one step of `tokens` tokens."""
        return self.fixed_s + self.per_token_s * tokens

    def prefill_s(self, prompt_tokens: int, step_tokens: int) -> float:
        """Seconds to prefill `prompt_tokens` in steps of at most `step_tokens` (each pays fixed_s)."""
        if step_tokens < 1 or prompt_tokens < 0:
            raise ValueError(f"step_tokens must be >= 1 and prompt_tokens >= 0, got {step_tokens}, {prompt_tokens}")
        return math.ceil(prompt_tokens / step_tokens) * self.fixed_s + prompt_tokens * self.per_token_s

    def tokens_within(self, limit_s: float, other_s: float = 0.0, multiple: int = 1) -> int:
        """The most tokens n, a multiple of `multiple`, with step_s(n) + other_s <= limit_s (other_s: what
        else the step carries, e.g. the decodes' own time); 0 when even the fixed cost does not fit."""
        if multiple < 1:
            raise ValueError(f"multiple must be >= 1, got {multiple}")
        room = limit_s - other_s - self.fixed_s
        if room < 0:
            return 0
        if self.per_token_s == 0:
            raise ValueError("a step cost with no per-token term fits any number of tokens")
        # NOTE: a tiny epsilon keeps an exact fit (e.g. 0.1 / 0.01) from rounding one token short
        return int(room / self.per_token_s * (1 + 1e-12)) // multiple * multiple


# H200, full-size Qwen3.6-35B-A3B block FP8, Triton prefill, every expert resident, one chunk per prompt
# (docs/bench/2026-12-01-bench-prefill-h200.json, scenario "resident"): 4,096 tokens in 0.2966 s and
# 8,192 in 0.5121 s.
H200_QWEN36_FP8 = StepCost.through(4096, 0.2966, 8192, 0.5121)
# one captured decode step at batch 4, all experts resident (docs/bench/2026-12-01-bench-decode-h200-run5.json:
# execute_median_ms 5.16)
H200_DECODE_BS4_S = 0.00516
MIXED_STEP_LIMIT_S = 0.120  # a mixed step's length we aim under: the 150 ms p99 target less HTTP/host slack
DEFAULT_MAX_STEP_TOKENS = 8192
DEFAULT_MIXED_STEP_TOKENS = 512
# The budget, decodes included, that sizes a layer group of a layered chunk beside decodes (ADR 0024, session 25):
# 1024 gives Qwen3.6's 8k chunk groups of 4 layers. Measured on an H100 at 24 GiB with an 8,196-token prompt beside 3
# streams: gap p99 130.0 ms against 131.0 at 512, the prompt's TTFT 1.06 s against 1.47
# (docs/bench/2026-12-05-h100-mixed-24gib-{512,1024}-layered.json); the mixed budget (512) still decides which
# prompts are layered, so prompts of 513-1,024 tokens do not become one unlayered step.
DEFAULT_LAYER_GROUP_TOKENS = 1024


def layer_group_tokens(max_prefill_length: int, mixed_step_tokens: int, layer_group_length: int | None = None) -> int:
    """`ft serve`'s layer-group budget: --layer-group-length, else DEFAULT_LAYER_GROUP_TOKENS raised to the mixed
    budget (a group never smaller than a mixed chunk) and bounded by --max-prefill-length."""
    if layer_group_length is not None:
        return layer_group_length
    return min(max_prefill_length, max(DEFAULT_LAYER_GROUP_TOKENS, mixed_step_tokens))


def activation_bytes_per_token(spec: ModelSpec, dtype_bytes: int = BF16_BYTES) -> int:
    """Bytes of activations one prompt token of a prefill step holds at the peak layer (fast path).

    Per layer kind, what one layer holds at once (the residual stream, its norm, the mixer's and the
    MoE's outputs: 4 x H in the model dtype, live throughout):
    - Gated DeltaNet: the projections qkv [C], z [Nv*Dv], a and b [Nv] and the normed core [Nv*Dv] in
      the model dtype, and the fp32 scratch of the chunk kernels 4 * (C + Nv*(Dk + 2*Dv + 2))
      (gdn_prefill's docstring: the conv output, w, u, the gates gc and the key scales ks, the core
      output); the window of entry states is gdn_window_bytes, per step;
    - MoE: fp32 partials [(K+s)*H] and the intermediate [(K+s)*I] in the model dtype (grouped_moe),
      fp32 router logits [E], the weights, ids and the alignment's index arrays ((4+8+12) bytes per pair);
      s = 1 with a shared expert;
    - full attention: q with its gate [2*N*D], k and v [2*M*D], the attention output and its gated copy
      [2*N*D], all in the model dtype. The context's K/V, gathered per layer (2*X*M*D, 64 MiB at 32k for
      Qwen3.6), is not per chunk token and is left to the memory ratio's headroom.
    Qwen3.6-35B-A3B in bf16: 131,456 bytes (128.4 KiB) per token, the Gated DeltaNet layer's.
    """
    if dtype_bytes < 1:
        raise ValueError(f"dtype_bytes must be >= 1, got {dtype_bytes}")
    h, d = spec.hidden_size, dtype_bytes
    common = 4 * h * d
    gdn = 0
    if spec.num_linear_attention_layers:
        c = spec.linear_conv_channels
        nv, dk, dv = spec.linear_num_value_heads, spec.linear_key_head_dim, spec.linear_value_head_dim
        gdn = d * (c + 2 * nv * dv + 2 * nv) + FP32_BYTES * (c + nv * (dk + 2 * dv + 2))
    pairs = spec.top_k + (1 if spec.shared_expert_intermediate else 0)
    moe = FP32_BYTES * pairs * h + d * pairs * spec.expert_intermediate + FP32_BYTES * spec.num_experts + 24 * pairs
    attention = 0
    if spec.num_full_attention_layers:
        n, m, hd = spec.num_attention_heads, spec.num_kv_heads, spec.head_dim
        attention = d * (4 * n * hd + 2 * m * hd)
    return common + max(gdn, moe, attention)


def gdn_window_bytes(spec: ModelSpec, step_tokens: int) -> int:
    """fp32 entry states the split Gated DeltaNet recurrence keeps for one window of a step of step_tokens:
    Nv*Dk*Dv*4 bytes per 64-token chunk, at most GDN_WINDOW_TOKENS / 64 chunks (64 MiB for Qwen3.6);
    0 for a model without Gated DeltaNet layers. Raises ValueError on a negative count."""
    if step_tokens < 0:
        raise ValueError(f"step_tokens must be >= 0, got {step_tokens}")
    if not spec.num_linear_attention_layers:
        return 0
    chunks = -(-min(step_tokens, GDN_WINDOW_TOKENS) // GDN_CHUNK_TOKENS)
    return FP32_BYTES * spec.linear_num_value_heads * spec.linear_key_head_dim * spec.linear_value_head_dim * chunks


def dense_scratch_bytes(spec: ModelSpec, dtype_bytes: int = BF16_BYTES) -> int:
    """The dequantized copy of the largest dense projection a long prefill chunk multiplies on cuBLAS
    (adapters/cuda_exec/prefill_linear.py, DEQUANT_MIN_ROWS; one copy at a time, reused layer after layer): the
    widest of the Gated DeltaNet in-projection (qkv and z fused, [C + Nv*Dv, H]) and out-projection, the attention's
    fused q (with its gate), k, v and its o, the shared expert's fused gate/up, in the model dtype. 0 when the
    dense weights are bf16 (nothing to dequantize). Qwen3.6-35B-A3B in bf16: 48 MiB."""
    if spec.dense_format == WeightFormat.BF16:
        return 0
    h = spec.hidden_size
    q_width = spec.num_attention_heads * spec.head_dim
    q_rows = 2 * q_width if spec.architecture == "qwen3_5_moe" else q_width
    value_dim = spec.linear_num_value_heads * spec.linear_value_head_dim
    elements = [2 * spec.shared_expert_intermediate * h]
    if spec.num_full_attention_layers:
        elements += [(q_rows + 2 * spec.num_kv_heads * spec.head_dim) * h, q_width * h]
    if spec.num_linear_attention_layers:
        elements += [(spec.linear_conv_channels + value_dim) * h, value_dim * h]
    return max(elements) * dtype_bytes


def step_activation_bytes(spec: ModelSpec, step_tokens: int, sampled_rows: int,
                          dtype_bytes: int = BF16_BYTES) -> int:
    """Activations of the largest step: step_tokens x activation_bytes_per_token, the Gated DeltaNet
    recurrence's window of entry states (gdn_window_bytes), plus the logits of the rows that sample
    ([rows, V] fp32 and its model-dtype matmul output). step_tokens is what the step may hold (the
    scheduler's max_step_tokens, no more than every running sequence's whole context).
    Raises ValueError on negative counts."""
    if step_tokens < 0 or sampled_rows < 0:
        raise ValueError(f"step_tokens and sampled_rows must be >= 0, got {step_tokens}, {sampled_rows}")
    return (step_tokens * activation_bytes_per_token(spec, dtype_bytes) + gdn_window_bytes(spec, step_tokens)
            + sampled_rows * spec.vocab_size * (FP32_BYTES + dtype_bytes))


def reserve_step(budget: GpuBudget, activation_bytes: int) -> GpuBudget:
    """The budget with the step's activations held outside the pools (added to fixed_bytes)."""
    if activation_bytes < 0:
        raise ValueError(f"activation_bytes must be >= 0, got {activation_bytes}")
    return replace(budget, fixed_bytes=budget.fixed_bytes + activation_bytes)


def blame_step(refused: PlanRefusal, without_reserve: PoolPlan | PlanRefusal, step_tokens: int,
               activation_bytes: int, option: str = "--max-prefill-length") -> PlanRefusal:
    """A refusal of the plan made beside the step's activation reserve, named for the step when the same
    request fits without the reserve (`without_reserve` is that plan): pool "activation", the same
    shortfall (a budget that many bytes larger fits the pools and the reserve), a message that says which
    option to lower. Otherwise `refused` as it is (the pools do not fit even without the reserve)."""
    if isinstance(without_reserve, PlanRefusal):
        return refused
    return PlanRefusal(
        "activation", refused.shortfall_bytes,
        f"a prefill step of {step_tokens} tokens ({option}) needs {format_bytes(activation_bytes)} of activations "
        f"beside the pools, and with it: {refused.message}; lower {option} or raise the memory budget")


def serve_step_tokens(spec: ModelSpec, max_prefill_length: int, max_running_requests: int) -> int:
    """The most tokens one `ft serve` step can hold: --max-prefill-length, no more than every running
    sequence's whole context."""
    return min(max_prefill_length, max_running_requests * spec.max_context)


def layered_chunk_bytes(spec: ModelSpec, step_tokens: int, dtype_bytes: int = BF16_BYTES) -> int:
    """The residual stream [T, H] a layered prefill chunk of step_tokens keeps between its layer groups
    (docs/adr/0024-layered-prefill.md): step_tokens x hidden x dtype_bytes (32 MiB at 8,192 tokens of
    Qwen3.6 in bf16). Raises ValueError on a negative count."""
    if step_tokens < 0:
        raise ValueError(f"step_tokens must be >= 0, got {step_tokens}")
    return step_tokens * spec.hidden_size * dtype_bytes


def serve_step_reserve(spec: ModelSpec, max_prefill_length: int, max_running_requests: int,
                       dtype_bytes: int = BF16_BYTES, layered_prefill: bool = False,
                       dense_copy: bool = False) -> int:
    """Bytes `ft serve` holds outside the pools for its largest step's activations (ADR 0011), plus, with
    layered prefill, the chunk kept between its groups (ADR 0024), and, with dense_copy (long chunks' dense
    projections on cuBLAS over a dequantized copy), that copy (dense_scratch_bytes); the server and the simulator
    both size it here."""
    tokens = serve_step_tokens(spec, max_prefill_length, max_running_requests)
    kept = layered_chunk_bytes(spec, tokens, dtype_bytes) if layered_prefill else 0
    copy = dense_scratch_bytes(spec, dtype_bytes) if dense_copy else 0
    return step_activation_bytes(spec, tokens, max_running_requests, dtype_bytes) + kept + copy
