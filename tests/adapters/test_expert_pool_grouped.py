"""DeviceExpertPool.routed on prefill-sized chunks (more than GEMV_MAX_PAIRS pairs): the grouped
tensor-core GEMMs give the reference MoE (shared expert and invalid rows included), bitwise the
same whether the layer's experts fit the pool (one call) or go in groups of S (several calls)."""

import torch

from adapters.checkpoint.expert_layout import ExpertLayout
from adapters.checkpoint.host_bank import HostExpertBank
from adapters.cuda_exec.expert_pool import GEMV_MAX_PAIRS, DeviceExpertPool
from domain.model_spec import WeightFormat
from tests.adapters.test_kernels_moe import FP32_BOUND, reference, rel_err
from tests.adapters.torch_exec_models import packed_expert_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, I, L, E, K = 64, 32, 2, 24, 6


def test_prefill_chunk_runs_the_grouped_gemms_at_any_pool_size():
    gen = torch.Generator().manual_seed(3)
    layout = ExpertLayout(WeightFormat.MXFP4, H, I)
    rows = packed_expert_rows(layout, L * E, gen)
    shared = packed_expert_rows(layout, L, gen)  # [L, R]
    if DEVICE == "cuda":
        rows = rows.pin_memory()
    bank = HostExpertBank(layout, L, E, rows)
    tokens = GEMV_MAX_PAIRS // K + 5  # enough pairs for the grouped path
    x = torch.randn(tokens, H, generator=gen).to(DEVICE)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(tokens)]).to(DEVICE)  # [T, K]
    weights = torch.rand(tokens, K + 1, generator=gen).to(DEVICE)  # column K: the shared expert's gate
    valid = torch.ones(tokens, dtype=torch.bool, device=DEVICE)
    valid[[2, 7]] = False  # padding rows: no routed expert (the resident shared expert still runs)
    outs = []
    for slots in (tokens * K, 10):  # the chunk's keys fit (tensor-op lookup); groups of 10 experts
        pool = DeviceExpertPool(bank, slots, DEVICE, shared_rows=shared)
        outs.append([pool.routed(layer, x, weights, ids, valid, shared=True) for layer in range(L)])
        pool.check_valid()
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)  # bitwise: same blocks, same per-pair arithmetic, one ordered sum
    for layer, got in enumerate(outs[0]):
        # reference: the layer's experts and its shared expert side by side as one pool
        table = torch.cat((rows[layer * E:(layer + 1) * E], shared[layer:layer + 1])).to(DEVICE)  # [E+1, R]
        slot_ids = torch.cat((ids, torch.full_like(ids[:, :1], E)), 1).to(torch.int32)  # [T, K+1]
        slot_ids[~valid, :K] = -1
        assert rel_err(got, reference(x, slot_ids, weights, table, layout)[1]) < FP32_BOUND
