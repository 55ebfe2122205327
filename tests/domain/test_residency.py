"""ExpertResidency: worked examples, then the differential contract against a list-based shadow."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from domain.residency import (
    ExpertResidency,
    Lookup,
    ResidencyExhausted,
    host_key_count,
    host_split,
    host_weight_passes,
)
from tests.contracts.residency_contract import residency_contract_machine, run_residency_contract


class ListResidency:
    """Trivially correct shadow: a plain list ordered by recency, rescanned on every decision."""

    def __init__(self, num_slots):
        self.num_slots = num_slots
        self.order = []  # resident keys, least recently used first
        self.slot = {}
        self.pinned = set()
        self.hits = self.misses = self.evictions = 0

    def can_lookup(self, keys):
        distinct = set(keys)
        return len(distinct) <= self.num_slots - len(self.pinned - distinct)

    def lookup(self, keys):
        if not self.can_lookup(keys):
            raise RuntimeError("does not fit")
        requested = set(keys)
        hits, fills, evicted, seen = [], [], [], set()
        for key in keys:
            if key in seen:
                continue
            seen.add(key)
            if key in self.slot:
                hits.append(key)
            else:
                free = [s for s in range(self.num_slots) if s not in self.slot.values()]
                if free:
                    slot = min(free)
                else:
                    victim = [k for k in self.order if k not in self.pinned and k not in requested][0]
                    self.order.remove(victim)
                    slot = self.slot.pop(victim)
                    evicted.append(victim)
                self.slot[key] = slot
                fills.append((key, slot))
            if key in self.order:
                self.order.remove(key)
            self.order.append(key)
        self.pinned |= requested
        self.hits += len(hits)
        self.misses += len(fills)
        self.evictions += len(evicted)
        return Lookup(tuple(self.slot[k] for k in keys), tuple(hits), tuple(fills), tuple(evicted))

    def release(self, keys=None):
        self.pinned = set() if keys is None else self.pinned - set(keys)

    def slot_of(self, key):
        return self.slot.get(key)

    def can_resize(self, num_slots):
        return not self.pinned

    def resize(self, num_slots):
        self.num_slots, self.order, self.slot = num_slots, [], {}

    def check_valid(self):
        assert sorted(self.slot) == sorted(self.order)


# ---- worked examples -------------------------------------------------------------------


def test_cold_misses_take_lowest_slots_and_duplicates_collapse():
    res = ExpertResidency(3)
    got = res.lookup([(0, 7), (0, 2), (0, 7)])
    assert got == Lookup(slots=(0, 1, 0), hits=(), fills=(((0, 7), 0), ((0, 2), 1)), evicted=())
    assert (res.hits, res.misses, res.evictions) == (0, 2, 0)
    res.check_valid()


def test_hit_refreshes_recency_so_the_other_key_is_evicted():
    res = ExpertResidency(2)
    res.lookup([(0, 0), (0, 1)])
    res.release()
    assert res.lookup([(0, 0)]).hits == ((0, 0),)
    res.release()
    got = res.lookup([(1, 5)])
    assert got.evicted == ((0, 1),) and got.fills == (((1, 5), 1),)
    assert res.lru_order() == ((0, 0), (1, 5))


def test_pinned_key_is_never_evicted_even_when_oldest():
    res = ExpertResidency(2)
    res.lookup([(0, 0)])  # pinned, oldest
    res.lookup([(0, 1)])
    res.release([(0, 1)])
    got = res.lookup([(0, 2)])
    assert got.evicted == ((0, 1),)
    assert res.slot_of((0, 0)) == 0


def test_requested_key_is_not_victim_of_an_earlier_miss_in_the_same_lookup():
    res = ExpertResidency(2)
    res.lookup([(0, 0), (0, 1)])
    res.release()
    # (0, 0) is the LRU key, but it is requested after the miss, so (0, 1) must go.
    got = res.lookup([(0, 9), (0, 0)])
    assert got.evicted == ((0, 1),) and got.hits == ((0, 0),)


def test_unsatisfiable_lookup_raises_and_changes_nothing():
    res = ExpertResidency(2)
    res.lookup([(0, 0)])
    assert not res.can_lookup([(0, 1), (0, 2)])
    before = (res.lru_order(), res.hits, res.misses, res.evictions)
    with pytest.raises(ResidencyExhausted, match="2 distinct experts cannot fit: 2 slots, 1 pinned"):
        res.lookup([(0, 1), (0, 2)])
    assert (res.lru_order(), res.hits, res.misses, res.evictions) == before
    assert res.can_lookup([(0, 0), (0, 1)])  # the pinned key itself does not count against it


def test_release_errors_and_release_all():
    res = ExpertResidency(2)
    res.lookup([(0, 0), (0, 1)])
    with pytest.raises(ValueError, match="not pinned"):
        res.release([(0, 0), (3, 3)])
    assert res.is_pinned((0, 0)), "a rejected release must not unpin anything"
    assert not res.can_release([(3, 3)])
    res.release(None)
    assert res.num_pinned == 0


@pytest.mark.parametrize("bad", [(0,), (0, -1), [0, 1], (0, 1.0), (True, 0), "ab"])
def test_bad_keys_are_rejected(bad):
    res = ExpertResidency(2)
    with pytest.raises(ValueError, match="expert key"):
        res.lookup([bad])


def test_resize_starts_cold_keeps_counters_and_is_refused_while_pinned():
    res = ExpertResidency(2)
    res.lookup([(0, 0), (0, 1)])
    assert not res.can_resize(4)
    with pytest.raises(RuntimeError, match="pinned"):
        res.resize(4)
    res.release()
    res.resize(4)
    assert (res.num_slots, res.num_resident, res.misses) == (4, 0, 2)
    assert res.lookup([(0, 0)]).fills == (((0, 0), 0),)
    res.check_valid()
    with pytest.raises(ValueError):
        ExpertResidency(-1)


# ---- host expert compute (ADR 0030) -------------------------------------------------------


def test_host_share_takes_the_last_misses_which_get_no_slot():
    res = ExpertResidency(4)
    res.lookup([(0, 1)])
    res.release()
    # misses in request order: (0, 5), (0, 6), (0, 7), (0, 8): 4 x 500 / 1000 = 2 on the host, the last two
    keys = [(0, 5), (0, 1), (0, 6), (0, 7), (0, 8), (0, 7)]
    assert not res.can_lookup(keys) and res.can_lookup(keys, host_permille=500)  # 5 distinct, 3 need a slot
    got = res.lookup([(0, 5), (0, 1), (0, 6), (0, 7), (0, 8), (0, 7)], host_permille=500)
    assert got == Lookup(slots=(1, 0, 2, -1, -1, -1), hits=((0, 1),), fills=(((0, 5), 1), ((0, 6), 2)),
                         evicted=(), host=((0, 7), (0, 8)))
    assert res.slot_of((0, 7)) is None and not res.is_pinned((0, 8))
    assert (res.hits, res.misses, res.evictions, res.host_computed) == (1, 5, 0, 2)
    res.check_valid()


@pytest.mark.parametrize("misses,permille,host", [(4, 423, 2), (3, 423, 1), (3, 155, 0), (4, 125, 1), (3, 500, 2),
                                                  (0, 1000, 0), (7, 0, 0), (7, 1000, 7), (1, 499, 0), (1, 500, 1)])
def test_host_key_count_rounds_half_up(misses, permille, host):
    assert host_key_count(misses, permille) == host


def test_host_share_rounds_and_evicts_only_for_fills():
    res = ExpertResidency(2)
    res.lookup([(0, 0), (0, 1)])
    res.release()
    got = res.lookup([(1, 0), (1, 1), (1, 2)], host_permille=400)  # 3 x 0.4 = 1.2: 1 host key
    assert got.host == ((1, 2),) and got.evicted == ((0, 0), (0, 1))
    res.release()
    every = res.lookup([(2, 0), (2, 1)], host_permille=1000)  # all misses on the host: the pool is untouched
    assert every.host == ((2, 0), (2, 1)) and every.fills == () and res.lru_order() == ((1, 0), (1, 1))


@pytest.mark.parametrize("bad", [-1, 1001, 0.5, True, "500"])
def test_host_permille_outside_0_to_1000_is_refused(bad):
    res = ExpertResidency(2)
    with pytest.raises(ValueError, match="host_permille"):
        res.lookup([(0, 0)], host_permille=bad)
    assert res.misses == 0 and res.num_resident == 0


_keys = st.lists(st.tuples(st.integers(0, 2), st.integers(0, 5)), min_size=1, max_size=8)


@given(slots=st.integers(4, 10), rounds=st.lists(st.tuples(_keys, st.integers(0, 1000)), max_size=12))
@settings(max_examples=300, deadline=None)
def test_a_host_lookup_decides_the_slots_as_a_plain_lookup_without_its_host_keys(slots, rounds):
    # the host keys are non-resident, so leaving them out changes no victim: every slot decision of
    # lookup(keys, p) equals plain lookup(keys minus its host keys), and the pools stay identical
    shared, plain = ExpertResidency(slots), ExpertResidency(slots)
    for keys, permille in rounds:
        if not shared.can_lookup(keys):
            continue
        got = shared.lookup(keys, host_permille=permille)
        host = set(got.host)
        assert not host & {k for k, _ in got.fills} and not host & set(got.hits)
        assert all(shared.slot_of(k) is None for k in host)
        missing = [k for k in dict.fromkeys(keys) if k in host or k in {f for f, _ in got.fills}]
        assert len(host) == host_split([keys.count(k) for k in missing], permille)
        ref = plain.lookup([k for k in keys if k not in host])
        assert (got.hits, got.fills, got.evicted) == (ref.hits, ref.fills, ref.evicted)
        assert [s for k, s in zip(keys, got.slots, strict=True) if k not in host] == list(ref.slots)
        assert shared.lru_order() == plain.lru_order()
        shared.check_valid()
        shared.release()
        plain.release()
    assert shared.misses == plain.misses + shared.host_computed


# ---- differential contract -------------------------------------------------------------


def test_contract_domain_against_list_shadow():
    run_residency_contract(ListResidency, max_examples=400, stateful_step_count=30)


# The domain class against itself: catches hidden shared state and nondeterminism.
TestContractSelf = residency_contract_machine(ExpertResidency, with_host=True).TestCase
TestContractSelf.settings = settings(max_examples=100, stateful_step_count=20, deadline=None)


@pytest.mark.parametrize("rows,passes", [(0, 0), (1, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_host_weight_passes_serve_four_rows_a_pass(rows, passes):
    assert host_weight_passes(rows) == passes


@pytest.mark.parametrize("miss_rows,permille,host", [
    ([1, 1, 1, 1], 500, 2),  # one row a key (bs1): host_key_count(4, 500) = 2
    ([4, 4, 4, 4], 500, 2),  # four rows alike: one pass a key, the same split
    ([6, 6, 6, 6], 500, 1),  # six rows alike: two passes a key, a budget of 2 passes takes one key
    ([6, 6, 6], 423, 0),  # budget 1 pass (3 x 0.423 = 1.27), the last key needs 2: none
    ([1, 1, 6], 700, 1),  # the last miss takes the whole budget of 2 passes
    ([1, 1, 9], 700, 0),  # the last miss alone is over the budget (3 passes): the run stops there
    ([6, 1, 1], 700, 2),  # the last two fit in 2 passes, the third would not
    ([2, 5, 1, 1, 1], 1000, 4),  # every miss: 5 keys, 6 passes over a budget of 5
])
def test_host_split_takes_the_last_misses_within_the_pass_budget(miss_rows, permille, host):
    assert host_split(miss_rows, permille) == host
    if all(r <= 4 for r in miss_rows):
        assert host == host_key_count(len(miss_rows), permille)


def test_a_lookup_weighs_a_key_by_the_rows_that_repeat_it():
    # six rows routed alike at 500 per mille: 3 misses, a budget of 2 passes; each key needs 2, so one host key
    res = ExpertResidency(8)
    got = res.lookup([(0, 1), (0, 2), (0, 3)] * 6, host_permille=500)
    assert got.host == ((0, 3),) and [k for k, _ in got.fills] == [(0, 1), (0, 2)]
    assert res.host_computed == 1 and res.misses == 3
    res.release()
    one_row = ExpertResidency(8).lookup([(0, 1), (0, 2), (0, 3)], host_permille=500)
    assert one_row.host == ((0, 2), (0, 3))  # host_key_count(3, 500) = 2 when no key is shared


def test_host_split_refuses_a_missed_key_without_rows():
    with pytest.raises(ValueError, match="at least one row"):
        host_split([1, 0], 500)
