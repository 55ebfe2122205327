"""One-off GPU diagnosis (session 7): split vs fused recurrence differences on the test geometries, and which
head dims crash gdn_chunk_wy's blocked inverse at 3xTF32 (each crash case in its own process)."""
import subprocess
import sys

DIFF = r'''
import torch
from adapters.kernels.gdn_chunk_wy import gdn_chunk_wy
from adapters.kernels.gdn_chunk_scan import gdn_chunk_scan
from adapters.kernels.gdn_chunk_state import gdn_chunk_state
from adapters.kernels.gdn_chunk_out import gdn_chunk_out
import adapters.kernels.gdn_chunk_wy as wy
from tests.adapters.test_kernels_prefill import GEOMETRIES, WIDE, random_wy_inputs, rel_err
wy.BLOCKED_INVERSE = False
for name in ("odd", "gqa", "wide"):
    geo = GEOMETRIES.get(name, WIDE)
    for tokens in (1, 64, 130):
        mixed, a, b, neg_a, dt_bias, state = random_wy_inputs(geo, tokens, seed=100 + tokens)
        w, u, gc, ks = gdn_chunk_wy(mixed, a, b, neg_a, dt_bias, geo.num_k_heads, geo.k_head_dim, geo.v_head_dim)
        fs = state.clone(); fused = gdn_chunk_scan(mixed, w, u.clone(), gc, fs, geo.num_k_heads, block_v=16)
        hs = gdn_chunk_state(mixed, w, u, gc, ks, state, geo.num_k_heads, block_v=16)
        got = gdn_chunk_out(mixed, u, gc, hs, geo.num_k_heads, block_v=16)
        print(name, tokens, "out", rel_err(got, fused), "state", rel_err(state, fs), "maxabs", float((state - fs).abs().max()), flush=True)
'''
CRASH = r'''
import sys, torch
import adapters.kernels.gdn_chunk_wy as wy
dk, dv = int(sys.argv[1]), int(sys.argv[2])
nk, nv, T = 2, 4, 130
mixed = torch.randn(T, 2 * nk * dk + nv * dv, device="cuda")
a, b = torch.randn(T, nv, device="cuda"), torch.randn(T, nv, device="cuda")
neg_a, dt = -torch.rand(nv, device="cuda") - 0.5, torch.randn(nv, device="cuda")
wy.gdn_chunk_wy(mixed, a, b, neg_a, dt, nk, dk, dv, precise=True); torch.cuda.synchronize(); print("ok")
'''
r = subprocess.run([sys.executable, "-c", DIFF], capture_output=True, text=True, timeout=150)
print(r.stdout, r.stderr[-1500:] if r.returncode else "", flush=True)
for dk, dv in ((8, 8), (16, 16), (32, 32), (8, 64), (64, 8), (128, 128), (12, 10)):
    r = subprocess.run([sys.executable, "-c", CRASH, str(dk), str(dv)], capture_output=True, text=True, timeout=60)
    print("precise blocked dk", dk, "dv", dv, "rc", r.returncode, (r.stdout + r.stderr).strip().splitlines()[-1][:120], flush=True)
