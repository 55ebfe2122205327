"""load_checkpoint(on_progress=...): per-phase byte counts that only grow and end at exactly
the bytes loaded (packed bank rows; stored dense tensors), for sharded and mmap checkpoints."""

from __future__ import annotations

import json
import threading
from itertools import pairwise
from pathlib import Path

import pytest
import torch

from adapters.checkpoint.loader import PHASE_BANK, PHASE_DENSE, PhaseCounter, load_checkpoint
from adapters.checkpoint.quant import QTensor
from adapters.checkpoint.synth import synthesize


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []
        self.threads: set[str] = set()
        self._busy = threading.Lock()

    def __call__(self, phase: str, done: int, total: int) -> None:
        # NOTE: the loader promises one call at a time; a second caller would find the lock held.
        assert self._busy.acquire(blocking=False), "on_progress called concurrently"
        try:
            self.threads.add(threading.current_thread().name)
            self.calls.append((phase, done, total))
        finally:
            self._busy.release()

    def phases(self) -> list[str]:
        return list(dict.fromkeys(p for p, _, _ in self.calls))

    def of(self, phase: str) -> list[tuple[int, int]]:
        return [(d, t) for p, d, t in self.calls if p == phase]


def assert_phase_counts(calls: list[tuple[int, int]], want_total: int, min_steps: int) -> None:
    assert calls[0] == (0, want_total), "a phase starts by announcing its total"
    assert calls[-1] == (want_total, want_total)
    assert {t for _, t in calls} == {want_total}, "the total of a phase never changes"
    dones = [d for d, _ in calls]
    assert all(a < b for a, b in pairwise(dones)), f"bytes_done must grow at every call: {dones}"
    assert len(calls) - 1 >= min_steps


def dense_nbytes(ckpt) -> int:
    total = 0
    for w in ckpt.dense.values():
        parts = (w.data, w.scale, w.global_scale) if isinstance(w, QTensor) else (w,)
        total += sum(t.numel() * t.element_size() for t in parts if t is not None)
    return total


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory) -> Path:
    out = synthesize(tmp_path_factory.mktemp("sharded"), "tiny", "bf16", shard_bytes=256 << 10, tokenizer=False)
    assert (out / "model.safetensors.index.json").exists()
    assert len(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]) > 0
    assert len(list(out.glob("*.safetensors"))) >= 3
    return out


def test_sharded_load_reports_each_phase_up_to_the_bytes_loaded(sharded_dir):
    rec = Recorder()
    ckpt = load_checkpoint(sharded_dir, progress=False, workers=4, on_progress=rec)
    spec = ckpt.spec
    assert rec.phases() == [PHASE_BANK, PHASE_DENSE]
    rows = spec.num_layers * spec.num_experts
    assert ckpt.experts.rows.numel() == ckpt.experts.nbytes
    assert_phase_counts(rec.of(PHASE_BANK), ckpt.experts.nbytes, min_steps=rows)
    # bf16: every dense tensor is kept as stored, so the bytes read are the bytes held
    assert_phase_counts(rec.of(PHASE_DENSE), dense_nbytes(ckpt), min_steps=len(ckpt.dense))


def test_mmap_load_reports_dense_weights_only(sharded_dir):
    rec = Recorder()
    ckpt = load_checkpoint(sharded_dir, progress=False, mmap=True, on_progress=rec)
    assert ckpt.experts.rows is None
    assert rec.phases() == [PHASE_DENSE], "no bank is filled in mmap mode"
    assert_phase_counts(rec.of(PHASE_DENSE), dense_nbytes(ckpt), min_steps=len(ckpt.dense))


def test_quantized_dense_counts_weights_and_scales(tmp_path):
    out = synthesize(tmp_path / "fp8", "tiny-qwen3moe", "fp8_block", tokenizer=False)
    rec = Recorder()
    ckpt = load_checkpoint(out, progress=False, on_progress=rec)
    assert any(isinstance(w, QTensor) and w.scale is not None for w in ckpt.dense.values())
    _, total = rec.of(PHASE_DENSE)[-1]
    assert total == dense_nbytes(ckpt)
    assert_phase_counts(rec.of(PHASE_BANK), ckpt.experts.nbytes, min_steps=ckpt.spec.total_experts)


def test_without_callback_loads_the_same(sharded_dir):
    a = load_checkpoint(sharded_dir, progress=False)
    b = load_checkpoint(sharded_dir, progress=False, on_progress=Recorder())
    assert torch.equal(a.experts.rows, b.experts.rows)


def test_phase_counter_refuses_to_pass_its_total():
    seen = []
    counter = PhaseCounter("x", 10, lambda *a: seen.append(a))
    assert counter.can_add(10) and not counter.can_add(11) and not counter.can_add(-1)
    counter.add(4)
    with pytest.raises(ValueError, match="would pass 4/10"):
        counter.add(7)
    counter.check_valid()
    assert seen == [("x", 0, 10), ("x", 4, 10)]
