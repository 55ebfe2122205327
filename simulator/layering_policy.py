"""What-if layering policies for short prompts beside decodes, in the simulator only (ADR 0024, "Short prompts
beside decodes"): NOT the engine's policy. `python -m simulator mixed --layer-streamed-chunks
--layer-group-length N` runs them; with neither, `predict_mixed` runs the domain Scheduler itself.

Today (domain/scheduler.py) a prompt chunk beside decodes is layered only when it is longer than the mixed step
budget (`mixed_step_tokens` - decodes), and that one budget also sizes each layer group. Two candidates:

- `layer_streamed` ("layer what streams"): beside decodes, also layer a chunk the budget would take whole when the
  step would stream experts through the staging rows (a plan not fully resident, with staging rows, and more than
  `stream_rows` rows in the step: DeviceExpertPool.routed's streamed path). Such a step copies every non-resident
  expert of every layer, however short the chunk (ADR 0011, "What the numbers do not cover").
- `layer_faulting` (with `layer_streamed`): also layer a chunk too short to stream, whose step looks its experts up
  through the residency instead (at most `stream_rows` rows: e.g. a 16-token prompt beside 3 decodes faults ~80
  experts a layer through the LRU in one step), wherever the plan is not fully resident.
- `group_tokens` ("decoupled group budget"): a layer group gets budget + (group_tokens - mixed_step_tokens) tokens
  of token x layers instead of the budget, so `mixed_step_tokens` keeps bounding the chunks that run unlayered while
  the group size is set apart. Since session 25 the domain does this itself (SchedulerConfig.layer_group_tokens,
  `ft serve --layer-group-length`, default 1024): group_tokens here only sets that field of the config.

`CandidateScheduler` is the domain Scheduler with its two layering decisions overridden: which chunk may be
layered (`_layered_chunk`) and whether a chunk about to run starts layer groups (`_takes_layers`, the domain's hook).
NOTE: tests/simulator/test_layering_policy.py checks that with the candidates off it schedules exactly as the domain
Scheduler does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from domain.ports import SequenceWork
from domain.scheduler import Scheduler, SchedulerConfig


@dataclass(frozen=True)
class LayeringPolicy:
    """The candidates' knobs; the defaults are today's policy."""

    layer_streamed: bool = False  # layer any chunk beside decodes whose step would stream experts
    layer_faulting: bool = False  # with layer_streamed: also those that would fault experts through the residency
    group_tokens: int | None = None  # the budget (decodes included) that sizes a layer group; None: mixed_step_tokens

    def __post_init__(self) -> None:
        if not isinstance(self.layer_streamed, bool) or not isinstance(self.layer_faulting, bool):
            raise ValueError("LayeringPolicy.layer_streamed and layer_faulting must be bools")
        if self.layer_faulting and not self.layer_streamed:
            raise ValueError("LayeringPolicy.layer_faulting needs layer_streamed")
        if self.group_tokens is not None and (isinstance(self.group_tokens, bool) or not isinstance(
                self.group_tokens, int) or self.group_tokens < 1):
            raise ValueError(f"LayeringPolicy.group_tokens must be an integer >= 1 or None, got {self.group_tokens!r}")

    @property
    def is_today(self) -> bool:
        return not self.layer_streamed and self.group_tokens is None

    def to_dict(self) -> dict:
        return {"layer_streamed": self.layer_streamed, "layer_faulting": self.layer_faulting,
                "group_tokens": self.group_tokens}


class CandidateScheduler(Scheduler):
    """The domain Scheduler under a LayeringPolicy. stream_rows: `layer_streamed` layers a chunk whose step has more
    rows than this (min(expert slots, lookup keys) // top-k: the step streams experts through the staging rows; 0
    with `layer_faulting`: the plan is not fully resident, so any chunk copies experts); None: no step copies experts
    (every expert resident), so `layer_streamed` changes nothing."""

    def __init__(self, config: SchedulerConfig, allocator, num_state_slots: int, num_snapshot_slots: int = 0, *,
                 policy: LayeringPolicy = LayeringPolicy(), stream_rows: int | None = None) -> None:
        if policy.group_tokens is not None and not config.layered_prefill:
            raise ValueError("a layer group budget needs layered prefill on")
        if policy.layer_streamed and not config.layered_prefill:
            raise ValueError("layering streamed chunks needs layered prefill on")
        if policy.group_tokens is not None:  # the domain's own knob (SchedulerConfig.layer_group_tokens)
            config = replace(config, layer_group_tokens=policy.group_tokens)
        super().__init__(config, allocator, num_state_slots, num_snapshot_slots)
        self.policy, self.stream_rows = policy, stream_rows
        self._decodes = 0  # decode rows of the step being scheduled

    def _schedule_decodes(self) -> list[SequenceWork]:
        works = super()._schedule_decodes()
        self._decodes = len(works)
        return works

    def _streams(self, chunk: int) -> bool:
        """Whether a step of this chunk beside this step's decodes streams experts (layer_streamed's test)."""
        return self.policy.layer_streamed and self.stream_rows is not None and chunk + self._decodes > self.stream_rows

    def _layered_chunk(self, pending: int, budget: int, with_decodes: bool) -> int:
        if not (self.config.layered_prefill and with_decodes and self._layered is None and 0 < budget):
            return 0
        if not (budget < pending or self._streams(min(pending, budget))):
            return 0
        return max(0, min(pending, self.config.max_step_tokens, self._group_budget(budget) * self.config.num_layers))

    def _takes_layers(self, chunk: int, budget: int, layered_chunk: int) -> bool:
        """Today: the chunk is longer than the budget. layer_streamed: also a layered chunk whose step streams."""
        return chunk > budget or (layered_chunk > 0 and self._streams(chunk))
