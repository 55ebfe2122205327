"""Compiles the tensor-core GEMMs of the prefill (dense_gemm, moe_grouped_gate_up, moe_grouped_down) for an H200
(sm_90) tile by tile, without a GPU, and prints per tile: compile seconds, registers and stack bytes per thread
(ptxas spills, from cuobjdump), whether the dot became wgmma (tensor cores) or FMA loops, the `pendings` of the
TTGIR's wgmma waits (0: each wgmma waited for at once; 1: async, the next K step's loads overlap it) and whether
the weight is a register operand of the wgmma (`dot_op opIdx 0` in the TTGIR: the W_LHS arrangement) rather than
written back to shared memory. The autotuner compiles every tile of a new key before it can benchmark, so the
sum over tiles is what the first call of a key waits. Pointers and row strides carry the 16-divisibility the
JIT specializes them with (without it the activation loads are not pipelined).

    python scripts/compile_probe.py --kernel dense --fmt mxfp4 --act fp32
    python scripts/compile_probe.py --kernel grouped --fmt nvfp4 --act bf16 --block-m 64
    python scripts/compile_probe.py --kernel grouped --fmt fp8_block --act fp8 --block-m 64   # W8A8 (ADR 0018)
    python scripts/compile_probe.py --kernel down --fmt fp8_block --block-m 64 --w-lhs   # the W_LHS tiles

fp32 activations take "ieee" dots, which Triton lowers to FMA loops (no tensor cores): the parity tests'
path, not the served one (bf16). Each tile compiles in a fresh cache directory (no reuse between tiles).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.pop("TRITON_INTERPRET", None)  # NOTE: before triton is imported: the probe compiles for real

import triton  # noqa: E402
import triton.backends.nvidia as nv  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from adapters.checkpoint.expert_layout import ExpertLayout  # noqa: E402
from adapters.kernels import dense_gemm, moe_grouped_down, moe_grouped_gate_up  # noqa: E402
from adapters.kernels.dequant_tile import GROUPED_FMA_TILES, GROUPED_TILES, GROUPED_W_LHS_TILES, scale_dtype  # noqa: E402
from adapters.kernels.packed_gemv import FORMAT_CODES, SCALE_GROUP, layout_consts  # noqa: E402
from domain.model_spec import WeightFormat  # noqa: E402

W_TYPES = {WeightFormat.FP8_BLOCK: "fp8e4nv", WeightFormat.FP8_TENSOR: "fp8e4nv", WeightFormat.FP8_CHANNEL: "fp8e4nv",
           WeightFormat.INT8_CHANNEL: "i8"}
S_TYPES = {WeightFormat.NVFP4: "fp8e4nv", WeightFormat.MXFP4: "u8"}


def _io(act: str) -> tuple[str, str, bool]:
    """(input pointer type, output pointer type, A8) of an --act choice: fp8 = e4m3 rows in, bf16 out."""
    return ("fp8e4nv", "bf16", True) if act == "fp8" else (act, act, False)


def _divisible(indices) -> dict:
    return {(i,): [["tt.divisibility", 16]] for i in indices}


def dense_source(fmt: WeightFormat, act: str, tile: tuple[int, int], w_lhs: bool = False) -> ASTSource:
    x_t, y_t, a8 = _io(act)
    ptrs = {"x_ptr": "*" + x_t, "xs_ptr": "*fp32", "w_ptr": "*" + W_TYPES.get(fmt, "u8"),
            "s_ptr": "*" + S_TYPES.get(fmt, "fp32"), "g_ptr": "*fp32", "y_ptr": "*" + y_t}
    consts = dict(N=4096, K=2048, FMT=FORMAT_CODES[fmt], GROUP=SCALE_GROUP.get(fmt, 1), F32_DOT=False,
                  PRECISION="ieee" if act == "fp32" else "tf32", A8=a8, BLOCK_M=tile[0], BLOCK_N=tile[1],
                  BLOCK_K=dense_gemm.BLOCK_K, GROUP_M=8, W_LHS=w_lhs)
    sig = {**ptrs, **{k: "i32" for k in ("M", "M_BUCKET", "stride_xm", "stride_ym")}, **dict.fromkeys(consts, "constexpr")}
    # the six pointers and the two row strides (8, 9: K and N, multiples of 16); M and M_BUCKET not specialized
    return ASTSource(dense_gemm._dense_gemm_kernel, sig, consts, _divisible((0, 1, 2, 3, 4, 5, 8, 9)))


def _grouped_consts(fmt: WeightFormat, act: str, block_m: int, block_n: int, w_lhs: bool) -> tuple:
    c = layout_consts(ExpertLayout(fmt, 2048, 512))
    common = dict(H=2048, I=512, R=c.row_bytes, W_DTYPE=c.gate.w_dtype, S_DTYPE=scale_dtype(c.fmt_code),
                  FMT=c.fmt_code, GROUP=max(c.group, 1), F32_DOT=False, PRECISION="ieee" if act == "fp32" else "tf32",
                  A8=_io(act)[2], BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128, W_LHS=w_lhs)
    return c, common


def grouped_source(fmt: WeightFormat, act: str, block_m: int, block_n: int, w_lhs: bool = False) -> ASTSource:
    """moe_grouped_gate_up at the Qwen3.6 expert shape (H 2048, I 512, top-8 + shared)."""
    c, common = _grouped_consts(fmt, act, block_m, block_n, w_lhs)
    consts = dict(K=9, G_DATA=c.gate.data, G_SCALE=c.gate.scale, G_GSCALE=c.gate.global_scale, U_DATA=c.up.data,
                  U_SCALE=c.up.scale, U_GSCALE=c.up.global_scale, **common)
    x_t, h_t, _ = _io(act)
    ptrs = {"x_ptr": "*" + x_t, "xs_ptr": "*fp32", "pairs_ptr": "*i32", "block_slots_ptr": "*i32", "slots_ptr": "*u8",
            "h_ptr": "*" + h_t}
    sig = {**ptrs, "S": "i32", **dict.fromkeys(consts, "constexpr")}
    return ASTSource(moe_grouped_gate_up._moe_grouped_gate_up_kernel, sig, consts, _divisible(range(len(ptrs))))


def down_source(fmt: WeightFormat, act: str, block_m: int, block_n: int, w_lhs: bool = False) -> ASTSource:
    """moe_grouped_down at the Qwen3.6 expert shape."""
    c, common = _grouped_consts(fmt, act, block_m, block_n, w_lhs)
    consts = dict(D_DATA=c.down.data, D_SCALE=c.down.scale, D_GSCALE=c.down.global_scale, **common)
    h_t = _io(act)[0]
    ptrs = {"h_ptr": "*" + h_t, "hs_ptr": "*fp32", "pairs_ptr": "*i32", "block_slots_ptr": "*i32",
            "weights_ptr": "*fp32", "slots_ptr": "*u8", "y_ptr": "*fp32"}
    sig = {**ptrs, "S": "i32", **dict.fromkeys(consts, "constexpr")}
    return ASTSource(moe_grouped_down._moe_grouped_down_kernel, sig, consts, _divisible(range(len(ptrs))))


def wgmma_overlap(ttgir: str, w_lhs: bool) -> str:
    """'pendings 1, weight-in-regs yes': the TTGIR's wgmma wait depths (distinct) and whether the weight tile is
    a register operand of the wgmma: only as its A operand (opIdx 0 of an #mma parent) under W_LHS; the B operand
    of a wgmma always comes from shared memory, so without W_LHS the converted weight is written back there."""
    pend = sorted(set(re.findall(r"pendings = (\d+)", ttgir)))
    reg_a = w_lhs and "#ttg.dot_op<{opIdx = 0, parent = #mma" in ttgir
    return f"pendings {','.join(pend) or '-'}, weight-in-regs {'yes' if reg_a else 'no'}"


def resources(cubin: bytes) -> str:
    """cuobjdump's 'REG:.. STACK:..' line of the compiled kernel."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        tool = os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return f"regs {found.group(1)} stack {found.group(2)} B" if found else "resources unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", choices=("dense", "grouped", "down"), default="dense",
                    help="grouped: moe_grouped_gate_up; down: moe_grouped_down")
    ap.add_argument("--fmt", default="mxfp4", help="weight format (fp8_block, nvfp4, mxfp4, ...)")
    ap.add_argument("--act", choices=("bf16", "fp32", "fp8"), default="bf16",
                    help="activations: fp8 = e4m3 rows with group scales (the W8A8 path of FP8 weights)")
    ap.add_argument("--block-m", type=int, default=16, help="grouped/down: the alignment's BLOCK_M")
    ap.add_argument("--w-lhs", action="store_true",
                    help="the W_LHS tiles (weight as the wgmma A operand; bf16 activations only)")
    args = ap.parse_args()
    fmt = WeightFormat(args.fmt)
    if args.w_lhs and args.act != "bf16":
        ap.error("--w-lhs is the bf16-activation path")
    if args.kernel == "dense":
        table = (dense_gemm.W_LHS_TILES if args.w_lhs else dense_gemm.FMA_TILES if args.act == "fp32"
                 else dense_gemm.TUNE_TILES)  # the autotuner's family
        tiles = [((bm, bn), w, st) for bm, bn, w, st in table]
    else:
        table = GROUPED_W_LHS_TILES if args.w_lhs else GROUPED_FMA_TILES if args.act == "fp32" else GROUPED_TILES
        tiles = [((args.block_m, bn), w, st) for bn, w, st in table]
    total = 0.0
    for (bm, bn), warps, stages in tiles:
        if args.kernel == "dense":
            src = dense_source(fmt, args.act, (bm, bn), args.w_lhs)
        else:
            src = (grouped_source if args.kernel == "grouped" else down_source)(fmt, args.act, bm, bn, args.w_lhs)
        with tempfile.TemporaryDirectory() as cache:
            os.environ["TRITON_CACHE_DIR"] = cache
            start = time.perf_counter()
            kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                    options=dict(num_warps=warps, num_stages=stages))
            took = time.perf_counter() - start
            ptx = kernel.asm["ptx"]
            lhs = " w_lhs" if args.w_lhs else ""
            print(f"{args.kernel} {fmt.value} {args.act} {bm}x{bn} w{warps} s{stages}{lhs}: {took:6.1f} s, "
                  f"{resources(kernel.asm['cubin'])}, wgmma {len(re.findall('wgmma.mma_async', ptx))}, "
                  f"fma.f32 {len(re.findall(r'fma.rn.f32', ptx))}, {wgmma_overlap(kernel.asm['ttgir'], args.w_lhs)}", flush=True)
        total += took
    print(f"total {total:.1f} s over {len(tiles)} tiles")


if __name__ == "__main__":
    main()
