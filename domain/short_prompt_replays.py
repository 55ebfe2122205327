"""Short prompt chunks as replays of the captured decode step: a chunk of a few tokens runs one token per replay,
beside the step's decodes in the first one, instead of one eager prefill step.

Why: an eager prefill step of a few tokens is bound by the host's Python (the token mixers launch layer by layer:
session 27's profile of a 4-token step, ADR 0025), ~40-48 ms on an H100 wall clock (the probe's TTFT for a prompt of
2 uncached tokens: 44.6 ms, session 31), where one decode replay is 2.75 ms at bs1 and 4.3 ms at bs4. A chunk of n
tokens unrolled costs n replays: under the eager step up to about n = 14 alone on that card. Turn-2 prompts over a
cached prefix and the chat template's few tokens after it are such chunks.

Exact by construction, as the decode step is: replay r computes token r of each chunk at its own position, its
K/V written before it attends (causal), its linear-attention state the one the replay before left. The last replay
of a chunk samples its token with the chunk's sampling (seed, output index); the tokens the replays before it
compute are not used. fp32 results match the eager prefill within rounding, not bitwise (the recurrent form of the
delta rule against the chunked one: ADR 0025).

Pure: which works go to which replay, here in the domain so that the fast executor
(adapters/cuda_exec/executor.py `_execute_replays`) and the simulator (simulator/sim_executor.py) apply one rule.
FLUXTIDE_SHORT_PROMPT_REPLAYS (adapters/cuda_exec/short_prompts.py) sets the chunk length; DEFAULT_TOKENS by default.

Not pool-dependent: a rule that replayed only where every expert is resident (tried in session 32) broke the
fast path's promise of bitwise-identical output at any expert-slot count (issue 8; test_fast_executor's
test_decode_logits_are_bitwise_identical_at_any_slot_count), because replays and the eager step agree within
rounding only. The chunk length is the only input besides the step itself.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from domain.ports import SequenceWork

# NOTE: 8 tokens since session 32 measured it on an H100 (docs/adr/0026-short-prompts-as-decode-replays.md):
# resident, the ladder's median TTFT fell 3-4x at c1 / c4 and every aggregate rose; at 24 GiB a lone 2-token
# prompt's TTFT fell 43 -> 35 ms and a long prompt's 4-token tail step beside 3 decodes took 86-90 ms against 90-96
# eager. 16 is untried
DEFAULT_TOKENS = 8


@dataclass(frozen=True)
class Row:
    """One single-token work of a replay; `source` is the step's work it came from, `last` whether it is that
    work's last token (the one whose sample the step returns)."""

    work: SequenceWork
    source: SequenceWork
    last: bool


def unroll(works: tuple[SequenceWork, ...] | list[SequenceWork], max_tokens: int,
           max_rows: int) -> list[list[Row]] | None:
    """The replays that compute `works` (a step's works, none layered) one token per row: replay r holds token r
    of every work longer than r, the one-token works (decodes) in replay 0. None when the step is not for
    replays: no work of 2..max_tokens tokens, a work past max_tokens or layered, or a replay with more rows than
    max_rows (the largest captured bucket).

    Each row is a SequenceWork of one token at its own position: the first of a work keeps its restore_from (the
    state is reset or restored once, before it), each one the snapshots due at its end (position start + r + 1),
    every one samples (the graph computes a token for every row; only a work's last row is used, and only where
    the work samples). Raises nothing."""
    if max_tokens < 2 or not works:
        return None
    lengths = [len(w.token_ids) for w in works]
    if any(w.layers is not None for w in works) or max(lengths) > max_tokens or max(lengths) < 2:
        return None
    replays: list[list[Row]] = [[] for _ in range(max(lengths))]
    for w, n in zip(works, lengths, strict=True):
        for r in range(n):
            position = w.start_position + r
            row = replace(w, token_ids=(w.token_ids[r],), start_position=position, sample=True,
                          restore_from=w.restore_from if r == 0 else None,
                          snapshots=tuple(s for s in w.snapshots if s[0] == position + 1))
            replays[r].append(Row(row, w, r == n - 1))
    if max(len(rows) for rows in replays) > max_rows:
        return None
    return replays
