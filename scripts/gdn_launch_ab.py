"""Launch-configuration A/Bs of the Gated DeltaNet prefill kernels, as the fast path's prefill launches them:
one prompt walked per 2,048-token window (prefill.delta_rule_walks: gdn_chunk_wy over its chunk table, then per
window one gdn_chunk_state over a span table and one gdn_chunk_out over the chunk table). Used by
scripts/bench_kernels.py (--only gdn-walk: bench_kernels.gdn_walk_points; --only gdn-out: gdn_out_points here).

Why the output's A/B (docs/prefill-kernels.md, "The output's launch configuration"): at 32 value columns a
program, each of a chunk's 4 programs per value head recomputes q k^T (64 x 64 x 128, more than half of its
products) and re-reads the chunk's q and k (fp32, 64 KiB); on the H100 (session 28) gdn_chunk_out took 28.4 ms of
an 8,192-token resident prefill of 302 ms, the GDN's largest kernel. 64 or 128 columns a program do that once or
twice a chunk, at the price of registers.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

# (BLOCK_V, num_warps, num_stages) of gdn_chunk_out, today's first (its kernel has no loop: stages change nothing
# but the build). 128 columns is one program a chunk and value head. (32, 8, 1) was the default until session 30
# (2026-12-06, H100: 64 x 4 warps 2.34x faster at 4k and 8k tokens).
GDN_OUT_CONFIGS = ((64, 4, 1), (32, 8, 1), (64, 8, 1), (64, 16, 1), (128, 8, 1), (128, 16, 1))
GDN_OUT_TOKENS = (4096, 8192)
QWEN36_GDN = (16, 32, 128, 128)  # Nk, Nv, Dk, Dv: Qwen3.6-35B-A3B's Gated DeltaNet heads


def max_rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest absolute difference relative to ref's largest value (0: the same bits)."""
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _cached_kernels(jit_fn) -> list:
    caches = getattr(jit_fn, "device_caches", None) or {}
    return [k for entry in caches.values() for k in entry[0].values()]


def kernel_ids(jit_fn) -> set[int]:
    """Ids of the binaries jit_fn has compiled so far (what compiled_stats compares against)."""
    try:
        return {id(k) for k in _cached_kernels(jit_fn)}
    except Exception:  # noqa: BLE001
        return set()


def compiled_stats(jit_fn, before: set[int]) -> dict | None:
    """Registers, spill bytes and shared memory of the binaries jit_fn compiled since `before` (kernel_ids), as the
    driver loaded them; None where this Triton keeps them elsewhere (or the interpreter ran)."""
    try:
        new = [k for k in _cached_kernels(jit_fn) if id(k) not in before]
        if not new:
            return None
        k = new[-1]
        # NOTE: the driver reports local memory per thread in 4-byte words (Triton's n_spills)
        return {"n_regs": int(k.n_regs), "spill_bytes": 4 * int(k.n_spills), "shared_bytes": int(k.metadata.shared)}
    except Exception:  # noqa: BLE001 - the stats are a bonus; the timing is the result
        return None


def prompt_walk(tokens: int, geometry=QWEN36_GDN, window: int | None = None, precise: bool = False,
                dev: str = "cuda", gen: torch.Generator | None = None) -> SimpleNamespace:
    """The inputs of one `tokens`-token prompt's GDN prefill at geometry (Nk, Nv, Dk, Dv), after gdn_chunk_wy:
    mixed fp32 [T, C] (the conv output), w / u0 [Nv, T, D*], gc / ks [Nv, T], state0 fp32 [1, Nv, Dk, Dv] (slot 0),
    the walk's launches and span table (step_plan.plan_walks over `window`-token windows, default
    prefill.GDN_WINDOW), the chunk table (starts, ends), u / state (working copies for the walk to overwrite),
    hs fp32 [Nv, chunks of the largest launch, Dk, Dv] and core fp32 [T, Nv, Dv] (buffers), and `reset()`, which
    puts u and state back to u0 and state0. bf16-model products (one TF32 pass) unless precise."""
    from adapters.cuda_exec.prefill import GDN_WINDOW
    from adapters.cuda_exec.step_plan import plan_walks
    from adapters.kernels.gdn_chunk_wy import gdn_chunk_wy

    window = window or GDN_WINDOW
    gen = gen or torch.Generator(device=dev).manual_seed(6)
    nk, nv, dk, dv = geometry
    mixed = torch.randn(tokens, 2 * nk * dk + nv * dv, device=dev, generator=gen)  # [T, C]
    a, b = (torch.randn(tokens, nv, device=dev, generator=gen) for _ in range(2))
    neg_a = -(torch.rand(nv, device=dev, generator=gen) * 2 - 1).exp()
    dt_bias = torch.randn(nv, device=dev, generator=gen)
    state0 = torch.randn(1, nv, dk, dv, device=dev, generator=gen) * 0.3  # [S, Nv, Dk, Dv], slot 0
    entries, launches = plan_walks([(slice(0, tokens), 0)], window)
    starts = torch.arange(0, tokens, 64, device=dev, dtype=torch.int64)  # [NC] the chunk table
    chunk_table = (starts, torch.full_like(starts, tokens))
    # [4, E], unit column stride even for one entry (a transposed [1, 4] keeps stride 4 there)
    walk_table = torch.tensor(list(zip(*entries, strict=True)), dtype=torch.int64, device=dev)
    wy_args = (mixed, a, b, neg_a, dt_bias, nk, dk, dv)
    w, u0, gc, ks = gdn_chunk_wy(*wy_args, precise=precise, chunks=chunk_table)
    p = SimpleNamespace(tokens=tokens, nk=nk, nv=nv, dk=dk, dv=dv, precise=precise, mixed=mixed, wy_args=wy_args,
                        w=w, u0=u0, gc=gc, ks=ks, state0=state0, launches=launches, walk_table=walk_table,
                        chunk_table=chunk_table, u=u0.clone(), state=state0.clone(),
                        hs=torch.empty(nv, max(c for *_, c in launches), dk, dv, device=dev),
                        core=torch.empty(tokens, nv, dv, device=dev))

    def reset():
        p.u.copy_(p.u0)
        p.state.copy_(p.state0)

    p.reset = reset
    return p


TODAY = (None, None, None)  # a kernel's launch as (block_v, num_warps, num_stages): None reads today's


def with_default_first(kernel_module, configs) -> tuple[tuple, list[tuple]]:
    """(today's launch of a kernel module with BLOCK_V and LAUNCH, configs as tuples with it first and not again)."""
    default = (kernel_module.BLOCK_V, kernel_module.LAUNCH["num_warps"], kernel_module.LAUNCH["num_stages"])
    return default, [default, *(tuple(c) for c in configs if tuple(c) != default)]


def first_build(stats: dict, cfg: tuple, jit_fn, fn):
    """fn(); the first time cfg runs, stats[cfg] records the binary jit_fn compiled for it (compiled_stats)."""
    before = kernel_ids(jit_fn) if cfg not in stats else None
    result = fn()
    if before is not None:
        stats[cfg] = compiled_stats(jit_fn, before)
    return result


def out_window(p: SimpleNamespace, chunk0: int, chunks: int, launch: tuple = TODAY) -> None:
    """One window's gdn_chunk_out (its chunks from chunk0 of the chunk table, entry states in p.hs) into p.core."""
    from adapters.kernels.gdn_chunk_out import gdn_chunk_out

    gdn_chunk_out(p.mixed, p.u, p.gc, p.hs[:, :chunks], p.nk, precise=p.precise, out=p.core,
                  chunks=(*p.chunk_table, chunk0), block_v=launch[0], num_warps=launch[1], num_stages=launch[2])


def walk(p: SimpleNamespace, walk_launch: tuple = TODAY, out_launch: tuple | None = None) -> None:
    """Every window of p's prompt through gdn_chunk_state at walk_launch, overwriting p.u, p.state and p.hs; with
    out_launch, each window's gdn_chunk_out at that launch into p.core right after its walk (what the prefill runs,
    whose hs buffer holds one window at a time)."""
    from adapters.kernels import gdn_chunk_state as walk_mod

    for first, count, chunk0, chunks in p.launches:
        walk_mod.gdn_chunk_state(p.mixed, p.w, p.u, p.gc, p.ks, p.state, p.nk, precise=p.precise, states=p.hs,
                                 walk=walk_mod.SpanWalk(p.walk_table, first, count, chunk0, chunks),
                                 block_v=walk_launch[0], num_warps=walk_launch[1], num_stages=walk_launch[2])
        if out_launch is not None:
            out_window(p, chunk0, chunks, out_launch)


def gdn_out_points(timer, tokens=GDN_OUT_TOKENS, configs=GDN_OUT_CONFIGS, dev: str = "cuda",
                   geometry=QWEN36_GDN, window: int | None = None, precise: bool = False) -> list[dict]:
    """gdn_chunk_out at each launch (block_v, num_warps, num_stages), one row per (prompt length, config), today's
    launch first. Each prompt is walked once at today's walk launch (gdn_chunk_state per window over a span table);
    then each config runs the prompt's gdn_chunk_out launches (one per window, over the chunk table, each with its
    window's entry states: the walk is re-run window by window between them, untimed) and is timed over the same
    launches with the last window's states (`out_us`: all of a prompt's output launches, i.e. window count x one
    window's time). `max_rel_diff`: core against today's launch's, relative to its largest value (0 or fp32
    rounding: the same operations per element). `compiled`: the binary's registers, spill and shared memory as
    loaded (None if unknown). timer(fn) -> µs or an error string (bench_kernels._timed: CUDA-graph replays).
    dev/timer/geometry/window let a CPU test run it at tiny shapes in Triton's interpreter."""
    from adapters.kernels import gdn_chunk_out as out_mod
    from adapters.kernels import gdn_chunk_state as walk_mod

    default, configs = with_default_first(out_mod, configs)
    gen = torch.Generator(device=dev).manual_seed(6)
    points, stats = [], {}  # stats: config -> its binary's compiled_stats, taken when it first compiles
    for t in tokens:
        p = prompt_walk(t, geometry, window, precise, dev, gen)

        def outputs(cfg, p=p):
            """Every window's output at cfg, each after its own window's walk (the states it reads)."""
            p.reset()
            first_build(stats, cfg, out_mod._gdn_chunk_out_kernel, lambda: walk(p, out_launch=cfg))
            return p.core.clone()

        last = p.launches[-1]  # the timed window: its states are in p.hs after outputs()
        ref = outputs(default)
        base_us = None
        for cfg in configs:
            block_v, warps, stages = cfg
            row = {"tokens": t, "block_v": block_v, "num_warps": warps, "num_stages": stages,
                   "default": cfg == default, "windows": len(p.launches), "chunks": -(-t // 64),
                   "programs_per_chunk": p.nv * -(-p.dv // walk_mod.tiles(p.dk, p.dv, block_v)[1])}
            try:
                row["max_rel_diff"] = max_rel(outputs(cfg), ref)
            except Exception as exc:  # a config that does not build or launch is a result, not the end of the run
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                points.append(row)
                print(row, flush=True)
                continue
            row["compiled"] = stats.get(cfg)

            us = timer(lambda cfg=cfg, p=p, chunk0=last[2], chunks=last[3]: out_window(p, chunk0, chunks, cfg))
            if isinstance(us, float):
                row["out_us"] = round(us * len(p.launches), 2)
                row["us_per_chunk"] = round(row["out_us"] / row["chunks"], 3)
                if row["default"]:
                    base_us = row["out_us"]
                row["speedup_vs_default"] = round(base_us / row["out_us"], 3) if base_us and row["out_us"] > 0 \
                    else None
            else:
                row["out_us"] = us
            points.append(row)
            print(row, flush=True)
    return points

