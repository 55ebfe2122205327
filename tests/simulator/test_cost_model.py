"""Cost model physics: rooflines, transfers, batch effects."""

import pytest

from domain.model_spec import LayerKind, qwen36_35b_a3b
from simulator.cost_model import CostModel, CostParams, SequenceLoad
from simulator.hardware import get_profile

SPEC = qwen36_35b_a3b()


def model(**params):
    return CostModel(SPEC, get_profile("rtx3090"), CostParams(**params))


def test_a_decode_expert_gemm_is_weight_read_bound_and_a_big_prefill_is_compute_bound():
    m = model(memory_efficiency=1.0, compute_efficiency=1.0)
    assert m.expert_gemms([1]) == pytest.approx(SPEC.expert_bytes() / 936e9)
    # GEMV -> GEMM: more tokens through the same expert cost nothing until compute dominates.
    assert m.expert_gemms([4]) == m.expert_gemms([1])
    big = m.expert_gemms([100_000])
    assert big == pytest.approx(100_000 * 6 * 2048 * 512 / 71e12)
    assert m.expert_gemms([1, 1]) == pytest.approx(2 * m.expert_gemms([1]))


def test_transfer_is_bytes_over_measured_bandwidth_plus_latency_per_expert():
    m = model(transfer_latency_s=35e-6)
    one = SPEC.expert_bytes() / 25.3e9 + 35e-6
    assert m.transfer(1) == pytest.approx(one) and m.transfer(7) == pytest.approx(7 * one)
    assert 120e-6 < SPEC.expert_bytes() / 25.3e9 < 130e-6  # a 3 MiB FP8 row over PCIe 4.0


def test_attention_cost_grows_with_context_and_gdn_with_sequences():
    m = model()
    assert SPEC.layer_kinds[3] is LayerKind.FULL_ATTENTION and SPEC.layer_kinds[0] is LayerKind.LINEAR_ATTENTION
    short = m.layer_pre_expert(3, [SequenceLoad(1, 100)])
    long = m.layer_pre_expert(3, [SequenceLoad(1, 500_000)])
    assert long > 2 * short
    assert m.layer_pre_expert(0, [SequenceLoad(1, 10)] * 8) > m.layer_pre_expert(0, [SequenceLoad(1, 10)])


def test_overheads_add_where_documented():
    base, tuned = model(), model(step_overhead_s=1e-3, sequence_overhead_s=2e-4, layer_overhead_s=5e-6)
    assert tuned.step_overhead(4) - base.step_overhead(4) == pytest.approx(1e-3 + 4 * 2e-4)
    loads = [SequenceLoad(1, 10)]
    assert tuned.layer_pre_expert(0, loads) - base.layer_pre_expert(0, loads) == pytest.approx(5e-6)
