"""Choose the prefix cache's snapshot interval: memory per cached token vs tokens recomputed on a hit.

A CPU calculation on the full-size geometry (Qwen3.6-35B-A3B by default), no GPU needed:
- memory: one snapshot (the Gated DeltaNet recurrent + conv state of every linear layer) vs the KV of
  the tokens it serves, per interval I; and what share of a fixed cache budget still holds KV;
- recompute: a replayed workload through the real domain code (RadixPrefixCache as PrefixStore fills
  it: snapshots every I tokens, at the end of each prompt and at the branch point), conversations sharing system prompts
  and diverging at random points; per hit, the tokens recomputed because of the interval = the longest
  cached whole-page prefix (KV alone) - the resumed position (the deepest snapshot at or before it).
  Multi-turn follow-ups (resuming at the end-of-output snapshot) recompute < one page whatever I is,
  so the workload here is the case the interval exists for: a prefix shared up to a divergence.

    python scripts/snapshot_interval.py [--json out.json] [--prefill-tok-s 4000]

docs/adr/0004-prefix-cache.md records the result and the choice.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from domain.kv_pages import PageAllocator  # noqa: E402
from domain.model_spec import qwen36_35b_a3b  # noqa: E402
from domain.prefix_cache import RadixPrefixCache  # noqa: E402

PAGE = 16
INTERVALS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)


def replay(interval: int, seed: int, conversations: int = 400) -> list[int]:
    """Tokens recomputed per hit for want of a snapshot: each conversation's prompt shares a random-length
    prefix of one of a few system prompts (1k..16k tokens) with earlier ones and diverges there."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1 << 20) for _ in range(rng.randrange(1024, 16384))] for _ in range(4)]
    alloc = PageAllocator(1 << 20)
    handles = iter(range(1 << 30))
    cache = RadixPrefixCache(alloc, PAGE)
    recomputed = []
    for c in range(conversations):
        system = rng.choice(systems)
        shared = rng.randrange(PAGE, len(system))  # where this conversation leaves the shared text
        prompt = system[:shared] + [-(c + 1)] * rng.randrange(16, 512)  # its own tokens from there
        found = cache.match(prompt[:-1], require_snapshot=True)
        cached = cache.match(prompt[:-1]).num_tokens
        if cached:
            recomputed.append(cached - found.num_tokens)
        # the prompt's computed tokens go in, snapshots every `interval` and at its last page boundary
        end = (len(prompt) - 1) // PAGE * PAGE
        marks = {p: next(handles) for p in range(interval, end + 1, interval)}
        marks[end] = next(handles)
        if cached > found.num_tokens:  # PrefixStore's branch-point snapshot where the cached KV ended
            marks[cached] = next(handles)
        pages = list(found.pages) + alloc.allocate(-(-len(prompt) // PAGE) - len(found.pages))
        alloc.free(cache.insert(prompt[:len(prompt) - 1], pages, snapshots=marks))
    return recomputed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--prefill-tok-s", type=float, default=4000.0,
                        help="prefill rate to turn recomputed tokens into seconds (an assumption, not measured here)")
    args = parser.parse_args()
    spec = qwen36_35b_a3b()
    snap = spec.linear_state_bytes_per_sequence()
    kv = spec.kv_bytes_per_token()
    rows = []
    for interval in INTERVALS:
        lost = replay(interval, seed=7)
        per_token = snap / interval
        rows.append({
            "interval": interval,
            "snapshot_bytes_per_cached_token": round(per_token),
            "snapshot_vs_kv": round(per_token / kv, 3),
            "kv_share_of_cache_memory": round(kv / (kv + per_token), 3),
            "snapshots_per_16k_conversation": 16384 // interval + 2,
            "recomputed_tokens_mean": round(statistics.mean(lost), 1),
            "recomputed_tokens_p90": sorted(lost)[int(0.9 * len(lost))],
            "recomputed_tokens_max": max(lost),
            "recompute_s_mean": round(statistics.mean(lost) / args.prefill_tok_s, 3),
            "hits": len(lost),
        })
    record = {"model": spec.name, "page_size": PAGE, "snapshot_bytes": snap, "kv_bytes_per_token": kv,
              "prefill_tok_s_assumed": args.prefill_tok_s, "rows": rows}
    print(f"{spec.name}: one snapshot {snap / 2**20:.1f} MiB = KV of {snap / kv:.0f} tokens ({kv} B/token)")
    print(f"{'I':>6} {'snap B/tok':>10} {'vs KV':>6} {'KV share':>8} {'snaps/16k':>9} {'recompute mean':>14} "
          f"{'p90':>6} {'max':>6} {'s mean':>7}")
    for r in rows:
        print(f"{r['interval']:>6} {r['snapshot_bytes_per_cached_token']:>10} {r['snapshot_vs_kv']:>6} "
              f"{r['kv_share_of_cache_memory']:>8} {r['snapshots_per_16k_conversation']:>9} "
              f"{r['recomputed_tokens_mean']:>14} {r['recomputed_tokens_p90']:>6} {r['recomputed_tokens_max']:>6} "
              f"{r['recompute_s_mean']:>7}")
    if args.json:
        args.json.write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
