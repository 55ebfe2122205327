"""Everything `ft serve` can be told, in one frozen record the container reads."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

from domain.arrival_window import DEFAULT_MAX_MS as DEFAULT_ARRIVAL_WINDOW_MS
from domain.prefill_choice import PREFILL_KERNELS
from domain.step_budget import DEFAULT_MAX_STEP_TOKENS, DEFAULT_MIXED_STEP_TOKENS, layer_group_tokens

PREFILL_GRAPHS = ("auto", "on", "off")  # --prefill-graphs
LAYER_SHORT_PROMPTS = ("auto", "off")  # --layer-short-prompts


@dataclass(frozen=True)
class ServeSettings:
    model_dir: str | None = None  # None: the embedded demo model
    served_model_name: str | None = None  # None: the model directory's name
    host: str = "127.0.0.1"
    port: int = 1919
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    max_running_requests: int = 4
    # step budgets (docs/adr/0011-mixed-step-budget.md): tokens of a step with no decode in it (time to first
    # token), and of a step that carries decodes (the running streams' gap); None = min(512, max_prefill_length)
    max_prefill_length: int = DEFAULT_MAX_STEP_TOKENS
    mixed_prefill_length: int | None = None
    # a step that carries decodes runs a long prompt as one chunk a layer group at a time (docs/adr/
    # 0024-layered-prefill.md): the streams' gap stays a mixed step's, the chunk's experts stream once
    layered_prefill: bool = True
    # the budget that sizes a layer group beside decodes (ADR 0024, session 25); None = 1024 raised to the mixed
    # budget and bounded by max_prefill_length (domain.step_budget.layer_group_tokens)
    layer_group_length: int | None = None
    # ADR 0024 "A0" (session 28): "auto" = with layered prefill on a plan that does not hold every expert (at start
    # and after each live resize), every prompt chunk beside decodes runs as layer groups, however short, and other
    # prompts wait while one is part-way; "off" = only prompts longer than the mixed budget are layered
    layer_short_prompts: str = "off"  # ADR 0024: "auto" measured in session 30, off by default
    # an idle engine's first step waits up to this long for the rest of a burst of requests (0: never);
    # domain/arrival_window.py, docs/adr/0021-arrival-window.md
    arrival_window_ms: float = DEFAULT_ARRIVAL_WINDOW_MS
    memory_ratio: float = 0.9
    gpu_budget_gib: float | None = None  # cap on the card's memory (emulate a smaller card)
    kv_tokens: int | None = None
    moe_slots: int | None = None
    kv_reserve_tokens: int = 8192
    api_key: str | None = None
    debug: bool = False
    cpu_threads: int = 1  # torch intra-op threads on the CPU (small models: more threads only add overhead)
    record_routing: str | None = None  # write every token's routed experts here (the simulator's trace format)
    # benchmark-only: replace the routers' choice: "locality[:NAME=VALUE,...]" | "uniform[:seed=N]" | "trace:FILE"
    routing_replay: str | None = None
    mmap_experts: bool = False  # keep expert weights memory-mapped from disk instead of in host RAM
    # "auto": the graph-captured fast path on CUDA (pinned bank, no routing recording), else the reference
    executor: str = "auto"  # "auto" | "reference" | "cuda-graph"
    # the fast path's prefill: "auto" (triton on CUDA for GPU-validated weight formats, domain/prefill_choice.py;
    # ADR 0020) | "reference" | "triton"
    prefill_kernels: str = "auto"
    # the Triton prefill's FP8 GEMMs take e4m3 activations per 128 columns (ADR 0018; off: bf16 activations)
    prefill_fp8_activations: bool = False
    # the MoE half of prefill steps of up to 32 tokens from CUDA graphs per token bucket (adapters/cuda_exec/
    # prefill_graphs.py), a mode of the fast path's Triton prefill: "auto" (on wherever the CUDA fast path runs the
    # Triton prefill without routing replay or expert parallelism, else off; the default since the H200 measured
    # it on 2026-12-04: a one-prompt 20-token step 11.49 -> 5.88 ms at 8 layers, c1 TTFT 0.080 -> 0.029-0.035 s)
    # | "on" (refused where it cannot run) | "off"
    prefill_graphs: str = "auto"
    tool_call_parser: str = "auto"  # "auto" (by architecture) | "none" | a name in app.tool_parsers
    reasoning_parser: str = "auto"  # "auto" (by architecture) | "none" | a name in app.reasoning
    allowed_origins: tuple[str, ...] = ()  # CORS for browser clients ("*" = any); () = no CORS headers
    verify_weights: bool = False  # scan every stored value for NaN/Inf at load (scales are always checked)
    # prefix cache (docs/adr/0004-prefix-cache.md): "radix" = resume from cached KV pages + GDN state snapshots
    cache_type: str = "radix"  # "radix" | "none"
    snapshot_slots: int | None = None  # GDN state snapshots; None = 4 per running request (radix), 0 (none)
    # streamed-prefill staging rows (docs/adr/0010-streamed-prefill.md); None = auto: the geometry's default on
    # the fast path when not every expert is resident, else 0; 0 = prefill through the expert LRU
    staging_experts: int | None = None
    # decode misses computed on the host CPU beside the link's copies (docs/adr/0030-host-expert-compute.md): a share
    # in per mille (0..1000) of each lookup's misses, or "auto" (the fast executor measures the host kernel's rate
    # and the link's at start-up and balances them); None or 0 = off. The CUDA fast path on one GPU only.
    host_experts: int | str | None = None
    # expert parallelism (docs/adr/0008-expert-parallel.md): N ranks, the experts split over them; rank 0 serves.
    expert_parallel: int = 1
    ep_rank: int = 0  # set by `ft serve --expert-parallel N` for the ranks it starts
    ep_address: str | None = None  # torch.distributed rendezvous (tcp://127.0.0.1:PORT), set with ep_rank

    @property
    def mixed_step_tokens(self) -> int:
        """The budget of a step that carries decodes: --mixed-prefill-length, else the default (512) bounded
        by --max-prefill-length and raised to --max-running-requests (every running request decodes)."""
        if self.mixed_prefill_length is not None:
            return self.mixed_prefill_length
        return min(self.max_prefill_length, max(DEFAULT_MIXED_STEP_TOKENS, self.max_running_requests))

    @property
    def layer_group_tokens(self) -> int:
        """The budget, decodes included, that sizes a layer group: --layer-group-length, else the default (1024)
        raised to the mixed budget and bounded by --max-prefill-length."""
        return layer_group_tokens(self.max_prefill_length, self.mixed_step_tokens, self.layer_group_length)

    @property
    def layers_short_prompts(self) -> bool:
        """--layer-short-prompts auto with --layered-prefill on: the scheduler layers every chunk beside decodes
        wherever the plan leaves experts out (SchedulerConfig.layer_short_prompts)."""
        return self.layered_prefill and self.layer_short_prompts == "auto"

    @property
    def host_experts_share(self) -> int | str:
        """--host-experts as the fast executor takes it: per mille of each lookup's misses, or "auto"; 0 = off."""
        return self.host_experts or 0

    def _fast_path_clashes(self, *extra: tuple[str, bool]) -> list[str]:
        """The flags set here that keep the CUDA-graph fast path from serving (the reference executor would), and
        those of `extra` (flag, set) pairs that are set: what a fast-path-only option is refused with."""
        return [flag for flag, on in (("--device cpu", self.device == "cpu"),
                                      ("--executor reference", self.executor == "reference"),
                                      *extra,
                                      ("--mmap-experts", self.mmap_experts),
                                      ("--record-routing", self.record_routing is not None)) if on]

    def __post_init__(self) -> None:
        if self.max_running_requests < 1:
            raise ValueError(f"--max-running-requests must be >= 1, got {self.max_running_requests}")
        if self.max_prefill_length < self.max_running_requests:
            raise ValueError(f"--max-prefill-length ({self.max_prefill_length}) must be >= --max-running-requests "
                             f"({self.max_running_requests}): every request decodes each step")
        if self.mixed_prefill_length is not None and not (
                self.max_running_requests <= self.mixed_prefill_length <= self.max_prefill_length):
            raise ValueError(f"--mixed-prefill-length ({self.mixed_prefill_length}) must be >= --max-running-requests "
                             f"({self.max_running_requests}) and <= --max-prefill-length ({self.max_prefill_length})")
        if self.layer_group_length is not None and not (
                self.max_running_requests <= self.layer_group_length <= self.max_prefill_length):
            raise ValueError(f"--layer-group-length ({self.layer_group_length}) must be >= --max-running-requests "
                             f"({self.max_running_requests}) and <= --max-prefill-length ({self.max_prefill_length})")
        if self.layer_group_length is not None and not self.layered_prefill:
            raise ValueError("--layer-group-length sizes layer groups: it needs --layered-prefill on")
        if self.layer_short_prompts not in LAYER_SHORT_PROMPTS:
            raise ValueError(f"--layer-short-prompts must be auto or off, got {self.layer_short_prompts!r}")
        if not (math.isfinite(self.arrival_window_ms) and 0 <= self.arrival_window_ms <= 1000):
            raise ValueError(f"--arrival-window-ms must be between 0 and 1000, got {self.arrival_window_ms}")
        if not 0 < self.memory_ratio <= 1:
            raise ValueError(f"--memory-ratio must be in (0, 1], got {self.memory_ratio}")
        if self.gpu_budget_gib is not None and not 0 < self.gpu_budget_gib < math.inf:  # NOTE: False for nan
            raise ValueError(f"--gpu-budget-gib must be a positive number of GiB, got {self.gpu_budget_gib}")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.prefill_kernels not in PREFILL_KERNELS:
            raise ValueError(f"--prefill-kernels must be auto, reference or triton, got {self.prefill_kernels!r}")
        if self.prefill_fp8_activations:
            # NOTE: with auto, whether the Triton prefill runs is known once the checkpoint is read (the executor
            # refuses it then, naming auto's reason); reference is refused here
            if self.prefill_kernels == "reference":
                raise ValueError("--prefill-fp8-activations is a mode of the Triton prefill: use --prefill-kernels "
                                 "triton (or auto), not reference")
            # NOTE: as for --executor cuda-graph: what can be known before loading is refused here; the rest
            # (--device auto without CUDA, an unpinned bank, no FP8 weights) when the executor is built, on /health
            clash = self._fast_path_clashes()
            if clash:
                raise ValueError(f"--prefill-fp8-activations needs the CUDA fast path, which cannot run with "
                                 f"{', '.join(clash)}")
        if self.prefill_graphs not in PREFILL_GRAPHS:
            raise ValueError(f"--prefill-graphs must be auto, on or off, got {self.prefill_graphs!r}")
        if self.prefill_graphs == "on":  # NOTE: auto turns itself off where these clash (app.containers)
            clash = self._fast_path_clashes(("--prefill-kernels reference", self.prefill_kernels == "reference"),
                                            ("--expert-parallel", self.expert_parallel > 1),
                                            ("--routing-replay", self.routing_replay is not None))
            if clash:
                raise ValueError(f"--prefill-graphs is a mode of the CUDA fast path's Triton prefill, which cannot run "
                                 f"with {', '.join(clash)}")
        if self.executor not in ("auto", "reference", "cuda-graph"):
            raise ValueError(f"--executor must be auto, reference or cuda-graph, got {self.executor!r}")
        if self.executor == "cuda-graph":
            # NOTE: what can be known before loading is refused here; the rest (no CUDA device after
            # --device auto, an unpinned bank) is refused when the executor is built, on /health
            clash = self._fast_path_clashes()  # (its --executor reference entry is off here)
            if clash:
                raise ValueError(f"--executor cuda-graph cannot run with {', '.join(clash)} (use --executor auto or "
                                 "reference)")
        if self.cache_type not in ("radix", "none"):
            raise ValueError(f"--cache-type must be radix or none, got {self.cache_type!r}")
        if self.snapshot_slots is not None and self.snapshot_slots < 0:
            raise ValueError(f"--snapshot-slots must be >= 0, got {self.snapshot_slots}")
        if self.staging_experts is not None and self.staging_experts < 0:
            raise ValueError(f"--staging-experts must be >= 0, got {self.staging_experts}")
        if self.host_experts is not None and (isinstance(self.host_experts, bool) or not (
                self.host_experts == "auto" or (isinstance(self.host_experts, int) and 0 <= self.host_experts <= 1000))):
            raise ValueError(f"--host-experts must be a share in per mille, 0 to 1000, or auto, got "
                             f"{self.host_experts!r}")
        if self.host_experts_share:
            # NOTE: as for --prefill-fp8-activations: what can be known before loading is refused here; the rest
            # (--device auto without CUDA, an unpinned bank) when the executor is chosen (app.containers), and what
            # only the checkpoint tells (experts not block FP8, no host compiler) by the executor itself
            clash = self._fast_path_clashes()
            if clash:
                raise ValueError(f"--host-experts needs the CUDA fast path (--executor cuda-graph on a CUDA device), "
                                 f"which cannot run with {', '.join(clash)}")
            if self.expert_parallel > 1:
                raise ValueError("--host-experts cannot run with --expert-parallel yet: ADR 0030 computes one GPU's "
                                 "misses on the host")
        if self.expert_parallel < 1 or not 0 <= self.ep_rank < self.expert_parallel:
            raise ValueError(f"--expert-parallel must be >= 1 (rank {self.ep_rank} of it), got {self.expert_parallel}")
        if self.expert_parallel > 1:
            # NOTE: routing replay rewrites each rank's ids from its own replay state (not proven to stay in
            # lockstep across ranks); routing recording runs on the one-process reference executor
            clash = [flag for flag, on in (("--record-routing", self.record_routing is not None),
                                           ("--routing-replay", self.routing_replay is not None)) if on]
            if clash:
                raise ValueError(f"--expert-parallel cannot run with {', '.join(clash)} yet")
        if self.api_key is not None and not (self.api_key and self.api_key.isascii() and self.api_key.isprintable()
                                             and self.api_key == self.api_key.strip()):
            # NOTE: "" used to mean "off" (`--api-key "$KEY"` with KEY unset served an open server); spaces around it
            # or characters outside printable ASCII can never arrive in a header, so every request was a 401
            raise ValueError("--api-key must be printable ASCII without surrounding spaces and not empty, got "
                             f"{len(self.api_key)} characters")
        if self.cpu_threads < 1:
            raise ValueError(f"--cpu-threads must be >= 1, got {self.cpu_threads}")
        if not 0 <= self.port < 65536:  # 0 = any free port (tests)
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        from app.reasoning import REASONING_PARSERS
        from app.tool_parsers import TOOL_PARSERS

        if self.tool_call_parser not in ("auto", "none", *TOOL_PARSERS):
            raise ValueError(f"--tool-call-parser must be auto, none or one of {sorted(TOOL_PARSERS)}, "
                             f"got {self.tool_call_parser!r}")
        if self.reasoning_parser not in ("auto", "none", *REASONING_PARSERS):
            raise ValueError(f"--reasoning-parser must be auto, none or one of {list(REASONING_PARSERS)}, "
                             f"got {self.reasoning_parser!r}")
        if self.routing_replay is not None and self.routing_replay.partition(":")[0] not in ("locality", "uniform",
                                                                                               "trace"):
            # NOTE: the spec's parameters are checked by app.containers.check_routing_replay (the simulator parses)
            raise ValueError(f"--routing-replay must be locality[:NAME=VALUE,...], uniform[:seed=N] or trace:FILE, "
                             f"got {self.routing_replay!r}")
        if self.record_routing is not None:
            # NOTE: checked before the model loads; otherwise the bad path surfaces only as a load error
            folder = os.path.dirname(os.path.abspath(self.record_routing))
            if not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
                raise ValueError(f"--record-routing {self.record_routing}: folder {folder} does not exist "
                                 "or is not writable")
