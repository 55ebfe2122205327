"""Routing models: which experts each token selects in each layer.

Shape legend: L layers, K top-k, E experts per layer, T tokens.

A routing model hands out *streams*. A stream is the routing of one token sequence: position p
of a stream is the [L][K] expert selection of the p-th token (prompt tokens first, then
generated ones). Streams are deterministic functions of (model seed, stream key), so two
requests that produce the same token sequence (same prompt, greedy decoding) share a stream
key and route identically, and re-running a prediction with the same seed gives the same
numbers. Every stream draws from its own numpy Generator (independent seeded streams).

Models:
- LocalityRouting: each of the K picks copies an expert of the previous token (p_prev), or
  of tokens t-2..t-window (p_recent), else draws from a weakly skewed per-layer popularity
  (stretched exponential in rank, randomly permuted per layer). Layers are independent.
  Defaults reproduce the published Qwen3-30B-A3B statistics in SPEC.md (tests check it).
- UniformRouting: K distinct experts uniformly at random, no memory.
- TraceRouting: replays a recorded JSONL trace (format in docs/simulator.md).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from simulator.params import StrictParams

TokenRouting = tuple[tuple[int, ...], ...]  # [L][K] expert ids of one token


def _stream_seed(seed: int, key: str) -> np.random.SeedSequence:
    # NOTE: crc32 rather than hash(): str hashes are salted per process, seeds must not be.
    return np.random.SeedSequence([seed, zlib.crc32(key.encode())])


@dataclass(frozen=True)
class LocalityParams(StrictParams):
    p_prev: float = 0.40  # share of picks copied from the previous token's experts
    p_recent: float = 0.38  # share copied from tokens t-2 .. t-window
    window: int = 8
    recent_decay: float = 1.0  # weight of distance d in t-2..t-window is recent_decay**(d-2)
    popularity_beta: float = 0.75  # stretched-exponential popularity exp(-(rank/(E*tau))^beta)
    popularity_tau: float = 0.125

    def check_valid(self) -> None:
        if not (0 <= self.p_prev and 0 <= self.p_recent and self.p_prev + self.p_recent <= 1):
            raise ValueError(f"p_prev and p_recent must be >= 0 and sum to <= 1: {self}")
        if self.window < 2:
            raise ValueError(f"window must be >= 2, got {self.window}")
        if not 0 < self.recent_decay <= 1:
            raise ValueError(f"recent_decay must be in (0, 1], got {self.recent_decay}")
        if self.popularity_beta <= 0 or self.popularity_tau <= 0:
            raise ValueError(f"popularity parameters must be > 0: {self}")


def popularity_weights(num_experts: int, beta: float, tau: float) -> np.ndarray:
    """[E] routing mass by popularity rank, normalised; rank 0 is the most popular."""
    rank = np.arange(num_experts) + 0.5
    w = np.exp(-((rank / (num_experts * tau)) ** beta))
    return w / w.sum()


class RoutingStream:
    """Lazily generated, memoised routing of one token sequence."""

    def __init__(self, generate_next) -> None:
        self._generate_next = generate_next
        self._tokens: list[TokenRouting] = []

    def at(self, position: int) -> TokenRouting:
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        while len(self._tokens) <= position:
            self._tokens.append(self._generate_next(len(self._tokens), self._tokens))
        return self._tokens[position]

    def __len__(self) -> int:
        """Positions generated and memoised so far."""
        return len(self._tokens)

    def tokens(self, start: int, count: int) -> list[TokenRouting]:
        self.at(start + count - 1) if count else None
        return self._tokens[start : start + count]


class RoutingModel:
    """Base: caches streams by key. Subclasses implement _make_generator(key)."""

    name = "base"

    def __init__(self, num_layers: int, num_experts: int, top_k: int, seed: int = 0) -> None:
        if not (num_layers >= 1 and num_experts >= 1 and 1 <= top_k <= num_experts):
            raise ValueError(f"bad routing geometry L={num_layers} E={num_experts} K={top_k}")
        self.num_layers, self.num_experts, self.top_k, self.seed = num_layers, num_experts, top_k, seed
        self._streams: dict[str, RoutingStream] = {}

    def stream(self, key: str) -> RoutingStream:
        if key not in self._streams:
            self._streams[key] = RoutingStream(self._make_generator(key))
        return self._streams[key]

    def forget(self, key: str) -> None:
        """Drop the memoised stream of `key`; asking for it again regenerates the same routing."""
        self._streams.pop(key, None)

    def _make_generator(self, key: str):  # pragma: no cover - abstract
        raise NotImplementedError


class UniformRouting(RoutingModel):
    name = "uniform"

    def _make_generator(self, key: str):
        rng = np.random.default_rng(_stream_seed(self.seed, key))
        L, E, K = self.num_layers, self.num_experts, self.top_k

        def generate(position: int, history: list[TokenRouting]) -> TokenRouting:
            keys = rng.random((L, E))  # [L, E]; the K smallest per layer = K distinct uniform picks
            picks = np.argpartition(keys, K - 1, axis=1)[:, :K]  # [L, K]
            return tuple(tuple(int(e) for e in row) for row in picks)

        return generate


class LocalityRouting(RoutingModel):
    name = "locality"

    def __init__(self, num_layers, num_experts, top_k, seed=0, params: LocalityParams | None = None):
        super().__init__(num_layers, num_experts, top_k, seed)
        self.params = params or LocalityParams()
        self.params.check_valid()
        weights = popularity_weights(num_experts, self.params.popularity_beta, self.params.popularity_tau)
        # Popularity is a property of the model, not of a sequence: one permutation per layer.
        perm_rng = np.random.default_rng(_stream_seed(seed, "popularity"))
        self.layer_weights = np.stack([weights[perm_rng.permutation(num_experts)] for _ in range(num_layers)])
        self._cumulative = np.cumsum(self.layer_weights, axis=1)  # [L, E]
        self._cumulative[:, -1] = 1.0

    def _make_generator(self, key: str):
        rng = np.random.default_rng(_stream_seed(self.seed, key))
        L, K, p = self.num_layers, self.top_k, self.params
        cumulative = self._cumulative
        # [window-1] cumulative weights of distances 2..window for copies from older tokens
        distance_cdf = np.cumsum(p.recent_decay ** np.arange(p.window - 1))
        distance_cdf /= distance_cdf[-1]

        def generate(position: int, history: list[TokenRouting]) -> TokenRouting:
            choice = rng.random((L, K))  # [L, K] which source each pick copies from
            index = rng.random((L, K))  # [L, K] which element of that source
            fresh = np.empty((L, 4 * K), dtype=np.int64)  # [L, 4K] popularity draws for rejections
            for layer in range(L):
                fresh[layer] = np.searchsorted(cumulative[layer], rng.random(4 * K), side="right")
            recent_tokens = history[-p.window :]
            out = []
            for layer in range(L):
                prev = recent_tokens[-1][layer] if recent_tokens else ()
                older = recent_tokens[-2::-1]  # distance 2 first
                chosen: list[int] = []
                spare = iter(fresh[layer].tolist())
                for j in range(K):
                    u = choice[layer, j]
                    if u < p.p_prev and prev:
                        e = prev[int(index[layer, j] * len(prev))]
                    elif u < p.p_prev + p.p_recent and older:
                        v = index[layer, j]  # reuse one uniform draw: distance, then element
                        d = min(int(np.searchsorted(distance_cdf, v, side="right")), len(older) - 1)
                        lo = distance_cdf[d - 1] if d else 0.0
                        frac = (v - lo) / (distance_cdf[d] - lo) if d < len(distance_cdf) else 0.0
                        row = older[d][layer]
                        e = row[min(int(frac * len(row)), len(row) - 1)]
                    else:
                        e = next(spare, None)
                    while e is None or e in chosen:
                        e = next(spare, None)
                        if e is None:
                            e = int(np.searchsorted(cumulative[layer], rng.random(), side="right"))
                    chosen.append(int(e))
                out.append(tuple(chosen))
            return tuple(out)

        return generate


class TraceRouting(RoutingModel):
    """Replays recorded routing. Stream k (in order of first use) replays the file's stream
    k mod n, so a batch of more requests than recorded streams reuses them; a position past
    the end of a recorded stream wraps around to its start."""

    name = "trace"

    def forget(self, key: str, assignment: bool = False) -> None:
        """As RoutingModel.forget; assignment=True also forgets which recorded stream `key` replays."""
        super().forget(key)
        if assignment:
            self._assigned.pop(key, None)

    def __init__(self, path: str | Path, seed: int = 0) -> None:
        self.path = Path(path)
        self.recorded = load_trace(self.path)
        first = next(iter(self.recorded.values()))
        super().__init__(len(first[0]), 1 + max(e for s in self.recorded.values() for t in s for row in t for e in row),
                         max(len(row) for s in self.recorded.values() for t in s for row in t), seed)
        self._names = list(self.recorded)
        self._assigned: dict[str, str] = {}
        self._handed_out = 0  # keys ever assigned a recorded stream (the order of first use)

    def _make_generator(self, key: str):
        # NOTE: a key keeps its recorded stream when only its memo was forgotten (forget) and is rebuilt
        name = self._assigned.get(key)
        if name is None:
            name = self._names[self._handed_out % len(self._names)]
            self._handed_out += 1
        self._assigned[key] = name
        recorded = self.recorded[name]

        def generate(position: int, history: list[TokenRouting]) -> TokenRouting:
            return recorded[position % len(recorded)]

        return generate


def load_trace(path: Path) -> dict[str, list[TokenRouting]]:
    """Reads a routing trace: JSON lines {"stream": str (optional, default "0"),
    "position": int (optional, checked when present), "layer_experts": [[e, ...] per layer]}."""
    streams: dict[str, list[TokenRouting]] = {}
    num_layers = None
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                layers = record["layer_experts"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise ValueError(f"{path}:{lineno}: not a routing record ({err})") from None
            unknown = set(record) - {"stream", "position", "layer_experts"}
            if unknown:
                raise ValueError(f"{path}:{lineno}: unknown fields {sorted(unknown)}")
            if not layers or not all(isinstance(r, list) and r and all(isinstance(e, int) and e >= 0 for e in r) for r in layers):
                raise ValueError(f"{path}:{lineno}: layer_experts must be non-empty lists of expert ids >= 0")
            if num_layers is None:
                num_layers = len(layers)
            elif len(layers) != num_layers:
                raise ValueError(f"{path}:{lineno}: {len(layers)} layers, earlier lines had {num_layers}")
            tokens = streams.setdefault(str(record.get("stream", "0")), [])
            if "position" in record and record["position"] != len(tokens):
                raise ValueError(f"{path}:{lineno}: position {record['position']}, expected {len(tokens)}")
            tokens.append(tuple(tuple(r) for r in layers))
    if not streams:
        raise ValueError(f"{path}: empty routing trace")
    return streams


def write_trace(path: str | Path, streams: dict[str, Sequence[TokenRouting]]) -> None:
    """Writes streams in the JSONL format load_trace reads (the engine's recorder uses the same)."""
    with open(path, "w", encoding="utf-8") as f:
        for name, tokens in streams.items():
            for position, token in enumerate(tokens):
                f.write(json.dumps({"stream": name, "position": position,
                                    "layer_experts": [list(r) for r in token]}) + "\n")


@dataclass(frozen=True)
class RoutingStatistics:
    next_token_reuse: float  # share of selections also selected by the previous token (same layer)
    within_8_reuse: float  # share also selected by one of the previous 8 tokens
    median_reuse_distance: float  # tokens since the same layer last selected this expert
    experts_for_90pct_mass: float  # mean over layers
    top_expert_share: float  # mean over layers of the busiest expert's share of selections


def routing_statistics(tokens: Sequence[TokenRouting], num_experts: int) -> RoutingStatistics:
    """The published locality statistics, measured on a [T][L][K] routing sequence."""
    if len(tokens) < 9:
        raise ValueError("need at least 9 tokens")
    num_layers = len(tokens[0])
    next_hits = within_hits = total = 0
    distances: list[int] = []
    counts = np.zeros((num_layers, num_experts))  # [L, E]
    for layer in range(num_layers):
        last_seen: dict[int, int] = {}
        for t, token in enumerate(tokens):
            for e in token[layer]:
                counts[layer, e] += 1
                if t >= 8:  # NOTE: score only tokens with a full 8-token history
                    total += 1
                    d = t - last_seen[e] if e in last_seen else None
                    next_hits += d == 1
                    within_hits += d is not None and d <= 8
                if e in last_seen:
                    distances.append(t - last_seen[e])
                last_seen[e] = t
    n90, top = [], []
    for row in counts:
        share = np.sort(row)[::-1] / row.sum()
        n90.append(int(np.searchsorted(np.cumsum(share), 0.9) + 1))
        top.append(float(share[0]))
    return RoutingStatistics(
        next_token_reuse=next_hits / total,
        within_8_reuse=within_hits / total,
        median_reuse_distance=float(np.median(distances)),
        experts_for_90pct_mass=float(np.mean(n90)),
        top_expert_share=float(np.mean(top)),
    )


def make_routing(kind: str, num_layers: int, num_experts: int, top_k: int, seed: int = 0,
                 locality: LocalityParams | None = None) -> RoutingModel:
    """'locality' | 'uniform' | 'trace:FILE' (the CLI's --routing)."""
    if kind == "locality":
        return LocalityRouting(num_layers, num_experts, top_k, seed, locality)
    if kind == "uniform":
        return UniformRouting(num_layers, num_experts, top_k, seed)
    if kind.startswith("trace:"):
        model = TraceRouting(kind[len("trace:"):], seed)
        if model.num_layers != num_layers or model.num_experts > num_experts:
            raise ValueError(f"trace {model.path} has {model.num_layers} layers and expert ids up to "
                             f"{model.num_experts - 1}; the model has {num_layers} layers x {num_experts} experts")
        model.num_experts, model.top_k = num_experts, top_k
        return model
    raise ValueError(f"unknown routing {kind!r}: use locality, uniform or trace:FILE")
