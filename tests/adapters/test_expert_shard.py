"""Expert parallelism inside the fast path's expert pool (ExpertShard, docs/adr/0008-expert-parallel.md),
two ranks simulated in one process: each rank's DeviceExpertPool looks up and computes only the keys it
owns (foreign pairs slot -1, the shared expert on rank 0 only), its device LRU makes the domain LRU's
decisions over `partition.split(keys)[rank]`, and the exchanged partials summed in k order are bitwise
the one-GPU pool's output on every lookup path: the one-launch decode lookup, the fused router + lookup,
the sort-based prefill lookup, the grouped path of a small pool and the streamed prefill."""

import pytest
import torch

from adapters.checkpoint.expert_layout import ExpertLayout
from adapters.checkpoint.host_bank import HostExpertBank, PartialHostExpertBank
from adapters.cuda_exec.device_residency import DeviceResidency
from adapters.cuda_exec.expert_pool import DeviceExpertPool
from adapters.cuda_exec.expert_shard import ExpertShard
from domain.expert_parallel import ExpertPartition
from domain.model_spec import WeightFormat
from domain.residency import ExpertResidency
from tests.adapters.torch_exec_models import packed_expert_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, I, L, E, K = 32, 16, 2, 12, 2
PARTITION = ExpertPartition.modulo(L, E, 2)


@pytest.fixture(scope="module")
def bank_and_shared():
    gen = torch.Generator().manual_seed(11)
    layout = ExpertLayout(WeightFormat.FP8_BLOCK, H, I)
    rows, shared = packed_expert_rows(layout, L * E, gen), packed_expert_rows(layout, L, gen)
    if DEVICE == "cuda":
        rows = rows.pin_memory()
    return HostExpertBank(layout, L, E, rows), shared


def partial(bank: HostExpertBank, rank: int) -> PartialHostExpertBank:
    """The rank's own rows only (what an expert-parallel rank loads): one copy of the experts over the ranks."""
    keys = [layer * E + e for layer in range(L) for e in PARTITION.experts_of(rank, layer)]
    rows = bank.rows[torch.tensor(keys)].contiguous()
    if DEVICE == "cuda":
        rows = rows.pin_memory()
    return PartialHostExpertBank(bank.layout, L, E, keys, rows)


class PairedShard(ExpertShard):
    """Rank 1 runs first and records every exchanged partials tensor; rank 0's all-reduce then adds the one
    rank 1 sent in the same call: the SUM of a two-rank group, in one process."""

    def __init__(self, rank: int, sent: list):
        super().__init__(PARTITION, rank, device=DEVICE)
        self.sent, self.calls = sent, 0

    def all_reduce(self, partials):
        if self.rank == 1:
            self.sent.append(partials.clone())
        else:
            partials += self.sent[self.calls]
        self.calls += 1
        self.exchanges += 1


def _inputs(tokens, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=gen).to(DEVICE)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(tokens)]).to(DEVICE)
    weights = torch.rand(tokens, K + 1, generator=gen).to(DEVICE)  # column K: the shared expert's gate
    valid = torch.ones(tokens, dtype=torch.bool, device=DEVICE)
    if tokens > 2:
        valid[1] = False
    return x, ids, weights, valid


def _domain_lookups(ref: ExpertResidency, rank: int | None, layer: int, ids, valid, slots: int) -> None:
    """What the domain LRU is asked for a layer: its (owned) distinct keys ascending, in groups of S."""
    keys = sorted({(layer, int(e)) for e in ids[valid].flatten().tolist()})
    if rank is not None:
        keys = PARTITION.split(keys)[rank]
    for start in range(0, len(keys), slots):
        ref.lookup(keys[start:start + slots])
        ref.release()


# (rows, one-GPU slots, rank slots, staging): decode-sized calls take the one-launch lookup; 6 rows x top-2 =
# 12 pairs over 8 rank slots take the sort-based lookup (a rank's layer keys, 6, fit) while one GPU's 8
# slots go grouped (12 layer keys); 4 rank slots take the grouped path too
CASES = {"decode": (3, 8, 6, 0), "sorted": (6, 8, 8, 0), "grouped": (6, 8, 4, 0), "streamed": (6, 8, 6, 4)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_ranks_sum_to_the_one_gpu_output_bitwise_and_keep_only_their_keys(bank_and_shared, case, monkeypatch):
    import adapters.cuda_exec.prefill_stream as stream

    rows, one_slots, rank_slots, staging = CASES[case]
    bank, shared = bank_and_shared
    copied: list[int] = []  # bank rows the streamed prefill copies into staging

    def spy(bank_rows, slots, keys, dst):
        copied.extend(k for k in keys.tolist() if k >= 0)
        return real_gather(bank_rows, slots, keys, dst)

    def spy_engine(bank_rows, slots, runs):  # the copy engine's runs of rows (rounds known on the host)
        copied.extend(s + i for s, _, n in runs for i in range(n))
        return real_engine(bank_rows, slots, runs)

    real_gather, real_engine = stream.gather_rows, stream.copy_engine_runs
    monkeypatch.setattr(stream, "gather_rows", spy)
    monkeypatch.setattr(stream, "copy_engine_runs", spy_engine)
    one = DeviceExpertPool(bank, one_slots, DEVICE, shared_rows=shared)
    sent: list = []
    # each rank gathers from a bank of its own keys only (row = the key's place among them)
    ranks = {r: DeviceExpertPool(partial(bank, r), rank_slots, DEVICE, shared_rows=shared, staging_slots=staging,
                                 shard=PairedShard(r, sent)) for r in (1, 0)}
    refs = {None: ExpertResidency(one_slots), 0: ExpertResidency(rank_slots), 1: ExpertResidency(rank_slots)}
    for step in range(3):
        x, ids, weights, valid = _inputs(rows, seed=10 * step + rows)
        want = [one.routed(layer, x, weights, ids, valid, shared=True) for layer in range(L)]
        got = {}
        staged = ranks[1].streaming_stats()["experts_staged"]
        copied.clear()
        for r in (1, 0):  # rank 1 first: it records what rank 0's exchange adds
            pool = ranks[r]
            if staging:
                with pool.streamed_step():
                    got[r] = [pool.routed(layer, x, weights, ids, valid, shared=True) for layer in range(L)]
                # only owned experts are staged: every copied row is one of this rank's bank
                assert copied and max(copied) < PARTITION.keys_of(r), (r, copied)
                copied.clear()
            else:
                got[r] = [pool.routed(layer, x, weights, ids, valid, shared=True) for layer in range(L)]
        if staging:
            assert 0 < ranks[1].streaming_stats()["experts_staged"] - staged <= PARTITION.keys_of(1)
        for layer in range(L):
            assert torch.equal(got[0][layer], want[layer]), (case, step, layer)  # bitwise the one-GPU output
            _domain_lookups(refs[None], None, layer, ids, valid, one_slots)
            if not staging:  # the streamed prefill leaves the residency alone
                for r in (0, 1):
                    _domain_lookups(refs[r], r, layer, ids, valid, rank_slots)
        assert ranks[0].shard.exchanges == ranks[1].shard.exchanges == L * (step + 1)
    for r, pool in ranks.items():
        order = pool.residency.lru_order()
        assert order == refs[r].lru_order(), (case, r)  # the domain LRU over the rank's own keys
        assert all(PARTITION.owns(r, key) for key in order)
        assert (pool.hits, pool.misses) == (refs[r].hits, refs[r].misses)
        pool.check_valid()
    if not staging:
        assert ranks[0].misses > 0 and ranks[1].misses > 0


def test_the_fused_router_lookup_keeps_only_owned_pairs(bank_and_shared):
    """routed_logits (moe_route_lookup): rank pools give the one-GPU pool's output once exchanged, and each
    rank's LRU is the domain's over its own keys; the shared gate weighs rank 0's shared column only."""
    bank, shared = bank_and_shared
    gen = torch.Generator().manual_seed(3)
    one = DeviceExpertPool(bank, 8, DEVICE, shared_rows=shared)
    sent: list = []
    ranks = {r: DeviceExpertPool(bank, 6, DEVICE, shared_rows=shared, shard=PairedShard(r, sent)) for r in (1, 0)}
    refs = {0: ExpertResidency(6), 1: ExpertResidency(6)}
    gate = (torch.randn(1, H, generator=gen) * 0.2).to(DEVICE)
    for _step in range(3):
        x = torch.randn(3, H, generator=gen).to(DEVICE)
        valid = torch.tensor([True, False, True], device=DEVICE)
        for layer in range(L):
            logits = (torch.randn(3, E, generator=gen) * 2).to(DEVICE)
            want = one.routed_logits(layer, x, logits, K, True, gate, valid)
            got = {r: ranks[r].routed_logits(layer, x, logits, K, True, gate, valid) for r in (1, 0)}
            assert torch.equal(got[0], want)
            top = torch.topk(torch.softmax(logits, -1), K, dim=-1).indices
            for r in (0, 1):
                _domain_lookups(refs[r], r, layer, top, valid, 6)
    for r, pool in ranks.items():
        assert pool.residency.lru_order() == refs[r].lru_order() and refs[r].misses > 0
        pool.check_valid()


def test_the_lookup_kernel_gives_foreign_pairs_slot_minus_one():
    owner = torch.tensor([r for row in PARTITION.owner for r in row], dtype=torch.int32)
    res = DeviceResidency(8, L, E, DEVICE, owner=owner, rank=1)
    ids = torch.tensor([[0, 1], [2, 3], [5, 4]], device=DEVICE)
    valid = torch.tensor([True, True, False], device=DEVICE)
    fill_keys, _, slot_ids = res.lookup_layer(1, ids, valid, shared_slot=-1)
    mine = [[PARTITION.owns(1, (1, int(e))) for e in row] for row in ids.tolist()]
    for t in range(3):
        for k in range(K):
            assert (int(slot_ids[t, k]) >= 0) == (mine[t][k] and bool(valid[t])), (t, k)
        assert int(slot_ids[t, K]) == -1  # no shared expert on this rank
    assert sorted(k for k in fill_keys.tolist() if k >= 0) == [E + e for e in (0, 2)]  # layer 1, rank 1's
    with pytest.raises(ValueError, match="belong to other ranks"):
        res.lookup([(1, 1)])
    with pytest.raises(ValueError, match=r"owner must be \[24\]"):
        DeviceResidency(8, L, E, DEVICE, owner=owner[:5], rank=1)
    res.check_valid()


def test_a_rank_pool_refuses_more_slots_than_its_keys(bank_and_shared):
    bank, _ = bank_and_shared
    with pytest.raises(ValueError, match="keys it owns"):
        DeviceExpertPool(bank, PARTITION.keys_of(1) + 1, DEVICE, shard=ExpertShard(PARTITION, 1))


def test_a_partial_bank_holds_only_its_keys_and_the_loader_builds_it(tmp_path, bank_and_shared):
    from adapters.checkpoint.loader import load_checkpoint
    from tests.adapters.torch_exec_models import QWEN3_CONFIGS, build_hf_model

    bank, _ = bank_and_shared
    mine = partial(bank, 1)
    assert mine.nbytes == PARTITION.keys_of(1) * bank.layout.row_bytes < bank.nbytes
    layer, expert = 1, PARTITION.experts_of(1, 1)[2]
    assert torch.equal(mine.row(layer, expert), bank.row(layer, expert))
    with pytest.raises(KeyError, match="not in this rank's bank"):
        mine.row(1, PARTITION.experts_of(0, 1)[0])
    with pytest.raises(ValueError, match="every key it holds"):  # rank 0's pool cannot gather from rank 1's bank
        DeviceExpertPool(mine, 4, DEVICE, shard=ExpertShard(PARTITION, 0))
    build_hf_model("qwen3_moe", QWEN3_CONFIGS["renormalised"]).save_pretrained(tmp_path)
    whole = load_checkpoint(tmp_path, progress=False)
    spec = whole.spec
    keys = [3, 5, spec.num_experts + 1]
    part = load_checkpoint(tmp_path, progress=False, expert_keys=keys)
    assert isinstance(part.experts, PartialHostExpertBank) and part.experts.rows.shape[0] == 3
    for key in keys:
        assert torch.equal(part.experts.row(*divmod(key, spec.num_experts)),
                           whole.experts.row(*divmod(key, spec.num_experts)))
