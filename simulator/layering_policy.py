"""What-if layering policies for short prompts beside decodes, in the simulator only (ADR 0024, "Short prompts
beside decodes"): NOT the engine's policy. `python -m simulator mixed --layer-streamed-chunks
--layer-group-length N` runs them; with neither, `predict_mixed` runs the domain Scheduler itself.

Before session 28 the domain Scheduler (domain/scheduler.py) layered a prompt chunk beside decodes only when it was
longer than the mixed step budget (`mixed_step_tokens` - decodes); it still does with `SchedulerConfig.
layer_short_prompts` off (`ft serve --layer-short-prompts off`), the baseline these candidates change. Two candidates:

- `layer_streamed` ("layer what streams", "A"): beside decodes, also layer a chunk the budget would take whole when
  the step would stream experts through the staging rows (a plan not fully resident, with staging rows, and more than
  `stream_rows` rows in the step: DeviceExpertPool.routed's streamed path). Such a step copies every non-resident
  expert of every layer, however short the chunk (ADR 0011, "What the numbers do not cover").
- `layer_faulting` (with `layer_streamed`, "A0"): also layer a chunk too short to stream, whose step looks its experts
  up through the residency instead (at most `stream_rows` rows: e.g. a 16-token prompt beside 3 decodes faults ~80
  experts a layer through the LRU in one step), wherever the plan is not fully resident. Since session 28 the domain
  does this itself (`layer_short_prompts` on a plan with `partial_residency`, `ft serve`'s default) and also makes
  other prompts wait while a chunk is part-way, which this candidate does not: with one prompt at a time the two
  schedule alike (tests/simulator/test_layering_policy.py checks it).
- `group_tokens` ("decoupled group budget", "B"): a layer group gets budget + (group_tokens - mixed_step_tokens)
  tokens of token x layers instead of the budget, so `mixed_step_tokens` keeps bounding the chunks that run unlayered
  while the group size is set apart. Since session 25 the domain does this itself (SchedulerConfig.layer_group_tokens,
  `ft serve --layer-group-length`, default 1024): group_tokens here only sets that field of the config.

`CandidateScheduler` is the domain Scheduler with its hook for "layer this chunk though the budget could take it
whole" (`_layers_short_chunk`) answered by `layer_streamed`'s test instead of the domain's; with `layer_streamed` the
domain's own policy (layer_short_prompts) is off, so the candidate is measured against the pre-session-28 baseline.
NOTE: tests/simulator/test_layering_policy.py checks that with the candidates off it schedules exactly as the domain
Scheduler does (both with the domain's policy off and on).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from domain.ports import SequenceWork
from domain.scheduler import Scheduler, SchedulerConfig


@dataclass(frozen=True)
class LayeringPolicy:
    """The candidates' knobs; the defaults are none (the domain's own policy, as its SchedulerConfig says)."""

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
        if policy.layer_streamed:  # NOTE: the candidate replaces the domain's own short-prompt policy (session 28)
            config = replace(config, layer_short_prompts=False)
        super().__init__(config, allocator, num_state_slots, num_snapshot_slots)
        self.policy, self.stream_rows = policy, stream_rows
        self._decodes = 0  # decode rows of the step being scheduled

    def _schedule_decodes(self) -> list[SequenceWork]:
        works = super()._schedule_decodes()
        self._decodes = len(works)
        return works

    def _streams(self, chunk: int) -> bool:
        """Whether a step of this chunk beside this step's decodes streams experts (layer_streamed's test)."""
        return self.stream_rows is not None and chunk + self._decodes > self.stream_rows

    def _layers_short_chunk(self, chunk: int) -> bool:
        """layer_streamed: a chunk the budget could take whole is layered when its step would stream; else the
        domain's answer."""
        return self._streams(chunk) if self.policy.layer_streamed else super()._layers_short_chunk(chunk)
