"""Canonical tensor names: strip the HF prefixes, drop MTP and vision tensors, find experts."""

from __future__ import annotations

import re
from dataclasses import dataclass

# Longest prefix first: nested (multimodal) checkpoints put the text model under
# model.language_model.*, flat ones under model.*.
TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
LM_HEAD_PREFIXES = ("language_model.lm_head.",)
IGNORED_PREFIXES = {
    "mtp.": "mtp",
    "model.mtp.": "mtp",
    "model.visual.": "vision",
    "visual.": "vision",
    "model.vision_tower.": "vision",
    "vision_tower.": "vision",
}

PER_EXPERT = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.(\w+)$")
# fused [E, ...] experts: plain (transformers) or compressed-tensors packed NVFP4 with its scales
FUSED_EXPERT = re.compile(
    r"^layers\.(\d+)\.mlp\.experts\.(gate_up|down)_proj(\.weight|_packed|_scale|_global_scale|_input_global_scale)?$"
)


def ignored_kind(name: str) -> str | None:
    """'mtp' or 'vision' for tensors the text engine never uses, else None."""
    for prefix, kind in IGNORED_PREFIXES.items():
        if name.startswith(prefix):
            return kind
    return None


def canonical_name(name: str) -> str:
    for prefix in LM_HEAD_PREFIXES:
        if name.startswith(prefix):
            return "lm_head." + name[len(prefix) :]
    for prefix in TEXT_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


@dataclass(frozen=True)
class ExpertTensor:
    layer: int
    expert: int  # -1 for fused [E, ...] tensors
    matrix: str  # gate | up | down | gate_up (fused)
    suffix: str  # weight, weight_scale_inv, ...; fused: weight, packed, scale, global_scale, input_global_scale


def parse_expert(canonical: str) -> ExpertTensor | None:
    m = PER_EXPERT.match(canonical)
    if m:
        return ExpertTensor(int(m.group(1)), int(m.group(2)), m.group(3), m.group(4))
    m = FUSED_EXPERT.match(canonical)
    if m:
        return ExpertTensor(int(m.group(1)), -1, m.group(2), (m.group(3) or ".weight")[1:])
    return None
