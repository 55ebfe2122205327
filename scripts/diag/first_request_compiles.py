"""What the first prefill requests of a server's life pay beyond their steady-state time, and why: every Triton
compile (JITFunction._do_compile) and autotune (Autotuner._bench) and every attention call through SDPA is
logged with its kernel, key and seconds, during the start-up warm-up and then during each prompt.

Why: on the H200 (HTTP, full Qwen3.6 block-FP8, resident, default `ft serve`, 2026-12-04) the first 1,030-token
prompt took 2.13 s to its first token and the second 0.14 s; the first 16,381-token prompt (two chunks of <= 8,192,
the second after 8k cached tokens) 2.31 s and the second 0.85 s; each first prompt of a new length ~90 ms more
than the second (4,090: 0.312 / 0.220, 8,187: 0.494 / 0.406). docs/prefill-kernels.md ("First requests") holds
what this script found.

Usage (CUDA): python scripts/diag/first_request_compiles.py --out DIR [--layers 4] [--chunk 8192]
    [--prompts 1030,1030,4090,4090,8187,8187,16381,16381] [--synth-dir /tmp/q36-first] [--no-graphs] [--cudnn-attention]
    python scripts/diag/first_request_compiles.py --out DIR --sdpa-probe
Builds the executor as `ft serve` does (prefill kernels, warm-up, prefill graphs), every expert resident, the
Qwen3.6-35B-A3B geometry at --layers layers (3 Gated DeltaNet : 1 attention), then prefills each prompt as a
fresh sequence in --chunk-token steps (time synchronised around each). Writes DIR/first_request_compiles.json:
per phase (warm-up, each prompt) its seconds, the compiles and tunings it ran, and its SDPA calls (query and
context lengths, the dispatch: cuDNN/flash for a span from 0, flash for one after a cached prefix; seconds,
synchronised). --sdpa-probe instead times bare SDPA calls at Qwen3.6's attention shape in a fresh process (the
first call of each kind and length against a repeat), writing DIR/sdpa_probe.json. --device cpu runs the logic on the tiny geometry in Triton's
interpreter (no compiles to see; a smoke run).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--prompts", default="1030,1030,4090,4090,8187,8187,16381,16381")
    p.add_argument("--synth-dir", default="/tmp/q36-first")
    p.add_argument("--device", default="cuda")
    p.add_argument("--no-graphs", action="store_true", help="without the prefill graphs (--prefill-graphs off)")
    p.add_argument("--cudnn-attention", action="store_true",
                   help="let torch pick cuDNN for a long span from position 0 (prefill_spans.CUDNN_ATTENTION; A/B)")
    p.add_argument("--sdpa-probe", action="store_true", help="only the bare SDPA probe, in this fresh process")
    args = p.parse_args()
    cuda = args.device.startswith("cuda")
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root))

    import torch
    import torch.nn.functional as F

    from adapters.checkpoint.loader import load_checkpoint
    from adapters.checkpoint.synth import synthesize
    from adapters.checkpoint.synth_config import GEOMETRIES
    from adapters.cuda_exec import prefill_spans
    from adapters.cuda_exec.executor import CudaGraphExecutor
    from domain.budget import GpuBudget, PoolRequest, plan_pools
    from domain.ports import SequenceWork, StepBatch
    from domain.request import SamplingParams

    prefill_spans.CUDNN_ATTENTION = args.cudnn_attention
    events: list[dict] = []

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    if cuda:
        from triton.runtime.autotuner import Autotuner
        from triton.runtime.jit import JITFunction

        compile_original, bench_original = JITFunction._do_compile, Autotuner._bench

        def compile_logged(self, key, *a, **kw):
            t0 = time.perf_counter()
            try:
                return compile_original(self, key, *a, **kw)
            finally:
                events.append({"what": "compile", "kernel": self.fn.__name__, "seconds": time.perf_counter() - t0,
                               "key": str(key)[:400]})

        def bench_logged(self, *a, config, **kw):
            t0 = time.perf_counter()
            try:
                return bench_original(self, *a, config=config, **kw)
            finally:
                named = getattr(self, "nargs", None) or {}
                key = [named.get(k, kw.get(k)) for k in self.keys]
                events.append({"what": "tune", "kernel": self.fn.__name__, "seconds": time.perf_counter() - t0,
                               "key": str(key), "config": str(config)})

        JITFunction._do_compile, Autotuner._bench = compile_logged, bench_logged

    sdpa_original = F.scaled_dot_product_attention

    def sdpa_logged(q, k, v, *a, **kw):
        sync()
        t0 = time.perf_counter()
        out = sdpa_original(q, k, v, *a, **kw)
        sync()
        events.append({"what": "sdpa", "q": q.shape[-2], "kv": k.shape[-2], "cudnn_allowed":
                       torch.backends.cuda.cudnn_sdp_enabled(), "seconds": time.perf_counter() - t0})
        return out

    # NOTE: prefill_spans' own F only: torch's CausalBias dispatch recognises SDPA by identity
    prefill_spans.F = SimpleNamespace(scaled_dot_product_attention=sdpa_logged)

    geometry = replace(GEOMETRIES["qwen3.6-35b-a3b" if cuda else "tiny"], num_hidden_layers=args.layers,
                       vocab_size=32768 if cuda else 256)
    out_dir = Path(args.synth_dir)
    t0 = time.perf_counter()
    if not (out_dir / "config.json").exists():
        synthesize(out_dir, geometry, "fp8_block", seed=0, tokenizer=False, progress=False, device=args.device)
    ckpt = load_checkpoint(out_dir, device=args.device, progress=False)
    spec = ckpt.spec
    prompts = [int(n) for n in args.prompts.split(",")]
    page = 16
    plan = plan_pools(spec, GpuBudget(total_bytes=1 << 40),
                      PoolRequest(kv_tokens=max(prompts) + args.chunk + 64, expert_slots=spec.total_experts,
                                  state_slots=4, page_size=page))
    record: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu (interpreter)",
                    "cudnn_attention": args.cudnn_attention,
                    "torch": torch.__version__, "layers": args.layers, "chunk": args.chunk,
                    "load_s": round(time.perf_counter() - t0, 2), "phases": []}
    try:
        import triton

        record["triton"] = triton.__version__
    except ImportError:
        pass

    def phase(name: str, fn) -> float:
        events.clear()
        sync()
        t = time.perf_counter()
        fn()
        sync()
        seconds = time.perf_counter() - t
        record["phases"].append({"phase": name, "seconds": round(seconds, 4),
                                 "compiles": sum(e["what"] == "compile" for e in events),
                                 "compile_s": round(sum(e["seconds"] for e in events if e["what"] == "compile"), 3),
                                 "tunings": sum(e["what"] == "tune" for e in events),
                                 "events": list(events)})
        print(f"{name}: {seconds:.3f} s, {record['phases'][-1]['compiles']} compiles "
              f"({record['phases'][-1]['compile_s']} s), {record['phases'][-1]['tunings']} tunings; sdpa "
              + ", ".join(f"{e['q']}x{e['kv']} {e['seconds'] * 1e3:.1f} ms" for e in events if e["what"] == "sdpa"),
              flush=True)
        for e in events:
            if e["what"] != "sdpa":
                print("   ", e["what"], e["kernel"], f"{e['seconds']:.3f}s", e["key"][:160], flush=True)
        return seconds

    if args.sdpa_probe:
        if cuda:
            probe(record, torch, sdpa_original)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "sdpa_probe.json").write_text(json.dumps(record, indent=1))
        return
    holder: dict = {}
    graphs = not args.no_graphs and cuda
    phase("start-up (decode capture, prefill warm-up, prefill graphs)", lambda: holder.setdefault("ex", CudaGraphExecutor(
        ckpt, plan, args.device, torch.bfloat16 if cuda else torch.float32, max_decode_rows=16,
        max_step_tokens=args.chunk, prefill_kernels=True, warm_prefill=True, prefill_graphs=graphs)))
    ex = holder["ex"]
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    pages = tuple(range(-(-(max(prompts) + 1) // page)))

    def prefill(n: int, seed: int) -> None:
        prompt = [(7919 * (i + 1) + 104729 * seed) % spec.vocab_size for i in range(n)]
        for s in range(0, n, args.chunk):
            part = tuple(prompt[s:s + args.chunk])
            ex.execute(StepBatch((SequenceWork(f"p{seed}", part, s, pages, 0, s + len(part) == n, greedy, 0),)))

    for i, n in enumerate(prompts):
        phase(f"prompt {n} (#{i})", lambda n=n, i=i: prefill(n, i))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "first_request_compiles.json").write_text(json.dumps(record, indent=1))


def probe(record: dict, torch, sdpa) -> None:
    """Bare SDPA at Qwen3.6's attention (16 query heads, 2 kv heads, D = 256, bf16): the first call of each
    (length, kind) against its repeat, kinds: is_causal (what a span from 0 dispatches to) and lower-right flash
    (a span after a cached prefix), and is_causal with the flash backend forced."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    rows = []

    def timed(kind: str, q_len: int, kv_len: int) -> None:
        q = torch.randn(1, 16, q_len, 256, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, 2, kv_len, 256, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        for rep in range(2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if kind == "causal":
                sdpa(q, k, v, is_causal=True, enable_gqa=True)
            elif kind == "causal_flash":
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    sdpa(q, k, v, is_causal=True, enable_gqa=True)
            else:
                sdpa(q, k, v, attn_mask=causal_lower_right(q_len, kv_len), enable_gqa=True)
            torch.cuda.synchronize()
            rows.append({"kind": kind, "q": q_len, "kv": kv_len, "rep": rep,
                         "ms": round((time.perf_counter() - t0) * 1e3, 2)})
            print("probe", rows[-1], flush=True)

    for kind, q_len, kv_len in (("causal", 1031, 1031), ("causal", 2000, 2000), ("causal", 4093, 4093),
                                ("causal_flash", 1033, 1033), ("causal_flash", 2001, 2001),
                                ("causal_flash", 8192, 8192), ("causal", 8192, 8192),
                                ("lower_right", 997, 1997), ("lower_right", 8189, 16381),
                                ("lower_right", 3001, 4001)):
        timed(kind, q_len, kv_len)
    record["sdpa_probe"] = rows


if __name__ == "__main__":
    main()
