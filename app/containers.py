"""The ONE wiring point: the only module in app/ that reaches adapters (import-linter enforces it).

Tests and demos swap any provider for a fake with ``provider.override(...)``; overriding
``model_spec``, ``generation_config``, ``tokenizer`` and ``executor`` means no checkpoint is
ever read. Adapter imports sit inside the factories so `ft ctl` starts without torch.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from dependency_injector import containers, providers

from app import reasoning, tool_parsers
from app.engine import Engine
from app.runtime import ModelInfo
from app.settings import ServeSettings
from app.stats import ServingStats
from domain.arrival_window import ArrivalWindow
from domain.budget import GpuBudget, PlanRefusal, PoolPlan, plan_pools
from domain.kv_pages import PageAllocator
from domain.model_spec import ModelSpec, WeightFormat
from domain.ports import Tokenizer
from domain.prefill_choice import PrefillChoice, resolve_prefill_kernels
from domain.prefix_store import snapshot_interval
from domain.scheduler import Scheduler, SchedulerConfig
from domain.serve_plan import ServePools, cap_bytes, embedding_on_host, plan_serve_pools, serve_budget
from domain.step_budget import blame_step, reserve_step, serve_step_reserve, serve_step_tokens

log = logging.getLogger("fluxtide.serve")
GiB = 1024**3
# NOTE: without a GPU the "card" is emulated in host RAM; keep it small unless told otherwise.
CPU_DEFAULT_BUDGET_GIB = 0.5

ProgressFn = Callable[..., None]


def default_model_dir() -> str:
    from app.demo_model import DEMO_MODEL_DIR

    return str(DEMO_MODEL_DIR)


def model_dir_problem(settings: ServeSettings) -> str | None:
    """Why --model cannot be a checkpoint folder (it does not exist, is not a folder, has no config.json), or None.
    ft serve checks it before it listens (exit 2, as vLLM exits); what only reading the files can tell (a damaged
    shard) still comes after the start, as a 503 with the reason."""
    path = Path(settings.model_dir or default_model_dir())
    if not path.exists():
        return f"--model {path}: no such file or directory"
    if not path.is_dir():
        return f"--model {path}: not a directory (give the checkpoint's folder, the one holding config.json)"
    if not (path / "config.json").exists():
        return f"--model {path}: not a checkpoint directory (no config.json)"
    return None


def _model_dir(settings: ServeSettings) -> Path:
    if problem := model_dir_problem(settings):
        raise FileNotFoundError(problem)
    return Path(settings.model_dir or default_model_dir())


def resolve_device(settings: ServeSettings) -> str:
    if settings.device != "auto":
        return settings.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _load_checkpoint(settings: ServeSettings, device: str, progress: ProgressFn | None):
    from adapters.checkpoint.loader import load_checkpoint

    model_dir = _model_dir(settings)
    if progress:
        progress(f"reading {model_dir.name}")
    # NOTE: the loader reports its phases ("expert banks", "dense weights") with their own byte counts.
    return load_checkpoint(model_dir, device=device, progress=True, on_progress=progress,
                           mmap=settings.mmap_experts, verify_weights=settings.verify_weights,
                           expert_keys=_rank_keys(settings) if settings.expert_parallel > 1 else None)


def _rank_keys(settings: ServeSettings):
    """--expert-parallel N: the flat keys this rank owns (a function of the checkpoint's spec), so each rank
    loads only its share of the host bank (one copy of the experts in host RAM over all ranks)."""
    from domain.expert_parallel import ExpertPartition

    def keys(spec: ModelSpec) -> list[int]:
        partition = ExpertPartition.modulo(spec.num_layers, spec.num_experts, settings.expert_parallel)
        return [layer * spec.num_experts + e for layer in range(spec.num_layers)
                for e in partition.experts_of(settings.ep_rank, layer)]
    return keys


def _load_tokenizer(settings: ServeSettings, spec: ModelSpec) -> Tokenizer:
    from adapters.checkpoint.tokenizer import check_fits_model, load_tokenizer

    model_dir = _model_dir(settings)
    tokenizer = load_tokenizer(model_dir)
    check_fits_model(tokenizer, model_dir, spec.vocab_size)
    return tokenizer


def cuda_device_count() -> int:
    """GPUs this process sees (0 without CUDA); `ft serve --data-parallel` gives one to each worker."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _device_total_bytes(settings: ServeSettings, device: str) -> int:
    """The device's memory as the driver reports it (--gpu-budget-gib caps it in serve_budget); without a GPU
    the emulated card is the cap, or CPU_DEFAULT_BUDGET_GIB."""
    if device.startswith("cuda"):
        import torch

        _, total = torch.cuda.mem_get_info(torch.device(device))
        return total
    return cap_bytes(settings.gpu_budget_gib) or int(CPU_DEFAULT_BUDGET_GIB * GiB)


def _step_tokens(settings: ServeSettings, spec: ModelSpec) -> int:
    return serve_step_tokens(spec, settings.max_prefill_length, settings.max_running_requests)


def _step_reserve(settings: ServeSettings, spec: ModelSpec, device: str) -> int:
    """Bytes of the largest step's activations (domain/step_budget.py), in the executor's dtype."""
    dtype_bytes = 2 if device.startswith("cuda") else 4  # bf16 on CUDA, fp32 on the CPU (_torch_executor)
    return serve_step_reserve(spec, settings.max_prefill_length, settings.max_running_requests, dtype_bytes,
                              layered_prefill=settings.layered_prefill, dense_copy=_dense_copy(settings, spec, device))


def _dense_copy(settings: ServeSettings, spec: ModelSpec, device: str) -> bool:
    """Whether the fast prefill will dequantize dense weights into a copy for long chunks, so the plan holds it
    (prefill_linear.DEQUANT_MIN_ROWS: 1,024 rows by default, 0 turns it off): only where the Triton prefill runs
    (FastDecoder._linear sends a longer step to prefill_linear only then; the reference prefill keeps the GEMV
    path) and a step can reach the cut (--max-prefill-length, capped by the running requests' contexts). Imported
    here, not at the top: the module pulls in Triton."""
    if not planned_prefill(settings, spec, device).triton:
        return False
    from adapters.cuda_exec import prefill_linear

    cut = prefill_linear.DEQUANT_MIN_ROWS
    return cut > 0 and _step_tokens(settings, spec) >= cut


def _budget(settings: ServeSettings, spec: ModelSpec, device: str) -> GpuBudget:
    """The card's budget with the largest step's activations held outside the pools (ADR 0011): every plan
    made from it, live resizes included, leaves them room."""
    # NOTE: on CUDA the loader and the decoder (either executor) keep the input embedding in pinned host memory,
    # unless FLUXTIDE_HOST_EMBEDDING=0 (the loader asks the same switch: the two agree)
    from adapters.checkpoint.loader import host_embedding_enabled

    on_host = embedding_on_host(spec, device.startswith("cuda") and host_embedding_enabled())
    budget = serve_budget(spec, _device_total_bytes(settings, device), settings.memory_ratio,
                          cap_bytes(settings.gpu_budget_gib), host_embedding=on_host)
    return reserve_step(budget, _step_reserve(settings, spec, device))


def _fast_path_planned(settings: ServeSettings, device: str) -> bool:
    """Whether the fast path will likely serve, as far as the settings tell before the checkpoint is read (what
    _use_fast_path checks besides the pinned bank: CUDA, not --executor reference, --mmap-experts or
    --record-routing)."""
    return (device.startswith("cuda") and settings.executor != "reference" and not settings.mmap_experts
            and not settings.record_routing)


def planned_prefill(settings: ServeSettings, spec: ModelSpec, device: str) -> PrefillChoice:
    """The prefill the pool plan expects: --prefill-kernels resolved before any weight is read, from the spec's
    formats (the experts' one, the widest dense one).
    NOTE: the executor resolves again from the loaded weights (_prefill_choice); their formats differ only for a
    mixed-precision checkpoint whose widest dense format is validated and a narrower one is not, where the plan
    holds staging rows the reference prefill leaves unused (memory, never a wrong kernel)."""
    return resolve_prefill_kernels(settings.prefill_kernels, device=device,
                                   fast_path=_fast_path_planned(settings, device),
                                   expert_format=spec.expert_format, dense_formats=(spec.dense_format,))


def _streams_prefill(settings: ServeSettings, spec: ModelSpec, device: str) -> bool:
    """Where --staging-experts auto plans the geometry's default rows: the fast path will likely run with the
    Triton prefill (--prefill-kernels triton, or auto resolved to it: streaming is part of that prefill, ADR 0010);
    elsewhere auto is 0 (prefill goes through the expert cache as before)."""
    return _fast_path_planned(settings, device) and planned_prefill(settings, spec, device).triton


def serve_pools(settings: ServeSettings, spec: ModelSpec, device: str = "cpu") -> ServePools:
    """The pool-sizing flags of these settings for this model, as domain.serve_plan (and the simulator) take
    them (the model's weight formats decide what --prefill-kernels auto plans for)."""
    return ServePools(kv_tokens=settings.kv_tokens, expert_slots=settings.moe_slots,
                      max_running_requests=settings.max_running_requests,
                      kv_reserve_tokens=settings.kv_reserve_tokens, cache_type=settings.cache_type,
                      snapshot_slots=settings.snapshot_slots, staging_experts=settings.staging_experts,
                      streams_prefill=_streams_prefill(settings, spec, device))


def _pool_plan(settings: ServeSettings, spec: ModelSpec, budget: GpuBudget, device: str = "cpu") -> PoolPlan:
    """This process's pools; with --expert-parallel N its rank's share of plan_expert_parallel (the KV, state
    and snapshot pools alike on every rank, the expert slots over the keys the rank owns)."""
    if settings.expert_parallel == 1:
        return _plan(settings, spec, budget, plan_pools, device)
    from domain.expert_parallel import ExpertPartition, plan_expert_parallel

    partition = ExpertPartition.modulo(spec.num_layers, spec.num_experts, settings.expert_parallel)
    plan = _plan(settings, spec, budget, lambda s, b, r: plan_expert_parallel(s, b, r, partition), device)
    return plan.ranks[settings.ep_rank]


def _plan(settings: ServeSettings, spec: ModelSpec, budget: GpuBudget, planner, device: str = "cpu"):
    """planner(spec, budget, request) -> a plan (PoolPlan, or the expert-parallel plan of every rank) or a
    PlanRefusal; domain.serve_plan drops the defaults that do not fit (logged here) and caps the KV. A refusal
    names the step size when it is what tips the plan over: the same pools fit without its reserve (a budget
    made elsewhere, without the reserve, is taken as it is)."""
    pools = serve_pools(settings, spec, device)
    planned = plan_serve_pools(spec, budget, pools, planner)
    if isinstance(planned, PlanRefusal) and planned.shortfall_bytes == 0 and planned.pool in _POOL_OPTIONS:
        # NOTE: a size no budget can make work (expert slots outside [top_k, experts], KV below one page): the flag
        # and the range only, as the live resize's 409 says it; "raise the budget" would be wrong advice here
        raise ValueError(f"{_POOL_OPTIONS[planned.pool]}: {planned.message}")
    if isinstance(planned, PlanRefusal):
        reserve = _step_reserve(settings, spec, device)
        if budget.fixed_bytes >= reserve:
            bare = plan_serve_pools(spec, replace(budget, fixed_bytes=budget.fixed_bytes - reserve), pools, planner)
            planned = blame_step(planned, getattr(bare, "plan", bare), _step_tokens(settings, spec), reserve)
        raise ValueError(f"the pools do not fit: {planned.message}; {_refusal_fix(planned.pool, settings, device)}")
    for note in planned.notes:
        log.warning("%s", note)
    return planned.plan


# The `ft serve` option that sizes each pool a start-up refusal can name (PlanRefusal.pool).
_POOL_OPTIONS = {"kv": "--kv-tokens", "moe": "--moe-slots", "state": "--max-running-requests",
                 "snapshot": "--snapshot-slots", "staging": "--staging-experts", "activation": "--max-prefill-length"}


def _refusal_fix(pool: str, settings: ServeSettings, device: str) -> str:
    """What to change when the start-up plan is refused: the options that size the pools (the one that tipped it
    first), then the memory budget's own, which differ on a GPU and on the CPU (where --gpu-budget-gib IS the
    budget). NOTE: a refusal is deterministic, the same flags fail the same way: `ft serve` exits on it."""
    first = _POOL_OPTIONS.get(pool)
    sizes = ["--kv-tokens", "--moe-slots"]
    if first and first not in sizes:
        sizes.insert(0, first)
    elif first:
        sizes.remove(first)
        sizes.insert(0, first)
    if device.startswith("cuda"):
        budget = "raise the budget with --gpu-budget-gib (at most the card's memory) or --memory-ratio"
    else:
        now = settings.gpu_budget_gib if settings.gpu_budget_gib else CPU_DEFAULT_BUDGET_GIB
        budget = f"raise the CPU budget with --gpu-budget-gib (now {now:g} GiB)"
    return f"lower {' or '.join(sizes)} (or leave them unset: sized from the budget), or {budget}"


def _eos_ids(tokenizer: Tokenizer, generation_config: dict) -> tuple[int, ...]:
    configured = generation_config.get("eos_token_id")
    if configured is None:
        configured = []
    elif isinstance(configured, int):
        configured = [configured]
    return tuple(sorted(set(tokenizer.eos_token_ids) | set(configured)))


def _scheduler_config(settings: ServeSettings, spec: ModelSpec, plan: PoolPlan, eos: tuple[int, ...]):
    return SchedulerConfig(
        max_running=min(settings.max_running_requests, max(plan.state_slots, 1)),
        max_step_tokens=settings.max_prefill_length,
        mixed_step_tokens=settings.mixed_step_tokens,
        layer_group_tokens=settings.layer_group_tokens,
        page_size=plan.page_size,
        max_context=spec.max_context,
        eos_token_ids=eos,
        prefix_cache=settings.cache_type == "radix",
        snapshot_interval=snapshot_interval(plan.page_size),
        linear_state=spec.linear_state_bytes_per_sequence() > 0,
        layered_prefill=settings.layered_prefill,
        num_layers=spec.num_layers,
        # ADR 0024 "A0": on a plan that leaves experts out; a live resize says so again (Engine._install_pools)
        layer_short_prompts=settings.layers_short_prompts,
        partial_residency=plan.partial_residency,
    )


def check_device(settings: ServeSettings) -> None:
    """--device cuda / cuda:N where torch sees no such device: refused before the port opens (the load
    used to fail on /health with torch's AssertionError traceback while the process kept running)."""
    if not settings.device.startswith("cuda"):
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ValueError(f"--device {settings.device}: no CUDA device here (torch {torch.__version__}, CUDA build "
                         f"{torch.version.cuda or 'none'}); use --device cpu or auto")
    index = int(settings.device.partition(":")[2] or 0)
    if index >= count:
        raise ValueError(f"--device {settings.device}: torch sees {count} CUDA device(s), cuda:0 to cuda:{count - 1}")


def check_routing_replay(settings: ServeSettings) -> None:
    """--routing-replay parsed by the simulator before anything loads; ValueError naming what is wrong."""
    if settings.routing_replay:
        from simulator.replay_source import parse_replay_spec

        parse_replay_spec(settings.routing_replay)


def _routing_replay(settings: ServeSettings, spec: ModelSpec):
    """The executors' routing replay over the simulator's routing model (None: natural routing)."""
    if not settings.routing_replay:
        return None
    from adapters.torch_exec.routing_replay import RoutingReplayer
    from simulator.replay_source import replay_source

    source = replay_source(settings.routing_replay, spec.num_layers, spec.num_experts, spec.top_k)
    return RoutingReplayer(source, spec.num_layers, spec.num_experts, spec.top_k)


def _torch_executor(settings: ServeSettings, checkpoint, plan: PoolPlan, device: str, progress=None,
                    routing_replay=None):
    import torch

    from adapters.torch_exec.executor import TorchExecutor

    if device == "cpu":
        # NOTE: measured on the demo model on a busy 2-core box: a decode step took 10 ms with
        # one intra-op thread and 20-300 ms with two (thread-pool wake-ups under contention).
        torch.set_num_threads(settings.cpu_threads)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    if settings.expert_parallel > 1:
        _no_step_profiler("--expert-parallel serves")
        return _expert_parallel_executor(settings, checkpoint, plan, device, dtype, progress)
    fast = _use_fast_path(settings, checkpoint, device)
    choice = _prefill_choice(settings, checkpoint, device, fast)
    graphs = _prefill_graphs(settings, choice, fast)
    if fast:
        from adapters.cuda_exec.executor import CudaGraphExecutor

        return _reporting(choice, CudaGraphExecutor(
            checkpoint, plan, device, dtype, max_decode_rows=settings.max_running_requests, on_phase=progress,
            prefill_kernels=choice.triton, routing_replay=routing_replay, max_step_tokens=settings.max_prefill_length,
            warm_prefill=True, fp8_activations=settings.prefill_fp8_activations, prefill_graphs=graphs,
            host_experts=settings.host_experts_share,  # NOTE: 0 = off; "auto" passes through as it is
            step_profiler=_step_profiler()))  # NOTE: made first: before the executor captures its graphs
    _no_step_profiler("the reference executor serves")
    if settings.host_experts_share:
        # NOTE: not ignored: ServeSettings refused what it could see (--device cpu, --executor reference, ...); here
        # --device auto found no CUDA device, or the bank is not pinned
        why = (f"--device {settings.device} resolved to {device}, no CUDA device" if not device.startswith("cuda")
               else "the expert bank is not in pinned host memory")
        raise ValueError(f"--host-experts needs the CUDA fast path (--executor cuda-graph on a CUDA device), and the "
                         f"reference executor serves here ({why}); leave --host-experts unset or 0")
    if settings.prefill_fp8_activations:
        raise ValueError("--prefill-fp8-activations applies to the fast path's Triton prefill, which cannot run "
                         "here (the reference executor serves: CPU, --executor reference, --mmap-experts or "
                         "--record-routing)")
    recorder = None
    if settings.record_routing:
        from adapters.torch_exec.routing_trace import RoutingTraceRecorder

        recorder = RoutingTraceRecorder(settings.record_routing, checkpoint.spec.num_layers)
    return _reporting(choice, TorchExecutor(checkpoint, plan, device, dtype, routing_recorder=recorder,
                                            routing_replay=routing_replay, on_phase=progress))


def _profile_env(environ) -> tuple[str, str, int, bool] | None:
    """The step profiler's environment (docs/serving.md, "Step profiles"): (FLUXTIDE_PROFILE_DIR, which enables it,
    FLUXTIDE_PROFILE_STEPS (default prefill>0), FLUXTIDE_PROFILE_MAX (default 8), FLUXTIDE_PROFILE_STACKS 0|1), or
    None when off; ValueError naming the variable that is malformed (the filter's grammar is the adapter's)."""
    out_dir = environ.get("FLUXTIDE_PROFILE_DIR")
    if not out_dir:
        return None
    raw_max = environ.get("FLUXTIDE_PROFILE_MAX") or "8"
    if not (raw_max.isdigit() and int(raw_max) >= 1):
        raise ValueError(f"FLUXTIDE_PROFILE_MAX must be a whole number of steps >= 1, got {raw_max!r}")
    stacks = environ.get("FLUXTIDE_PROFILE_STACKS") or "0"
    if stacks not in ("0", "1"):
        raise ValueError(f"FLUXTIDE_PROFILE_STACKS must be 0 or 1, got {stacks!r}")
    return out_dir, environ.get("FLUXTIDE_PROFILE_STEPS") or "prefill>0", int(raw_max), stacks == "1"


def check_step_profiler(environ=None) -> None:
    """The FLUXTIDE_PROFILE_* variables checked before anything loads (`ft serve`), the directory made: ValueError
    naming what is wrong. Nothing imported or made when FLUXTIDE_PROFILE_DIR is unset."""
    _step_profiler(environ, build=False)


def _step_profiler(environ=None, build: bool = True):
    """The fast path's StepProfiler from the environment (adapters/cuda_exec/step_profiler.py), logged; None when
    FLUXTIDE_PROFILE_DIR is unset (or build is False: only checked)."""
    env = _profile_env(os.environ if environ is None else environ)
    if env is None:
        return None
    from adapters.cuda_exec.step_profiler import StepProfiler, parse_step_filter

    out_dir, steps, max_steps, stacks = env
    try:
        step_filter = parse_step_filter(steps)
        Path(out_dir).mkdir(parents=True, exist_ok=True)
    except ValueError as exc:
        raise ValueError(f"FLUXTIDE_PROFILE_STEPS: {exc}") from None
    except OSError as exc:
        raise ValueError(f"FLUXTIDE_PROFILE_DIR {out_dir}: cannot make it ({exc.strerror or exc})") from None
    if not build:
        return None
    log.info("step profiler: on: up to %d steps matching %r (FLUXTIDE_PROFILE_STEPS), Python stacks %s, into %s",
             max_steps, str(step_filter), "on" if stacks else "off", out_dir)
    return StepProfiler(out_dir, step_filter, max_steps, with_stack=stacks)


def _no_step_profiler(why: str, environ=None) -> None:
    """Says that FLUXTIDE_PROFILE_DIR profiles nothing here (where the fast path does not serve one process)."""
    if _profile_env(os.environ if environ is None else environ) is not None:
        log.warning("step profiler: off: FLUXTIDE_PROFILE_DIR profiles steps of the CUDA fast path in one process "
                    "only, and %s", why)


def _prefill_choice(settings: ServeSettings, checkpoint, device: str, fast: bool) -> PrefillChoice:
    """--prefill-kernels resolved for the executor about to serve (fast: _use_fast_path's answer) from the loaded
    weights' formats (domain/prefill_choice.py), logged; ValueError when --prefill-fp8-activations needs the Triton
    prefill that auto turned down (explicit triton keeps the executor's own checks)."""
    expert_format, dense_formats = None, ()
    if fast and device.startswith("cuda"):  # NOTE: only the fast path's checkpoint is read (a stub elsewhere)
        from adapters.checkpoint.quant import QTensor

        expert_format = checkpoint.experts.layout.fmt
        # plain tensors are the float weights (embeddings, norms, unquantized projections)
        dense_formats = {w.fmt if isinstance(w, QTensor) else WeightFormat.BF16 for w in checkpoint.dense.values()}
    choice = resolve_prefill_kernels(settings.prefill_kernels, device=device, fast_path=fast,
                                     expert_format=expert_format, dense_formats=dense_formats)
    if choice.triton and not fast:  # NOTE: as before auto: the reference executor has its own prefill only
        log.info("prefill: reference (%s applies to the CUDA-graph fast path; the reference executor serves)",
                 choice.reason)
    else:
        log.info("prefill: %s (%s)", choice.kernels, choice.reason)
    if settings.prefill_fp8_activations and fast and not choice.triton:
        raise ValueError(f"--prefill-fp8-activations is a mode of the Triton prefill, and --prefill-kernels "
                         f"{choice.requested} chose the reference prefill ({choice.reason}); add --prefill-kernels "
                         f"triton to run the Triton prefill anyway")
    return choice


def _prefill_graphs(settings: ServeSettings, choice: PrefillChoice, fast: bool) -> bool:
    """--prefill-graphs resolved for the executor about to serve (fast: _use_fast_path's answer; choice: the
    prefill _prefill_choice resolved), logged once. auto: on wherever the fast path runs the Triton prefill and
    neither routing replay (it rewrites ids between router and lookup) nor expert parallelism (a shard) excludes
    the segments, else off without complaint; on: ValueError where it cannot run (ServeSettings refused the clashes
    it can see before loading); off: never."""
    if settings.prefill_graphs == "on":
        if not fast:
            raise ValueError("--prefill-graphs applies to the fast path's Triton prefill, which cannot run here (the "
                             "reference executor serves: CPU, --executor reference, --mmap-experts or "
                             "--record-routing)")
        if not choice.triton:
            raise ValueError(f"--prefill-graphs is a mode of the Triton prefill, and --prefill-kernels "
                             f"{choice.requested} chose the reference prefill ({choice.reason}); add --prefill-kernels "
                             "triton to run it anyway")
    why_not = [why for why, off in (("--prefill-graphs off", settings.prefill_graphs == "off"),
                                    ("the reference executor serves", not fast),
                                    ("the reference prefill runs", fast and not choice.triton),
                                    ("--routing-replay", settings.routing_replay is not None),
                                    ("--expert-parallel", settings.expert_parallel > 1)) if off]
    # NOTE: "on" gets here only fast with the Triton prefill, and ServeSettings refused it with the last two
    if why_not:
        log.info("prefill graphs: off (%s: %s)", settings.prefill_graphs, "; ".join(why_not))
        return False
    log.info("prefill graphs: on (%s: the MoE half of steps of up to 32 tokens from CUDA graphs)",
             settings.prefill_graphs)
    return True


def _reporting(choice: PrefillChoice, executor):
    """The executor, carrying the prefill choice that Engine.executor_info reports (read by attribute, as the
    executor's own modes are; a fake without it reports none)."""
    executor.prefill_choice = choice
    return executor


def _expert_parallel_executor(settings: ServeSettings, checkpoint, plan: PoolPlan, device: str, dtype,
                              progress=None):
    """This rank's expert-parallel executor once every rank has joined the group (gloo on the CPU, NCCL on
    CUDA): the fast path's (captured decode graphs with the all-reduces inside) where `_use_fast_path` takes
    it, else the reference one; rank 0's wrapped in the StepLeader that sends each step to the others.
    NOTE: every rank decides alike (the same flags, the same kind of device and bank), and must."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    from adapters.torch_exec.expert_parallel import ExpertParallelExecutor, StepLeader
    from domain.expert_parallel import ExpertPartition

    if settings.ep_address is None:
        raise ValueError("--expert-parallel: no rendezvous address (ft serve sets it for every rank)")
    fast = _use_fast_path(settings, checkpoint, device)
    choice = _prefill_choice(settings, checkpoint, device, fast)
    _prefill_graphs(settings, choice, fast)  # NOTE: off here (a shard has no segments); logged as the prefill is
    if device.startswith("cuda"):
        # NOTE: allocations on the capture stream stay in the graph's pool (no record_stream), and NVLink
        # SHARP/multicast stays off (ADR 0005); an operator's own setting wins
        os.environ.setdefault("TORCH_NCCL_AVOID_RECORD_STREAMS", "1")
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    # NOTE: a rank that dies leaves the others in a collective; the timeout bounds how long they wait
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", init_method=settings.ep_address,
                            rank=settings.ep_rank, world_size=settings.expert_parallel, timeout=timedelta(minutes=10))
    spec = checkpoint.spec
    partition = ExpertPartition.modulo(spec.num_layers, spec.num_experts, settings.expert_parallel)
    if fast:
        from adapters.cuda_exec.expert_parallel import FastExpertParallelExecutor

        executor = FastExpertParallelExecutor(checkpoint, plan, partition, device=device, dtype=dtype,
                                              max_decode_rows=settings.max_running_requests, on_phase=progress,
                                              prefill_kernels=choice.triton,
                                              max_step_tokens=settings.max_prefill_length, warm_prefill=True,
                                              fp8_activations=settings.prefill_fp8_activations)
    elif settings.prefill_fp8_activations:
        raise ValueError("--prefill-fp8-activations applies to the fast path's Triton prefill; these expert-parallel "
                         "ranks run the reference executor")
    else:
        executor = ExpertParallelExecutor(checkpoint, plan, partition, device=device, dtype=dtype)
    _reporting(choice, executor)
    return StepLeader(executor) if settings.ep_rank == 0 else executor


def run_expert_parallel_follower(settings: ServeSettings) -> int:
    """Rank 1..N-1 of `ft serve --expert-parallel N`: load, plan, join the group, then run every step rank 0
    sends until it says stop. No HTTP, no scheduler: rank 0's are the only ones."""
    from adapters.torch_exec.expert_parallel import follow

    container = Container()
    container.settings.override(providers.Object(settings))
    executor = container.executor()
    steps = follow(executor)
    log.info("rank %d: stopped after %d steps", settings.ep_rank, steps)
    return 0


def _use_fast_path(settings: ServeSettings, checkpoint, device: str) -> bool:
    """--executor cuda-graph (refused where it cannot run) or auto (taken where it can)."""
    reasons = []
    if not device.startswith("cuda"):
        reasons.append("it needs a CUDA device")
    if checkpoint.experts.rows is None or not checkpoint.experts.rows.is_pinned():
        reasons.append("it gathers misses from a pinned host bank (not with --mmap-experts)")
    if settings.record_routing:
        reasons.append("routing recording runs on the reference executor")
    if settings.executor == "cuda-graph" and reasons:
        raise ValueError("--executor cuda-graph cannot run here: " + "; ".join(reasons))
    return settings.executor != "reference" and not reasons


def served_name(settings: ServeSettings) -> str:
    """--served-model-name, else the model directory's name; the embedded demo model (whose
    directory is just `checkpoint`) gets a name that says what it is."""
    if settings.served_model_name:
        return settings.served_model_name
    if not settings.model_dir or Path(settings.model_dir).resolve() == Path(default_model_dir()).resolve():
        from app.demo_model import DEMO_MODEL_NAME

        return DEMO_MODEL_NAME
    return Path(settings.model_dir).name


def _model_info(settings: ServeSettings, spec: ModelSpec, generation_config: dict) -> ModelInfo:
    name = served_name(settings)
    do_sample = generation_config.get("do_sample", True)
    return ModelInfo(
        served_name=name,
        model_dir=str(settings.model_dir or ""),
        max_context=spec.max_context,
        default_temperature=float(generation_config.get("temperature", 1.0)) if do_sample else 0.0,
        default_top_p=float(generation_config.get("top_p", 1.0)),
        default_top_k=int(generation_config.get("top_k", 0) or 0),
        tool_call_parser=_parser_choice(settings.tool_call_parser, tool_parsers.DEFAULT_BY_ARCHITECTURE, spec),
        reasoning_parser=_parser_choice(settings.reasoning_parser, reasoning.DEFAULT_BY_ARCHITECTURE, spec),
    )


def _parser_choice(setting: str, defaults: dict[str, str], spec: ModelSpec) -> str | None:
    if setting == "auto":
        return defaults.get(spec.architecture)
    return None if setting == "none" else setting


class Container(containers.DeclarativeContainer):
    settings = providers.Object(ServeSettings())
    progress = providers.Object(None)  # callable(phase, bytes_done, bytes_total) or None

    device = providers.Singleton(resolve_device, settings)
    checkpoint = providers.Singleton(_load_checkpoint, settings, device, progress)
    model_spec = providers.Singleton(lambda checkpoint: checkpoint.spec, checkpoint)
    generation_config = providers.Singleton(lambda checkpoint: dict(checkpoint.generation_config), checkpoint)
    tokenizer = providers.Singleton(_load_tokenizer, settings, model_spec)
    eos_token_ids = providers.Singleton(_eos_ids, tokenizer, generation_config)

    budget = providers.Singleton(_budget, settings, model_spec, device)
    pool_plan = providers.Singleton(_pool_plan, settings, model_spec, budget, device)
    allocator = providers.Singleton(lambda plan: PageAllocator(plan.kv_pages), pool_plan)
    scheduler_config = providers.Singleton(_scheduler_config, settings, model_spec, pool_plan, eos_token_ids)
    scheduler = providers.Singleton(
        lambda config, allocator, plan: Scheduler(config, allocator, plan.state_slots, plan.snapshot_slots),
        scheduler_config,
        allocator,
        pool_plan,
    )
    routing_replay = providers.Singleton(_routing_replay, settings, model_spec)
    executor = providers.Singleton(_torch_executor, settings, checkpoint, pool_plan, device, progress, routing_replay)
    stats = providers.Singleton(ServingStats)
    model_info = providers.Singleton(_model_info, settings, model_spec, generation_config)
    engine = providers.Singleton(
        lambda settings, **kw: Engine(debug=settings.debug,
                                      arrival_window=ArrivalWindow(settings.arrival_window_ms / 1000), **kw),
        settings,
        scheduler=scheduler,
        allocator=allocator,
        executor=executor,
        tokenizer=tokenizer,
        spec=model_spec,
        budget=budget,
        plan=pool_plan,
        stats=stats,
        eos_token_ids=eos_token_ids,
        routing_replay=routing_replay,
    )


def synth_main(argv: list[str]) -> int | None:
    """`ft synth ...`: the checkpoint synthesiser lives in adapters; forward the arguments."""
    from adapters.checkpoint.synth import main

    return main(argv)


# What the "sim" extra brings that the "serve" extra does not (pyproject.toml).
_SIM_EXTRA_MODULES = frozenset({"simpy", "matplotlib"})


def sim_main(argv: list[str]) -> int:
    """`ft sim ...`: the simulator's CLI (`python -m simulator`), arguments forwarded. Without the "sim" extra
    (the quick start installs "serve" only) it says what to install in one line instead of a traceback."""
    try:
        from simulator.__main__ import main

        return main(argv)
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] not in _SIM_EXTRA_MODULES:
            raise
        import sys

        print(f"ft sim: the simulator needs {exc.name}, which the sim extra installs: pip install -e \".[sim]\"",
              file=sys.stderr)
        return 1


def check_checkpoint_dir(model_dir: str, verify_weights: bool) -> str:
    """`ft check DIR`: every load-time check without allocating or serving; a summary line, or
    CheckpointFormatError (a ValueError) / FileNotFoundError naming the file and tensor."""
    from adapters.checkpoint.loader import check_checkpoint
    from adapters.checkpoint.tokenizer import check_fits_model, load_tokenizer

    checked = check_checkpoint(model_dir, verify_weights=verify_weights)
    checked.files.close()
    # NOTE: `ft serve` loads it too: a missing or broken tokenizer, or one past the vocabulary, fails the load
    check_fits_model(load_tokenizer(model_dir), model_dir, checked.spec.vocab_size)
    spec = checked.spec
    scan = "every value finite" if verify_weights else "scales finite (values not scanned: --verify-weights)"
    summary = (f"{model_dir}: ok: {spec.architecture}, {spec.num_layers} layers x {spec.num_experts} experts, "
               f"format {checked.format_label}, {len(checked.files.entries)} tensors; {scan}")
    return summary


def environment_api_key() -> str | None:
    return os.environ.get("FT_API_KEY") or None
