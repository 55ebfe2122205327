"""Which routing stream a request replays: the one rule the simulator's SimExecutor and the executors'
routing replay (`ft serve --routing-replay`) share, so a benchmark served with a replay routes exactly as
`python -m simulator --routing ...` predicts it with the same seed and parameters.

A greedy request is keyed by the head of its prompt: requests with the same prompt produce the same tokens
and, on a trained model, route identically (the customer's benchmark sends one prompt to every request).
A seeded sampled request is keyed by (seed, prompt head); an unseeded one by its request id (its own stream).
"""

from __future__ import annotations

import zlib
from collections import OrderedDict

from domain.ports import SequenceWork

KEY_TOKENS = 64  # prompt-head length that names a stream
MAX_TRACKED_REQUESTS = 4096  # request ids whose key is remembered (least recently used forgotten first)


def stream_key(work: SequenceWork) -> str:
    """The stream of the request whose FIRST work is `work`.

    NOTE: crc32, not hash(): str hashes are salted per process and keys must not be. A first work that
    does not start at position 0 (a prefix served from a cache) is keyed by what it computes, with its
    start position, so it stays deterministic. The head is what the first work holds: a first chunk shorter
    than KEY_TOKENS (a mixed step's budget under 64 tokens, --mixed-prefill-length < 64 + running) names
    another stream than the same prompt in one chunk would; every default budget holds the whole head.
    """
    head = ",".join(map(str, work.token_ids[:KEY_TOKENS]))
    s = work.sampling
    if s.temperature == 0:
        key = f"greedy:{zlib.crc32(head.encode())}"
    elif s.seed is not None:
        key = f"seeded:{s.seed}:{zlib.crc32(head.encode())}"
    else:
        key = f"sampled:{work.request_id}"
    return key if work.start_position == 0 else f"{key}@{work.start_position}"


class StreamKeys:
    """request id -> stream key, keyed at the request's first work and kept while the request is used.

    Bounded: the least recently used ids are forgotten beyond `capacity`; a live request is used every
    step, so it is never the one forgotten while fewer than `capacity` requests run.
    """

    def __init__(self, capacity: int = MAX_TRACKED_REQUESTS) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._keys: OrderedDict[str, str] = OrderedDict()

    def key_for(self, work: SequenceWork) -> str:
        key = self._keys.get(work.request_id)
        if key is None:
            key = stream_key(work)
            self._keys[work.request_id] = key
            while len(self._keys) > self.capacity:
                self._keys.popitem(last=False)
        else:
            self._keys.move_to_end(work.request_id)
        return key

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def check_valid(self) -> None:
        assert len(self._keys) <= self.capacity, "stream keys exceed the bound"
