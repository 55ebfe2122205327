"""Where moe_route_lookup (compiled) and layer_lookup disagree: fresh tables, one lookup each, over row counts,
top-k, rows alike or not, live rows, shares, 10-16 and 128 experts. Prints every disagreement with both results
and the failing (rows, top-k) pairs (a GPU diagnosis). Session 42 (H100, Triton 3.6): before moe_route_lookup took its
lanes from memory, every 5-8 row case disagreed (keys counted twice after a compiled tl.reshape); the interpreter
never did. Run: PYTHONPATH=. python3 scripts/diag/route_lookup_probe.py"""
import itertools
import random

import torch

from adapters.cuda_exec.device_residency import DeviceResidency

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def logits_for(rows, experts, rng):
    lg = torch.tensor([[rng.uniform(-3.0, -1.0) for _ in range(experts)] for _ in rows])
    for r, ids in enumerate(rows):
        for j, e in enumerate(ids):
            lg[r, e] = 8.0 - j
    return lg.to(DEV)


bad = 0
fails = set()
total = 0
for rows, k, alike, live, p, S, wide in itertools.product((1, 2, 3, 4, 5, 6, 8, 16), (1, 2, 3, 8), (True, False),
                                                           (1, 2, 4, 6, 16), (0, 500), (12, 160), (False, True)):
    experts = (128 if wide else 10) if k < 8 else (128 if wide else 16)
    if live > rows or rows * k > S or rows * experts > 4096:  # moe_route_lookup.fits
        continue
    rng = random.Random(rows * 1000 + k * 10 + live)
    first = rng.sample(range(experts), k)
    ids = [list(first) if alike else rng.sample(range(experts), k) for _ in range(rows)]
    valid = torch.tensor([r < live for r in range(rows)], device=DEV)
    a = DeviceResidency(S, 3, experts, DEV)
    b = DeviceResidency(S, 3, experts, DEV)
    ra = a.route_layer(2, logits_for(ids, experts, rng), torch.zeros(rows, 8, device=DEV), k, True, None, valid,
                       host_permille=p)
    rb = b.lookup_layer(2, torch.tensor(ids, device=DEV), valid, None, host_permille=p)
    got = (ra[2].tolist(), ra[1].tolist(), a.slot_of_key.tolist(), a.counters())
    want = (rb[0].tolist(), rb[2].tolist(), b.slot_of_key.tolist(), b.counters())
    total += 1
    if got != want:
        bad += 1
        fails.add((rows, k, alike, live, p))
        if bad <= 3:
            print(f"MISMATCH rows={rows} E={experts} k={k} alike={alike} live={live} p={p} S={S} ids={ids}")
            print("  route fills", got[0], "slots", got[1], "counters", got[3])
            print("  layer fills", want[0], "slots", want[1], "counters", want[3])
print(f"{bad} of {total} configurations disagree")
for rk in sorted({(r, k) for r, k, *_ in fails}):
    print("fails at rows, k =", rk, sorted({(a, lv, p) for r, k, a, lv, p in fails if (r, k) == rk}))
