#!/usr/bin/env bash
# The fast path's GPU checks in phases that each fit one 10-minute device call (pick them by name):
#   tests    GPU pytest of the default decode path's kernels and executor, one pytest per file, 60 s per test
#   tests-prefill  the same for the Triton prefill's kernels, warm-up and streamed paths
#            (-v -rfE: each result and every failure's message is in the log, a hang costs one test)
#   tests-grouped  the same for the grouped MoE GEMMs and the expert pool's grouped paths (their real-geometry
#            fp32 tests tune and compile for minutes: 240 s did not finish test_kernels_moe_grouped.py on 2026-12-01)
#   tests-launch  the same for the prefill MoE's set lookup and Triton alignment (session 8), their callers and
#            the FP8-activation GEMMs (session 9, ADR 0018)
#   tests-w-lhs  the same for the GEMMs with W_LHS tiles (dense, split-K, grouped; on by default since session 25)
#   kernels  scripts/bench_kernels.py (kernels one by one, GEMV/GEMM crossovers)
#   decode   scripts/bench_decode.py resident bs1/4/16 with the profile and fp32 parity, twice:
#            --prefill-kernels reference into $OUT/decode_reference and triton into $OUT/decode_triton. The decode
#            graphs ran the same kernels both ways in run 7 (2026-12-02: bs16 replay 8.53 ms each, the tensor-core
#            dense GEMM for its projections): the pair is a run-to-run check
#   formats  scripts/bench_decode.py resident bs1/4 for each of $FORMATS (default the two NVFP4 layouts, nvfp4_modelopt
#            and nvfp4_ct: issue 8's 300 tok/s; ft synth names formats by layout, a bare nvfp4 is refused).
#            BF16 (200 tok/s): the phase bf16 below (its checkpoint fits neither the disk nor /dev/shm alone)
#   bf16     issue 8's BF16 target on the single-GPU kind: the 64.6 GiB checkpoint exceeds the 64 GiB disk, and in
#            /dev/shm it plus its 60 GiB pinned bank exceed the 128 GiB of host memory, so ft synth --spill-dir
#            splits it (SHM_GIB in /dev/shm, default what host memory leaves beside the bank and 24 GiB of
#            headroom, the rest on the disk; symlinked into /tmp/qwen36-bf16), then bench_decode.py resident bs1/4
#            as in formats (~6 min on a cold machine; the 2-GPU kind, never lent so far, would hold it unsplit)
#   formats-http  ft serve each of $FORMATS resident (the checkpoint formats or bf16 in /tmp/qwen36-FMT, synthesized
#            if absent (bf16 split as in the phase bf16), other /tmp/qwen36-* checkpoints removed where the disk is
#            short, tokenizer added) and ft bench ladder c1/c4 (LEVELS) and probe: issue 8's format targets through
#            the HTTP API, as the customer measures. BF16 on an 80 GB card: RESIDENT_KV=8k RESIDENT_RUNNING=4
#   prefill-a8  scripts/bench_prefill.py resident 4k/32k with bf16 and with FP8 activations (ADR 0018), each with
#            its record ($OUT/prefill_bf16, $OUT/prefill_a8: the latter's a8_logits says how far the logits move)
#   spans    the batched prefill spans (sessions 12-14): their warm-up's, step's and kernels' GPU tests, then
#            scripts/diag/bench_prefill_spans.py (one step of 1..16 short prompts, with a profile of the 1- and
#            16-span steps: device busy vs wall time, host syncs, top kernels and host ops) into $OUT/prefill_spans.json
#   splitk   the split-K GEMM's and the pair buckets' GPU tests (the fast executor's and the prefill graphs' too:
#            they tune and capture), then bench_kernels.py --only crossover (GEMV / split-K / GEMM per row count);
#            synthesizes $CKPT meanwhile
#   splitk-tiles  bench_kernels.py --only splitk-tiles (every fixed split-K tile, split, warps, stages at 4/16/32 rows
#            against the autotuned launch and the GEMV; ~4 min), then --only crossover (the tuned tiles named)
#   gdn-walk  bench_kernels.py --only gdn-walk (session 25): the Gated DeltaNet state walk at each launch of
#            GDN_WALK_CONFIGS (BLOCK_V x warps x chunk-loop stages, today's 16x8x1 first) over one 4k and one 8k
#            prompt, beside gdn_chunk_wy and gdn_chunk_out, into $OUT/gdn_walk (docs/prefill-kernels.md, "The state
#            walk's launch configuration"; ~1-2 min)
#   gdn-out  bench_kernels.py --only gdn-out (session 28): the Gated DeltaNet output kernel (gdn_chunk_out) at each
#            launch of gdn_launch_ab.GDN_OUT_CONFIGS over one 4k and one 8k prompt, into $OUT/gdn_out (~1 min)
#   dense-prefill  bench_kernels.py --only dense-prefill (session 29): the dense projections at 1k-16k rows, dense_gemm
#            against cuBLAS over a dequantized copy, and the routed experts' grouped GEMMs against torch._grouped_mm
#            over bf16 experts, into $OUT/dense_prefill (~3-5 min)
#   dequant  bench_prefill.py resident 8k/32k with FLUXTIDE_PREFILL_DEQUANT_ROWS=0 (dense_gemm) then 1,024 (cuBLAS
#            over a dequantized copy from 1,024 rows) into $OUT/prefill_dequant{0,1024} (~8 min on a cold machine)
#   splitk-decode  bench_decode.py resident bs1/4/16, split-K off/on x pair buckets off/on, in one process
#   w-lhs    the prefill GEMMs with the weight as the wgmma's left operand (session 23): bench_prefill.py resident
#            4k/32k with FLUXTIDE_PREFILL_W_LHS=0 then 1 into $OUT/prefill_wlhs{0,1} (~8 min on a cold machine)
#   w-lhs-decode  the same arrangement in the decode kernels: bench_kernels.py --only crossover (the split-K GEMM's
#            W_LHS tiles) with FLUXTIDE_PREFILL_W_LHS=0 then 1, and --only grouped with it set (~6 min)
#   w-lhs-step  bench_decode.py resident bs1/4/16, the control, then with FLUXTIDE_PREFILL_W_LHS=1 and grouped
#            decode from 64 pairs into $OUT/decode_grouped_wlhs (~8 min)
#   staging  ADR 0010's staging rows: bench_prefill.py budget (24 GiB) 8k/32k with --staging 66 then 132 into
#            $OUT/prefill_staging{66,132} (~9 min on a cold machine)
#   http-ab  ADR 0022's HTTP A/B on one machine: the resident ladder per variant of $AB (default, splitk0,
#            pairs256), each server through scripts/diag/serve_with_knobs.py (~4-5 min a variant on a cold machine)
#   http     scripts/gpu_http_bench.sh under ft serve's default --prefill-kernels auto (Triton on a GPU)
#   dedup    the expert-deduplicated MoE GEMVs (ADR 0015, off by default): their GPU tests (bitwise the per-pair
#            kernels, autotuned tiles, graph replay), bench_kernels.py --only dedup (per-pair vs dedup at rows
#            1/4/8/16, random and local routing), then bench_decode.py resident bs1/4/16 with them on
#            (--dedup-min-pairs 1; needs the checkpoint the decode phase made: run after it, same machine)
#   grouped  the decode calls on the grouped GEMMs aligned by expert (expert_pool.GROUPED_DECODE_MIN_PAIRS, off by
#            default): their GPU tests (the per-pair layers within fp32 rounding, the same residency decisions,
#            inside the captured graphs), bench_kernels.py --only grouped (the layer per pair vs grouped, part by
#            part, 1/4/8/16 tokens), then bench_decode.py resident bs1/4/16 with them on from 64 routed pairs
#            (bs8 and bs16; bs1 and bs4 keep the GEMVs: the control). Synthesizes $CKPT if absent (~40 s)
#   graphs   the MoE half of short prefill steps from CUDA graphs (ft serve --prefill-graphs, default auto since
#            2026-12-04: on with the fast path's Triton prefill; bench_prefill_spans.py only when asked): its GPU test
#            (the eager path's logits, tokens and residency decisions, now with the segments captured and
#            replayed), then bench_prefill_spans.py at 1 and 2 spans of 20 tokens (a one-span step of 20 tokens
#            is a segment step; two spans, 40 tokens, run eagerly: the control) without and with --prefill-graphs
#            into $OUT/prefill_spans_{eager,graphs}.json
# Usage: ./scripts/gpu_fast_path.sh tests kernels   (carry the serving wheels in .whl/ for http)
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
export OUT
CKPT=${CKPT:-/tmp/qwen36-fp8}
# bench_prefill LIMIT NAME ARGS...: scripts/bench_prefill.py on $CKPT (synthesized if absent) into $OUT/NAME, cut at
# LIMIT seconds, its scenario lines and failures in the log (an env assignment before the call reaches it)
bench_prefill() {
  local limit=$1 name=$2; shift 2
  timeout "$limit" python3 scripts/bench_prefill.py --out "$OUT/$name" --synth-dir "$CKPT" --reuse "$@" 2>&1 \
    | grep -E "^resident|^budget|Error|failed" | cut -c1-300
}
# free_disk GIB KEEP: removes the other synthesized checkpoints (/tmp/qwen36-*, their /dev/shm spills) until the disk
# has GIB free; KEEP (a checkpoint directory) stays. Session 35: formats-http after the resident FP8 runs found the
# 34 GiB FP8 and the 20 GiB NVFP4 checkpoints still on the 64 GiB disk, and the next synthesis died of ENOSPC
free_disk() {
  local need=$1 keep=$2 d
  for d in /tmp/qwen36-*; do
    (( $(df --output=avail -BG /tmp | tail -1 | tr -dc 0-9) >= need )) && return 0
    [[ -e $d && $d != "$keep" ]] || continue
    echo "free_disk: removing $d (${need} GiB wanted on /tmp)"; rm -rf "$d" "/dev/shm/$(basename "$d")"
  done
}
# synth_bf16: the BF16 checkpoint in /tmp/qwen36-bf16 (the phase bf16's note: split between /dev/shm and the disk);
# fails (status 1) where it cannot fit
synth_bf16() {
  local ck=/tmp/qwen36-bf16 total=65  # GiB: 60.0 of experts + 4.6 dense (domain.model_spec: qwen36_35b_a3b(WeightFormat.BF16))
  [ -f "$ck/config.json" ] && return 0
  rm -rf "$ck" /dev/shm/qwen36-bf16  # a synthesis cut short leaves no config.json, and its files would count as used
  local mem shm_free shm keep disk
  mem=$(awk '/^MemTotal/ {print int($2 / 1048576)}' /proc/meminfo)
  shm_free=$(df --output=avail -BG /dev/shm | tail -1 | tr -dc 0-9)
  shm=${SHM_GIB:-$(( mem - 60 - 24 ))}  # the pinned bank (60) and headroom (CUDA, torch, page cache) stay free
  (( shm > shm_free )) && shm=$shm_free
  keep=$(( total - shm )); (( keep < 0 )) && keep=0
  free_disk $(( keep + 4 )) "$ck"
  disk=$(df --output=avail -BG /tmp | tail -1 | tr -dc 0-9)
  echo "bf16: host memory $mem GiB, disk free $disk GiB, /dev/shm free $shm_free GiB: $keep GiB on the disk, the rest in /dev/shm"
  if (( keep + 4 > disk )); then echo "bf16: does not fit this machine (needs $keep + 4 GiB on the disk)"; return 1; fi
  timeout 420 python3 -m app synth --out "$ck" --geometry qwen3.6-35b-a3b --format bf16 --device cuda \
    --spill-dir /dev/shm/qwen36-bf16 --max-out-gb "$keep" 2>&1 | tail -1
  [ -f "$ck/config.json" ]
}
for phase in "$@"; do
  echo "=== $phase"
  case $phase in
    tests|tests-prefill|tests-grouped|tests-launch|tests-w-lhs|spans)
      # NOTE: one pytest per file, appended to one log: a hanging test costs its own 60 s (pytest-timeout
      # fails it with its stack) instead of the phase, and every file's failures and summary reach the log.
      # A file gets at most $file_limit s (SIGINT first, so pytest still prints what ran); files past 480 s of the
      # phase are skipped, and said so, to leave the summary inside one 10-minute device call.
      log="$OUT/gpu_pytest_fast_path.log"; : > "$log"
      # the prefill warm-up's tests tune every kernel key of a model: 60 s was too short on 2026-12-01
      per_test=(--timeout "$(case $phase in tests) echo 60 ;; tests-prefill|tests-launch|spans) echo 150 ;; *) echo 300 ;; esac)")
      file_limit=240
      python3 -c "import pytest_timeout" 2>/dev/null || { per_test=(); echo "pytest-timeout missing: no per-test limit" | tee -a "$log"; }
      start=$SECONDS
      # `tests`: the default decode path (what every CUDA server runs, ~7 min on 2026-12-01);
      # `tests-prefill`: the Triton prefill's files (the 480 s cap cut them from one phase);
      # `tests-grouped`: the grouped MoE GEMMs (their real-geometry tests alone outlast 240 s)
      if [[ $phase == tests ]]; then
        files=(tests/adapters/test_fast_executor.py tests/adapters/test_kernel_fused_routing.py
               tests/adapters/test_kernels_moe.py tests/adapters/test_kernel_moe_router.py
               tests/adapters/test_kernels_attention_gdn.py tests/adapters/test_device_residency.py)
      elif [[ $phase == tests-prefill ]]; then
        # the newest kernels first: a phase cut at 480 s skips its last files
        log="$OUT/gpu_pytest_prefill.log"; : > "$log"
        files=(tests/adapters/test_kernels_prefill.py tests/adapters/test_fast_executor_streamed.py
               tests/adapters/test_prefill_warmup.py tests/adapters/test_prefill_linear.py
               tests/adapters/test_kernel_dense_gemm.py)
      elif [[ $phase == tests-launch ]]; then
        # session 8's launch cuts of the prefill MoE (the set lookup, the Triton alignment) and their callers
        log="$OUT/gpu_pytest_launch.log"; : > "$log"
        files=(tests/adapters/test_residency_set_lookup.py tests/adapters/test_kernel_moe_align.py
               tests/adapters/test_expert_pool_paths.py tests/adapters/test_expert_pool_grouped.py
               tests/adapters/test_expert_shard.py tests/adapters/test_fp8_activations.py
               tests/adapters/test_prefill_warmup.py)
      elif [[ $phase == tests-w-lhs ]]; then
        # the W_LHS tiles (on by default since session 25) on the device: every arrangement's tiles against the
        # reference in bf16 (the folding test the interpreter cannot run) and fp32; the grouped file last (longest)
        log="$OUT/gpu_pytest_w_lhs.log"; : > "$log"; file_limit=300
        files=(tests/adapters/test_kernel_dense_gemm.py tests/adapters/test_kernel_dense_gemm_splitk.py
               tests/adapters/test_kernels_moe_grouped.py)
      elif [[ $phase == spans ]]; then
        # the warm-up's no-compile check first (it failed on 2026-12-02 before the state walk took every span in
        # one launch); test_kernels_prefill.py's real-geometry tests did not finish in 150 s there
        log="$OUT/gpu_pytest_spans.log"; : > "$log"; file_limit=200
        files=(tests/adapters/test_prefill_warmup.py tests/adapters/test_prefill_spans.py
               tests/adapters/test_kernel_paged_prefill_attention.py tests/adapters/test_kernels_prefill.py)
      else
        log="$OUT/gpu_pytest_grouped.log"; : > "$log"; file_limit=400
        files=(tests/adapters/test_kernels_moe_grouped.py tests/adapters/test_expert_pool_paths.py
               tests/adapters/test_expert_pool_grouped.py)
      fi
      for f in "${files[@]}"; do
        if (( SECONDS - start > 480 )); then echo "SKIPPED $f (phase past 480 s)" | tee -a "$log"; continue; fi
        echo "=== $f" >> "$log"
        t0=$SECONDS; lines=$(wc -l < "$log")
        timeout -k 10 -s INT "$file_limit" python3 -m pytest -v -p no:cacheprovider -m "not slow" -o addopts="" -rfE \
          ${per_test[@]+"${per_test[@]}"} "$f" >> "$log" 2>&1
        rc=$?
        summary=$(tail -n +"$((lines + 1))" "$log" | grep -E "^=+ .*(passed|failed|error|skipped|deselected|no tests ran).* =+$" | tail -1)
        echo "=== $f exit $rc in $((SECONDS - t0)) s" >> "$log"
        echo "$f: exit $rc in $((SECONDS - t0)) s ${summary:-(no pytest summary: killed?)}"
      done
      grep -E "^(FAILED|ERROR) |Timeout" "$log" | cut -c1-300
      if [[ $phase == spans ]]; then
        timeout 150 python3 scripts/diag/bench_prefill_spans.py --out "$OUT/prefill_spans.json" 2>&1 | tail -12 | cut -c1-300
      fi ;;
    kernels) timeout 240 python3 scripts/bench_kernels.py --out "$OUT" 2>&1 | tail -3 ;;
    splitk)
      # session 19: the split-K GEMM for 2..32-row projections and the per-pair GEMVs' pair buckets. Synthesizes
      # $CKPT in the background for `splitk-decode` (the next call, same warm machine)
      [[ -f $CKPT/config.json ]] || { python3 -c "import sys; from pathlib import Path
from adapters.checkpoint.synth import synthesize; from adapters.checkpoint.synth_config import GEOMETRIES
synthesize(Path(sys.argv[1]), GEOMETRIES['qwen3.6-35b-a3b'], 'fp8_block', seed=0, tokenizer=False, progress=False,
           device='cuda')" "$CKPT" > "$OUT/synth.log" 2>&1 & }
      timeout -k 10 -s INT 330 python3 -m pytest -q -p no:cacheprovider -m "not slow" -o addopts="" -rfE \
        tests/adapters/test_kernel_dense_gemm_splitk.py tests/adapters/test_prefill_linear.py \
        tests/adapters/test_kernels_moe.py tests/adapters/test_fast_executor.py tests/adapters/test_prefill_graphs.py \
        2>&1 | tee "$OUT/splitk_pytest.log" | tail -12
      timeout 150 python3 scripts/bench_kernels.py --out "$OUT/crossover" --only crossover 2>&1 | tail -2 | cut -c1-300
      wait ;;
    splitk-tiles)
      # session 20: the split-K GEMM at every fixed tile x split x warps x stages (BLOCK_N 128 and 8 warps are
      # outside the autotuner's space) at 4/16/32 rows, beside its autotuned launch and the GEMV: does a tile
      # reach the GEMV's ~3.2 TB/s on the wide projections? Then the crossover again, with the tuned tiles named
      timeout 420 python3 scripts/bench_kernels.py --out "$OUT/splitk_tiles" --only splitk-tiles 2>&1 | tail -14 | cut -c1-300
      timeout 150 python3 scripts/bench_kernels.py --out "$OUT/crossover" --only crossover 2>&1 | tail -2 | cut -c1-300 ;;
    gdn-walk)
      # session 25: does pipelining the walk's chunk loop (num_stages), or 32 value columns a program, cut its
      # ~11 us a chunk step? Each row: walk_us, us_per_chunk_step, speedup_vs_default, max_rel_diff, compiled
      timeout 280 python3 scripts/bench_kernels.py --out "$OUT/gdn_walk" --only gdn-walk 2>&1 | tail -12 ;;
    gdn-out)
      # session 28: gdn_chunk_out (28.4 ms of the H100's 8k resident prefill) at 64 / 128 value columns a program,
      # computing q k^T once or twice a chunk instead of 4 times. Rows: out_us, speedup_vs_default, max_rel_diff
      timeout 280 python3 scripts/bench_kernels.py --out "$OUT/gdn_out" --only gdn-out 2>&1 | tail -14 ;;
    dense-prefill)
      # session 29: the dense projections at prefill chunk sizes, dense_gemm (autotuned) against cuBLAS bf16 over a
      # dequantized copy (dequant_weight + F.linear), per shape and row count; then the routed experts' grouped GEMMs
      # against torch._grouped_mm over bf16 experts at 2k / 8k tokens, and a layer's dequantization (~3-5 min)
      timeout 420 python3 scripts/bench_kernels.py --out "$OUT/dense_prefill" --only dense-prefill 2>&1 \
        | grep -E "^\{|Error" | cut -c1-400 ;;
    dequant)
      # session 29: the resident 8k/32k prefill with the dense projections on dense_gemm (FLUXTIDE_PREFILL_DEQUANT_ROWS=0)
      # then on cuBLAS over a dequantized copy from 1,024 rows (FLUXTIDE_PREFILL_DEQUANT_ROWS=1024), profiling one 8k chunk of the latter
      # (synthesizes $CKPT: ~40 s; ~8 min on a cold machine)
      for rows in 0 1024; do
        FLUXTIDE_PREFILL_DEQUANT_ROWS=$rows bench_prefill 270 "prefill_dequant$rows" --scenarios resident \
          --prompts 8192,32768 --profile-tokens "$([[ $rows != 0 ]] && echo 8192 || echo 0)"
      done ;;
    splitk-decode)
      # the A/B in one process: split-K off (1) / on (32) x one pair bucket (1, the tile tuned at bs1) / the decode buckets (256)
      timeout 560 python3 scripts/bench_decode.py --out "$OUT/decode_splitk" --synth-dir "$CKPT" --reuse \
        --batch 1,4,16 --plans resident --warmup 16 --steps 32 --parity-steps 2 --prefill-kernels triton \
        --splitk-max-rows 1,32 --pairs-bucket-max 1,256 2>&1 | grep -E "^resident|parity|Error|failed" | cut -c1-300 ;;
    dedup)
      timeout -k 10 -s INT 200 python3 -m pytest -q -p no:cacheprovider -m "not slow" -o addopts="" -rfE \
        tests/adapters/test_kernels_moe_dedup.py tests/adapters/test_expert_pool_dedup.py \
        tests/adapters/test_fast_executor_dedup.py 2>&1 | tail -8
      timeout 150 python3 scripts/bench_kernels.py --out "$OUT/dedup" --only dedup 2>&1 | tail -3
      timeout 200 python3 scripts/bench_decode.py --out "$OUT/decode_dedup" --synth-dir "$CKPT" --reuse \
        --batch 1,4,16 --plans resident --warmup 16 --steps 32 --parity-steps 2 --prefill-kernels triton \
        --dedup-min-pairs 1 2>&1 \
        | grep -E "^resident|parity|Error" | cut -c1-300 ;;
    graphs)
      timeout -k 10 -s INT 200 python3 -m pytest -q -p no:cacheprovider -m "not slow" -o addopts="" -rfE \
        tests/adapters/test_prefill_graphs.py 2>&1 | tee "$OUT/graphs_pytest.log" | tail -6
      for mode in eager graphs; do
        timeout 170 python3 scripts/diag/bench_prefill_spans.py --out "$OUT/prefill_spans_$mode.json" --spans 1,2 \
          $([[ $mode == graphs ]] && echo --prefill-graphs) 2>&1 | grep -E "^spans|^mixed|Error" | cut -c1-300
      done ;;
    grouped)
      timeout -k 10 -s INT 200 python3 -m pytest -q -p no:cacheprovider -m "not slow" -o addopts="" -rfE \
        tests/adapters/test_expert_pool_grouped_decode.py tests/adapters/test_fast_executor_grouped_decode.py \
        2>&1 | tee "$OUT/grouped_pytest.log" | tail -8
      timeout 150 python3 scripts/bench_kernels.py --out "$OUT/grouped" --only grouped 2>&1 | tail -3
      timeout 220 python3 scripts/bench_decode.py --out "$OUT/decode_grouped" --synth-dir "$CKPT" --reuse \
        --batch 1,4,16 --plans resident --warmup 16 --steps 32 --parity-steps 2 --prefill-kernels triton \
        --grouped-decode-min-pairs 64 2>&1 | grep -E "^resident|parity|Error" | cut -c1-300 ;;
    decode)
      for kernels in reference triton; do
        timeout 270 python3 scripts/bench_decode.py --out "$OUT/decode_$kernels" --synth-dir "$CKPT" --reuse \
          --batch 1,4,16 --plans resident --warmup 16 --steps 32 --parity-steps 2 --prefill-kernels "$kernels" 2>&1 \
          | grep -E "^resident|parity|Error" | cut -c1-300
      done ;;
    formats)
      for fmt in ${FORMATS:-nvfp4_modelopt nvfp4_ct}; do
        timeout 280 python3 scripts/bench_decode.py --out "$OUT/decode_$fmt" --synth-dir "/tmp/qwen36-$fmt" --reuse \
          --format "$fmt" --batch 1,4 --plans resident --warmup 16 --steps 32 --parity-steps 2 2>&1 \
          | grep -E "^resident|parity|Error" | cut -c1-300
      done ;;
    bf16)
      ck=/tmp/qwen36-bf16
      synth_bf16 || continue
      free -g | head -2; df -h /tmp /dev/shm | tail -2
      timeout 400 python3 scripts/bench_decode.py --out "$OUT/decode_bf16" --synth-dir "$ck" --reuse \
        --format bf16 --batch 1,4 --plans resident --warmup 16 --steps 32 --parity-steps 2 2>&1 \
        | grep -E "^resident|parity|Error" | cut -c1-300 ;;
    formats-http)
      ( . "$(dirname "$0")/gpu_http_bench.sh"
        for fmt in ${FORMATS:-nvfp4_modelopt}; do
          CKPT=/tmp/qwen36-$fmt
          if [[ $fmt == bf16 ]]; then
            synth_bf16 || continue
          elif [ ! -f "$CKPT/config.json" ]; then
            free_disk 40 "$CKPT"  # the largest other format (FP8, 34 GiB) and the tokenizer
            timeout 200 python3 -m app synth --out "$CKPT" --geometry qwen3.6-35b-a3b --format "$fmt" --device cuda \
              2>&1 | tail -1
          fi
          synth_ckpt  # adds the tokenizer files bench_decode.py leaves out
          if serve 8101 "$OUT/serve_$fmt.log" $(resident_serve_args); then
            LADDER_ARGS="--levels ${LEVELS:-1,4} --rounds 2" bench_ladder http://127.0.0.1:8101 "$OUT/ladder_$fmt.json" > /dev/null
            timeout "$BENCH_TIMEOUT" python3 -m app bench probe --base-url http://127.0.0.1:8101 --model-dir "$CKPT" \
              --quiet --out "$OUT/probe_$fmt.json" 2>&1 | tail -3
            python3 -c "import json, sys; r = json.load(open(sys.argv[1])); print(sys.argv[2], 'c/aggregate/TTFT/steady:',
  *(f\"{p['concurrency']}/{p['aggregate_tok_s']:.0f}/{p['ttft_s_median']:.3f}/{p['steady_decode_tok_s_median']:.0f}\"
    for p in r['points']))" "$OUT/ladder_$fmt.json" "$fmt"
            kill $SERVER; wait $SERVER 2>/dev/null
          else
            tail -5 "$OUT/serve_$fmt.log"
          fi
        done ) ;;
    prefill-a8)
      # ADR 0018: the resident 32k prefill with bf16 and with e4m3 activations (synthesizes $CKPT if absent: ~40 s)
      for mode in bf16 a8; do
        bench_prefill 270 "prefill_$mode" --scenarios resident --prompts 4096,32768 --profile-tokens 0 \
          $([[ $mode == a8 ]] && echo --fp8-activations)
      done ;;
    w-lhs)
      # session 23's W_LHS prefill GEMMs (docs/prefill-kernels.md, "Weight as the left operand"): the resident 4k/32k
      # prefill with the right-operand tiles only, then with both arrangements autotuned (synthesizes $CKPT: ~40 s)
      for w in 0 1; do
        # the W_LHS run also profiles one 8k chunk: where the resident prefill's time goes with the new tiles
        FLUXTIDE_PREFILL_W_LHS=$w bench_prefill 270 "prefill_wlhs$w" --scenarios resident --prompts 4096,32768 \
          --profile-tokens "$([[ $w == 1 ]] && echo 8192 || echo 0)"
      done ;;
    w-lhs-decode)
      # the W_LHS tiles in the decode step (weights as the wgmma M side, 16 tokens as its N: the small-batch swap):
      # the projections' split-K GEMM per row count without and with them (the rows' tuned_choice names the
      # winner), then the MoE layer per pair vs grouped at 1/4/8/16 tokens (the step itself: w-lhs-step)
      for w in 0 1; do
        FLUXTIDE_PREFILL_W_LHS=$w timeout 150 python3 scripts/bench_kernels.py --out "$OUT/crossover_wlhs$w" \
          --only crossover 2>&1 | tail -2 | cut -c1-300
      done
      FLUXTIDE_PREFILL_W_LHS=1 timeout 150 python3 scripts/bench_kernels.py --out "$OUT/grouped_wlhs" --only grouped \
        2>&1 | tail -3 ;;
    w-lhs-step)
      # the decode step with every W_LHS tile in its autotuned space, grouped decode from 64 pairs (bs16), and the
      # control without either in the same call (synthesizes $CKPT if absent: ~40 s)
      FLUXTIDE_PREFILL_W_LHS=0 timeout 200 python3 scripts/bench_decode.py --out "$OUT/decode_control" --synth-dir "$CKPT" --reuse \
        --batch 1,4,16 --plans resident --warmup 16 --steps 32 --parity-steps 2 --prefill-kernels triton 2>&1 \
        | grep -E "^resident|parity|Error" | cut -c1-300
      export FLUXTIDE_PREFILL_W_LHS=1
      timeout 220 python3 scripts/bench_decode.py --out "$OUT/decode_grouped_wlhs" --synth-dir "$CKPT" --reuse \
        --batch 1,4,16 --plans resident --warmup 16 --steps 32 --parity-steps 2 --prefill-kernels triton \
        --grouped-decode-min-pairs 64 2>&1 | grep -E "^resident|parity|Error" | cut -c1-300
      unset FLUXTIDE_PREFILL_W_LHS ;;
    staging)
      # ADR 0010's staging size, never measured past the default 66 rows: the 24 GiB budget's streamed 8k / 32k
      # prefill with 66 then 132 rows (the simulator predicts 0.49 -> 0.37 s at 8k and 2.19 -> 1.71 s at 32k,
      # docs/bench/2026-12-05-sim-staging-h200-24gib.json; synthesizes $CKPT if absent: ~40 s)
      for g in 66 132; do
        bench_prefill 280 "prefill_staging$g" --scenarios budget --prompts 8192,32768 --staging "$g" --profile-tokens 0
      done ;;
    http) timeout 500 "$(dirname "$0")/gpu_http_bench.sh" 2>&1 | grep -v "^INFO" | tail -8 ;;
    http-ab)
      # ADR 0022's same-machine A/B: the resident ladder once per variant of $AB (default "default splitk0"; also
      # "pairs256"), each a fresh server through scripts/diag/serve_with_knobs.py on one machine, one after the
      # other; then what each server logged after it was ready (a tuning or compile on the request path)
      ( . "$(dirname "$0")/gpu_http_bench.sh"
        synth_ckpt
        for variant in ${AB:-default splitk0}; do
          case $variant in
            default) knobs=() ;;
            splitk0) knobs=(--splitk-max-rows 0) ;;
            pairs256) knobs=(--pairs-bucket-max 256) ;;
            *) echo "unknown A/B variant $variant"; continue ;;
          esac
          log="$OUT/serve_$variant.log"
          # shellcheck disable=SC2046
          python3 scripts/diag/serve_with_knobs.py ${knobs[@]+"${knobs[@]}"} -- $(serve_flags) --port 8101 \
            $(resident_serve_args) > "$log" 2>&1 &
          SERVER=$!
          if wait_healthy 8101 "$SERVER" "$log" "$READY_TRIES"; then
            ready=$(wc -l < "$log")
            LADDER_ARGS="--rounds 3" bench_ladder http://127.0.0.1:8101 "$OUT/ladder_$variant.json" > /dev/null
            python3 -c "import json, sys; r = json.load(open(sys.argv[1])); print(sys.argv[2], 'c/aggregate/TTFT/steady:',
  *(f\"{p['concurrency']}/{p['aggregate_tok_s']:.0f}/{p['ttft_s_median']:.3f}/{p['steady_decode_tok_s_median']:.0f}\"
    for p in r['points']))" "$OUT/ladder_$variant.json" "$variant"
            echo "$variant: logged after ready:"; tail -n +"$((ready + 1))" "$log" | grep -v "POST\|GET" | cut -c1-200 | tail -5
          fi
          kill $SERVER; wait $SERVER 2>/dev/null
        done ) ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
done
