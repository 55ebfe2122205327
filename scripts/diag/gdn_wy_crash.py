"""One-off GPU diagnosis (session 7): which gdn_chunk_wy configuration hits an illegal address. Each case runs
in its own process (an illegal address poisons the CUDA context)."""
import subprocess
import sys

CASE = r'''
import sys, torch
import adapters.kernels.gdn_chunk_wy as wy
from tests.adapters.test_kernels_prefill import GEOMETRIES, WIDE, random_wy_inputs
name, tokens, precise, blocked = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4] == "1"
wy.BLOCKED_INVERSE = blocked
geo = GEOMETRIES.get(name, WIDE)
mixed, a, b, neg_a, dt_bias, state = random_wy_inputs(geo, tokens, seed=tokens)
out = wy.gdn_chunk_wy(mixed, a, b, neg_a, dt_bias, geo.num_k_heads, geo.k_head_dim, geo.v_head_dim, precise=precise)
torch.cuda.synchronize()
print("ok", [tuple(t.shape) for t in out], float(out[0].abs().max()))
'''
for name in ("gqa", "wide"):
    for tokens in (1, 130):
        for precise in (1, 0):
            for blocked in (1, 0):
                r = subprocess.run([sys.executable, "-c", CASE, name, str(tokens), str(precise), str(blocked)],
                                   capture_output=True, text=True, timeout=120)
                tail = (r.stdout + r.stderr).strip().splitlines()
                print(name, tokens, "precise" if precise else "tf32", "blocked" if blocked else "subst",
                      "rc", r.returncode, tail[-1][:200] if tail else "", flush=True)
