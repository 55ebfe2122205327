"""The simulator's routing models behind the domain RoutingSource port: what `ft serve --routing-replay`
replays instead of the routers' choice. app/containers.py wires it into the executors (adapters never
import the simulator), so the server and `python -m simulator --routing ...` run the one model.

Spec grammar (the --routing-replay value):
  locality[:NAME=VALUE,...]  the locality model; NAMEs are LocalityParams fields and seed
                             (locality:p_prev=0.6,p_recent=0.3,seed=3); omitted fields keep their defaults
  uniform[:seed=N]           K distinct experts uniformly at random per token and layer
  trace:FILE                 replays a recorded trace (ft serve --record-routing FILE); stream k in order of
                             first use replays the file's stream k mod n, positions past its end wrap around

Shape legend: L layers, E experts per layer, K top-k.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from simulator.routing import LocalityParams, RoutingModel, TokenRouting, TraceRouting, make_routing

MODES = ("locality", "uniform", "trace")
DEFAULT_MAX_MEMO_BYTES = 512 * 2**20  # memoised routing kept in host RAM, all streams together
DEFAULT_MAX_KEYS = 65536  # stream keys remembered (trace replay: which recorded stream each key replays)


@dataclass(frozen=True)
class ReplaySpec:
    mode: str  # "locality" | "uniform" | "trace"
    seed: int = 0
    locality: LocalityParams | None = None  # mode "locality"
    path: str | None = None  # mode "trace"

    @property
    def text(self) -> str:
        """The canonical spec: every parameter spelled out (what /health and the bench records show)."""
        if self.mode == "trace":
            return f"trace:{self.path}"
        params = dict(self.locality.to_dict()) if self.locality else {}
        params["seed"] = self.seed
        return f"{self.mode}:" + ",".join(f"{k}={v}" for k, v in params.items())


def parse_replay_spec(text: str) -> ReplaySpec:
    """ReplaySpec for a --routing-replay value; ValueError naming what is wrong."""
    mode, _, rest = text.strip().partition(":")
    if mode == "trace":
        if not rest:
            raise ValueError("--routing-replay trace:FILE needs a file")
        path = Path(rest).expanduser()
        if not path.is_file():
            raise ValueError(f"--routing-replay {text}: {path} is not a readable file")
        return ReplaySpec("trace", path=str(path.resolve()))
    if mode not in MODES:
        raise ValueError(f"--routing-replay {text!r}: use locality[:NAME=VALUE,...], uniform[:seed=N] or trace:FILE")
    fields: dict[str, float | int] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        name, eq, value = part.partition("=")
        if not eq:
            raise ValueError(f"--routing-replay {text}: {part!r} is not NAME=VALUE")
        try:
            fields[name.strip()] = int(value) if name.strip() in ("seed", "window") else float(value)
        except ValueError:
            raise ValueError(f"--routing-replay {text}: {name} = {value!r} is not a number") from None
    seed = fields.pop("seed", 0)
    if mode == "uniform":
        if fields:
            raise ValueError(f"--routing-replay {text}: uniform takes only seed, got {sorted(fields)}")
        return ReplaySpec("uniform", seed=int(seed))
    params = LocalityParams.from_dict({**LocalityParams().to_dict(), **fields}, where="--routing-replay locality")
    return ReplaySpec("locality", seed=int(seed), locality=params)


class ReplaySource:
    """Implements domain.ports.RoutingSource over a RoutingModel, with bounded memory.

    Streams are memoised by the model (a preempted request re-prefills with the same routing); the least
    recently used are forgotten once all memos together would exceed `max_memo_bytes`, and regenerate
    identically when asked again (each stream draws from its own seeded generator). Beyond `max_keys`
    keys the oldest is forgotten entirely (for trace replay: which recorded stream it was handed).
    """

    def __init__(self, model: RoutingModel, spec: ReplaySpec, max_memo_bytes: int = DEFAULT_MAX_MEMO_BYTES,
                 max_keys: int = DEFAULT_MAX_KEYS) -> None:
        self.model, self.spec = model, spec
        self.num_layers, self.num_experts, self.top_k = model.num_layers, model.num_experts, model.top_k
        # NOTE: what one memoised position costs: L tuples of K small ints and the outer tuple
        self._token_bytes = self.num_layers * (56 + 8 * self.top_k) + 56 + 8 * self.num_layers
        self.max_memo_tokens = max(1, max_memo_bytes // self._token_bytes)
        self.max_keys = max_keys
        self._keys: OrderedDict[str, int] = OrderedDict()  # key -> positions memoised (0: memo forgotten)
        self._memo_tokens = 0

    def tokens(self, key: str, start: int, count: int) -> Sequence[TokenRouting]:
        if start < 0 or count < 0:
            raise ValueError(f"stream {key}: positions {start}..{start + count - 1} are not >= 0")
        stream = self.model.stream(key)
        out = stream.tokens(start, count)
        self._memo_tokens += len(stream) - self._keys.pop(key, 0)
        self._keys[key] = len(stream)
        for old in list(self._keys):
            if self._memo_tokens <= self.max_memo_tokens and len(self._keys) <= self.max_keys:
                break
            if old == key:
                continue
            self._forget(old, entirely=len(self._keys) > self.max_keys)
        return out

    def _forget(self, key: str, entirely: bool) -> None:
        self._memo_tokens -= self._keys[key]
        if isinstance(self.model, TraceRouting):
            self.model.forget(key, assignment=entirely)
        else:
            self.model.forget(key)
        if entirely:
            del self._keys[key]
        else:
            self._keys[key] = 0

    def describe(self) -> dict:
        out = {"mode": self.spec.mode, "spec": self.spec.text, "seed": self.spec.seed}
        if self.spec.locality is not None:
            out["params"] = self.spec.locality.to_dict()
        if isinstance(self.model, TraceRouting):
            out.update(file=self.spec.path, recorded_streams=len(self.model.recorded),
                       recorded_tokens=sum(len(s) for s in self.model.recorded.values()))
        out.update(memo_tokens=self._memo_tokens, streams_held=sum(1 for n in self._keys.values() if n))
        return out

    def check_valid(self) -> None:
        assert self._memo_tokens == sum(self._keys.values()), "memo count drifted"
        assert len(self._keys) <= self.max_keys + 1, "keys exceed the bound"
        assert all(n == len(self.model.stream(k)) for k, n in list(self._keys.items()) if n), "memo count != stream"


def replay_source(text: str, num_layers: int, num_experts: int, top_k: int, **bounds) -> ReplaySource:
    """The RoutingSource for a --routing-replay value and the served model's geometry; ValueError when the
    spec is bad or a trace does not fit the model (layers, expert ids, K distinct ids per row)."""
    spec = parse_replay_spec(text)
    kind = f"trace:{spec.path}" if spec.mode == "trace" else spec.mode
    model = make_routing(kind, num_layers, num_experts, top_k, spec.seed, spec.locality)
    if isinstance(model, TraceRouting):
        for name, tokens in model.recorded.items():
            for position, token in enumerate(tokens):
                if any(len(row) != top_k or len(set(row)) != top_k for row in token):
                    raise ValueError(f"trace {spec.path}: stream {name} position {position} does not hold "
                                     f"{top_k} distinct experts per layer (the model's top-k)")
    return ReplaySource(model, spec, **bounds)

