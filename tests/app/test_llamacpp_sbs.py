"""scripts/llama_cpp/sbs.py (the llama.cpp side by side): the --n-cpu-moe plan that fits llama-server
into fluxtide's GPU budget, and the per-role merge that lines llama.cpp's per-KV-size server starts up
with fluxtide's live-rebuilt sweep. The GGUF layout comes from its cache file, so no gguf-py is needed."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "sbs", Path(__file__).resolve().parents[2] / "scripts" / "llama_cpp" / "sbs.py")
sbs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sbs)
GIB = 2**30


def _gguf_with_layout(tmp_path, experts_per_layer: list[int], dense: int) -> str:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    stat = gguf.stat()
    trunk = len(experts_per_layer)
    layout = {"key": {"size": stat.st_size, "mtime": stat.st_mtime}, "architecture": "qwen35moe",
              "trunk_layers": trunk, "mtp_layers": 1, "recurrent": [(i + 1) % 4 != 0 for i in range(trunk)],
              "experts_per_layer": experts_per_layer, "gpu_dense_bytes": dense, "host_embedding_bytes": 0,
              "kv_heads": 2, "key_length": 256, "value_length": 256,
              "ssm": {"state_size": 128, "time_step_rank": 32, "group_count": 16, "inner_size": 4096,
                      "conv_kernel": 4}}
    Path(str(gguf) + ".layout.json").write_text(json.dumps(layout))
    return str(gguf)


def _plan(gguf, budget, ctx=8192, parallel=4, margin=1.5):
    return sbs.plan(argparse.Namespace(gguf=gguf, budget_gib=budget, ctx=ctx, parallel=parallel, margin_gib=margin))


def test_plan_keeps_the_first_layers_experts_in_host_memory_to_fit_the_budget(tmp_path):
    gguf = _gguf_with_layout(tmp_path, [GIB] * 8, dense=2 * GIB)
    # 10 GiB - 2 GiB dense - 1.5 GiB margin - KV (8192 x 2 full layers x 2 x 512 x 2 B = 32 MiB)
    # - GDN state (4 slots x 6 layers x ~2.1 MiB) leaves room for 6 layers of 1 GiB experts
    plan = _plan(gguf, 10)
    assert plan["kv_bytes"] == 8192 * 2 * 2 * 512 * 2
    assert plan["recurrent_state_bytes"] == 4 * 6 * (32 * 128 * 128 * 4 + 3 * (2 * 16 * 128 + 4096) * 4)
    assert (plan["n_cpu_moe"], plan["expert_layers_on_gpu"]) == (2, 6) and plan["fits"]
    assert plan["planned_gpu_gib"] <= 10
    # a longer context takes room from the experts; a budget below the dense part does not fit at all
    assert _plan(gguf, 10, ctx=8192 * 64)["n_cpu_moe"] == 4  # + 2 GiB of KV: one layer fewer on the GPU
    assert _plan(gguf, 100)["n_cpu_moe"] == 0
    tight = _plan(gguf, 3)
    assert tight["n_cpu_moe"] == 8 and not tight["fits"]


def test_a_stale_layout_cache_is_not_used(tmp_path, monkeypatch):
    import sys
    import types

    gguf = _gguf_with_layout(tmp_path, [GIB] * 2, dense=GIB)
    assert sbs.layout(gguf)["trunk_layers"] == 2  # the cache answers: gguf-py is not even imported
    Path(gguf).write_bytes(b"GGUF and more")  # another file now: the cache's key no longer matches
    opened = []

    def reader(path):
        opened.append(path)
        raise RuntimeError("read the GGUF again")

    monkeypatch.setitem(sys.modules, "gguf", types.SimpleNamespace(GGUFReader=reader))
    with pytest.raises(RuntimeError, match="read the GGUF again"):
        sbs.layout(gguf)
    assert opened == [gguf]


def _record(kind, points):
    return {"kind": kind, "points": points, "target": {"base_url": "http://x"}}


def test_llama_cpp_sweep_points_take_their_server_starts_kv_size(tmp_path):
    llama = {"engine": "llama.cpp", "runs": [
        {"role": "sweep", "name": "budget-8k", "kv_tokens": 8192, "record": _record("sweep", [
            {"kv_tokens_requested": "current", "batch_size": 1, "aggregate_tok_s": 20.0}])},
        {"role": "sweep", "name": "budget-64k", "kv_tokens": 65536, "record": _record("sweep", [
            {"kv_tokens_requested": "current", "batch_size": 1, "aggregate_tok_s": 10.0}])},
        {"role": "ladder", "name": "resident", "kv_tokens": 65536, "record": _record("ladder", [
            {"concurrency": 1, "aggregate_tok_s": 100.0}])}]}
    ours = {"engine": "fluxtide", "runs": [
        {"role": "sweep", "name": "budget", "kv_tokens": None, "record": _record("sweep", [
            {"kv_tokens_requested": 8192, "batch_size": 1, "aggregate_tok_s": 60.0},
            {"kv_tokens_requested": 65536, "batch_size": 1, "aggregate_tok_s": 40.0}])}]}
    paths = []
    for e in (llama, ours):
        paths.append(tmp_path / f"{e['engine']}.json")
        paths[-1].write_text(json.dumps(e))
    out = tmp_path / "sbs.json"
    assert sbs.main(["compare", str(out), *map(str, paths)]) == 0
    tables = json.loads(out.read_text())["tables"]
    sweep = {tuple(r["point"]): r for r in tables["sweep"]["rows"]}
    assert tables["sweep"]["columns"] == ["llama.cpp", "fluxtide"]
    assert sweep[(8192, 1)]["ratio_to_first"] == [1.0, 3.0] and sweep[(65536, 1)]["ratio_to_first"] == [1.0, 4.0]
    assert tables["ladder"]["rows"] == [{"point": [1], "values": [100.0], "ratio_to_first": [1.0]}]
