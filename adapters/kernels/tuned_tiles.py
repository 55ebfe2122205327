"""Which tile the autotuner chose for each key of the tensor-core GEMMs that have W_LHS tiles (the prefill's
dense_gemm, moe_grouped_gate_up and moe_grouped_down, and the decode buckets' dense_gemm_splitk), read from the
autotuners' caches: what a benchmark record and the start-up log say about the choice between the right-operand
tiles and the W_LHS ones (on unless FLUXTIDE_PREFILL_W_LHS=0, docs/prefill-kernels.md, "Weight as the left operand";
docs/fast-decode.md, session 24). Read-only; nothing is tuned here. In Triton's interpreter no key is ever tuned, so
every list is empty there.
"""

from __future__ import annotations

from adapters.kernels import dense_gemm, dense_gemm_splitk, moe_grouped_down, moe_grouped_gate_up

TUNERS = {"dense_gemm": dense_gemm._TUNED, "moe_grouped_gate_up": moe_grouped_gate_up._TUNED,
          "moe_grouped_down": moe_grouped_down._TUNED, "dense_gemm_splitk": dense_gemm_splitk._TUNED}


def tuned_tiles(tuners: dict | None = None) -> dict[str, list[dict]]:
    """Per kernel name, one entry per tuned key: {"key": the autotune key's values (the kernel's `key` arguments
    in order, then the argument dtypes Triton appends), "tile": the chosen config's kwargs with num_warps and
    num_stages, "w_lhs": whether it is a W_LHS tile}. `tuners`: name → triton Autotuner (default TUNERS)."""
    out = {}
    for name, tuner in (TUNERS if tuners is None else tuners).items():
        rows = []
        for key, cfg in getattr(tuner, "cache", {}).items():
            tile = {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
            rows.append({"key": [k if isinstance(k, (int, float, bool)) else str(k) for k in key], "tile": tile,
                         "w_lhs": bool(cfg.kwargs.get("W_LHS", False))})
        out[name] = rows
    return out


def w_lhs_wins(tiles: dict[str, list[dict]]) -> tuple[int, int]:
    """(keys whose chosen tile is a W_LHS one, keys tuned) over every kernel of `tiles` (a tuned_tiles() result)."""
    rows = [r for kernel in tiles.values() for r in kernel]
    return sum(r["w_lhs"] for r in rows), len(rows)
