"""The simulated serving host: simpy resources for the GPU compute stream, the PCIe copy engine and
the host CPU's expert lane (ADR 0030), each recording time-weighted utilisation and how long requests
waited for it."""

from __future__ import annotations

from dataclasses import dataclass

import simpy


class TimedResource:
    """A capacity-1 simpy resource (one stream / one copy engine) that records busy time.

    Busy time is integrated exactly: every use adds its duration when it starts and the
    ongoing use is clipped to `now`, so utilisation over any window between two snapshots
    is (busy_at(t1) - busy_at(t0)) / (t1 - t0), always within [0, 1].
    """

    def __init__(self, env: simpy.Environment, name: str) -> None:
        self.env, self.name = env, name
        self.resource = simpy.Resource(env, capacity=1)
        self._busy_closed = 0.0  # completed uses
        self._current_start: float | None = None
        self._current_end = 0.0
        self.uses = 0
        self.total_wait = 0.0
        self.max_wait = 0.0
        self.min_wait = 0.0

    def use(self, seconds: float):
        """simpy process body: wait for the resource, hold it `seconds`, release it."""
        if seconds < 0:
            raise ValueError(f"{self.name}: negative duration {seconds}")
        asked = self.env.now
        with self.resource.request() as grant:
            yield grant
            wait = self.env.now - asked
            self.total_wait += wait
            self.max_wait = max(self.max_wait, wait)
            self.min_wait = min(self.min_wait, wait)
            self.uses += 1
            if seconds == 0:
                return
            self._current_start, self._current_end = self.env.now, self.env.now + seconds
            yield self.env.timeout(seconds)
            self._busy_closed += seconds
            self._current_start = None

    def busy_at(self, now: float | None = None) -> float:
        now = self.env.now if now is None else now
        ongoing = 0.0
        if self._current_start is not None:
            ongoing = min(now, self._current_end) - self._current_start
        return self._busy_closed + max(0.0, ongoing)

    def check_valid(self) -> None:
        assert self.min_wait >= 0, f"{self.name}: negative wait"
        assert 0 <= self.busy_at() <= self.env.now + 1e-12, f"{self.name}: busy longer than elapsed"


@dataclass(frozen=True)
class HostSnapshot:
    time: float
    gpu_busy: float
    pcie_busy: float
    cpu_busy: float = 0.0  # the host lane (0 where a host has none, e.g. expert_parallel's)


class SimHost:
    """One GPU host: compute stream + host->device copy engine + the host CPU's expert lane (the
    host keys of a lookup, CostParams.host_permille; idle otherwise) on one simpy clock."""

    def __init__(self, env: simpy.Environment | None = None) -> None:
        self.env = env or simpy.Environment()
        self.gpu = TimedResource(self.env, "gpu")
        self.pcie = TimedResource(self.env, "pcie")
        self.cpu = TimedResource(self.env, "cpu")

    def now(self) -> float:  # domain.ports.Clock
        return float(self.env.now)

    def snapshot(self) -> HostSnapshot:
        return HostSnapshot(self.now(), self.gpu.busy_at(), self.pcie.busy_at(), self.cpu.busy_at())

    @staticmethod
    def utilisation(start: HostSnapshot, end: HostSnapshot) -> tuple[float, float]:
        """(gpu, pcie) time-weighted utilisation between two snapshots."""
        span = end.time - start.time
        if span <= 0:
            return 0.0, 0.0
        return (end.gpu_busy - start.gpu_busy) / span, (end.pcie_busy - start.pcie_busy) / span

    @staticmethod
    def cpu_utilisation(start: HostSnapshot, end: HostSnapshot) -> float:
        """The host lane's time-weighted utilisation between two snapshots."""
        span = end.time - start.time
        return (end.cpu_busy - start.cpu_busy) / span if span > 0 else 0.0

    def advance_to(self, time: float) -> None:
        if time > self.env.now:
            self.env.run(until=time)

    def check_valid(self) -> None:
        self.gpu.check_valid()
        self.pcie.check_valid()
        self.cpu.check_valid()
