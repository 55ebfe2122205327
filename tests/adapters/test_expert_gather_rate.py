"""DeviceExpertPool.gather_rate: how fast misses land from the host bank, by the gather kernel and by the copy
engine, measured on the pool's own bank before it holds anything (session 30: an H100 host whose fill ran at
9.8 GB/s); the fast path on CUDA keeps it for /v1/stats (`executor.expert_gather`)."""

import pytest
import torch

from adapters.cuda_exec.expert_pool import DeviceExpertPool
from tests.adapters.torch_exec_models import random_fp8_bank

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, I, L, E = 32, 16, 2, 12


def test_the_rate_is_measured_on_the_bank_and_leaves_the_pool_empty():
    bank = random_fp8_bank(H, I, L, E)
    pool = DeviceExpertPool(bank, 6, DEVICE)
    rate = pool.gather_rate(rows=4)
    assert rate["rows"] == 4 and rate["bytes"] == 4 * pool.layout.row_bytes
    assert rate["kernel_gb_s"] > 0 and rate["copy_engine_gb_s"] > 0
    # both copies wrote the rows spread over the bank (every 24 // 4 = 6th) into the first slots
    for slot, row in enumerate((0, 6, 12, 18)):
        assert torch.equal(pool.slots[slot].cpu(), bank.rows[row])
    # nothing became resident: the slots it wrote are empty to the residency, and lookups count from zero
    assert bool((pool.residency.slot_of_key[:-1] < 0).all()) and (pool.hits, pool.misses) == (0, 0)
    pool.check_valid()
    assert pool.gather_rate(rows=100)["rows"] == 6  # at most the slots


def test_the_rate_is_refused_once_the_pool_holds_an_expert():
    bank = random_fp8_bank(H, I, L, E)
    pool = DeviceExpertPool(bank, 6, DEVICE)
    pool.residency.lookup_flat(torch.tensor([3], device=DEVICE), pin=False)
    with pytest.raises(ValueError, match="only for a pool that holds nothing yet"):
        pool.gather_rate()


def test_the_engine_reports_the_executors_rate_in_its_info():
    from types import SimpleNamespace

    from app.engine import Engine

    rate = {"rows": 64, "bytes": 1, "kernel_gb_s": 9.8, "copy_engine_gb_s": 52.0}
    engine = SimpleNamespace(executor=SimpleNamespace(expert_gather=rate))
    assert Engine.executor_info(engine)["expert_gather"] == rate
    assert "expert_gather" not in Engine.executor_info(SimpleNamespace(executor=SimpleNamespace()))
