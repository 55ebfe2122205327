"""Expert parallelism on the fast path, proven on the CPU with gloo and Triton's interpreter (no graphs): two
processes on 127.0.0.1 run FastExpertParallelExecutor on tiny parity models (a hybrid with a resident shared
expert, a Qwen3 without one), chunked prefill and decode steps with continuous batching, each rank looking
up and computing only its own experts; greedy tokens equal the one-process fast path's and the reference
executor's, logits are bitwise the one-process fast path's, every rank's cache holds only its keys.
A second run drives the domain scheduler on rank 0 through StepLeader with a streamed prefill and a live
resize in the middle, rank 1 following and checking its pools after every step.
The GPU test at the end captures the decode graphs with NCCL all-reduces inside (needs 2 CUDA devices).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from adapters.checkpoint.loader import load_checkpoint
from adapters.cuda_exec.executor import CudaGraphExecutor
from adapters.cuda_exec.expert_parallel import FastExpertParallelExecutor
from adapters.torch_exec.executor import TorchExecutor
from adapters.torch_exec.expert_parallel import StepLeader, follow
from domain.budget import GpuBudget, PoolPlan, PoolRequest, plan_pools
from domain.expert_parallel import ExpertParallelPlan, ExpertPartition, plan_expert_parallel
from domain.kv_pages import PageAllocator
from domain.request import Request, SamplingParams
from domain.scheduler import Scheduler, SchedulerConfig
from tests.adapters.test_expert_parallel import free_port
from tests.adapters.torch_exec_models import (
    PAGE_SIZE,
    QWEN3_5_CONFIGS,
    QWEN3_CONFIGS,
    Sequence,
    build_hf_model,
    pages_for,
    run_requests,
)

# the module's `runs` fixture (two models on one process, then two spawned ranks, all in Triton's interpreter)
# counts against its first test's limit: ~10 min with the suite's other worker on the same two cores
pytestmark = pytest.mark.timeout(1800)
MODELS = {"hybrid_3to1": ("qwen3_5_moe", QWEN3_5_CONFIGS), "renormalised": ("qwen3_moe", QWEN3_CONFIGS)}
NEW_TOKENS = 5
PROMPTS = ([3, 14, 15, 92, 65, 35, 8], [35, 89, 79], [32, 38, 46, 26, 43, 38, 32, 79, 50])


def _request(spec, slots: int, staging: int = 0) -> PoolRequest:
    return PoolRequest(kv_tokens=512, expert_slots=slots, state_slots=4, page_size=PAGE_SIZE,
                       staging_experts=staging)


def one_plan(spec, slots: int, staging: int = 0) -> PoolPlan:
    plan = plan_pools(spec, GpuBudget(total_bytes=1 << 40), _request(spec, slots, staging))
    assert isinstance(plan, PoolPlan), plan
    return plan


def ep_plan(spec, partition: ExpertPartition, slots: int, staging: int = 0) -> ExpertParallelPlan:
    plan = plan_expert_parallel(spec, GpuBudget(total_bytes=1 << 40), _request(spec, slots, staging), partition)
    assert isinstance(plan, ExpertParallelPlan), plan
    return plan


def slots_for(spec) -> int:
    return spec.top_k * 4  # every rank's pool smaller than its keys: decode lookups evict


def lockstep(executor) -> dict:
    """Three sequences, prefill chunks of 4 beside decode rows, greedy: tokens and every sampled row's logits."""
    seqs = [Sequence(f"r{i}", p, pages_for(i, len(p) + NEW_TOKENS + 1), i) for i, p in enumerate(PROMPTS)]
    record: dict = {}
    run_requests(executor, seqs, NEW_TOKENS, chunk=4, record=record)
    return {"tokens": {s.request_id: list(s.output) for s in seqs},
            "logits": {rid: torch.stack(rows) for rid, rows in record.items()}}


def scheduled(spec, run, phases, resize) -> dict:
    """Requests through the domain scheduler in two phases with resize() between them."""
    scheduler = Scheduler(SchedulerConfig(max_running=3, max_step_tokens=8, page_size=PAGE_SIZE),
                          PageAllocator(run.plan.kv_pages), run.plan.state_slots)
    out = {}
    for phase in range(phases):
        requests = [Request(f"p{phase}q{i}", [(t + phase) % spec.vocab_size for t in p],
                            SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)) for i, p in enumerate(PROMPTS)]
        for r in requests:
            scheduler.add(r)
        while (step := scheduler.schedule()) is not None:
            scheduler.complete(step, run.execute(step))
            scheduler.check_valid()
            run.check_valid()
        out.update({r.request_id: list(r.output_token_ids) for r in requests})
        if phase == 0:
            resize()
    scheduler.check_valid()
    return out


def _rank_main(rank: int, world: int, port: int, root: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results = {}
        for name in MODELS:
            ckpt = load_checkpoint(root / name, progress=False)
            spec = ckpt.spec
            partition = ExpertPartition.modulo(spec.num_layers, spec.num_experts, world)
            plan = ep_plan(spec, partition, min(slots_for(spec), partition.keys_of(1))).ranks[rank]
            ex = FastExpertParallelExecutor(ckpt, plan, partition, device="cpu", dtype=torch.float32,
                                            max_decode_rows=4, prefill_kernels=True)
            result = lockstep(ex)
            for rid in sorted(result["logits"]):  # the replicated compute is bitwise the same on every rank
                ex.check_replicas(result["logits"][rid])
            ex.check_valid()
            result.update(exchanges=ex.exchanges, misses=ex.experts.misses, resident=ex.experts.residency.lru_order(),
                          decode_rows=ex.decode_rows)
            results[name] = result
        # the scheduler on rank 0, a streamed prefill (staging rows) and a live resize broadcast by the leader
        ckpt = load_checkpoint(root / "hybrid_3to1", progress=False)
        spec = ckpt.spec
        partition = ExpertPartition.modulo(spec.num_layers, spec.num_experts, world)
        plan = ep_plan(spec, partition, 8, staging=4)
        ex = FastExpertParallelExecutor(ckpt, plan.ranks[rank], partition, device="cpu", dtype=torch.float32,
                                        max_decode_rows=4, prefill_kernels=True)
        smaller = ep_plan(spec, partition, 6, staging=4)
        if rank == 0:
            leader = StepLeader(ex)
            tokens = scheduled(spec, leader, 2, lambda: leader.resize_pools(smaller))
            leader.stop()
        else:
            tokens = {}
            assert follow(ex, after_step=lambda e: e.check_valid()) > 0
        ex.check_valid()
        results["scheduled"] = {"tokens": tokens, "slots": ex.experts.num_slots, "decode_rows": ex.decode_rows,
                                "streamed": ex.prefill_stats()["steps"], "exchanges": ex.exchanges}
        torch.save(results, root / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fast_ep")
    single = {}
    for name, (arch, configs) in MODELS.items():
        build_hf_model(arch, configs[name]).save_pretrained(root / name)
        ckpt = load_checkpoint(root / name, progress=False)
        fast = CudaGraphExecutor(ckpt, one_plan(ckpt.spec, slots_for(ckpt.spec)), "cpu", torch.float32,
                                 max_decode_rows=4, prefill_kernels=True)
        fast.short_prompt_tokens = 0  # as the ranks: expert parallelism runs no short-prompt replays (ADR 0026)
        single[name] = lockstep(fast)
        ref = TorchExecutor(ckpt, one_plan(ckpt.spec, slots_for(ckpt.spec)), "cpu", torch.float32)
        single[name]["reference_tokens"] = lockstep(ref)["tokens"]
    ckpt = load_checkpoint(root / "hybrid_3to1", progress=False)
    fast = CudaGraphExecutor(ckpt, one_plan(ckpt.spec, 16, staging=4), "cpu", torch.float32, max_decode_rows=4,
                             prefill_kernels=True)
    fast.short_prompt_tokens = 0
    single["scheduled"] = scheduled(ckpt.spec, fast, 2, lambda: fast.resize_pools(one_plan(ckpt.spec, 12, staging=4)))
    mp.start_processes(_rank_main, args=(2, free_port(), root), nprocs=2, join=True, start_method="spawn")
    return root, single, [torch.load(root / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_two_ranks_give_the_one_gpu_fast_paths_tokens_and_logits_bitwise(runs, name):
    root, single, ranks = runs
    want = single[name]
    assert want["tokens"] == want["reference_tokens"]  # the one-process fast path is the reference's
    spec = load_checkpoint(root / name, progress=False).spec
    partition = ExpertPartition.modulo(spec.num_layers, spec.num_experts, 2)
    for rank, results in enumerate(ranks):
        got = results[name]
        assert got["tokens"] == want["tokens"], f"{name} rank {rank}: greedy tokens differ"
        for rid, logits in want["logits"].items():
            assert torch.equal(got["logits"][rid], logits), f"{name} rank {rank} {rid}: not bitwise the fast path"
        # every rank's cache holds only its own keys (the domain LRU's per-rank contract is test_expert_shard's)
        assert got["resident"] and all(partition.owns(rank, key) for key in got["resident"])
        assert got["misses"] > 0 and got["decode_rows"] == 4
    assert ranks[0][name]["exchanges"] == ranks[1][name]["exchanges"] > 0  # the collectives paired up


def test_rank0_schedules_streams_and_resizes_and_rank1_follows(runs):
    _, single, ranks = runs
    lead, follower = ranks[0]["scheduled"], ranks[1]["scheduled"]
    assert lead["tokens"] == single["scheduled"] and len(lead["tokens"]) == 2 * len(PROMPTS)
    assert all(len(t) == 4 for t in lead["tokens"].values())
    for got in (lead, follower):  # the resize reached both ranks: 6 slots, so 3 decode rows (6 // top-2)
        assert got["slots"] == 6 and got["decode_rows"] == 3
        assert got["streamed"] > 0  # prefill chunks went through the staging rows
    assert lead["exchanges"] == follower["exchanges"] > 0


def _gpu_rank_main(rank: int, world: int, port: int, root: Path) -> None:
    os.environ.setdefault("TORCH_NCCL_AVOID_RECORD_STREAMS", "1")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    try:
        ckpt = load_checkpoint(root / "hybrid_3to1", progress=False, pin=True)
        spec = ckpt.spec
        partition = ExpertPartition.modulo(spec.num_layers, spec.num_experts, world)
        plan = ep_plan(spec, partition, min(slots_for(spec), partition.keys_of(1))).ranks[rank]
        ex = FastExpertParallelExecutor(ckpt, plan, partition, device=f"cuda:{rank}", dtype=torch.bfloat16,
                                        max_decode_rows=4, prefill_kernels=True)
        assert ex.graphs, "no decode graph was captured"
        result = lockstep(ex)
        ex.check_valid()
        result["exchanges"] = ex.exchanges
        torch.save({k: v for k, v in result.items() if k != "logits"} | {
            "logits": {r: t.cpu() for r, t in result["logits"].items()}}, root / f"gpu_rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_two_gpus_capture_the_exchange_in_the_decode_graphs_and_match_one_gpu(tmp_path):
    arch, configs = MODELS["hybrid_3to1"]
    build_hf_model(arch, configs["hybrid_3to1"]).save_pretrained(tmp_path / "hybrid_3to1")
    ckpt = load_checkpoint(tmp_path / "hybrid_3to1", progress=False, pin=True)
    one = CudaGraphExecutor(ckpt, one_plan(ckpt.spec, slots_for(ckpt.spec)), "cuda:0", torch.bfloat16,
                            max_decode_rows=4, prefill_kernels=True)
    one.short_prompt_tokens = 0  # as the ranks (ADR 0026)
    want = lockstep(one)
    del one
    mp.start_processes(_gpu_rank_main, args=(2, free_port(), tmp_path), nprocs=2, join=True, start_method="spawn")
    for rank in range(2):
        got = torch.load(tmp_path / f"gpu_rank{rank}.pt")
        assert got["tokens"] == want["tokens"], f"rank {rank}: greedy tokens differ from one GPU"
        for rid, logits in want["logits"].items():
            assert torch.equal(got["logits"][rid], logits.cpu()), f"rank {rank} {rid}: not bitwise one GPU"
        assert got["exchanges"] > 0


def _sync_main(rank: int, world: int, port: int, root: Path) -> None:
    from adapters.cuda_exec.expert_parallel import _autotuners, sync_autotune
    from adapters.kernels import dense_gemm, moe_down  # noqa: F401  (their autotuners exist once imported)

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        tuners = dict(_autotuners())
        down, gemm = tuners["adapters.kernels.moe_down._TUNED"], tuners["adapters.kernels.dense_gemm._TUNED"]
        for t in (down, gemm):
            t.cache.clear()
        # rank 0 and rank 1 "measured" different winners for one key; rank 1 alone tuned another key
        down.cache[(8, 64, 32, 96, 1)] = down.configs[0 if rank == 0 else 1]
        gemm.cache[(16, 128, 64, 0)] = gemm.configs[2]
        if rank == 1:
            down.cache[("only", "rank1")] = down.configs[3]
        changed = sync_autotune(rank, None)
        torch.save({"changed": changed, "down": {k: down.configs.index(v) for k, v in down.cache.items()},
                    "gemm": {k: gemm.configs.index(v) for k, v in gemm.cache.items()}}, root / f"sync{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_every_rank_adopts_rank0s_autotuned_tiles(tmp_path):
    """Near-equal tiles can win on one rank and lose on another; a different tile sums in another order, so
    the replicated compute would drift apart: sync_autotune makes rank 0's choices everyone's."""
    mp.start_processes(_sync_main, args=(2, free_port(), tmp_path), nprocs=2, join=True, start_method="spawn")
    lead, follower = (torch.load(tmp_path / f"sync{r}.pt") for r in range(2))
    assert lead["changed"] == 0 and follower["changed"] == 1  # only the disagreeing key moved
    assert follower["down"][(8, 64, 32, 96, 1)] == lead["down"][(8, 64, 32, 96, 1)] == 0
    assert follower["gemm"] == lead["gemm"] == {(16, 128, 64, 0): 2}
    assert follower["down"][("only", "rank1")] == 3  # a key rank 0 never tuned stays as measured
