"""DeviceResidency (the slot table as tensors) against the domain LRU specification: the shared
differential contract, plus layer-style lookups with padding as the decode step issues them."""

import random
from unittest.mock import patch

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.cuda_exec.device_residency import DeviceResidency
from adapters.kernels import residency_lookup
from domain.residency import ExpertResidency
from tests.contracts.residency_contract import lookup_decisions, residency_contract_machine

LAYERS, EXPERTS = 3, 5
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel runs in Triton's interpreter on the CPU

TestDeviceResidencyContract = residency_contract_machine(
    lambda num_slots: DeviceResidency(num_slots, LAYERS, EXPERTS), with_host=True).TestCase
TestDeviceResidencyContract.settings = settings(max_examples=150, stateful_step_count=25, deadline=None)


@settings(max_examples=60, deadline=None)
@given(num_slots=st.integers(8, 24), seed=st.integers(0, 2**31 - 1))
def test_layer_lookups_with_padding_match_the_domain(num_slots, seed):
    """The decode pattern: per layer, top-k ids of a padded batch, sorted distinct order, no pins kept.
    Padded rows (-1) never route, never miss and never evict."""
    rng = random.Random(seed)
    layers, experts, top_k = 4, 12, 2
    ref, dev = ExpertResidency(num_slots), DeviceResidency(num_slots, layers, experts)
    for _step in range(12):
        batch = rng.randint(1, 4)
        padded = 4
        for layer in range(layers):
            ids = [[rng.randrange(experts) for _ in range(top_k)] for _ in range(batch)]
            distinct = sorted({e for row in ids for e in row})
            expected = ref.lookup([(layer, e) for e in distinct])
            ref.release()
            flat = torch.full((padded * top_k,), -1, dtype=torch.int64)
            flat[: len(distinct)] = torch.tensor([layer * experts + e for e in distinct])
            found = dev.lookup_flat(flat, pin=False)
            fills = [(divmod(k, experts), s) for k, s in zip(found.fill_keys.tolist(), found.fill_slots.tolist(),
                                                               strict=True) if k >= 0]
            assert fills == list(expected.fills)
            assert [divmod(k, experts) for k in found.evicted.tolist() if k >= 0] == list(expected.evicted)
            assert found.slots.tolist()[: len(distinct)] == list(expected.slots)
            assert found.slots.tolist()[len(distinct):] == [-1] * (padded * top_k - len(distinct))
    assert (dev.hits, dev.misses, dev.evictions) == (ref.hits, ref.misses, ref.evictions)
    assert dev.lru_order() == ref.lru_order()
    dev.check_valid()


def test_lookup_decisions_are_plain_tuples():
    dev = DeviceResidency(2, LAYERS, EXPERTS)
    got = lookup_decisions(dev.lookup([(0, 1), (0, 1), (2, 4)]))
    assert got == ((0, 0, 1), (), (((0, 1), 0), ((2, 4), 1)), ())


@settings(max_examples=25, deadline=None)
@given(num_slots=st.integers(8, 20), seed=st.integers(0, 2**31 - 1))
def test_layer_lookup_kernel_matches_the_domain(num_slots, seed):
    """The one-launch lookup kernel (Triton's interpreter here) against the domain LRU: fills, evictions,
    every entry's slot (duplicates and padded rows included), counters and the LRU order."""
    _layer_lookups_match_the_domain(num_slots, seed)


@settings(max_examples=15, deadline=None)
@given(num_slots=st.integers(9, 20), block=st.sampled_from([1, 2, 4, 8]), seed=st.integers(0, 2**31 - 1))
def test_layer_lookup_kernel_scanning_victims_in_several_blocks_matches_the_domain(num_slots, block, seed):
    """The same with the victim scan's block narrower than the pool (as a 24 GiB pool's ~5.5k slots are
    wider than VICTIM_BLOCK): the smallest stamp is found across blocks, whichever block holds it."""
    with patch.object(residency_lookup, "VICTIM_BLOCK", block):
        _layer_lookups_match_the_domain(num_slots, seed)


def _layer_lookups_match_the_domain(num_slots: int, seed: int) -> None:
    rng = random.Random(seed)
    layers, experts, top_k, rows = 3, 10, 2, 4
    ref, dev = ExpertResidency(num_slots), DeviceResidency(num_slots, layers, experts, DEVICE)
    for _step in range(6):
        live = rng.randint(1, rows)
        for layer in range(layers):
            # the router's [T, K+1] output sliced to [T, K] half the time: a strided view, read in place
            wide = torch.tensor([[rng.randrange(experts) for _ in range(top_k + 1)] for _ in range(rows)],
                                device=DEVICE)
            ids = wide[:, :top_k] if rng.random() < 0.5 else wide[:, :top_k].contiguous()
            valid = torch.tensor([r < live for r in range(rows)], device=DEVICE)
            distinct = sorted({int(e) for e in ids[:live].flatten().tolist()})
            expected = ref.lookup([(layer, e) for e in distinct])
            ref.release()
            shared = num_slots + layer if layer % 2 else None  # a resident shared expert's slot as column K
            fill_keys, fill_slots, slot_ids = dev.lookup_layer(layer, ids, valid, shared)
            fills = [(divmod(k, experts), s) for k, s in zip(fill_keys.tolist(), fill_slots.tolist(), strict=True)
                     if k >= 0]
            assert fills == list(expected.fills)
            want = [[ref.slot_of((layer, e)) if r < live else -1 for e in ids[r].tolist()]
                    + ([] if shared is None else [shared if r < live else -1]) for r in range(rows)]
            assert slot_ids.tolist() == want
    assert (dev.hits, dev.misses, dev.evictions) == (ref.hits, ref.misses, ref.evictions)
    assert dev.lru_order() == ref.lru_order()
    dev.check_valid()


@settings(max_examples=40, deadline=None)
@given(num_slots=st.integers(4, 24), seed=st.integers(0, 2**31 - 1))
def test_presorted_lookup_makes_the_sorting_lookups_decisions(num_slots, seed):
    """The prefill's call: a layer's keys with repeats, sorted ascending with the padding as one run at the
    end; presorted=True skips the lookup's own sort and must leave the same decisions and tables."""
    rng = random.Random(seed)
    layers, experts = 3, 9
    plain, fast = DeviceResidency(num_slots, layers, experts), DeviceResidency(num_slots, layers, experts)
    for _step in range(8):
        layer = rng.randrange(layers)
        keys = sorted(layer * experts + rng.randrange(experts) for _ in range(rng.randint(1, 3 * num_slots)))
        flat = torch.tensor(keys + [-1] * rng.randint(0, 5), dtype=torch.int64)
        if len(set(keys)) > num_slots:
            continue  # more distinct keys than slots: a lookup the caller never makes
        want, got = plain.lookup_flat(flat, pin=False), fast.lookup_flat(flat, pin=False, presorted=True)
        for name in ("slots", "fill_keys", "fill_slots", "evicted"):
            assert torch.equal(getattr(want, name), getattr(got, name)), name
        for table in ("slot_of_key", "key_of_slot", "stamp", "pinned", "clock"):
            assert torch.equal(getattr(plain, table), getattr(fast, table)), table
    assert plain.counters() == fast.counters()


def test_narrow_keys_picks_the_narrowest_type_and_keeps_the_stable_order():
    from adapters.kernels.moe_align import narrow_keys

    keys = torch.tensor([5, -1, 3, 5, 0, 3, -1, 10239])
    assert narrow_keys(keys, 10240).dtype == torch.int16 and narrow_keys(keys, 2**15).dtype == torch.int32
    assert narrow_keys(keys, 2**31).dtype == torch.int64
    assert torch.equal(narrow_keys(keys, 10240).to(torch.int64), keys)
    assert torch.equal(torch.sort(narrow_keys(keys, 10240), stable=True).indices, torch.sort(keys, stable=True).indices)
    with pytest.raises(ValueError):
        narrow_keys(keys, -1)
