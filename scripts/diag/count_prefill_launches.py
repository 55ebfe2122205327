"""Launches of one prefill step of N short prompts on the fast path (--prefill-kernels triton), counted on the CPU:
a random Qwen3.5 MoE with the Qwen3.6-35B-A3B layer mix (40 layers: 3 Gated DeltaNet + 1 attention, ten
times) at tiny widths, one step of `--spans` prompts of `--tokens` tokens each (plus `--decodes` one-token
rows of sequences prefilled before), through CudaGraphExecutor's forward in Triton's interpreter.

Counted: every Triton kernel launch (by kernel) and every torch operator that would launch a kernel on a GPU
(view and allocation operators left out; operators run inside an interpreted kernel are not counted), in
the token mixers (`_attention`, `_linear_attention`) and in the whole forward. Launch counts do not depend
on the widths; they do on the layer mix, the span count and lengths (a Gated DeltaNet span over 2,048 tokens
walks its state in several windows) and the MoE's path (the tiny model's few experts route differently).

Why: the per-span cost of a step of many short prompts was launches and their Python (~40 ms per extra span
on the H200, 2026-12-02); this counts what a change removes, before a GPU run times it.

Also reported: `host_waits`, the operators that make a CUDA host wait for the device (`.item()`, a boolean mask's
`nonzero`, ...) with the adapters' line that called them; and, with --time-host, `host_ms`: the step's wall time on
this CPU with every Triton launch stubbed out (the kernels' arguments are still built, the interpreter does not
run), i.e. the Python and torch-operator time a GPU host would spend besides the Triton launchers' own overhead
(median of 5; the MoE half runs eagerly here, where the server replays it from a graph for steps of <= 32 tokens).

Usage: python scripts/diag/count_prefill_launches.py [--spans 16] [--tokens 20] [--decodes 0] [--time-host]
Run it from the root of the checkout to measure (PYTHONPATH=. for another checkout of the repository).
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, os.getcwd())

# operators after which a CUDA host waits for the device (the value or the shape comes back to the host)
HOST_WAITS = {"_local_scalar_dense", "item", "is_nonzero", "nonzero", "masked_select", "equal", "allclose", "unique",
              "_unique2", "repeat_interleave"}
NOT_LAUNCHES = {"empty", "empty_strided", "empty_like", "detach", "lift_fresh", "set_", "resize_"}


class Launches(TorchDispatchMode):
    """Counts torch operators (as a GPU would launch them) and Triton launches, by scope."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()  # (scope, name)
        self.triton: Counter = Counter()
        self.scope = "moe and the rest"
        self.in_kernel = False
        self.waits: Counter = Counter()  # (scope, operator, the adapters' calling line)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.in_kernel and name in HOST_WAITS:
            import traceback
            caller = [f for f in traceback.extract_stack() if "/adapters/" in f.filename][-1:]
            self.waits[(self.scope, name, " ".join(f"{Path(f.filename).name}:{f.lineno}" for f in caller))] += 1
        if not self.in_kernel and not func.is_view and name not in NOT_LAUNCHES:
            self.ops[(self.scope, name)] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spans", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=20)
    parser.add_argument("--decodes", type=int, default=0)
    parser.add_argument("--time-host", action="store_true", help="also time the step with Triton launches stubbed out")
    args = parser.parse_args()

    from triton.runtime.interpreter import InterpretedFunction

    from adapters.cuda_exec.executor import CudaGraphExecutor
    from adapters.torch_exec.step_inputs import flatten
    from domain.budget import GpuBudget, PoolRequest, plan_pools
    from domain.ports import SequenceWork, StepBatch
    from domain.request import SamplingParams
    from tests.adapters.torch_exec_models import PAGE_SIZE, build_hf_model, save_and_load

    torch.set_num_threads(1)
    config = dict(hidden_size=32, num_hidden_layers=40, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 10,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_key_heads=1,
                  linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=8,
                  num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
    ckpt = save_and_load(build_hf_model("qwen3_5_moe", config), Path(tempfile.mkdtemp()))
    rows = args.spans + args.decodes
    plan = plan_pools(ckpt.spec, GpuBudget(total_bytes=1 << 40),
                      PoolRequest(kv_tokens=PAGE_SIZE * rows * (-(-(args.tokens + 2) // PAGE_SIZE)),
                                  expert_slots=ckpt.spec.total_experts, state_slots=rows, page_size=PAGE_SIZE))
    ex = CudaGraphExecutor(ckpt, plan, "cpu", torch.float32, max_decode_rows=max(1, args.decodes),
                           prefill_kernels=True, use_graphs=False)
    pages = -(-(args.tokens + 2) // PAGE_SIZE)
    greedy = SamplingParams(temperature=0.0, max_tokens=4)

    def work(i: int, start: int, length: int) -> SequenceWork:
        return SequenceWork(f"r{i}", tuple((7 * i + j) % 96 for j in range(start, start + length)), start,
                            tuple(range(i * pages, (i + 1) * pages)), i, True, greedy, 0)

    def step(works) -> torch.Tensor:
        batch = StepBatch(tuple(works))
        assert ex.can_execute(batch) is None, ex.can_execute(batch)
        inp = flatten(batch, ex.device)
        ex._prepare_states(batch.works)
        with torch.inference_mode(), ex.experts.streamed_step():
            return ex.model.forward(inp, ex.kv, ex.state, ex.experts, ex.snapshots)

    decodes = range(args.spans, rows)
    if args.decodes:  # their prompts first, in a step of their own
        step([work(i, 0, args.tokens) for i in decodes])
    mode = Launches()
    run = InterpretedFunction.run

    def counted_run(self, *a, **k):
        mode.triton[(mode.scope, self.fn.__name__)] += 1
        mode.in_kernel = True
        try:
            return run(self, *a, **k)
        finally:
            mode.in_kernel = False

    def scoped(method):
        def wrapped(*a, **k):
            mode.scope = "token mixers"
            try:
                return method(*a, **k)
            finally:
                mode.scope = "moe and the rest"
        return wrapped

    InterpretedFunction.run = counted_run
    # NOTE: torch's CausalBias (a tensor subclass) cannot be created under a dispatch mode: made outside it
    import importlib

    from torch.utils._python_dispatch import _disable_current_modes

    def outside(fn):
        def wrapped(*a, **k):
            with _disable_current_modes():
                return fn(*a, **k)
        return wrapped

    for name in ("adapters.cuda_exec.prefill", "adapters.cuda_exec.prefill_spans"):
        try:
            module = importlib.import_module(name)
        except ImportError:  # the checkout before the batched mixers
            continue
        module.causal_lower_right = outside(module.causal_lower_right)
    ex.model._attention = scoped(ex.model._attention)
    ex.model._linear_attention = scoped(ex.model._linear_attention)
    works = [work(i, 0, args.tokens) for i in range(args.spans)] + [work(i, args.tokens, 1) for i in decodes]
    with mode:
        step(works)
    InterpretedFunction.run = run
    out = {"spans": args.spans, "tokens": args.tokens, "decodes": args.decodes, "layers": "30 GDN + 10 attention"}
    for scope in ("token mixers", "moe and the rest"):
        torch_ops = {n: c for (s, n), c in mode.ops.items() if s == scope}
        kernels = {n: c for (s, n), c in mode.triton.items() if s == scope}
        out[scope] = {"torch_ops": sum(torch_ops.values()), "triton": sum(kernels.values()),
                      "total": sum(torch_ops.values()) + sum(kernels.values()),
                      "triton_by_kernel": dict(sorted(kernels.items())),
                      "torch_by_op": dict(sorted(torch_ops.items(), key=lambda kv: -kv[1]))}
    out["host_waits"] = [{"scope": sc, "operator": n, "caller": c, "count": k} for (sc, n, c), k in mode.waits.items()]
    if args.time_host:
        out["host_ms"] = time_host(ex, step, works, InterpretedFunction)
    print(json.dumps(out, indent=1))


def time_host(ex, step, works, interpreted) -> dict:
    """{"step", "token mixers"}: median ms of 5 runs of `step(works)` with every Triton launch a no-op (the same
    works again: the outputs are garbage, only the host's time counts)."""
    import statistics
    import time

    run, mixers = interpreted.run, {"ms": 0.0}
    interpreted.run = lambda self, *a, **k: None

    def timed(method):
        def wrapped(*a, **k):
            t0 = time.perf_counter()
            try:
                return method(*a, **k)
            finally:
                mixers["ms"] += (time.perf_counter() - t0) * 1e3
        return wrapped

    ex.model._attention = timed(ex.model._attention)
    ex.model._linear_attention = timed(ex.model._linear_attention)
    steps, mixed = [], []
    try:
        for _ in range(5):
            mixers["ms"] = 0.0
            t0 = time.perf_counter()
            step(works)
            steps.append((time.perf_counter() - t0) * 1e3)
            mixed.append(mixers["ms"])
    finally:
        interpreted.run = run
    return {"step": round(statistics.median(steps), 2), "token mixers": round(statistics.median(mixed), 2)}


if __name__ == "__main__":
    main()
