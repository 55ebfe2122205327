"""Where a host-lane hand-off's time goes on the GPU, by rows (session 43): torch.profiler over eager publish +
wait_add pairs with one host pair (row 0) and T rows published, kernel by kernel, idle and while pinned copies
loop. Usage (CUDA only): PYTHONPATH=. python3 scripts/diag/host_handoff_profile.py"""

import contextlib
import os
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_host_experts as bhe  # noqa: E402

from adapters.host_kernels import host_lane  # noqa: E402

bank, layout = bhe._paths(1, bhe.available(), 64)["_bank"]
K, M, N = 8, 8, 32
threads = max(1, (os.cpu_count() or 2) - 1)  # the executor's default team: every core but one
with host_lane.HostLane(bank, layout, torch.arange(bank.shape[0]), K, M, "cuda", threads=threads) as lane:
    for rows in (1, 4, 8):
        x = torch.randn(rows, layout.hidden, device="cuda", dtype=torch.bfloat16)
        w = torch.full((rows, K), 1.0 / K, device="cuda")
        out = torch.zeros(rows, layout.hidden, device="cuda", dtype=torch.bfloat16)
        pairs = torch.full((N, rows, K), -1, dtype=torch.int64)
        pairs[:, 0, 0] = torch.arange(N)
        pairs = pairs.reshape(N, -1).cuda()
        for loaded in (False, True):
            for i in range(N):  # warm
                lane.publish(x, pairs[i], w)
                lane.wait_add(out)
            torch.cuda.synchronize()
            with bhe.CopyLoad() if loaded else contextlib.nullcontext(), \
                    profile(activities=[ProfilerActivity.CUDA]) as prof:
                for i in range(N):
                    lane.publish(x, pairs[i], w)
                    lane.wait_add(out)
                torch.cuda.synchronize()
            for e in prof.key_averages():
                if "publish" in e.key or "wait_add" in e.key:
                    print(f"rows {rows} {'copies' if loaded else 'idle  '} {e.key:24s} "
                          f"{e.device_time_total / e.count:8.1f} us x {e.count}")
