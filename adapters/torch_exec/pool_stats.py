"""What both executors report about their pools (the engine's /v1/stats and /metrics read it)."""


class PoolStats:
    """Mixin for an executor holding `kv`, `experts` (with hits/misses) and optional `state` pools."""

    def pool_bytes(self) -> dict[str, int]:
        return {"kv": self.kv.nbytes(), "moe": self.experts.nbytes(),
                "state": self.state.nbytes() if self.state is not None else 0}

    @property
    def expert_hits(self) -> int:
        return self.experts.hits

    @property
    def expert_misses(self) -> int:
        return self.experts.misses
