"""Differential contract for expert residency: any implementation must match domain.residency.

Usage (e.g. for a GPU slot table)::

    from tests.contracts.residency_contract import run_residency_contract
    run_residency_contract(lambda num_slots: GpuResidency(num_slots, device="cuda"))

or, to get a pytest test class::

    TestGpuResidency = residency_contract_machine(factory).TestCase

The candidate needs the ExpertResidency surface from ADR 0001: ``can_lookup``, ``lookup``
(returning an object with ``slots``, ``hits``, ``fills``, ``evicted``), ``release``,
``slot_of``, ``hits``/``misses``/``evictions``, ``num_slots``, ``check_valid`` and — unless
``with_resize=False`` — ``can_resize``/``resize``. A lookup the reference refuses must raise
(any exception) and leave the candidate unchanged. Keys and slots may come back as any
sequence type; they are compared as tuples of Python ints.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from domain.residency import ExpertResidency, ResidencyExhausted

ResidencyFactory = Callable[[int], Any]


def _as_key(key: Any) -> tuple[int, int]:
    layer, expert = key
    return (int(layer), int(expert))


def lookup_decisions(result: Any) -> tuple:
    """Normalise a Lookup-like result to plain tuples so implementations can be compared."""
    return (
        tuple(int(s) for s in result.slots),
        tuple(_as_key(k) for k in result.hits),
        tuple((_as_key(k), int(s)) for k, s in result.fills),
        tuple(_as_key(k) for k in result.evicted),
    )


def residency_contract_machine(
    factory: ResidencyFactory,
    *,
    max_layers: int = 3,
    max_experts: int = 5,
    max_slots: int = 6,
    with_resize: bool = True,
    with_host: bool = False,
) -> type[RuleBasedStateMachine]:
    """A state machine driving ``factory(num_slots)`` and ExpertResidency with the same calls;
    ``with_host``: also lookups with a host share (``host_permille``, ADR 0030) and ``host_computed``."""
    all_keys = [(layer, expert) for layer in range(max_layers) for expert in range(max_experts)]
    key = st.sampled_from(all_keys)
    key_lists = st.lists(key, max_size=max_slots + 2)

    class ResidencyContract(RuleBasedStateMachine):
        @initialize(num_slots=st.integers(1, max_slots))
        def setup(self, num_slots: int) -> None:
            self.reference = ExpertResidency(num_slots)
            self.candidate = factory(num_slots)

        def _lookup_both(self, keys: list[tuple[int, int]], host_permille: int = 0) -> None:
            share = {"host_permille": host_permille} if host_permille else {}
            can = self.reference.can_lookup(keys, **share)
            assert bool(self.candidate.can_lookup(keys, **share)) == can, f"can_lookup({keys}) disagrees"
            if not can:
                with pytest.raises(ResidencyExhausted):
                    self.reference.lookup(keys, **share)
                with pytest.raises(Exception):  # noqa: B017 - any clear error is acceptable
                    self.candidate.lookup(keys, **share)
                return
            order_before = self.reference.lru_order()
            pinned_before = {k for k in all_keys if self.reference.is_pinned(k)}
            expected = self.reference.lookup(keys, **share)
            got = self.candidate.lookup(keys, **share)
            assert lookup_decisions(got) == lookup_decisions(expected), f"lookup({keys}) decisions differ"
            if host_permille:
                assert tuple(_as_key(k) for k in got.host) == expected.host, f"lookup({keys}) host keys differ"
            self._check_victims(expected.evicted, order_before, pinned_before, set(keys))

        @staticmethod
        def _check_victims(evicted, order_before, pinned_before, requested) -> None:
            # Eviction hook: each victim must be the least recently used key that was neither
            # pinned nor part of this lookup, taken in LRU order.
            legal = [k for k in order_before if k not in pinned_before and k not in requested]
            assert list(evicted) == legal[: len(evicted)], (
                f"victims {evicted} are not the LRU unpinned {legal}"
            )
            assert not (set(evicted) & pinned_before), "a pinned key was evicted"

        @rule(keys=key_lists)
        def lookup(self, keys):
            self._lookup_both(keys)

        @rule(keys=key_lists)
        def layer_step(self, keys):
            # The executor pattern: release the previous group, then look up the next one.
            self.reference.release()
            self.candidate.release()
            self._lookup_both(keys[: self.reference.num_slots])

        @precondition(lambda self: with_host)
        @rule(keys=key_lists, host_permille=st.integers(0, 1000))
        def host_lookup(self, keys, host_permille):
            self._lookup_both(keys, host_permille)

        @precondition(lambda self: with_host)
        @rule(keys=st.lists(key, min_size=1, max_size=3), rows=st.integers(1, 6), host_permille=st.integers(1, 1000))
        def host_lookup_rows_alike(self, keys, rows, host_permille):
            # a batch's rows routed alike: each key repeated `rows` times, so a miss weighs 2 weight passes past
            # 4 rows and the split takes fewer keys (host_split); the random lists above rarely repeat a key 5 times
            self._lookup_both(keys * rows, host_permille)

        @rule(data=st.data())
        def release_some(self, data):
            pinned = [k for k in all_keys if self.reference.is_pinned(k)]
            if not pinned:
                return
            keys = data.draw(st.lists(st.sampled_from(pinned), max_size=len(pinned)))
            self.reference.release(keys)
            self.candidate.release(keys)

        @rule()
        def release_all(self):
            self.reference.release(None)
            self.candidate.release(None)

        @precondition(lambda self: with_resize)
        @rule(num_slots=st.integers(1, max_slots))
        def resize(self, num_slots):
            can = self.reference.can_resize(num_slots)
            assert bool(self.candidate.can_resize(num_slots)) == can, "can_resize disagrees"
            if can:
                self.reference.resize(num_slots)
                self.candidate.resize(num_slots)

        @invariant()
        def same_state(self):
            self.reference.check_valid()
            self.candidate.check_valid()
            ref, cand = self.reference, self.candidate
            assert int(cand.num_slots) == ref.num_slots
            assert (int(cand.hits), int(cand.misses), int(cand.evictions)) == (
                ref.hits,
                ref.misses,
                ref.evictions,
            )
            if with_host:
                assert int(cand.host_computed) == ref.host_computed, "host_computed differs"
            for k in all_keys:
                slot = cand.slot_of(k)
                assert (None if slot is None else int(slot)) == ref.slot_of(k), f"slot_of({k}) differs"

    return ResidencyContract


def run_residency_contract(
    factory: ResidencyFactory,
    *,
    max_examples: int = 300,
    stateful_step_count: int = 30,
    **machine_options: Any,
) -> None:
    """Run the contract once, raising on the first decision where ``factory``'s object differs."""
    machine = residency_contract_machine(factory, **machine_options)
    run_state_machine_as_test(
        machine,
        settings=settings(max_examples=max_examples, stateful_step_count=stateful_step_count, deadline=None),
    )
