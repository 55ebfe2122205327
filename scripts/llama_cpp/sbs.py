"""Helpers of scripts/gpu_llamacpp_side_by_side.sh (run with llama.cpp's gguf-py on PYTHONPATH for `plan`).

  layout GGUF
      Read the GGUF's tensor sizes and shapes once into GGUF.layout.json (plan reuses it).
  plan GGUF --budget-gib G --ctx N --parallel P [--margin-gib M]
      How many layers' experts llama-server must keep in host memory (--n-cpu-moe N) so that what it
      puts on the GPU fits G GiB, like fluxtide's --gpu-budget-gib G: every tensor but the trunk
      layers' routed experts (the token embedding stays in host memory in llama.cpp; the MTP layer is
      not loaded) + f16 KV of N tokens in the full-attention layers + the recurrent (GDN) state of P
      slots + M GiB for CUDA context and compute buffers. Prints one JSON object; the script then
      measures what the server really uses (nvidia-smi) and keeps both.
  engine NAME OUT.json RUN.json...
      One record per engine: its runs (server command, planned and measured VRAM, readiness time,
      the ft bench record each run wrote).
  compare OUT.json ENGINE.json...
      The side-by-side table (ft bench's own: headline figure per point, ratio to the first engine)
      for each pair of runs with the same role, printed and written to OUT.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

GIB = 2**30
EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_up_exps")


def _field(reader, key: str, default=None):
    field = reader.get_field(key)
    return default if field is None else field.contents()


def layout(gguf: str) -> dict:
    """What `plan` needs from a GGUF: bytes per layer of routed experts, the other tensors, the
    attention and recurrent-state shapes. Cached beside the file (GGUF.layout.json): reading the
    header of a Qwen3.6 GGUF takes ~17 s, most of it its 248k-token vocabulary."""
    cache = Path(gguf + ".layout.json")
    stat = Path(gguf).stat()
    key = {"size": stat.st_size, "mtime": stat.st_mtime}
    if cache.exists():
        cached = json.loads(cache.read_text())
        if cached.get("key") == key:
            return cached
    from gguf import GGUFReader  # llama.cpp's gguf-py, from the packed tree

    reader = GGUFReader(gguf)
    arch = _field(reader, "general.architecture")
    blocks = int(_field(reader, f"{arch}.block_count"))
    nextn = int(_field(reader, f"{arch}.nextn_predict_layers", 0) or 0)
    trunk = blocks - nextn
    recurrent = _field(reader, f"{arch}.attention.recurrent_layers")
    if recurrent is None:
        interval = int(_field(reader, f"{arch}.full_attention_interval", 4))
        recurrent = [(i + 1) % interval != 0 for i in range(trunk)]
    experts_per_layer, gpu_other, host_other = [0] * trunk, 0, 0
    for t in reader.tensors:
        parts = t.name.split(".")
        layer = int(parts[1]) if parts[0] == "blk" else None
        if layer is not None and layer >= trunk:
            continue  # the MTP layer: llama-server loads it only for --spec-type draft-mtp
        if layer is not None and parts[2] in EXPERT_TENSORS:
            experts_per_layer[layer] += int(t.n_bytes)
        elif t.name.startswith("token_embd."):
            host_other += int(t.n_bytes)  # llama.cpp keeps the input embedding in host memory
        else:
            gpu_other += int(t.n_bytes)
    ssm = {k: _field(reader, f"{arch}.ssm.{k}") for k in ("state_size", "time_step_rank", "group_count",
                                                          "inner_size", "conv_kernel")}
    result = {"key": key, "architecture": arch, "trunk_layers": trunk, "mtp_layers": nextn,
              "recurrent": [bool(r) for r in recurrent[:trunk]], "experts_per_layer": experts_per_layer,
              "gpu_dense_bytes": gpu_other, "host_embedding_bytes": host_other,
              "kv_heads": int(_field(reader, f"{arch}.attention.head_count_kv")),
              "key_length": int(_field(reader, f"{arch}.attention.key_length")),
              "value_length": int(_field(reader, f"{arch}.attention.value_length")),
              "ssm": {k: None if v is None else int(v) for k, v in ssm.items()}}
    cache.write_text(json.dumps(result))
    return result


def plan(args) -> dict:
    g = layout(args.gguf)
    trunk, recurrent, experts_per_layer = g["trunk_layers"], g["recurrent"], g["experts_per_layer"]
    full_layers = trunk - sum(recurrent)
    kv_bytes = args.ctx * full_layers * g["kv_heads"] * (g["key_length"] + g["value_length"]) * 2  # f16 K, V
    state_bytes = 0
    if any(recurrent):  # GDN: fp32 state [v_heads, k_dim, v_dim] + conv window per slot and layer
        ssm = g["ssm"]
        d_state, v_heads = ssm["state_size"], ssm["time_step_rank"]
        conv_channels = 2 * ssm["group_count"] * d_state + ssm["inner_size"]
        per_layer = v_heads * d_state * d_state * 4 + (ssm["conv_kernel"] - 1) * conv_channels * 4
        state_bytes = args.parallel * sum(recurrent) * per_layer
    fixed = g["gpu_dense_bytes"] + kv_bytes + state_bytes + args.margin_gib * GIB
    room = args.budget_gib * GIB - fixed
    on_gpu, used = 0, 0
    # --n-cpu-moe N keeps layers 0..N-1 in host memory: the GPU holds the experts of the LAST layers
    for layer in reversed(range(trunk)):
        if used + experts_per_layer[layer] > room:
            break
        used += experts_per_layer[layer]
        on_gpu += 1
    return {"gguf": args.gguf, "architecture": g["architecture"], "trunk_layers": trunk, "mtp_layers": g["mtp_layers"],
            "budget_gib": args.budget_gib, "ctx": args.ctx, "parallel": args.parallel, "margin_gib": args.margin_gib,
            "n_cpu_moe": trunk - on_gpu, "expert_layers_on_gpu": on_gpu,
            "expert_bytes_per_layer": max(experts_per_layer) if experts_per_layer else 0,
            "gpu_dense_bytes": g["gpu_dense_bytes"], "host_embedding_bytes": g["host_embedding_bytes"],
            "kv_bytes": kv_bytes, "recurrent_state_bytes": state_bytes,
            "planned_gpu_gib": round((fixed + used) / GIB, 2), "fits": room >= 0}


def engine(args) -> dict:
    runs = [json.loads(Path(p).read_text()) for p in args.runs if Path(p).exists()]
    for run in runs:
        path = run.get("record_path")
        run["record"] = json.loads(Path(path).read_text()) if path and Path(path).exists() else None
    return {"schema": "fluxtide.side_by_side.engine/1", "engine": args.name, "runs": runs}


def compare(args) -> dict:
    from rich.console import Console

    from app.bench.view import HEADLINE, side_by_side

    engines = [json.loads(Path(p).read_text()) for p in args.engines if Path(p).exists()]
    by_role: dict[str, list[tuple[str, list[dict]]]] = {}
    for e in engines:
        roles: dict[str, list[dict]] = {}
        for run in e["runs"]:
            if run.get("record"):
                roles.setdefault(run["role"], []).append(run)
        for role, runs in roles.items():
            by_role.setdefault(role, []).append((e["engine"], runs))
    tables = {}
    console = Console(width=160)
    for role, engine_runs in by_role.items():
        records = [_merged(name, runs) for name, runs in engine_runs]
        kind = records[0]["kind"]
        if len(records) > 1:
            console.print(side_by_side(records))
        figure, keys = HEADLINE[kind]
        tables[role] = {"kind": kind, "figure": figure, "point_keys": list(keys),
                        "columns": [name for name, _ in engine_runs],
                        "runs": [[{"name": r["name"], "vram_mib": r.get("vram_mib"), "ready_s": r.get("ready_s"),
                                   "record_path": r.get("record_path")} for r in runs] for _, runs in engine_runs],
                        "rows": _rows(records, figure, keys)}
    return {"schema": "fluxtide.side_by_side/1", "tables": tables}


def _merged(engine_name: str, runs: list[dict]) -> dict:
    """One record per engine and role: the points of its runs, in order. A server without a rebuild
    API is swept with one start per KV size (`--kv current`): its points get that run's KV size so
    they line up with fluxtide's live-rebuilt ones."""
    points = []
    for run in runs:
        for point in run["record"]["points"]:
            if point.get("kv_tokens_requested") == "current" and run.get("kv_tokens"):
                point = dict(point, kv_tokens_requested=int(run["kv_tokens"]))
            points.append(point)
    first = runs[0]["record"]
    return dict(first, points=points, target={**(first.get("target") or {}), "base_url": engine_name})


def _rows(records: list[dict], figure: str, keys) -> list[dict]:
    points = [{tuple(p.get(k) for k in keys): p.get(figure) for p in r["points"]} for r in records]
    rows = []
    for key in points[0] if points else []:
        values = [pts.get(key) for pts in points]
        base = values[0]
        ratios = [v / base if isinstance(v, (int, float)) and isinstance(base, (int, float)) and base else None
                  for v in values]
        rows.append({"point": list(key), "values": values, "ratio_to_first": ratios})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="sbs.py", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("plan")
    s.add_argument("gguf")
    s.add_argument("--budget-gib", type=float, required=True)
    s.add_argument("--ctx", type=int, required=True)
    s.add_argument("--parallel", type=int, required=True)
    s.add_argument("--margin-gib", type=float, default=1.5)
    s = sub.add_parser("layout")
    s.add_argument("gguf")
    s = sub.add_parser("engine")
    s.add_argument("name")
    s.add_argument("out")
    s.add_argument("runs", nargs="*")
    s = sub.add_parser("compare")
    s.add_argument("out")
    s.add_argument("engines", nargs="+")
    args = p.parse_args(argv)
    if args.cmd == "layout":
        result = layout(args.gguf)
        print(f"{args.gguf}: {result['trunk_layers']} layers (+{result['mtp_layers']} MTP), "
              f"{max(result['experts_per_layer']) / GIB:.3f} GiB of experts per layer")
        return 0
    if args.cmd == "plan":
        result = plan(args)
        print(json.dumps(result))
        return 0 if result["fits"] else 3
    result = engine(args) if args.cmd == "engine" else compare(args)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
