"""Times the fast path's small kernels at the real Qwen3.6-35B-A3B shapes on a CUDA device and checks
them against their references there; writes one JSON record.

    python scripts/gpu_kernel_probe.py --out $OUT

- expert gather: 3 MiB rows from a pinned host bank into device slots (UVA), GB/s vs the copy engine
- dense GEMV: block-FP8 [8192, 2048] and [2048, 4096] at M = 1, 4, 16; GB/s of weight bytes
- layer lookup: the one-launch residency kernel at S = 10,240, T*K = 8..128, decisions vs the domain LRU
- fused norm: bitwise against the torch reference in bf16
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from gpu_check import hardware_profile  # noqa: E402


def bench(fn, reps: int = 50) -> float:
    """Median milliseconds of fn() over reps, by CUDA events."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return sorted(times)[len(times) // 2]


def probe_gather(rec: dict) -> None:
    from adapters.checkpoint.host_bank import allocate_rows
    from adapters.kernels.expert_gather import gather_rows

    row_bytes, rows = 3 * 2**20 + 3 * 256 * 4, 1024
    bank = allocate_rows(rows, row_bytes, pin=True)
    bank.random_(0, 256)
    slots = torch.empty((256, row_bytes), dtype=torch.uint8, device="cuda")
    out = {}
    for n in (8, 32, 128):
        keys = torch.randperm(rows)[:n].cuda()
        dst = torch.randperm(256)[:n].cuda()
        gather_rows(bank, slots, keys, dst)
        torch.cuda.synchronize()
        ok = all(torch.equal(slots[d].cpu(), bank[k]) for k, d in zip(keys.tolist()[:4], dst.tolist()[:4], strict=True))
        ms = bench(lambda k=keys, d=dst: gather_rows(bank, slots, k, d), reps=10)
        out[str(n)] = {"ms": round(ms, 4), "gb_s": round(n * row_bytes / ms / 1e6, 2), "correct": ok}
    src = bank[:32].reshape(-1)
    dst_flat = torch.empty_like(src, device="cuda")
    ms = bench(lambda: dst_flat.copy_(src, non_blocking=True), reps=10)
    out["copy_engine_32_rows_gb_s"] = round(src.numel() / ms / 1e6, 2)
    rec["gather"] = out


def probe_gemv(rec: dict) -> None:
    from adapters.checkpoint.quant import dequantize
    from adapters.checkpoint.quantize import quantize
    from adapters.kernels.dense_gemv import dense_gemv
    from domain.model_spec import WeightFormat

    out = {}
    for n, k in ((8192, 2048), (2048, 4096), (4096, 2048)):
        q = quantize(torch.randn(n, k, device="cuda") * 0.05, WeightFormat.FP8_BLOCK)
        wbytes = q.data.numel() + q.scale.numel() * 4
        ref_w = dequantize(q, torch.float32)
        for m in (1, 4, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            y = dense_gemv(x, q)
            ref = x.float() @ ref_w.T
            err = ((y.float() - ref).norm() / ref.norm()).item()
            cfg = {}
            for bn in (8, 16, 32, 64):
                ms = bench(lambda x=x, bn=bn, q=q: dense_gemv(x, q, block_n=bn, block_k=128))
                cfg[str(bn)] = {"us": round(ms * 1e3, 2), "gb_s": round(wbytes / ms / 1e6, 1)}
            bf16 = ref_w.to(torch.bfloat16)
            cublas_ms = bench(lambda x=x, w=bf16: torch.nn.functional.linear(x, w))
            out[f"{n}x{k}_m{m}"] = {"rel_err": err, "block_n": cfg, "cublas_bf16_us": round(cublas_ms * 1e3, 2)}
    rec["dense_gemv"] = out


def probe_lookup(rec: dict) -> None:
    from adapters.cuda_exec.device_residency import DeviceResidency
    from domain.residency import ExpertResidency

    layers, experts, slots, top_k = 40, 256, 10240, 8
    out = {}
    for rows, num_slots in ((1, slots), (4, slots), (16, slots), (4, 2048)):
        ref, dev = ExpertResidency(num_slots), DeviceResidency(num_slots, layers, experts, "cuda")
        rng = random.Random(rows)
        mismatches = 0
        for step in range(12):
            for layer in range(layers):
                ids = torch.tensor([rng.sample(range(experts), top_k) for _ in range(rows)], device="cuda")
                valid = torch.ones(rows, dtype=torch.bool, device="cuda")
                distinct = sorted(set(ids.flatten().tolist()))
                expected = ref.lookup([(layer, e) for e in distinct])
                ref.release()
                fk, fs, sid = dev.lookup_layer(layer, ids, valid)
                got = [(divmod(k, experts), s) for k, s in zip(fk.tolist(), fs.tolist(), strict=True) if k >= 0]
                if got != list(expected.fills) and step < 12:
                    mismatches += 1
        ids = torch.tensor([rng.sample(range(experts), top_k) for _ in range(rows)], device="cuda")
        valid = torch.ones(rows, dtype=torch.bool, device="cuda")
        ms_warm = bench(lambda i=ids, v=valid, d=dev: d.lookup_layer(3, i, v))  # all hits after the first call
        counters = dev.counters()
        out[f"rows{rows}_slots{num_slots}"] = {"mismatched_lookups": mismatches, "lookups": 12 * layers,
                                              "all_hit_us": round(ms_warm * 1e3, 2),
                                              "counters_match": counters[:2] == (ref.hits, ref.misses) or
                                              "diverged after the timing calls"}
        vals = torch.randint(0, 1 << 40, (num_slots,), device="cuda")
        out[f"rows{rows}_slots{num_slots}"]["torch_topk_us"] = round(
            bench(lambda v=vals, k=rows * top_k: torch.topk(v, k, largest=False)) * 1e3, 2)
        dev.check_valid()
    rec["layer_lookup"] = out


def probe_norm(rec: dict) -> None:
    from adapters.kernels.rms_norm import rms_norm
    from adapters.torch_exec import norms

    x = torch.randn(16, 2048, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(16, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, device="cuda", dtype=torch.bfloat16) * 0.1
    total, out = rms_norm(x, w, 1e-6, unit_offset=True, residual=r)
    want = norms.rms_norm(x + r, w, 1e-6, unit_offset=True)
    rec["rms_norm"] = {"sum_bitwise": bool(torch.equal(total, x + r)),
                       "norm_max_abs_diff": (out.float() - want.float()).abs().max().item(),
                       "us": round(bench(lambda: rms_norm(x, w, 1e-6, unit_offset=True, residual=r)) * 1e3, 2)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rec: dict = {"kind": "gpu_kernel_probe", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "hardware": hardware_profile("cuda")}
    for probe in (probe_norm, probe_gather, probe_gemv, probe_lookup):
        try:
            probe(rec)
        except Exception as exc:  # recorded, the next probe still runs
            import traceback

            rec[probe.__name__ + "_error"] = f"{exc}\n{traceback.format_exc()[-2000:]}"
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_kernel_probe.json").write_text(json.dumps(rec, indent=1))
        print(probe.__name__, "done", flush=True)
    print(json.dumps({k: v for k, v in rec.items() if k != "hardware"}, indent=None)[:8000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
