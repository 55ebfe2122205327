"""`ft serve --staging-experts` (docs/adr/0010-streamed-prefill.md): checked, planned where the fast path
runs (auto) or as asked, a default that does not fit dropped, an explicit one refused by name; the
pools snapshot carries the executor's streamed-prefill stats."""

import pytest

from app.cli import _count_or_auto
from app.containers import _pool_plan
from app.pool_snapshot import PoolPublisher, prefill_streaming
from app.settings import ServeSettings
from app.stats import ServingStats
from domain.budget import GpuBudget
from tests.app.conftest import TINY_SPEC


def test_the_option_parses_and_is_checked():
    assert _count_or_auto("auto") is None and _count_or_auto("64") == 64
    with pytest.raises(ValueError, match="--staging-experts"):
        ServeSettings(staging_experts=-1)


def test_auto_staging_is_planned_for_the_fast_path_only_and_dropped_when_it_does_not_fit():
    settings = ServeSettings(kv_tokens=1024, moe_slots=8, max_running_requests=4, cache_type="none")
    roomy = GpuBudget(total_bytes=1 << 30, memory_ratio=1.0)
    assert _pool_plan(settings, TINY_SPEC, roomy).staging_experts == 0  # CPU: the reference executor
    assert _pool_plan(ServeSettings(kv_tokens=1024, moe_slots=8, cache_type="none", executor="reference"),
                      TINY_SPEC, roomy, "cuda").staging_experts == 0
    # the reference prefill goes through the expert cache: no staging unless the Triton prefill is on (explicitly,
    # or --prefill-kernels auto on a validated format: tests/app/test_prefill_auto.py)
    reference = ServeSettings(kv_tokens=1024, moe_slots=8, max_running_requests=4, cache_type="none",
                              prefill_kernels="reference")
    assert _pool_plan(reference, TINY_SPEC, roomy, "cuda").staging_experts == 0
    settings = ServeSettings(kv_tokens=1024, moe_slots=8, max_running_requests=4, cache_type="none",
                             prefill_kernels="triton")
    fast = _pool_plan(settings, TINY_SPEC, roomy, "cuda")
    assert fast.staging_experts > 0 and fast.staging_bytes == fast.staging_experts * TINY_SPEC.expert_bytes()
    tight = GpuBudget(total_bytes=fast.used_bytes - 1, memory_ratio=1.0)
    assert _pool_plan(settings, TINY_SPEC, tight, "cuda").staging_experts == 0  # started without (and logged)
    explicit = ServeSettings(kv_tokens=1024, moe_slots=8, cache_type="none", staging_experts=fast.staging_experts)
    assert _pool_plan(explicit, TINY_SPEC, roomy).staging_experts == fast.staging_experts  # as asked, anywhere
    with pytest.raises(ValueError, match="staging"):
        _pool_plan(explicit, TINY_SPEC, tight, "cuda")


class _Streaming:
    def __init__(self):
        self.calls = 0

    def prefill_stats(self):
        self.calls += 1
        return {"steps": self.calls, "pcie_bound_s": 0.5}

    def expert_counters(self):
        return 0, 0


class _Batch:
    def __init__(self, prefill):
        self.num_prefill_tokens, self.num_decode_tokens = prefill, 1
        self.works, self.layered = (None,) * (1 + bool(prefill)), None


def test_the_pools_snapshot_carries_the_streamed_prefill_stats_read_after_prefill_steps():
    executor = _Streaming()
    publisher = PoolPublisher(ServingStats(), executor)
    assert executor.calls == 1
    publisher.record_step(_Batch(0), 0.01)  # a decode step: no read
    publisher.record_step(_Batch(5), 0.01)
    assert executor.calls == 2
    assert prefill_streaming(object()) is None  # an executor without streaming: null in the snapshot
