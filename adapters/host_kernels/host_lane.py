"""The host lane (ADR 0030, "a flag handshake inside the one graph"): a C++ thread computes each layer's host
expert pairs while the captured decode step runs, handing requests and answers through a mailbox in pinned
memory; two GPU kernels (adapters/kernels/host_lane_publish.py, host_lane_wait.py) are the step's side.

Shape legend: M mailbox rows (the largest T a step publishes), T rows, K top-k, KO router weight columns, H hidden,
N bank rows, R row bytes, L*E keys.

Mailbox (host memory: pinned on CUDA hosts, where the GPU reaches it through UVA; plain memory otherwise, where
Triton's interpreter runs the kernels), one reused layer after layer (the step runs its layers in order, so at
most one request is outstanding):
  ctrl     int64 [48]  three 128-byte lines, so the GPU's and the host's writes never share a line:
                       [REQUEST] sequence number, [ROWS] T (the GPU's); [DONE] +seq served / -seq refused
                       (the host thread's); [ERROR] first host error (HostError), [ERROR_SEQ] its request,
                       [ERROR_DETAIL] the bad key or row count, [SERVED] requests answered (the host's, for
                       Python: diagnostics and tests)
  x        fp32 [M, H]   the layer's MoE input rows
  pairs    int64 [M*K]   lane t*K + k: pair (t, k)'s key where the host computes it, else -1
  weights  fp32 [M*K]    lane t*K + k: pair (t, k)'s router weight
  partial  fp32 [M, H]   the host's answer: rows [0, T), zero where a row has no host pair

Orderings. publish (GPU): x, pairs, weights, ROWS, then REQUEST = seq with a system-scope release (seq from a
device counter the kernel increments, so graph replays never match a stale number). Host thread: acquires
REQUEST > the last it served, reads the rest, computes partial, then DONE = ±seq with a release store.
wait_add (GPU): acquires DONE until it is ±seq, then reads partial. Nothing else crosses between the two.

A layer without host pairs sends no request (both kernels decide it from one device word; see
host_lane_publish). Errors: a wait that gives up after max_spins polls, or gets -seq, adds nothing and sets the
device error word (DeviceError); the first of a step makes its later waits return at once. The host thread
answers a bad request (a key beyond the table or without a bank row, a row count beyond M, a failing kernel)
with -seq, keeps the first reason in the mailbox (HostError) and goes on serving: the step fails, the lane
stays up. The executor reads device_error() with the step's tokens and clears both words between steps.
"""

from __future__ import annotations

import enum
import functools
import logging
import time
from pathlib import Path

import torch

from adapters.checkpoint.expert_layout import ExpertLayout
from adapters.host_kernels import fp8_block_experts as fp8
from adapters.kernels import host_lane_publish, host_lane_wait
from domain.residency import host_key_count

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_suffix(".cpp")
# NOTE: ctrl word indices, host_lane.cpp's constants
CTRL_WORDS = 48
REQUEST, ROWS, DONE = 0, 1, 16
ERROR, ERROR_SEQ, ERROR_DETAIL, SERVED = 32, 33, 34, 35
# ~1 s on CUDA (a poll is a PCIe read, ~1 us): far beyond a layer's host share (milliseconds at bs16), short
# enough that a stalled host thread fails the step rather than looking like a hang
MAX_SPINS = 1_000_000
TEAMS = ("spin", "openmp")  # the thread's kernel team (HostLane's team argument)


class DeviceError(enum.IntEnum):
    """The device error word (state[2]): why a wait added nothing."""

    NONE = 0
    TIMEOUT = host_lane_wait.TIMEOUT  # no answer within max_spins polls
    HOST_FAILED = host_lane_wait.HOST_FAILED  # the host refused the request: see host_error()


class HostError(enum.IntEnum):
    """The mailbox's first host error (ctrl[ERROR])."""

    NONE = 0
    BAD_KEY = 1  # a key beyond row_of_key (detail: the key)
    NO_ROW = 2  # a key whose bank row is -1 or beyond the bank (detail: the key)
    BAD_ROWS = 3  # T beyond the mailbox (detail: T)
    KERNEL_FAILED = 4  # the expert kernel raised


@functools.cache
def _module():
    from torch.utils.cpp_extension import load

    # the expert kernel's own source compiled in (no module of its own here): one kernel, two bindings
    return load(name="fluxtide_host_lane", sources=[str(_SOURCE), str(fp8.SOURCE)],
                extra_cflags=[*fp8.CFLAGS, "-DFLUXTIDE_FP8_EMBEDDED"], extra_ldflags=["-fopenmp"], verbose=False)


def available() -> tuple[bool, str]:
    """(True, "") when the lane's extension builds here, else (False, the reason)."""
    try:
        _module()
        return True, ""
    except Exception as exc:  # noqa: BLE001 - any build failure is reported, not raised
        return False, f"{type(exc).__name__}: {exc}".splitlines()[0]


class HostLane:
    """The mailbox, the device words and the serving thread of one decode step's host lane.

    bank: uint8 [N, R] block-FP8 rows packed by `layout` (pinned or not); row_of_key: int64 [L*E] on the CPU,
    the bank row of each key (-1 where the bank has none); top_k: K, the pairs per row; max_rows: M; device:
    where the step runs (cuda: a pinned mailbox; cpu: Triton's interpreter); threads: the team of the
    thread's kernel calls, itself included (default: torch's intra-op count); team: "spin" (a SpinTeam of
    spinning workers that lives as long as the thread, host_kernels/spin_team.h) or "openmp" (the thread's own
    OpenMP team, forked by ATen's parallel_for twice a request); max_spins: the waits' bound;
    share: the per mille of a decode lookup's misses the pool sends here, at most (domain.residency.host_split:
    the budget in weight passes; read by DeviceExpertPool, not by the lane). The thread is not started here:
    start() it. Raises ValueError on arguments that do not fit."""

    def __init__(self, bank: torch.Tensor, layout: ExpertLayout, row_of_key: torch.Tensor, top_k: int,
                 max_rows: int, device: torch.device | str, *, share: int = 1000, threads: int | None = None,
                 team: str = "spin", max_spins: int = MAX_SPINS) -> None:
        offsets = fp8.row_offsets(layout)
        if bank.dtype != torch.uint8 or bank.dim() != 2 or bank.shape[1] != layout.row_bytes or bank.is_cuda:
            raise ValueError(f"bank must be uint8 [N, {layout.row_bytes}] in host memory, got {bank.dtype} "
                             f"{tuple(bank.shape)} on {bank.device}")
        if row_of_key.dtype != torch.int64 or row_of_key.dim() != 1 or row_of_key.is_cuda:
            raise ValueError(f"row_of_key must be int64 [L*E] on the CPU, got {row_of_key.dtype} "
                             f"{tuple(row_of_key.shape)} on {row_of_key.device}")
        if top_k < 1 or max_rows < 1 or max_spins < 1 or (threads is not None and threads < 1):
            raise ValueError("top_k, max_rows, max_spins and threads must be positive")
        if team not in TEAMS:
            raise ValueError(f"team must be one of {', '.join(TEAMS)}, got {team!r}")
        host_key_count(0, share)  # refuses a share outside 0..1000
        self.device = torch.device(device)
        self.top_k, self.max_rows, self.max_spins, self.share = top_k, max_rows, max_spins, share
        self.threads = threads or torch.get_num_threads()
        self._team = team
        self.hidden = layout.hidden
        pin = self.device.type == "cuda"
        h = layout.hidden

        def host(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, pin_memory=pin)

        self.ctrl = host(CTRL_WORDS, dtype=torch.int64)
        self.x = host(max_rows, h, dtype=torch.float32)  # [M, H]
        self.pairs = host(max_rows * top_k, dtype=torch.int64)  # [M*K]
        self.weights = host(max_rows * top_k, dtype=torch.float32)  # [M*K]
        self.partial = host(max_rows, h, dtype=torch.float32)  # [M, H]
        self.state = torch.zeros(4, dtype=torch.int64, device=self.device)  # seq, live, error, error seq
        self._keys = torch.nonzero(row_of_key >= 0).flatten()  # keys with a bank row: what measure() reads
        self._row_bytes = layout.row_bytes
        self._lane = _module().HostLane(self.ctrl, self.x, self.pairs, self.weights, self.partial,
                                        bank.contiguous(), offsets, row_of_key.contiguous(), top_k,
                                        layout.intermediate, fp8.GRAIN_ROWS, self.threads, team == "spin")

    def start(self) -> None:
        """Starts the serving thread (a no-op while it runs); a request published before is served. Logs a
        warning when a spin team was asked for and the thread serves on OpenMP's (its workers did not start)."""
        self._lane.start()
        if self.team != self._team:
            log.warning("host lane: the %s team could not start; serving on the %s team", self._team, self.team)

    @property
    def team(self) -> str:
        """The team the thread serves with (or last served with): "spin" or "openmp"; before the first start,
        the team asked for."""
        return self._lane.team() or self._team

    def stop(self) -> None:
        """Ends the thread once its current request, if any, is answered; idempotent. Also on destruction."""
        self._lane.stop()

    @property
    def running(self) -> bool:
        return self._lane.running()

    def __enter__(self) -> HostLane:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def publish(self, x: torch.Tensor, host_pairs: torch.Tensor, weights: torch.Tensor) -> None:
        """Hands this layer's host pairs to the thread (host_lane_publish). x [T, H] bf16/fp16/fp32; host_pairs
        int64 [T*K] (a key, or -1); weights fp32 [T, KO >= K]; all on the lane's device. No host sync."""
        host_lane_publish.publish(x, host_pairs, weights, self.x, self.pairs, self.weights,
                                  self.ctrl[REQUEST:ROWS + 1], self.state)

    def wait_add(self, out: torch.Tensor) -> torch.Tensor:
        """out[t] += partial[t] for t < T once the thread answered the last publish (host_lane_wait); out [T, H]
        any float dtype on the lane's device. Returns out. No host sync."""
        return host_lane_wait.wait_add(out, self.partial, self.ctrl[DONE:DONE + 1], self.state, self.max_spins)

    def warm_up(self, requests: int, experts: int | None = None) -> None:
        """`requests` untimed measure() requests of `experts` experts (default top_k): run before timing the lane.
        NOTE: on session 43's H100 machine at 15 threads the first ~0.1 s of requests after a start ran up to 2x slow
        (one expert of one row 232 us, then 127 us; cause not established). Before any step only, as measure."""
        self.measure(requests=requests, experts=experts)

    def measure(self, requests: int = 8, timeout_s: float = 30.0, experts: int | None = None, rows: int = 1) -> float:
        """GB/s of expert bytes (packed rows) the running thread computes, measured through the mailbox itself: one
        warm-up and `requests` timed requests of `rows` rows (default 1, at most M) that all route through the same
        `experts` (default top_k, at most top_k) distinct experts, as a batch of one prompt does, issued from Python,
        so the figure holds the thread's team, the bank's memory and a request's round trip (`ft serve
        --host-experts auto` balances it against the link). The bytes counted are the distinct experts' rows. Before
        any step only: it takes sequence numbers and moves the device counter past them (a host sync). Raises
        RuntimeError when the thread is not running or an answer takes longer than timeout_s, ValueError for
        requests < 1, experts outside 1..top_k or rows outside 1..M."""
        k = self.top_k if experts is None else experts
        if requests < 1 or not 1 <= k <= self.top_k or not 1 <= rows <= self.x.shape[0]:
            raise ValueError(f"requests must be at least 1, experts in 1..{self.top_k} and rows in "
                             f"1..{self.x.shape[0]}, got {requests}, {k}, {rows}")
        if not self.running:
            raise RuntimeError("the host lane's thread is not running: start() it first")
        n = self._keys.numel()
        seq = max(int(self.state[0]), abs(int(self.ctrl[DONE])), int(self.ctrl[REQUEST]))
        self.x[:rows].normal_()
        self.weights.fill_(1.0 / k)
        # NOTE: the next experts of the bank each request, so the rate is the bank's memory's, not a cache's. Every
        # request's pairs are made before the clock starts and the mailbox is written and polled through numpy views
        # of its memory: torch's indexing took ~34 us a request in Python (dev box), about half of what the thread
        # takes for a request of one expert, and none of it is the lane's (in a step the publish kernel writes)
        picked = self._keys[(torch.arange(requests + 1)[:, None] * k + torch.arange(k)) % n]  # [R+1, k]
        plan = torch.full((requests + 1, self.x.shape[0], self.top_k), -1, dtype=torch.int64)  # [R+1, M, K]
        plan[:, :rows, :k] = picked[:, None, :]
        plan = plan.reshape(requests + 1, -1).numpy()  # [R+1, M*K]
        ctrl, pairs = self.ctrl.numpy(), self.pairs.numpy()
        start = 0.0
        for r in range(requests + 1):
            if r == 1:
                start = time.perf_counter()
            seq += 1
            pairs[:] = plan[r]
            ctrl[ROWS] = rows
            ctrl[REQUEST] = seq  # last: the thread reads the rest after it (x86 keeps stores in order)
            deadline = time.perf_counter() + timeout_s
            while abs(int(ctrl[DONE])) != seq:
                if time.perf_counter() > deadline:
                    raise RuntimeError(f"the host lane did not answer a measurement request in {timeout_s} s")
            if int(ctrl[DONE]) != seq:
                raise RuntimeError(f"the host lane refused a measurement request: {self.host_error()}")
        elapsed = time.perf_counter() - start
        self.state[0] = seq  # the GPU's next request follows these
        return requests * k * self._row_bytes / elapsed / 1e9

    def device_error(self) -> tuple[DeviceError, int]:
        """(the first wait error since clear_errors(), the sequence number it was raised at). A host sync."""
        code, seq = self.state[2:4].tolist()
        return DeviceError(code), seq

    def host_error(self) -> tuple[HostError, int, int]:
        """(the first request the thread refused since clear_errors(), its sequence number, the bad key or T)."""
        code, seq, detail = self.ctrl[ERROR:ERROR_DETAIL + 1].tolist()
        return HostError(code), seq, detail

    @property
    def served(self) -> int:
        """Requests the thread has answered (served or refused)."""
        return int(self.ctrl[SERVED])

    def clear_errors(self) -> None:
        """Clears the device and host error words; between steps (no request outstanding)."""
        self.state[2:4].zero_()
        self.ctrl[ERROR:ERROR_DETAIL + 1].zero_()
