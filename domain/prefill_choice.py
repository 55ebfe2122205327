"""`--prefill-kernels auto`: which prefill the fast path runs, decided from the device, the executor and the
checkpoint's weight formats (docs/adr/0020-prefill-kernels-auto.md). Pure: the caller says what it knows."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from domain.model_spec import WeightFormat

PREFILL_KERNELS = ("auto", "reference", "triton")

# NOTE: the formats the Triton prefill has passed its GPU tests and been measured with on the H200 (ADR 0017,
# docs/prefill-kernels.md). BF16 is every unquantized float checkpoint (bf16, fp16, fp32 on disk: the loader keeps
# them as float tensors); FP8_BLOCK the canonical 128x128-tile form every block-FP8 variant is read into; NVFP4 the
# one form both NVFP4 layouts (ModelOpt, compressed-tensors) are read into: its GEMM tests passed on an H100 (session
# 28) and a ModelOpt checkpoint served end to end with the Triton prefill (session 30: TTFT 0.59 -> 0.03 s). Add a
# format here once its GEMM paths pass on a GPU and a server ran it (the MXFP4 ones hung on the H200 at some
# parameters).
GPU_VALIDATED_FORMATS = frozenset({WeightFormat.BF16, WeightFormat.FP8_BLOCK, WeightFormat.NVFP4})


@dataclass(frozen=True)
class PrefillChoice:
    """The prefill a server runs: what was asked (`requested`), what it resolved to (`kernels`), and why."""

    requested: str  # "auto" | "reference" | "triton" (--prefill-kernels)
    kernels: str  # "reference" | "triton"
    reason: str

    @property
    def triton(self) -> bool:
        return self.kernels == "triton"


def resolve_prefill_kernels(requested: str, *, device: str, fast_path: bool,
                            expert_format: WeightFormat | None = None,
                            dense_formats: Iterable[WeightFormat] = ()) -> PrefillChoice:
    """What `--prefill-kernels REQUESTED` runs.

    - "reference" and "triton" are taken as asked (where the reference executor serves, it ignores "triton",
      as it always has).
    - "auto" is "triton" only where all of these hold, else "reference":
      1. the device is CUDA: on the CPU the Triton kernels run only in the interpreter (tests);
      2. the CUDA-graph fast path serves (`fast_path`): the reference executor has no Triton prefill;
      3. the routed experts' format and every dense projection's format is in GPU_VALIDATED_FORMATS (unquantized
         float, block FP8, NVFP4): there the H200 served 3.1-4.7x the reference prefill's aggregate throughput at
         1-16 concurrent requests (ADR 0020), while the MXFP4 GEMM paths (and per-tensor/per-channel FP8, INT8)
         have not passed on a GPU. An unknown format (None) counts as not validated.
    `expert_format` and `dense_formats` are read only for "auto" on the fast path on CUDA."""
    if requested not in PREFILL_KERNELS:
        raise ValueError(f"--prefill-kernels must be one of {', '.join(PREFILL_KERNELS)}, got {requested!r}")
    if requested != "auto":
        return PrefillChoice(requested, requested, f"--prefill-kernels {requested}")
    if not device.startswith("cuda"):
        return PrefillChoice(requested, "reference", f"auto: {device} has no Triton prefill (CUDA only)")
    if not fast_path:
        return PrefillChoice(requested, "reference", "auto: the reference executor serves (the Triton prefill is the "
                                                     "CUDA-graph fast path's)")
    expert_format = None if expert_format is None else WeightFormat(expert_format)
    dense = sorted({WeightFormat(f) for f in dense_formats})
    unvalidated = [f"experts {expert_format.value if expert_format is not None else 'of an unknown format'}"
                   ] if expert_format not in GPU_VALIDATED_FORMATS else []
    unvalidated += [f"dense {f.value}" for f in dense if f not in GPU_VALIDATED_FORMATS]
    if unvalidated:
        return PrefillChoice(requested, "reference",
                             f"auto: the Triton prefill is not GPU-validated with {', '.join(unvalidated)} "
                             f"(validated: {_names(GPU_VALIDATED_FORMATS)}; --prefill-kernels triton forces it)")
    formats = f"experts {expert_format.value}" + (f", dense {'+'.join(f.value for f in dense)}" if dense else "")
    return PrefillChoice(requested, "triton", f"auto: CUDA fast path, {formats}: formats the Triton prefill is "
                                              f"GPU-validated with")


def _names(formats: Iterable[WeightFormat]) -> str:
    return ", ".join(sorted(f.value for f in formats))
