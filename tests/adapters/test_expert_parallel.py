"""Expert parallelism on the reference path, proven on the CPU with gloo: 2 and 3 processes on 127.0.0.1
run the tiny parity models and the demo model with each rank computing only its own experts, and give the
single-process reference executor's greedy tokens and logits bit for bit (so well within 1e-5); every
rank's cache holds only its keys, pins nothing after a step, and the replicated compute agrees on every
rank. A second run drives the domain scheduler on rank 0 through StepLeader with the others following.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from adapters.checkpoint.loader import load_checkpoint
from adapters.torch_exec.executor import TorchExecutor
from adapters.torch_exec.expert_parallel import (
    ExpertParallelExecutor,
    PartitionedSlotCache,
    StepLeader,
    follow,
)
from domain.budget import GpuBudget, PoolRequest
from domain.expert_parallel import ExpertParallelPlan, ExpertPartition, plan_expert_parallel
from domain.kv_pages import PageAllocator
from domain.request import Request, SamplingParams
from domain.scheduler import Scheduler, SchedulerConfig
from tests.adapters.torch_exec_models import (
    PAGE_SIZE,
    QWEN3_5_CONFIGS,
    QWEN3_CONFIGS,
    Sequence,
    build_hf_model,
    make_plan,
    pages_for,
    run_requests,
)

DEMO_DIR = Path(__file__).resolve().parents[2] / "app" / "demo_model" / "checkpoint"
MODELS = [("qwen3_5_moe", "hybrid_3to1"), ("qwen3_5_moe", "alternating_mqa"), ("qwen3_moe", "renormalised")]
NEW_TOKENS = 6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sequences(ckpt, count: int = 3) -> list[Sequence]:
    vocab = ckpt.spec.vocab_size
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (9, 4, 13)[:count]]
    return [Sequence(f"r{i}", p, pages_for(i, len(p) + NEW_TOKENS + 1), i) for i, p in enumerate(prompts)]


def slots_for(ckpt) -> int:
    return ckpt.spec.top_k + 1  # fewer than one layer's experts: lookups split into groups and evict


def rank_plan(ckpt, partition: ExpertPartition, rank: int):
    plan = plan_expert_parallel(ckpt.spec, GpuBudget(total_bytes=1 << 40),
                                PoolRequest(kv_tokens=1024, expert_slots=min(slots_for(ckpt), partition.keys_of(rank)),
                                            state_slots=4, page_size=PAGE_SIZE), partition)
    assert isinstance(plan, ExpertParallelPlan), plan
    return plan.ranks[rank]


def run_model(ckpt, executor, dtype) -> dict:
    seqs, record = sequences(ckpt), {}
    run_requests(executor, seqs, NEW_TOKENS, chunk=5, record=record)
    return {"tokens": {s.request_id: list(s.output) for s in seqs},
            "logits": {rid: torch.stack(rows) for rid, rows in record.items()}}


def models(root: Path) -> list[tuple[str, Path, torch.dtype]]:
    out = [(f"{arch}/{name}", root / name, torch.float32) for arch, name in MODELS]
    if (DEMO_DIR / "model.safetensors").exists():
        out += [("demo/fp32", DEMO_DIR, torch.float32), ("demo/bf16", DEMO_DIR, torch.bfloat16)]
    return out


def _rank_main(rank: int, world: int, port: int, root: Path, driver: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results = {}
        for label, path, dtype in models(root):
            ckpt = load_checkpoint(path, progress=False)
            partition = ExpertPartition.modulo(ckpt.spec.num_layers, ckpt.spec.num_experts, world)
            executor = ExpertParallelExecutor(ckpt, rank_plan(ckpt, partition, rank), partition, dtype=dtype)
            assert isinstance(executor.experts, PartitionedSlotCache)
            if driver == "lockstep":
                result = run_model(ckpt, executor, dtype)
                for rid in sorted(result["logits"]):  # the replicated compute is bitwise the same everywhere
                    executor.check_replicas(result["logits"][rid])
            else:
                result = {"tokens": scheduled(ckpt, executor, rank)}
            cache = executor.experts
            result.update(exchanges=executor.moe.exchanges, misses=cache.misses, pinned=cache.residency.num_pinned,
                          resident=cache.residency.lru_order())
            executor.check_valid()
            results[label] = result
        torch.save(results, root / f"rank{rank}-{driver}.pt")
    finally:
        dist.destroy_process_group()


PROMPTS = ([3, 14, 15, 92, 65], [35, 89, 79], [32, 38, 46, 26, 43, 38, 32, 79, 50])


def scheduled(ckpt, executor, rank: int | None) -> dict:
    """Requests through the domain scheduler (rank 0 or one process) with the executor; followers follow."""
    if rank not in (None, 0):
        steps = follow(executor, after_step=lambda e: e.check_valid())
        assert steps > 0
        return {}
    run = StepLeader(executor) if rank == 0 else executor
    scheduler = Scheduler(SchedulerConfig(max_running=3, max_step_tokens=8, page_size=PAGE_SIZE),
                          PageAllocator(executor.plan.kv_pages), executor.plan.state_slots)
    requests = [Request(f"q{i}", [t % ckpt.spec.vocab_size for t in p],
                        SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)) for i, p in enumerate(PROMPTS)]
    for r in requests:
        scheduler.add(r)
    while (step := scheduler.schedule()) is not None:
        scheduler.complete(step, run.execute(step))
        scheduler.check_valid()
        run.check_valid()
    if rank == 0:
        run.stop()
    return {r.request_id: list(r.output_token_ids) for r in requests}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep")
    configs = {**QWEN3_5_CONFIGS, **QWEN3_CONFIGS}
    for arch, name in MODELS:
        build_hf_model(arch, configs[name]).save_pretrained(root / name)
    reference = {}
    for label, path, dtype in models(root):
        ckpt = load_checkpoint(path, progress=False)
        executor = TorchExecutor(ckpt, make_plan(ckpt, slots_for(ckpt)), "cpu", dtype)
        reference[label] = run_model(ckpt, executor, dtype)
        reference[label]["scheduled"] = scheduled(ckpt, TorchExecutor(ckpt, make_plan(ckpt, slots_for(ckpt)),
                                                                       "cpu", dtype), None)
    return root, reference


def spawn(world: int, root: Path, driver: str) -> list[dict]:
    mp.start_processes(_rank_main, args=(world, free_port(), root, driver), nprocs=world, join=True,
                       start_method="spawn")
    return [torch.load(root / f"rank{r}-{driver}.pt") for r in range(world)]


@pytest.mark.parametrize("world", [2, 3])
def test_expert_parallel_matches_the_single_process_reference_bitwise(checkpoints, world):
    root, reference = checkpoints
    ranks = spawn(world, root, "lockstep")
    for label, ref in reference.items():
        ckpt_spec = load_checkpoint(root / label.split("/")[1], progress=False).spec if not label.startswith("demo") \
            else load_checkpoint(DEMO_DIR, progress=False).spec
        partition = ExpertPartition.modulo(ckpt_spec.num_layers, ckpt_spec.num_experts, world)
        for rank, results in enumerate(ranks):
            got = results[label]
            assert got["tokens"] == ref["tokens"], f"{label} rank {rank}: greedy tokens differ"
            for rid, logits in ref["logits"].items():
                ours = got["logits"][rid]
                assert ours.dtype == torch.float32 and ours.shape == logits.shape
                rel = ((ours - logits).abs().max() / logits.abs().max()).item()
                assert rel <= 1e-5, f"{label} rank {rank} {rid}: relative logit error {rel:.3g}"
                assert torch.equal(ours, logits), f"{label} rank {rank} {rid}: not bitwise the reference"
            # every rank's cache: only its own keys, no pins left, it did miss (so it copied and evicted)
            assert got["resident"] and all(partition.owns(rank, key) for key in got["resident"])
            assert got["pinned"] == 0 and got["misses"] > 0
            assert got["exchanges"] > 0
        assert len({r[label]["exchanges"] for r in ranks}) == 1  # every rank issued the same collectives


def test_rank0_drives_the_scheduler_and_the_followers_follow(checkpoints):
    root, reference = checkpoints
    ranks = spawn(2, root, "scheduled")
    for label, ref in reference.items():
        assert ranks[0][label]["tokens"] == ref["scheduled"], label
        assert all(len(t) == 5 for t in ref["scheduled"].values())
        assert ranks[1][label]["exchanges"] == ranks[0][label]["exchanges"] > 0


def test_a_partitioned_cache_refuses_foreign_keys(checkpoints):
    root, _ = checkpoints
    ckpt = load_checkpoint(root / "hybrid_3to1", progress=False)
    partition = ExpertPartition.modulo(ckpt.spec.num_layers, ckpt.spec.num_experts, 2)
    cache = PartitionedSlotCache(ckpt.experts, 4, "cpu", partition, 1)
    mine, theirs = partition.experts_of(1, 0), partition.experts_of(0, 0)
    with pytest.raises(ValueError, match="belong to other ranks"):
        list(cache.resident_groups(0, [mine[0], theirs[0]]))
    assert cache.residency.num_resident == 0 and cache.bytes_copied == 0  # nothing looked up or copied
    for group in cache.resident_groups(0, list(mine[:2])):
        assert [e for e, _ in group] == list(mine[:2])
    cache.check_valid()
    with pytest.raises(ValueError, match="expert slots for the"):
        PartitionedSlotCache(ckpt.experts, partition.keys_of(1) + 1, "cpu", partition, 1)


def test_the_executor_needs_a_process_group(checkpoints):
    root, _ = checkpoints
    ckpt = load_checkpoint(root / "hybrid_3to1", progress=False)
    partition = ExpertPartition.modulo(ckpt.spec.num_layers, ckpt.spec.num_experts, 2)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ExpertParallelExecutor(ckpt, make_plan(ckpt, 3), partition, dtype=torch.float32)


def test_the_step_leader_forwards_the_launch_hook_to_its_executor_and_only_where_it_has_one():
    """The engine sets ModelExecutor.on_launched on what it holds (the leader, on rank 0): it must reach the
    local executor, which is the one that calls it; a local executor without the hook gives the leader none."""

    class Hooked:
        rank = 0
        on_launched = None

    class Plain:
        rank = 0

    local = Hooked()
    leader = StepLeader(local)
    assert hasattr(leader, "on_launched") and leader.on_launched is None

    def hook():
        return None

    leader.on_launched = hook
    assert local.on_launched is hook and leader.on_launched is hook
    assert not hasattr(StepLeader(Plain()), "on_launched")


def test_the_step_leader_releases_a_kept_chunk_on_every_rank_and_only_when_one_is_kept(monkeypatch):
    """ModelExecutor.release reaches the followers (each keeps the same layered chunk, running the same steps),
    through one broadcast sent only when rank 0 keeps a chunk of that request: an abort otherwise costs no
    collective. The follower's loop applies it between steps."""
    from adapters.torch_exec import expert_parallel as ep

    class Local:
        def __init__(self, rank: int, kept: str | None) -> None:
            self.rank, self.group, self.kept_request, self.released, self.steps = rank, None, kept, [], []

        def release(self, request_id: str) -> None:
            self.released.append(request_id)
            if self.kept_request == request_id:
                self.kept_request = None

        def execute(self, batch) -> dict:
            self.steps.append(batch)
            return {}

    local = Local(0, kept="r")
    leader = StepLeader(local)
    sent: list[tuple] = []
    monkeypatch.setattr(leader, "_send", sent.append)
    leader.release("other")  # rank 0 keeps no chunk of it: nothing sent, nothing to drop
    assert sent == [] and local.released == [] and local.kept_request == "r"
    leader.release("r")
    assert sent == [(ep.RELEASE, "r")] and local.released == ["r"] and local.kept_request is None
    leader.release("r")  # released already: nothing more
    assert sent == [(ep.RELEASE, "r")]

    follower = Local(1, kept="r")
    messages = iter([(ep.STEP, "batch"), (ep.RELEASE, "r"), (ep.STOP, None)])

    def broadcast(box, src, group):
        box[0] = next(messages)

    monkeypatch.setattr(ep.dist, "broadcast_object_list", broadcast)
    seen = []
    assert follow(follower, after_step=lambda e: seen.append(e.kept_request)) == 1
    assert follower.steps == ["batch"] and follower.released == ["r"] and seen == ["r", None]
