"""One line per measured batch of every bench_decode record under a directory (DIR/*/bench_decode.json): the run's
folder, scenario, expert slots, host lane share / team / threads, batch, median and p90 step ms, aggregate tok/s,
and the point's error if it failed. For A/B runs on the device, where a call's output is all one sees at once.
Usage: ``python scripts/summarize_bench_decode.py $OUT``."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def lines(root: Path) -> list[str]:
    out = []
    for path in sorted(root.glob("*/bench_decode.json")):
        record = json.loads(path.read_text())
        for name, scen in record.get("scenarios", {}).items():
            lane = scen.get("host_experts") or {}
            slots = (scen.get("plan") or {}).get("expert_slots")
            for rows, p in (scen.get("batches") or {}).items():
                out.append(f"{path.parent.name} {name} slots={slots} host={lane.get('share')}/{lane.get('team')}/"
                           f"{lane.get('threads')} bs{rows} median={p.get('execute_median_ms')} "
                           f"p90={p.get('execute_p90_ms')} agg={p.get('aggregate_tok_s')} {p.get('error', '')[:200]}")
    return out


if __name__ == "__main__":
    print("\n".join(lines(Path(sys.argv[1]))))
