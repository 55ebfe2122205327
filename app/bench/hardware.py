"""The profile of the machine `ft bench` runs on: GPU and driver, measured pinned host->device
bandwidth, host RAM, CPU, library versions. Every field is null when it cannot be known here."""

from __future__ import annotations

import functools
import json
import os
import platform
import shutil
import subprocess
import sys
from importlib import metadata

LIBRARIES = ("fluxtide", "torch", "triton", "transformers", "httpx", "litestar", "uvicorn", "numpy", "safetensors")


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _host_ram_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _versions() -> dict:
    out = {"python": sys.version.split()[0]}
    for name in LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _nvidia_smi() -> list[dict]:
    if not shutil.which("nvidia-smi"):
        return []
    try:
        text = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max",
             "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=20, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 3:
            gpus.append({"name": parts[0], "driver": parts[1], "memory_mib": _num(parts[2]),
                         "pcie_gen_max": _num(parts[3]) if len(parts) > 3 else None,
                         "pcie_width_max": _num(parts[4]) if len(parts) > 4 else None})
    return gpus


def _num(text: str) -> int | None:
    try:
        return int(float(text))
    except ValueError:
        return None


def pinned_h2d_gb_s(size_mib: int = 256, repeats: int = 5) -> float | None:
    """Median pinned host->device copy bandwidth in GB/s (1e9 bytes/s) on cuda:0; None without CUDA."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    n = size_mib * 2**20
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda:0")
    dev.copy_(host, non_blocking=True)  # warm-up: first copy pays for mapping
    torch.cuda.synchronize()
    rates = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dev.copy_(host, non_blocking=True)
        stop.record()
        stop.synchronize()
        rates.append(n / (start.elapsed_time(stop) / 1e3) / 1e9)
    del host, dev
    return sorted(rates)[len(rates) // 2]


def _torch_gpus(measure_bandwidth: bool) -> dict:
    """GPUs as torch sees them (and the bandwidth), in this process: run it in a child process
    (see hardware_profile) so the benchmark's own process never holds a CUDA context."""
    try:
        import torch
    except ImportError:
        return {"gpus": [], "cuda_runtime": None, "pinned_h2d_gb_s": None}
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append({"name": p.name, "memory_bytes": p.total_memory,
                         "capability": f"{p.major}.{p.minor}", "multiprocessors": p.multi_processor_count})
    return {"gpus": gpus, "cuda_runtime": torch.version.cuda,
            "pinned_h2d_gb_s": pinned_h2d_gb_s() if measure_bandwidth and gpus else None}


@functools.cache
def hardware_profile(measure_bandwidth: bool = True) -> dict:
    """The host's profile (see module docstring), measured once per process (callers copy it). GPU facts and the pinned host->device bandwidth
    are measured in a child process: a CUDA context held by the client for the whole run would take
    device memory that the server under test planned its pools with."""
    torch_facts = {"gpus": [], "cuda_runtime": None, "pinned_h2d_gb_s": None, "error": None}
    try:
        done = subprocess.run([sys.executable, "-m", "app.bench.hardware"] + (["--bandwidth"] if measure_bandwidth else []),
                              capture_output=True, text=True, timeout=300, check=True)
        torch_facts.update(json.loads(done.stdout.strip().splitlines()[-1]))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        torch_facts["error"] = f"GPU probe failed: {exc}"
    gpus = torch_facts["gpus"]
    smi = _nvidia_smi()
    for gpu, info in zip(gpus, smi, strict=False):
        gpu.update({k: v for k, v in info.items() if k != "name"})
    if not gpus:
        gpus = smi
    return {
        "gpus": gpus,
        "gpu_driver": smi[0]["driver"] if smi else None,
        "cuda_runtime": torch_facts["cuda_runtime"],
        "pinned_h2d_gb_s": torch_facts["pinned_h2d_gb_s"],
        "gpu_probe_error": torch_facts["error"],
        "host_ram_bytes": _host_ram_bytes(),
        "cpu": {"model": _cpu_model(), "logical_cores": os.cpu_count(), "machine": platform.machine()},
        "os": platform.platform(),
        "hostname": platform.node(),
        "libraries": _versions(),
        "measured_on": "the host that ran `ft bench` (the client); the server's host may differ",
    }


if __name__ == "__main__":
    print(json.dumps(_torch_gpus("--bandwidth" in sys.argv)))
