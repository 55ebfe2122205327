"""The decode step's small kernels lowered for an H200 (sm_90) without a GPU: catches what Triton's
interpreter does not check (type and shape rules of the compiler, resource limits), at the Qwen3.6
shapes the decode graph runs them with. The MoE GEMVs have their own check in test_kernels_moe.py and
the prefill kernels in test_kernels_prefill.py."""

import pytest

from tests.adapters.sm90 import build_for_sm90

_COMPILE_CHECK = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tests.adapters.sm90_usage import with_defaults
from adapters.kernels import (dense_gemv, moe_route_lookup, moe_router, residency_lookup, residency_settle_hits,
                              rms_norm, rms_norm_router)

def build(kernel, sig, consts):
    consts = with_defaults(kernel, consts)
    sig = {**sig, **{k: "constexpr" for k in consts}}
    compiled = triton.compile(ASTSource(kernel, sig, consts, {}), target=GPUTarget("cuda", 90, 32))
    assert compiled.metadata.shared <= 232448, (kernel.__name__, compiled.metadata.shared)

# without and with the resident pool's slot outputs (ADR 0027: the bs8/16 buckets over a pool holding every key)
for slots, ks in ((False, 8), (True, 9)):
    build(moe_router._moe_router_kernel,
          {"x_ptr": "*bf16", "w_ptr": "*fp32", "logits_ptr": "*fp32", "g_ptr": "*bf16", "wout_ptr": "*fp32",
           "iout_ptr": "*i64", "slot_of_ptr": "*i64", "valid_ptr": "*i1", "presence_ptr": "*u8", "sout_ptr": "*i32",
           "E": "i32", "H": "i32", "stride_x": "i32", "stride_l": "i32", "shared_id": "i32", "base": "i32",
           "shared_slot": "i32"},
          dict(K=8, HAS_LOGITS=True, ROUND_LOGITS=False, KO=9, HAS_SHARED=True, ROUND_GATE=True, RENORM=True,
               HAS_SLOTS=slots, KS=ks, BLOCK_E=256, BLOCK_H=16, BLOCK_G=1024, BLOCK_K=16))
build(residency_settle_hits._settle_hits_kernel,
      {"presence_ptr": "*u8", "slot_of_ptr": "*i64", "stamp_ptr": "*i64", "clock_ptr": "*i64",
       "counters_ptr": "*i64", "N": "i32"},
      dict(BLOCK_N=residency_settle_hits.BLOCK))
# the decode step's lookup after moe_router: 1-2 rows of top-8 (16 keys) and the 16-row bucket (128 keys,
# 8 warps), which takes it again since moe_route_lookup.pays stops at 4 rows at E = 256
for block_n in (16, 128):
    build(residency_lookup._layer_lookup_kernel,
          {"ids_ptr": "*i64", "valid_ptr": "*i1", "slot_of_ptr": "*i64", "key_of_ptr": "*i64",
           "stamp_ptr": "*i64", "clock_ptr": "*i64", "counters_ptr": "*i64", "fill_keys_ptr": "*i64",
           "fill_slots_ptr": "*i64", "slot_ids_ptr": "*i32", "owner_ptr": "*i32", "n": "i32", "base": "i32",
           "S": "i32", "shared_slot": "i32", "stride_ids": "i32", "rank": "i32"},
          dict(K=8, KO=9, HAS_OWNER=True, BLOCK_N=block_n, BLOCK_S=residency_lookup.VICTIM_BLOCK))
# the decode step takes the fused router + lookup up to T*E = FUSED_MAX_TILE (4 rows at E = 256, 2 at 512);
# it fits up to MAX_TILE (16 rows at E = 256, 8 at 512), which bench_kernels' A/B runs to find the
# crossover; the 16-row tile also with the owner table (expert parallelism: one more load and compare in
# the biggest register tile)
assert moe_route_lookup.FUSED_MAX_TILE <= moe_route_lookup.MAX_TILE
for block_t, block_e, owner in ((1, 256, False), (4, 256, False), (2, 512, False), (16, 256, False),
                                (8, 512, False), (16, 256, True)):
    build(moe_route_lookup._moe_route_lookup_kernel,
          {"logits_ptr": "*fp32", "x_ptr": "*bf16", "g_ptr": "*bf16", "valid_ptr": "*i1", "wout_ptr": "*fp32",
           "slot_ids_ptr": "*i32", "slot_of_ptr": "*i64", "key_of_ptr": "*i64", "stamp_ptr": "*i64",
           "clock_ptr": "*i64", "counters_ptr": "*i64", "fill_keys_ptr": "*i64", "fill_slots_ptr": "*i64",
           "owner_ptr": "*i32", "T": "i32", "E": "i32", "H": "i32", "stride_l": "i32", "stride_x": "i32",
           "base": "i32", "S": "i32", "shared_slot": "i32", "rank": "i32"},
          dict(K=8, KO=9, KS=9, HAS_GATE=True, HAS_OWNER=owner, ROUND_GATE=True, RENORM=True, BLOCK_T=block_t,
               BLOCK_E=block_e, BLOCK_G=min(2048, 8192 // block_t), BLOCK_K=16, BLOCK_R=8,
               BLOCK_N=max(16, 8 * block_t), BLOCK_S=residency_lookup.VICTIM_BLOCK))
# every tile the autotuner may pick (4 warps at D 2048), row blocks (BLOCK_R > 1) included
for block_r, block_e, block_h in rms_norm_router.TUNE_TILES:
    build(rms_norm_router._rms_norm_router_kernel,
          {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "r_ptr": "*fp32", "sum_ptr": "*bf16",
           "out_ptr": "*bf16", "logits_ptr": "*fp32", "T": "i32", "D": "i32", "E": "i32", "eps": "fp32"},
          dict(UNIT_OFFSET=True, BLOCK_D=2048, BLOCK_R=block_r, BLOCK_E=block_e, BLOCK_H=block_h))
build(rms_norm._rms_norm_kernel,
      {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "sum_ptr": "*bf16", "out_ptr": "*bf16",
       "out32_ptr": "*fp32", "D": "i32", "eps": "fp32"},
      dict(HAS_RES=True, UNIT_OFFSET=True, FP32_COPY=True, BLOCK_D=2048))
for n, k, bn, bk in ((12288, 2048, 16, 256), (2048, 4096, 8, 512), (200, 384, 16, 128)):  # even and ragged
    build(dense_gemv._dense_gemv_kernel,
          {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "y_ptr": "*bf16", "stride_xm": "i32",
           "stride_ym": "i32"},
          dict(N=n, K=k, scale_cols=-(-k // 128), SCALE_MODE=0, G=128, BLOCK_N=bn, BLOCK_K=bk))
print("ok")
"""


@pytest.mark.slow
def test_decode_kernels_compile_for_sm90():
    assert build_for_sm90(_COMPILE_CHECK, timeout=300).strip() == "ok"
