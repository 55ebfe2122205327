"""Tool calls paired with their results, as OpenAI and Anthropic pair them: shared by the three agent routes.

A chat template renders whatever it is handed: a result to no call, a call left without a result, two calls with
one id. The model then reads a conversation that cannot have happened (an answer nobody asked for, a call whose
result never came, a result it cannot tell which call it answers) and the route answers 200 where the real API
answers 400. Each route feeds its calls and results in order to one ``ToolPairing``, says where a turn ends
(``settle``), and gets the real API's refusals in its own words (``PairingWords``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from app.api.errors import bad_value


@dataclass(frozen=True)
class PairingWords:
    """One API's refusals. ``unanswered`` is formatted with ``ids`` (the open call ids, comma-separated);
    ``duplicate_call`` and ``duplicate_answer`` with ``id`` (the id, quoted) and ``first`` (where it came before).
    ``dangling(call_id, pairing)`` words a result whose id answers no open call."""

    unanswered: str
    duplicate_call: str
    duplicate_answer: str
    dangling: Callable[[str, ToolPairing], str]


class ToolPairing:
    """The calls of a conversation and their results. Refuses (400, invalid_value): a call id used twice, a
    second result to one call, a result to no open call, and calls still open where a turn ends.

    NOTE: a call is open from its call to its result; every open call must be answered by ``settle()``, which a
    route calls where its API wants the results by (the next message, the next turn, or the end)."""

    def __init__(self, words: PairingWords) -> None:
        self.words = words
        self.calls: dict[str, str] = {}  # every call id so far -> where it was made (param of its id), in order
        self.turn: list[str] = []  # the ids called since the last settle()
        self._open: dict[str, str] = {}  # call id -> the message or item that made it, until a result answers it
        self._answers: dict[str, str] = {}  # call id -> where its result is

    def call(self, call_id: str, param: str, at: str) -> None:
        """A call with id ``call_id`` (at ``param``) made by the message or item ``at``. Refused: an id an earlier
        call has, since a result names its call by id alone."""
        if call_id in self.calls:
            raise bad_value(param, self.words.duplicate_call.format(id=repr(call_id), first=self.calls[call_id]))
        self.calls[call_id] = param
        self.turn.append(call_id)
        self._open[call_id] = at

    def answer(self, call_id: str, param: str) -> None:
        """A result to the call ``call_id`` (at ``param``). Refused: a second result to one call (the model would
        read two answers to one question), and a result to an id no open call has (an answer nothing asked for)."""
        if call_id in self._answers:
            raise bad_value(param, self.words.duplicate_answer.format(id=repr(call_id), first=self._answers[call_id]))
        if call_id not in self._open:
            raise bad_value(param, self.words.dangling(call_id, self))
        del self._open[call_id]
        self._answers[call_id] = param

    def settle(self) -> None:
        """Where a turn ends: every call so far must have its result. Refused, naming the message or item that made
        the first open call and every open id: a call the model made and never saw answered."""
        if self._open:
            at = next(iter(self._open.values()))
            raise bad_value(at, self.words.unanswered.format(ids=", ".join(self._open)))
        self.turn = []
