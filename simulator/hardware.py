"""Hardware profiles: the figures of one GPU host that the cost model needs.

Built-in profiles carry the figures of SPEC.md (measured pinned host->device bandwidth,
memory bandwidth); dense bf16 tensor throughput is the public datasheet figure (dense, no
sparsity), marked as such because nothing in SPEC.md measured it. Users add profiles from a
JSON or TOML file: {"profiles": [{...}, ...]} or a single profile object / [[profiles]] table.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass
from pathlib import Path

from simulator.params import StrictParams, require_positive

GB = 1e9
GIB = 2**30
MIB = 2**20
H200_TOTAL_MEMORY = 150_109_880_320  # bytes CUDA reports on the H200 (143,156 MiB; the datasheet says 141 GB)
H100_TOTAL_MEMORY = 85_017_493_504  # bytes CUDA reports on the H100 SXM (81,079 MiB; the datasheet says 80 GB)
H100_HOST_RAM = 135_129_063_424  # the lent H100 host's MemTotal (docs/bench/2026-12-05-h100-mixed-*.json)


@dataclass(frozen=True)
class HardwareProfile(StrictParams):
    name: str
    vram_bytes: int
    h2d_bytes_per_s: float  # pinned host->device copies (the expert-miss path)
    memory_bytes_per_s: float  # GPU memory bandwidth (weights, KV, state reads)
    bf16_flops: float  # dense bf16 tensor-core throughput (datasheet unless noted)
    host_ram_bytes: int = 64 * GIB
    pageable_h2d_bytes_per_s: float = 0.0  # 0 = unknown; unused while expert banks are pinned
    source: str = ""  # where the figures come from

    def check_valid(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("HardwareProfile.name must be a non-empty string")
        require_positive(self, "vram_bytes", "h2d_bytes_per_s", "memory_bytes_per_s", "bf16_flops",
                         "host_ram_bytes")
        require_positive(self, "pageable_h2d_bytes_per_s", allow_zero=True)
        # NOTE: every figure is bytes (or bytes/s); a file written in GB gave "pool budget is -4294967275 bytes"
        for name, unit in (("vram_bytes", "bytes"), ("host_ram_bytes", "bytes"), ("h2d_bytes_per_s", "bytes/s"),
                           ("memory_bytes_per_s", "bytes/s")):
            value = getattr(self, name)
            if value < MIB:
                raise ValueError(f"HardwareProfile {self.name!r}: {name} = {value!r} looks like GB, expected {unit} "
                                 f"(e.g. 24 GiB is {24 * GIB}, 25 GB/s is 25e9)")


BUILTIN_PROFILES: dict[str, HardwareProfile] = {
    p.name: p
    for p in (
        HardwareProfile("rtx3090", 24 * GIB, 25.3 * GB, 936 * GB, 71e12, int(60 * GB),
                        source="SPEC.md: 25.3 GB/s measured pinned H2D, 936 GB/s, 60 GB host RAM; 71 TFLOPS datasheet"),
        HardwareProfile("rtx4090", 24 * GIB, 25.1 * GB, 1008 * GB, 165e12,
                        source="SPEC.md: 25.1 GB/s measured pinned H2D, 1008 GB/s; 165 TFLOPS datasheet"),
        HardwareProfile("rtx5090", 32 * GIB, 52.7 * GB, 1792 * GB, 210e12,
                        source="SPEC.md: 52.7 GB/s measured pinned H2D, 1792 GB/s; 210 TFLOPS datasheet"),
        HardwareProfile("rtx4060-laptop", 8 * GIB, 11.8 * GB, 256 * GB, 45e12,
                        source="SPEC.md: 11.8 GB/s measured (x8), 256 GB/s; ~45 TFLOPS datasheet"),
        # NOTE: vram is what the server budgets from (torch's total_memory / mem_get_info total on the lent
        # H200, docs/bench/2026-12-01-http-sweep-24gib-h200-triton-prefill.json), not the datasheet's 141 GB.
        HardwareProfile("h200", H200_TOTAL_MEMORY, 53.3 * GB, 4.2e12, 989e12, 512 * GIB, 6.8 * GB,
                        source="SPEC.md: 53.3 GB/s measured pinned, 6.8 GB/s pageable, ~4.2 TB/s "
                               "copy measured (4.8 spec); 989 TFLOPS datasheet; memory as CUDA reports it"),
        # NOTE: the SXM5 card ('NVIDIA H100 80GB HBM3'), the H200's die (GH100, 132 SMs, the same clocks and tensor
        # throughput) with 80 GB of HBM3 at 3.35 TB/s instead of 141 GB of HBM3e at 4.8. Sources: NVIDIA's H100
        # datasheet (https://www.nvidia.com/en-us/data-center/h100/: H100 SXM 80 GB, 3.35 TB/s, BF16 1,979 TFLOPS
        # with sparsity = 989 dense, PCIe Gen5 128 GB/s) and the Hopper whitepaper (NVIDIA H100 Tensor Core GPU
        # Architecture: SXM5 132 SMs; the PCIe card is another one, 114 SMs and 2.0 TB/s HBM2e, which is why 'pcie'
        # is a variant word in simulator/mixed_record.py). The link is
        # measured: 54.5-54.7 GB/s pinned host->device (PCIe 5.0 x16) on the lent host, 2026-12-05
        # (docs/bench/2026-12-05-h100-*.json `h2d_pinned_gbps`); memory bandwidth is the datasheet's, not a copy
        # measured as the H200's 4.2 is (nothing on the H100 measured one; the H200's copy reached 87.5 % of spec).
        HardwareProfile("h100", H100_TOTAL_MEMORY, 54.6 * GB, 3.35e12, 989e12, H100_HOST_RAM,
                        source="H100 SXM5 datasheet: 80 GB HBM3 at 3.35 TB/s (spec), 989 TFLOPS dense bf16, 132 SMs, "
                               "PCIe 5.0 x16; 54.6 GB/s pinned H2D measured 2026-12-05; memory as CUDA reports it"),
    )
}


def load_profiles(path: str | Path) -> dict[str, HardwareProfile]:
    """Profiles from a .json or .toml file; unknown fields are errors."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".toml":
        data = tomllib.loads(text)
    elif path.suffix == ".json":
        data = json.loads(text)
    else:
        raise ValueError(f"{path}: hardware profiles must be .json or .toml")
    entries = data.get("profiles", [data]) if isinstance(data, dict) else data
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{path}: expected a profile object or {{'profiles': [...]}}")
    profiles = {}
    for i, entry in enumerate(entries):
        profile = HardwareProfile.from_dict(entry, where=f"{path} profile {i}")
        profiles[profile.name] = profile
    return profiles


def get_profile(name: str, extra: dict[str, HardwareProfile] | None = None) -> HardwareProfile:
    profiles = {**BUILTIN_PROFILES, **(extra or {})}
    if name not in profiles:
        raise ValueError(f"unknown hardware {name!r}; known: {sorted(profiles)} (add one with --hardware-file)")
    return profiles[name]
