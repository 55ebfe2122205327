"""The host split (ADR 0030) in the decode step's one-launch lookups, residency_lookup.layer_lookup and
moe_route_lookup (Triton's interpreter on the CPU, compiled on a GPU): of a layer's m misses in ascending key
order the last domain.residency.host_split takes (those whose weight passes, ceil(rows / 4) a key, fit
host_key_count(m, p)) take no slot and are listed in host_pairs.
- a worked example, numbers by hand;
- a differential against the domain (ExpertResidency.lookup(keys, host_permille), fed the layer's pairs in
  ascending key order, a key once per row routed to it, then released) and, bit for bit, against the torch
  path (DeviceResidency.lookup_flat, the same keys): tables, stamps, clock, counters, lookup by lookup;
- host_permille 0 is the plain lookup, bit for bit; bad arguments are refused before anything is written;
- the HOST variants build for sm_90, spilling no more than the plain ones; a GPU run at the Qwen3.6
  geometry.
"""

import random
from unittest.mock import patch

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.cuda_exec.device_residency import DeviceResidency
from adapters.kernels import residency_lookup
from adapters.kernels.moe_route_lookup import moe_route_lookup
from adapters.kernels.residency_lookup import layer_lookup
from domain.residency import ExpertResidency
from tests.adapters.sm90 import build_for_sm90

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PERMILLES = (0, 1, 250, 423, 500, 999, 1000)
PATHS = ("layer", "route")


def _tables(r: DeviceResidency) -> list[torch.Tensor]:
    # NOTE: without slot_of_key's sink entry, which lookup_flat's scatters of padding write (read by nothing)
    return [v.clone() for v in (r.slot_of_key[:-1], r.key_of_slot, r.stamp, r.clock, r._counters,
                                r._host_computed)]


def _assert_same_tables(a: DeviceResidency, b: DeviceResidency) -> None:
    names = ("slot_of_key", "key_of_slot", "stamp", "clock", "counters", "host_computed")
    for name, ours, theirs in zip(names, _tables(a), _tables(b), strict=True):
        assert torch.equal(ours, theirs), name


def _logits_for(rows: list[list[int]], experts: int, rng: random.Random) -> torch.Tensor:
    """Router logits fp32 [T, E] whose top-k is each row's ids, in that order (distinct within a row)."""
    logits = torch.tensor([[rng.uniform(-3.0, -1.0) for _ in range(experts)] for _ in rows])
    for r, ids in enumerate(rows):
        for j, e in enumerate(ids):
            logits[r, e] = 8.0 - j
    return logits.to(DEVICE)


def _lookup(path: str, res: DeviceResidency, layer: int, rows: list[list[int]], valid: torch.Tensor,
            host_permille: int, rng: random.Random, shared_slot: int | None = None) -> tuple:
    """(fill_keys, fill_slots, slot_ids[:, :K], host_pairs or None) of layer `layer`'s lookup of `rows` through
    DeviceResidency.lookup_layer (the layer_lookup kernel) or route_layer (moe_route_lookup, logits chosen so
    its top-k is `rows`)."""
    k = len(rows[0])
    if path == "layer":
        out = res.lookup_layer(layer, torch.tensor(rows, device=DEVICE), valid, shared_slot,
                               host_permille=host_permille)
        fill_keys, fill_slots, slot_ids = out[:3]
    else:
        x = torch.zeros(len(rows), 8, device=DEVICE)
        out = res.route_layer(layer, _logits_for(rows, res.num_experts, rng), x, k, True, None, valid, shared_slot,
                              host_permille=host_permille)
        _, slot_ids, fill_keys, fill_slots = out[:4]
    assert len(out) == (3 if path == "layer" else 4) + (host_permille > 0)  # host_pairs only with a split
    if shared_slot is not None:
        assert slot_ids[:, k].tolist() == [shared_slot if v else -1 for v in valid.tolist()]
    return fill_keys, fill_slots, slot_ids[:, :k], out[-1] if host_permille else None


# ---------------------------------------------------------------- the worked example


@pytest.mark.parametrize("path", PATHS)
def test_worked_example_the_two_largest_of_four_misses_go_to_the_host(path):
    """S = 8, L x E = 2 x 8 (flat key = 8 * layer + expert). Resident before: flat 0..5 in slots 0..5 (stamps
    0..5), flat 8 and 9 in slots 6 and 7 (stamps 6, 7), the clock at 8. Layer 1 looks up rows [1, 4], [7, 6],
    [5, 7] and a padded row [7, 6] at 500 permille: flat 9 hits; 12, 13, 14, 15 miss, and (4 x 500 + 500) //
    1000 = 2 of them, the two largest (14, 15), are host keys. The fills take what a lookup of 9, 12, 13
    alone would: the least recently used slots 0 and 1, evicting flat 0 and 1."""
    rng = random.Random(0)
    res, ref = DeviceResidency(8, 2, 8, DEVICE), ExpertResidency(8)
    _lookup(path, res, 0, [[0, 1], [2, 3], [4, 5]], torch.ones(3, dtype=torch.bool, device=DEVICE), 0, rng)
    _lookup(path, res, 1, [[1, 0]], torch.ones(1, dtype=torch.bool, device=DEVICE), 0, rng)
    assert res.key_of_slot.tolist()[:8] == [0, 1, 2, 3, 4, 5, 8, 9] and res.counters() == (0, 8, 0)
    for keys in ([(0, e) for e in range(6)], [(1, 0), (1, 1)]):
        ref.lookup(keys)
        ref.release()

    valid = torch.tensor([True, True, True, False], device=DEVICE)
    fill_keys, fill_slots, slot_ids, host_pairs = _lookup(path, res, 1, [[1, 4], [7, 6], [5, 7], [7, 6]], valid,
                                                          500, rng, shared_slot=8)
    assert fill_keys.tolist() == [12, 13] + [-1] * 6 and fill_slots.tolist() == [0, 1] + [-1] * 6
    assert slot_ids.tolist() == [[7, 0], [-1, -1], [1, -1], [-1, -1]]
    # lane t*K + k: the host keys on every valid lane carrying them (15 twice), never on the padded row
    assert host_pairs.tolist() == [-1, -1, 15, 14, -1, 15, -1, -1]
    assert res.key_of_slot.tolist() == [12, 13, 2, 3, 4, 5, 8, 9, -1]
    assert res.slot_of_key.tolist()[14:16] == [-1, -1] and res.slot_of_key.tolist()[:2] == [-1, -1]
    # stamps: clock 8 + each key's rank among the distinct 9, 12, 13, 14, 15; host keys stamp nothing but
    # take their ticks (the clock moves by all five, as in the torch path)
    assert res.stamp.tolist()[:8] == [9, 10, 2, 3, 4, 5, 6, 8] and int(res.clock) == 13
    assert res.counters() == (1, 12, 2) and res.host_computed == 2
    res.check_valid()

    want = ref.lookup([(1, 1), (1, 4), (1, 5), (1, 6), (1, 7)], 500)
    ref.release()
    assert want.host == ((1, 6), (1, 7)) and want.fills == (((1, 4), 0), ((1, 5), 1))
    assert want.evicted == ((0, 0), (0, 1))
    assert (ref.hits, ref.misses, ref.evictions, ref.host_computed) == (*res.counters(), res.host_computed)
    assert res.lru_order() == ref.lru_order()


# ---------------------------------------------------------------- against the domain and the torch path


def _differential(path: str, num_slots: int, seed: int, with_owner: bool) -> None:
    rng = random.Random(seed)
    layers, experts, top_k, rows = 3, 10, 2, 6  # 5 or 6 rows on one key weigh 2 passes
    owner = torch.tensor([rng.randrange(2) for _ in range(layers * experts)]) if with_owner else None
    if owner is not None:
        owner[0] = 0  # rank 0 owns at least one key
    kernel = DeviceResidency(num_slots, layers, experts, DEVICE, owner=owner)
    twin = DeviceResidency(num_slots, layers, experts, DEVICE, owner=owner)  # lookup_flat, the torch path
    ref = ExpertResidency(num_slots)
    mine = (lambda f: True) if owner is None else (lambda f: int(owner[f]) == 0)
    for _step in range(5):
        live = rng.randint(1, rows)
        valid = torch.tensor([r < live for r in range(rows)], device=DEVICE)
        for layer in range(layers):
            base, p = layer * experts, rng.choice(PERMILLES)
            # distinct within a row (a top-k), repeated across rows; padded rows hold ids too. Half the layers
            # route every row alike (one prompt at temperature 0), so a key's rows reach 5-6: 2 weight passes
            alike = rng.random() < 0.5
            first = rng.sample(range(experts), top_k)
            ids = [list(first) if alike else rng.sample(range(experts), top_k) for _ in range(rows)]
            fill_keys, fill_slots, slot_ids, host_pairs = _lookup(path, kernel, layer, ids, valid, p, rng)
            # the domain and the torch path get every owned valid pair (a key once per row), ascending
            pairs = sorted(base + e for row in ids[:live] for e in row if mine(base + e))
            want = ref.lookup([divmod(f, experts) for f in pairs], p)
            ref.release()
            twin.lookup_flat(torch.tensor(pairs + [-1] * (rows * top_k - len(pairs))), pin=False,
                             host_permille=p)
            _assert_same_tables(kernel, twin)  # stamps and clock included, lookup by lookup
            fills = [(divmod(f, experts), s) for f, s in zip(fill_keys.tolist(), fill_slots.tolist(), strict=True)
                     if f >= 0]
            assert fills == list(want.fills)
            host = {base + e for (_, e) in want.host}
            want_slots = [[ref.slot_of((layer, e)) if r < live and mine(base + e) else None for e in row]
                          for r, row in enumerate(ids)]
            assert slot_ids.tolist() == [[-1 if s is None else s for s in row] for row in want_slots]
            # slot -1 on a valid, owned lane exactly where its key is a host key
            assert all((s is None) == (base + e in host) for r, row in enumerate(ids[:live])
                       for e, s in zip(row, want_slots[r], strict=True) if mine(base + e))
            if p:
                want_pairs = [base + e if r < live and base + e in host else -1 for r, row in enumerate(ids)
                              for e in row]
                assert host_pairs.tolist() == want_pairs
    assert (*kernel.counters(), kernel.host_computed) == (ref.hits, ref.misses, ref.evictions, ref.host_computed)
    assert kernel.lru_order() == ref.lru_order()
    kernel.check_valid()


@settings(max_examples=12, deadline=None)
@given(num_slots=st.integers(12, 20), seed=st.integers(0, 2**31 - 1), with_owner=st.booleans(),
       block=st.sampled_from([4, residency_lookup.VICTIM_BLOCK]))
def test_layer_lookup_host_split_matches_the_domain(num_slots, seed, with_owner, block):
    """layer_lookup: random decode steps (padded rows, ids repeated across rows, a share drawn per lookup from
    0, 1, 250, 423, 500, 999 and 1000 permille, half the runs with an owner table of two ranks, half with a
    victim scan over several blocks)."""
    with patch.object(residency_lookup, "VICTIM_BLOCK", block):
        _differential("layer", num_slots, seed, with_owner)


@settings(max_examples=8, deadline=None)
@given(num_slots=st.integers(12, 20), seed=st.integers(0, 2**31 - 1), with_owner=st.booleans(),
       block=st.sampled_from([4, residency_lookup.VICTIM_BLOCK]))
def test_route_lookup_host_split_matches_the_domain(num_slots, seed, with_owner, block):
    """moe_route_lookup, the same steps, its logits chosen so its top-k is the drawn ids."""
    with patch.object(residency_lookup, "VICTIM_BLOCK", block):
        _differential("route", num_slots, seed, with_owner)


def test_the_split_takes_effect_in_many_lookups():
    """The differential's draws are not vacuous: lookups of its size at a pool smaller than the keys see host
    keys, fills into empty slots and evictions on both paths (a guard on the test, not on the kernels)."""
    for path in PATHS:
        rng = random.Random(3)
        res = DeviceResidency(8, 3, 10, DEVICE)
        valid = torch.ones(4, dtype=torch.bool, device=DEVICE)
        for layer in (0, 1, 2, 0):
            _lookup(path, res, layer, [rng.sample(range(10), 2) for _ in range(4)], valid, 500, rng)
        hits, misses, evictions = res.counters()
        assert res.host_computed > 0 and evictions > 0 and misses > res.host_computed + evictions


@pytest.mark.parametrize("path", PATHS)
def test_six_rows_routed_alike_send_the_host_fewer_keys(path):
    """Six rows route alike to experts 1, 2, 3 of layer 0 (all miss) at 500 permille: host_key_count(3, 500) = 2
    passes of budget, and a key that six rows share needs 2 passes (ceil(6 / 4)), so only the largest, 3, is a
    host key; with four rows (1 pass a key) the two largest are, as without weights."""
    rng = random.Random(0)
    for live, host in ((6, [3]), (4, [2, 3])):
        res = DeviceResidency(18, 1, 8, DEVICE)  # the decode step's buckets hold T*K slots
        valid = torch.tensor([r < live for r in range(6)], device=DEVICE)
        fill_keys, _, slot_ids, host_pairs = _lookup(path, res, 0, [[1, 2, 3]] * 6, valid, 500, rng)
        assert [f for f in fill_keys.tolist() if f >= 0] == [k for k in (1, 2, 3) if k not in host]
        assert sorted({f for f in host_pairs.tolist() if f >= 0}) == host
        assert res.host_computed == len(host) and res.counters()[1] == 3
        want = ExpertResidency(18).lookup([(0, e) for e in (1, 2, 3)] * live, 500)
        assert [e for _, e in want.host] == host


def test_the_split_weighs_passes_of_as_many_rows_as_the_host_kernel_serves():
    """domain.residency.HOST_ROWS_PER_PASS, the rows a key's weight pass is counted for in the split, is the host
    kernel's MAX_VECTORS (fp8_block_experts.cpp): a kernel serving more or fewer rows a pass needs a new split."""
    import re
    from pathlib import Path

    from domain.residency import HOST_ROWS_PER_PASS

    source = (Path(residency_lookup.__file__).parents[1] / "host_kernels" / "fp8_block_experts.cpp").read_text()
    assert [int(v) for v in re.findall(r"constexpr int MAX_VECTORS = (\d+);", source)] == [HOST_ROWS_PER_PASS]


# ---------------------------------------------------------------- off is the plain lookup


@pytest.mark.parametrize("path", PATHS)
def test_permille_zero_is_the_plain_lookup_bit_for_bit(path):
    """host_permille=0 against the call without it: the same outputs and tables after every lookup, the same
    tuple (no host_pairs), host_computed untouched. And 1 permille, whose count rounds to 0 below 500 misses,
    makes the plain lookup's decisions too, with host_pairs all -1."""
    rng = random.Random(11)
    plain, zero, one = (DeviceResidency(9, 2, 8, DEVICE) for _ in range(3))
    for step in range(6):
        live = 1 + step % 4
        valid = torch.tensor([r < live for r in range(4)], device=DEVICE)
        ids = [rng.sample(range(8), 2) for _ in range(4)]
        seed = rng.random()
        if path == "layer":
            t_ids = torch.tensor(ids, device=DEVICE)
            want = plain.lookup_layer(step % 2, t_ids, valid)
            got = zero.lookup_layer(step % 2, t_ids, valid, host_permille=0)
        else:
            logits, x = _logits_for(ids, 8, random.Random(seed)), torch.randn(4, 8, device=DEVICE)
            want = plain.route_layer(step % 2, logits, x, 2, True, None, valid)
            got = zero.route_layer(step % 2, logits, x, 2, True, None, valid, host_permille=0)
        assert len(got) == len(want) == (3 if path == "layer" else 4)
        for ours, theirs in zip(got, want, strict=True):
            assert torch.equal(ours, theirs)
        _assert_same_tables(plain, zero)
        host_pairs = _lookup(path, one, step % 2, ids, valid, 1, random.Random(seed))[3]
        assert host_pairs.tolist() == [-1] * 8
        for name in ("slot_of_key", "key_of_slot", "stamp", "clock", "_counters"):
            assert torch.equal(getattr(one, name), getattr(plain, name)), name
    assert zero.host_computed == one.host_computed == 0 and plain.misses > 0


# ---------------------------------------------------------------- bad arguments


def _launch_args(res: DeviceResidency) -> dict:
    return dict(slot_of_key=res.slot_of_key, key_of_slot=res.key_of_slot, stamp=res.stamp, clock=res.clock,
                counters=res._counters, num_slots=res.num_slots)


# name -> (the host arguments, given a good host_count c and host_pairs p for 2 rows x top-2; whether the
# share itself is bad, which DeviceResidency's entries refuse too)
_BAD = {
    "permille -1": (lambda c, p: dict(host_permille=-1, host_count=c, host_pairs=p), True),
    "permille 1001": (lambda c, p: dict(host_permille=1001, host_count=c, host_pairs=p), True),
    "permille 2.5": (lambda c, p: dict(host_permille=2.5, host_count=c, host_pairs=p), True),
    "permille True": (lambda c, p: dict(host_permille=True, host_count=c, host_pairs=p), True),
    "permille '500'": (lambda c, p: dict(host_permille="500", host_count=c, host_pairs=p), True),
    "host_pairs missing": (lambda c, p: dict(host_permille=500, host_count=c), False),
    "host_count missing": (lambda c, p: dict(host_permille=500, host_pairs=p), False),
    "both missing": (lambda c, p: dict(host_permille=500), False),
    "outputs without a share": (lambda c, p: dict(host_permille=0, host_count=c, host_pairs=p), False),
    "host_pairs without a share": (lambda c, p: dict(host_pairs=p), False),
    "int32 host_count": (lambda c, p: dict(host_permille=500, host_count=c.int(), host_pairs=p), False),
    "short host_pairs": (lambda c, p: dict(host_permille=500, host_count=c, host_pairs=p[:3]), False),
    "int32 host_pairs": (lambda c, p: dict(host_permille=500, host_count=c, host_pairs=p.int()), False),
    "strided host_pairs": (lambda c, p: dict(host_permille=500, host_count=c, host_pairs=p.repeat(2)[::2]),
                           False),
}


@pytest.mark.parametrize("case", list(_BAD))
def test_bad_host_arguments_are_refused_before_anything_changes(case):
    """Both launchers (and for a bad share both DeviceResidency entries): a share that is not an int in
    0..1000, host_count / host_pairs missing with a share or given without one, or of the wrong dtype, length
    or layout: ValueError naming the argument, and the tables, counters and every output are as before."""
    make, bad_share = _BAD[case]
    res = DeviceResidency(8, 2, 6, DEVICE)
    valid = torch.ones(2, dtype=torch.bool, device=DEVICE)
    ids = torch.tensor([[0, 5], [3, 5]], device=DEVICE)
    logits, x = _logits_for([[0, 5], [3, 5]], 6, random.Random(0)), torch.zeros(2, 8, device=DEVICE)
    host = make(torch.zeros((), dtype=torch.int64, device=DEVICE), torch.full((4,), 7, dtype=torch.int64,
                                                                              device=DEVICE))
    outputs = [torch.full((4,), 9, dtype=torch.int64, device=DEVICE) for _ in range(2)]
    outputs.append(torch.full((2, 2), 9, dtype=torch.int32, device=DEVICE))
    before = _tables(res) + [v.clone() for v in host.values() if isinstance(v, torch.Tensor)]
    match = "host_permille|host_count|host_pairs"
    with pytest.raises(ValueError, match=match):
        layer_lookup(ids, valid, 0, **_launch_args(res), fill_keys=outputs[0], fill_slots=outputs[1],
                     slot_ids=outputs[2], **host)
    with pytest.raises(ValueError, match=match):
        moe_route_lookup(logits, x, 2, True, None, valid, 0, **_launch_args(res), **host)
    if bad_share:
        with pytest.raises(ValueError, match="host_permille"):
            res.lookup_layer(0, ids, valid, host_permille=host["host_permille"])
        with pytest.raises(ValueError, match="host_permille"):
            res.route_layer(0, logits, x, 2, True, None, valid, host_permille=host["host_permille"])
    after = _tables(res) + [v for v in host.values() if isinstance(v, torch.Tensor)]
    for ours, theirs in zip(after, before, strict=True):
        assert torch.equal(ours, theirs)
    assert all(bool(out.eq(9).all()) for out in outputs)


# ---------------------------------------------------------------- compiled


_SM90_HOST = r"""
import json

import tests.adapters.sm90_usage as usage
from adapters.kernels import moe_route_lookup, residency_lookup

HOST = {"host_permille": "i32", "host_count_ptr": "*i64", "host_pairs_ptr": "*i64"}
# the host split's runtime arguments carry defaults (a plain build or launch need not name them), which
# with_defaults would bind as constexprs: with HOST on they are typed arguments instead
_bind = usage.with_defaults
usage.with_defaults = lambda fn, consts: {k: v for k, v in _bind(fn, consts).items()
                                          if not (consts.get("HOST") and k in HOST)}
LOOKUP = {"ids_ptr": "*i64", "valid_ptr": "*i1", "slot_of_ptr": "*i64", "key_of_ptr": "*i64", "stamp_ptr": "*i64",
          "clock_ptr": "*i64", "counters_ptr": "*i64", "fill_keys_ptr": "*i64", "fill_slots_ptr": "*i64",
          "slot_ids_ptr": "*i32", "owner_ptr": "*i32"}
ROUTE = {"logits_ptr": "*fp32", "x_ptr": "*bf16", "g_ptr": "*bf16", "valid_ptr": "*i1", "wout_ptr": "*fp32",
         "slot_ids_ptr": "*i32", "slot_of_ptr": "*i64", "key_of_ptr": "*i64", "stamp_ptr": "*i64",
         "clock_ptr": "*i64", "counters_ptr": "*i64", "fill_keys_ptr": "*i64", "fill_slots_ptr": "*i64",
         "owner_ptr": "*i32"}
out = {}
for host in (False, True):
    types = {**LOOKUP, **HOST} if host else LOOKUP
    for block_n in (16, 128):  # 1-2 rows of top-8 and the 16-row bucket
        out[f"lookup{block_n}_{host}"] = usage.resource_usage(
            residency_lookup._layer_lookup_kernel, types,
            dict(K=8, KO=9, HAS_OWNER=True, BLOCK_N=block_n, BLOCK_S=residency_lookup.VICTIM_BLOCK, HOST=host),
            {"num_warps": 8 if block_n >= 64 else 4})
    types = {**ROUTE, **HOST} if host else ROUTE
    for block_t, block_e in ((1, 256), (4, 256), (2, 512), (16, 256)):  # the fused kernel's tiles, up to MAX_TILE
        out[f"route{block_t}x{block_e}_{host}"] = usage.resource_usage(
            moe_route_lookup._moe_route_lookup_kernel, types,
            dict(K=8, KO=9, KS=9, HAS_GATE=True, HAS_OWNER=False, ROUND_GATE=True, RENORM=True, BLOCK_T=block_t,
                 BLOCK_E=block_e, BLOCK_G=min(2048, 8192 // block_t), BLOCK_K=16, BLOCK_R=8,
                 BLOCK_N=max(16, 8 * block_t), BLOCK_S=residency_lookup.VICTIM_BLOCK, HOST=host),
            {"num_warps": 4 if block_t * block_e <= 2048 else 8})
print(json.dumps(out))
"""


# ptxas, 2026-12-07 (session 41: the split weighing passes), REG / STACK bytes a thread, plain -> HOST. Triton 3.9:
# lookup 16 lanes 72/0 -> 64/8, 128 lanes 255/40 both; route 1x256 114/0 -> 106/0, 4x256 168/24 -> 168/32, 2x512
# 119/0 -> 121/0, 16x256 231/0 -> 238/0. Triton 3.6 (the device's, FT_SM90_TRITON): lookup 16 lanes 128/0 both,
# 128 lanes 255/104 -> 255/64 (a suffix sum by rank as a [BN, BN] tile made it 352: measured on the H100 machine);
# route 1x256 128/0 both, 4x256 192/0 -> 204/0, 2x512 127/0 both, 16x256 255/472 -> 255/648 (a tile the decode step
# does not take: `pays`)
_STACK_SLACK = 32  # ptxas' choices move by a few words either way (3.9's 16 lanes: 8 B more at 8 fewer registers)


@pytest.mark.slow
def test_host_variants_build_for_sm90_and_spill_no_more_than_the_plain_lookup():
    """The interpreter proves the decisions, not the build: both kernels with HOST on and off build for sm_90 at
    the decode shapes (the lookup's 16 and 128 lanes, the fused kernel's tiles up to MAX_TILE) within an SM's
    shared memory, and where the decode step runs them (the lookup, the fused tiles `pays` admits) the host
    split adds at most _STACK_SLACK bytes of spill stack a thread to the plain build's."""
    import json

    from adapters.kernels.moe_route_lookup import pays

    usage = json.loads(build_for_sm90(_SM90_HOST, timeout=600).strip().splitlines()[-1])
    assert len(usage) == 12 and all(found["SMEM"] <= 227 * 1024 for found in usage.values()), usage
    for name in {name.rsplit("_", 1)[0] for name in usage}:
        if name.startswith("route") and not pays(*map(int, name[len("route"):].split("x"))):
            continue
        plain, host = usage[f"{name}_False"], usage[f"{name}_True"]
        assert host["STACK"] <= plain["STACK"] + _STACK_SLACK, (name, plain, host)


# ---------------------------------------------------------------- on the GPU, the Qwen3.6 geometry


@pytest.mark.gpu
# route at 8 rows: the tile that counted lanes twice when its ids were flattened by tl.reshape (session 42, H100)
@pytest.mark.parametrize(("path", "rows"), [("layer", 1), ("layer", 16), ("route", 1), ("route", 4),
                                           ("route", 8)])
def test_host_split_at_the_qwen3_6_geometry_on_gpu(path, rows):
    """40 layers x 256 experts, top-8, 5,632 slots (a 24 GiB pool's size: the victim scan crosses blocks of
    VICTIM_BLOCK), the balanced 423 permille, compiled: the pool filled with layers 0..21, then steps over every
    layer that hit, miss and evict; the tables against the torch path bit for bit, host pairs and counters
    against the domain."""
    rng = random.Random(rows)
    layers, experts, top_k, slots = 40, 256, 8, 5632
    kernel, twin = (DeviceResidency(slots, layers, experts, "cuda") for _ in range(2))
    ref = ExpertResidency(slots)
    for res in (kernel, twin):
        res.lookup_flat(torch.arange(slots), pin=False)
    ref.lookup([divmod(f, experts) for f in range(slots)])
    ref.release()
    valid = torch.ones(rows, dtype=torch.bool, device="cuda")
    for _step in range(2):
        for layer in range(layers):
            ids = [rng.sample(range(experts), top_k) for _ in range(rows)]
            _, _, slot_ids, host_pairs = _lookup(path, kernel, layer, ids, valid, 423, rng)
            pairs = sorted(layer * experts + e for row in ids for e in row)  # a key once per row (its weight)
            want = ref.lookup([divmod(f, experts) for f in pairs], 423)
            ref.release()
            twin.lookup_flat(torch.tensor(pairs, device="cuda"), pin=False, host_permille=423)
            _assert_same_tables(kernel, twin)
            host = {layer * experts + e for (_, e) in want.host}
            assert host_pairs.tolist() == [layer * experts + e if layer * experts + e in host else -1
                                           for row in ids for e in row]
            assert torch.equal(slot_ids.flatten() < 0, host_pairs >= 0)
    assert (*kernel.counters(), kernel.host_computed) == (ref.hits, ref.misses, ref.evictions, ref.host_computed)
    assert ref.host_computed > 0 and ref.evictions > 0 and ref.hits > 0
