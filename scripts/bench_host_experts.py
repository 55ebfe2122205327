"""How fast can the host CPU compute decode-step experts? (ADR 0030's first question.)

ADR 0030 proposes computing part of a decode step's expert misses on the host instead of copying them over
PCIe. It pays only if the host computes experts from the pinned bank at tens of GB/s of weight bytes
(llama.cpp's CPU-experts figure on the H200's host implies ~47 GB/s through hand-written Q8_0 kernels). This
script times one token (bs1) through N experts of the Qwen3.6-35B-A3B geometry (gate/up 2×512×2048, down
2048×512) along every path torch offers on the CPU and our own kernel, at 1, 2, 4, 8, half and all threads, and
writes one JSON record:

- ``fp8_to_bf16``: the block-FP8 bank's bytes cast to bf16 (torch's cast), then two GEMVs: what a pure-torch
  host path over the bank we already keep would do.
- ``fp8_bits``: the same through integer bit operations (e4m3 → bf16 bits, the 2^120 exponent offset folded
  into the block scale), the fastest cast we found without native code.
- ``bf16``: GEMVs over weights already in bf16: the memory-bandwidth ceiling (would need a second, 2× larger
  host copy of every expert).
- ``int8_dynamic``: fbgemm's dynamically quantized int8 linear (a re-quantized host copy, not bitwise).
- ``compiled``: our host kernel (adapters/host_kernels/fp8_block_experts), reading packed block-FP8 bank
  rows in place, compiled for this host on first use (the build's seconds are recorded); ``compiled_2`` and
  ``compiled_4`` time calls of 2 and 4 experts, one layer's host share at bs1, where fixed costs show.

With ``--lane`` the host lane's thread itself is timed (adapters/host_kernels/host_lane): requests of 1, 2, 4 and
8 experts for one token, of 1 expert for 2, 4, 6 and 8 tokens routed alike and of 2 experts for 4 and 6, through its
mailbox, for each kind of team (``spin``: the lane's own spinning workers; ``openmp``: ATen's parallel_for on the
thread's OpenMP team) at half,
all but two and all but one of the cores: a request's fixed cost (waking the team, joining it) is what separates a
bs1 layer's ~1.5 experts from the rate above.

With ``--with-gather`` (CUDA) the compiled paths are timed again while pinned host → device copies loop (``CopyLoad``):
the decode step's gathers read the same host DRAM as the host lane, so what each gets while the other runs is what
ADR 0030's split has to work with (the record keeps both rates).

With ``--round-trip`` (CUDA) a layer's whole hand-off is timed through the GPU's two kernels by rows, against the
host's own time for the same request (``_round_trip``).

Rates are weight bytes of the block-FP8 expert (3 MiB) per second, so every path compares with the PCIe
link's 51 GB/s. Usage: ``python scripts/bench_host_experts.py --out $OUT/host_experts [--experts 16]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from adapters.checkpoint.expert_layout import ExpertLayout  # noqa: E402
from adapters.checkpoint.quant import QTensor  # noqa: E402
from adapters.host_kernels.fp8_block_experts import available, fp8_block_experts  # noqa: E402
from app.bench.hardware import hardware_profile  # noqa: E402
from domain.model_spec import WeightFormat  # noqa: E402

HIDDEN, INTER = 2048, 512
FP8_EXPERT_BYTES = 3 * HIDDEN * INTER  # gate, up, down at one byte a weight (scales left out)


def _fp8_bits_to_bf16(w: torch.Tensor) -> torch.Tensor:
    """e4m3 bytes → bf16 whose value is the e4m3 value × 2^-120 (normals and subnormals alike: both formats'
    fields line up once the 4 exponent bits sit in bf16's low exponent bits); the caller folds 2^120 into
    the block scale."""
    b = w.view(torch.uint8).to(torch.int16)
    return (((b & 0x80) << 8) | ((b & 0x7F) << 4)).view(torch.bfloat16)


def _paths(n: int, built: tuple[bool, str], bank_rows: int) -> dict:
    """name -> (a timed call, the experts it computes)."""
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(n, 2 * INTER, HIDDEN, generator=g) * 0.05).to(torch.float8_e4m3fn)  # [N, 2I, H]
    w2 = (torch.randn(n, HIDDEN, INTER, generator=g) * 0.05).to(torch.float8_e4m3fn)  # [N, H, I]
    x = torch.randn(1, HIDDEN, generator=g).to(torch.bfloat16)  # [1, H]
    silu = torch.nn.functional.silu

    def expert(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        gate, up = (x @ a.T).chunk(2, dim=-1)
        return (silu(gate) * up) @ b.T

    def fp8_to_bf16():
        for e in range(n):
            expert(w13[e].to(torch.bfloat16), w2[e].to(torch.bfloat16))

    scale = torch.tensor(2.0 ** 120, dtype=torch.bfloat16)

    def fp8_bits():
        for e in range(n):
            expert(_fp8_bits_to_bf16(w13[e]) * scale, _fp8_bits_to_bf16(w2[e]) * scale)

    w13b, w2b = w13.to(torch.bfloat16), w2.to(torch.bfloat16)

    def bf16():
        for e in range(n):
            expert(w13b[e], w2b[e])

    with warnings.catch_warnings():  # fbgemm's dynamic quantization is deprecated upstream; timed all the same
        warnings.simplefilter("ignore")
        q = [(torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(_linear(w13[e])), {torch.nn.Linear},
                                                     dtype=torch.qint8),
              torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(_linear(w2[e])), {torch.nn.Linear},
                                                     dtype=torch.qint8)) for e in range(n)]
    xf = x.float()

    def int8_dynamic():
        for a, b in q:
            gate, up = a(xf).chunk(2, dim=-1)
            b(silu(gate) * up)

    # the bit cast must equal torch's cast exactly, or its rate means nothing
    assert torch.equal(_fp8_bits_to_bf16(w13[0]).float() * 2.0 ** 120, w13[0].float())
    paths = {"fp8_to_bf16": (fp8_to_bf16, n), "fp8_bits": (fp8_bits, n), "bf16": (bf16, n),
             "int8_dynamic": (int8_dynamic, n)}
    if built[0]:
        layout = ExpertLayout(WeightFormat.FP8_BLOCK, HIDDEN, INTER)
        scales = [torch.ones(-(-r // 128), -(-c // 128)) for r, c in ((INTER, HIDDEN), (INTER, HIDDEN),
                                                                        (HIDDEN, INTER))]
        bank = torch.stack([layout.pack(*(QTensor(WeightFormat.FP8_BLOCK, tuple(d.shape), data=d, scale=s)
                                          for d, s in zip((w13[e, :INTER], w13[e, INTER:], w2[e]), scales,
                                                          strict=True))) for e in range(n)])  # [N, R]
        # NOTE: the bank is tiled to bank_rows rows and each call takes the next rows, so the weights come from
        # DRAM as a real bank's would, not from a last-level cache that holds 16 experts (48 MiB)
        bank = bank.repeat(-(-bank_rows // n), 1)  # [N', R]
        paths["compiled"] = (_rotating(xf, bank, layout, n), n)
        paths["_bank"] = (bank, layout)  # not a path: the bank --lane serves from
        for k in (2, 4):  # one layer's host share at bs1: a call's fixed costs (threads forked twice) show here
            paths[f"compiled_{k}"] = (_rotating(xf, bank, layout, k), k)
    return paths


def _rotating(x: torch.Tensor, bank: torch.Tensor, layout: ExpertLayout, k: int):
    """A call of k experts for one token, each call on the bank's next k rows."""
    state = {"next": 0}
    tokens, weights = torch.zeros(k, dtype=torch.int64), torch.full((k,), 1.0 / k)

    def call():
        rows = (state["next"] + torch.arange(k)) % bank.shape[0]
        state["next"] = int(rows[-1]) + 1
        fp8_block_experts(x, bank, layout, tokens, rows, weights)
    return call


class CopyLoad:
    """Pinned host → device copies looping on a side stream (what a decode step's gathers do to host DRAM while the
    host lane computes), from a thread, in batches of 16 copies of `rows` 3 MiB rows between syncs. A context
    manager; `gb_s` is the copies' rate while it ran."""

    def __init__(self, rows: int = 64):
        self.src = torch.empty(rows, 3 << 20, dtype=torch.uint8, pin_memory=True)
        self.dst = torch.empty_like(self.src, device="cuda")
        self.stream = torch.cuda.Stream()
        self.gb_s = 0.0

    def _loop(self) -> None:
        copied, start = 0, time.perf_counter()
        with torch.cuda.stream(self.stream):
            while not self._stop.is_set():
                for _ in range(16):
                    self.dst.copy_(self.src, non_blocking=True)
                self.stream.synchronize()  # releases the GIL while the copies run
                copied += 16 * self.src.numel()
        self.gb_s = copied / (time.perf_counter() - start) / 1e9

    def __enter__(self) -> CopyLoad:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        time.sleep(0.2)  # the copies under way before anything is timed
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _lane_rates(bank: torch.Tensor, layout: ExpertLayout, threads: list[int], requests: int) -> dict:
    """name -> µs a request and GB/s through a running host lane, per team, thread count and experts a request."""
    from adapters.host_kernels import host_lane

    device = "cuda" if torch.cuda.is_available() else "cpu"  # cuda: the mailbox pinned, as the executor has it
    results = {}
    for team in host_lane.TEAMS:
        for t in threads:
            with host_lane.HostLane(bank, layout, torch.arange(bank.shape[0]), 8, 8, device, threads=t,
                                    team=team) as lane:
                lane.warm_up(requests=1500, experts=2)  # ~0.25 s
                # (experts, rows): one row, then rows routed alike (a batch of one prompt: each expert read once a
                # weight pass of 4 rows): 2, 4, 6 and 8 rows of one expert, 4 and 6 rows of two, the price of a host
                # key by its rows (ADR 0030, "Session 42": 6 rows alike cost more than the split's weights say)
                for k, rows in ((1, 1), (2, 1), (4, 1), (8, 1), (2, 4), (1, 2), (1, 4), (1, 6), (1, 8), (2, 6)):
                    lane.measure(requests=8, experts=k, rows=rows)  # the team awake and spinning, as inside a step
                    gb_s = lane.measure(requests=requests, experts=k, rows=rows)
                    us = k * layout.row_bytes / gb_s / 1e3
                    name = f"lane_{team}_{k}@{t}" + ("" if rows == 1 else f"x{rows}rows")
                    results[name] = {"us_per_request": round(us, 1), "experts_per_call": k, "rows": rows,
                                     "fp8_gb_s": round(gb_s, 2), "threads": t, "team": team}
                    print(f"lane {team:7s} {t:3d} threads {k} experts {rows} rows {us:8.1f} us/request"
                          f"  {gb_s:7.2f} GB/s")
    return results


def _round_trip(bank: torch.Tensor, layout: ExpertLayout, threads: int, replays: int = 20) -> dict:
    """name -> µs of one layer's hand-off through the GPU (CUDA only): host_lane_publish then host_lane_wait, as a
    decode step runs them, CUDA-graph replays of one such pair an expert of the bank (each a different expert, the
    whole bank cycled as HostLane.measure cycles it, so both read the same memory), for T = 1, 2, 4, 6, 8 rows in
    three shapes: ``alike`` (every row routed to the one host expert: the host's work grows with the rows), ``one``
    (T rows published, only row 0 routed: the host's work is one row's, the hand-off's is T rows': x out, the partial
    back) and ``none`` (no host pair: the two launches alone). Beside each, the host alone (HostLane.measure from
    Python: one expert for T rows alike, for ``one`` for its one row), and ``excess_us``, the round trip less it
    (``gpu_side_us`` in session 43's record): the hand-off's GPU side plus whatever the host does for the rows it is
    handed beyond that request (ADR 0030, "Session 43": the step profiles put ~17 µs a routed row there). At 1, 4 and
    6 rows both are timed again while pinned copies loop (``+copies``: a step's gathers read the host's DRAM while the
    host computes)."""
    from adapters.host_kernels import host_lane

    k_top, m = 8, 8
    n_pairs = bank.shape[0]
    results = {}

    def graph_of(lane, x, pairs, w, out):
        for _ in range(2):  # compile, then warm the team
            for i in range(n_pairs):
                lane.publish(x, pairs[i], w)
                lane.wait_add(out)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(n_pairs):
                lane.publish(x, pairs[i], w)
                lane.wait_add(out)
        graph.replay()
        torch.cuda.synchronize()
        return graph

    def timed(lane, graph, shape: str, rows: int) -> dict:
        start = time.perf_counter()
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
        us = (time.perf_counter() - start) / (replays * n_pairs) * 1e6
        error = lane.device_error()
        if error[0]:
            raise RuntimeError(f"the host lane failed a round trip: {error}, {lane.host_error()}")
        entry = {"us_per_layer": round(us, 2), "rows": rows, "shape": shape, "threads": threads}
        if shape != "none":
            host_rows = rows if shape == "alike" else 1
            lane.measure(requests=8, experts=1, rows=host_rows)
            gb_s = lane.measure(requests=n_pairs * 4, experts=1, rows=host_rows)
            entry["host_alone_us"] = round(layout.row_bytes / gb_s / 1e3, 2)
            entry["excess_us"] = round(us - entry["host_alone_us"], 2)
        return entry

    with host_lane.HostLane(bank, layout, torch.arange(bank.shape[0]), k_top, m, "cuda", threads=threads) as lane:
        lane.warm_up(requests=1500, experts=2)  # ~0.25 s
        for rows in (1, 2, 4, 6, 8):
            x = torch.randn(rows, layout.hidden, device="cuda", dtype=torch.bfloat16)
            w = torch.full((rows, k_top), 1.0 / k_top, device="cuda")
            out = torch.zeros(rows, layout.hidden, device="cuda", dtype=torch.bfloat16)
            for shape in ("alike", "one", "none"):
                pairs = torch.full((n_pairs, rows, k_top), -1, dtype=torch.int64)
                keys = torch.arange(n_pairs)  # [P] one expert (bank row) a pair of launches
                if shape == "alike":
                    pairs[:, :, 0] = keys[:, None]
                elif shape == "one":
                    pairs[:, 0, 0] = keys
                pairs = pairs.reshape(n_pairs, -1).cuda()  # [P, T*K]
                graph = graph_of(lane, x, pairs, w, out)
                loads = (False, True) if rows in (1, 4, 6) and shape != "none" else (False,)
                for loaded in loads:
                    if loaded:
                        with CopyLoad() as load:
                            entry = timed(lane, graph, shape, rows)
                        entry["copies_gb_s"] = round(load.gb_s, 2)
                    else:
                        entry = timed(lane, graph, shape, rows)
                    name = f"round_trip_{shape}{'+copies' if loaded else ''}_x{rows}@{threads}"
                    results[name] = entry
                    print(f"round trip {shape + ('+copies' if loaded else ''):12s} {rows} rows "
                          f"{entry['us_per_layer']:8.1f} us/layer"
                          + (f"  host alone {entry['host_alone_us']:7.1f}  excess {entry['excess_us']:7.1f}"
                             if shape != "none" else ""))
    return results


def _linear(w: torch.Tensor) -> torch.nn.Linear:
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight.data.copy_(w.float())
    return lin


def _time(fn, repeats: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t) / repeats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for host_experts.json")
    p.add_argument("--experts", type=int, default=16, help="experts per timed call (one token's misses)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--bank-rows", type=int, default=256, help="rows of the compiled path's bank (3 MiB each)")
    p.add_argument("--with-gather", action="store_true",
                   help="on CUDA: also time our kernel at every thread count while pinned host->device copies loop "
                        "(the decode step's gathers read the same DRAM; ADR 0030), and the copies alone")
    p.add_argument("--lane", action="store_true",
                   help="also time the host lane's thread through its mailbox, per kind of team (module docstring)")
    p.add_argument("--round-trip", action="store_true",
                   help="on CUDA: time a layer's hand-off through the GPU (publish, then wait) by rows (_round_trip)")
    args = p.parse_args()
    cores = os.cpu_count() or 1
    threads = sorted({t for t in (1, 2, 4, 8, cores // 2, cores) if 1 <= t <= cores})
    t = time.perf_counter()
    built = available()
    build_seconds = round(time.perf_counter() - t, 1)
    paths = _paths(args.experts, built, args.bank_rows)
    bank_layout = paths.pop("_bank", None)
    record: dict = {"kind": "bench_host_experts", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "hardware": hardware_profile(measure_bandwidth=False), "experts": args.experts,
                    "bank_rows": args.bank_rows, "fp8_expert_bytes": FP8_EXPERT_BYTES,
                    "compiled_build": {"ok": built[0], "detail": built[1], "seconds": build_seconds}, "results": {}}
    for t in threads:
        torch.set_num_threads(t)
        for name, (fn, n) in paths.items():
            sec = _time(fn, args.repeats * max(1, args.experts // n))
            rate = n * FP8_EXPERT_BYTES / sec / 1e9
            record["results"][f"{name}@{t}"] = {"ms_per_call": round(sec * 1e3, 4), "experts_per_call": n,
                                                "ms_per_expert": round(sec * 1e3 / n, 4),
                                                "fp8_gb_s": round(rate, 2), "threads": t}
            print(f"{name:14s} {t:3d} threads  {sec * 1e3 / n:8.3f} ms/expert  {rate:7.2f} GB/s")
    if args.with_gather and torch.cuda.is_available() and built[0]:
        with CopyLoad() as alone:
            time.sleep(1.0)
        record["copies_alone_gb_s"] = round(alone.gb_s, 2)
        print(f"pinned copies alone {alone.gb_s:7.2f} GB/s")
        for t in threads:
            torch.set_num_threads(t)
            for name in (n for n in paths if n.startswith("compiled")):
                fn, n = paths[name]
                with CopyLoad() as load:
                    sec = _time(fn, args.repeats * max(1, args.experts // n))
                rate = n * FP8_EXPERT_BYTES / sec / 1e9
                record["results"][f"{name}+copies@{t}"] = {
                    "ms_per_call": round(sec * 1e3, 4), "experts_per_call": n, "fp8_gb_s": round(rate, 2),
                    "threads": t, "copies_gb_s": round(load.gb_s, 2)}
                print(f"{name + '+copies':20s} {t:3d} threads  {rate:7.2f} GB/s, copies {load.gb_s:7.2f} GB/s")
    if args.lane and bank_layout is not None:
        lane_threads = sorted({t for t in (cores // 2, cores - 2, cores - 1) if t >= 1})
        record["results"].update(_lane_rates(*bank_layout, lane_threads, args.repeats * 20))
    if args.round_trip and bank_layout is not None and torch.cuda.is_available():
        record["results"].update(_round_trip(*bank_layout, max(1, cores - 1)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "host_experts.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
