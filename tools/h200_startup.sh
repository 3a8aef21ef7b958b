#!/usr/bin/env bash
# The H200 measurements of issue 26 (serve in seconds), through the device tool: `bash
# tools/h200_startup.sh STAGE` in the repository root there, the wheels the image lacks carried in
# .whl/ (pyzmq, msgspec, paho-mqtt, grpcio-health-checking, grpcio-reflection; for gputests also the
# test extras the suite's conftest checks for: openai, grpcio-tools, psycopg, aiomqtt). Results under $OUT.
#   probe   — the image's versions, and Triton compiles serial vs in compile_only()'s threads
#   start   — `bench startup` fresh + warm: 0.6B bf16 (8k prompt beside 8 streams), 4B bf16, 4B INT4 ($START: others)
#   tune    — `jetserve tune` for each shape and weight format: tables to ship, and the tuned cache
#   phases  — where the engine core's start goes before the model loads (tools/startup_probe.py)
#   mtp, binv — `bench mtp` on the demo: default drafting; the batch-invariant mode's cost
#   mtps    — `bench mtp` on the demo, default drafting against plain at 1, 4, 8 and 32 streams
#   ratio06 — `bench mtp --shape qwen3-0.6b`: the k=3 step against the plain step, batch 1 ($DVS: a draft vocabulary)
#   steptiles — tools/step_tiles_probe.py: the k=3 step's product tiles chosen by timing the whole step
#             ($QUANT: the quantized products'; $TABLE=1: the gains into the sm90 table; $STEPKEYS: only those keys)
#   prefill — `bench prefill`: an 8k prompt beside 8 streams, by token budget ($BUDGETS) and step latency target ($TARGETS)
#   quant, profile — `bench quant` (TPOT and kernels), `bench profile` (the 0.6B's step by kernel, $PROFILE_BATCHES)
#   baseline — `bench decode` against transformers, same run: 0.6B batch 1 and 32, 4B batch 1
#   decode  — `bench decode` batch 1: shipped table vs tuned tiles, interleaved, same run
#   ab      — `bench decode` of this tree against variants, interleaved this/variants/this in one run:
#             $AB_VARIANTS "name=tar …", each tar a variant's versions of the changed files (a base:
#             git archive BASE $(git diff --name-only BASE)); $AB_BASE alone: "base=$AB_BASE"
#   stream  — tools/stream_probe.py: the shipped tile against its L2-prefetching twin (Tile.prefetch), the
#             pipelined tiles (Tile.stages), their register-prefetch and prefetching twins, tinygemm and
#             cuBLAS, product by product ($STREAM_SHAPES, $STREAM_ROWS, $STREAM_FORMATS)
#   mma     — tools/mma_probe.py: the quantized MMA kernel against the engine's products ($MMA_SHAPES, $MMA_ROWS,
#             $MMA_FORMATS)
#   mmaquant — after mma: `bench quant` INT4 as routed now, then with the MMA wins in the table and tinygemm off
#   mmatable — after mma: its wins into this copy's sm90 table, for a following ab
#   gemlite — tools/gemlite_probe.py: GemLite's kernels product by product ($GEMLITE_SHAPES, $GEMLITE_ROWS, $GEMLITE_FORMATS)
#   fromstream — after stream: its wins written into this tree's sm90 table (tools/table_from_stream.py,
#             the rows of $STREAM_ROWS), the table before tarred as /tmp/table-before.tar for a following
#             `AB_VARIANTS=before=/tmp/table-before.tar … ab`; the new table back as $OUT/sm90-from-stream.json
#   gputests — the GPU tests named in $TESTS (those matching $TEST_K, when set)
#   script  — $SCRIPT once for each of $SCRIPT_ARGS ("a b;c"): a one-off probe carried in .ab/
#   spy     — after start: a warm 4B INT4 start under py-spy
set -uo pipefail
# Stages write under /tmp/res; after each one, everything so far is packed into $OUT/results.tgz
# (the device tool brings back few files, and a call cut short by its limit keeps what it packed).
FINAL=${OUT:-/tmp/out}
OUT=/tmp/res
mkdir -p "$OUT" "$FINAL"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
# PYTHONSAFEPATH: the working directory (the repo root, whose jetserve/ holds only the top package) never
# shadows the link farm.
export PYTHONPATH=/tmp/site:$PWD/.jetserve-src PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1 PYTHONSAFEPATH=1
# The image's packages come without usable bytecode (each process compiled torch's sources: ~3 s
# of every start, spy stage), where pip writes it at install and deploy/install.sh makes sure of
# it: compiled once per machine here, before any timed run, as an install would.
echo "[setup] python: dont_write_bytecode=$(python3 -c 'import sys; print(sys.flags.dont_write_bytecode)')" \
  "PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-} torch pyc: $(python3 -c 'import importlib.util as u, os, torch
p = u.cache_from_source(torch.__file__); print(p, os.path.exists(p), os.access(os.path.dirname(torch.__file__), os.W_OK))')"
SITE=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
began=$(date +%s)
python3 -c 'import os, sys, torch; sys.exit(not os.access(os.path.dirname(torch.__file__), os.W_OK))' \
  || export PYTHONPYCACHEPREFIX=/tmp/pycache  # a read-only install: the bytecode beside it
timeout 150 python3 -m compileall -q -j 0 "$SITE" /tmp/site >/dev/null 2>&1
echo "[setup] bytecode compiled in $(( $(date +%s) - began )) s${PYTHONPYCACHEPREFIX:+ (into $PYTHONPYCACHEPREFIX)}"
# The source tree maps to `jetserve.*` through pyproject's package-dir: a link farm does it without pip.
mkdir -p .jetserve-src/jetserve
for part in engine server agent device wire fleet bench; do ln -sfn "$PWD/$part" ".jetserve-src/jetserve/$part"; done
for f in jetserve/*; do ln -sfn "$PWD/$f" ".jetserve-src/jetserve/$(basename "$f")"; done
J="python3 -m jetserve.cli"
W=/tmp/work
checkpoints() {  # random-weight Qwen3 shapes, made once per machine (on the GPU: seconds)
  python3 -c "
import torch; from pathlib import Path; from jetserve.bench.common import random_checkpoint
for s in ('qwen3-0.6b', 'qwen3-4b'):
    p = Path('$W/ckpt') / s
    if not (p / 'config.json').exists(): random_checkpoint(s, p, torch.bfloat16, torch.device('cuda'))
"
}
for stage in "$@"; do
case $stage in
probe)
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
    torch.cuda.get_device_name(), torch.cuda.get_device_capability())'
  python3 tools/compile_probe.py
  python3 -X importtime -c "import jetserve.engine.core, jetserve.engine.llm_engine" 2>&1 | sort -t'|' -k2 -n | tail -12
  ;;
phases)  # where the core's start goes before the model loads, twice (the second with warm file caches)
  checkpoints
  for m in qwen3-0.6b qwen3-4b qwen3-4b; do python3 tools/startup_probe.py "$W/ckpt/$m" 2>&1 | grep -E 'probe|Error'; done
  python3 -X importtime -c "import jetserve.engine.core" 2>&1 | sort -t'|' -k2 -n | tail -14
  for i in 1 2; do /usr/bin/time -f "[probe] jetserve --help %e s" $J --help >/dev/null; done
  ;;
mtp)  # the demo: plain, the default (adaptive) drafting, fixed k=3; held-out prompts
  timeout 300 $J bench mtp --dtype bfloat16 --ks 3 --out "$OUT/mtp" 2>&1 | grep -vE 'it/s|Writing|^\s*$' | tail -14
  ;;
binv)  # batch-invariant mode: its cost, and greedy with drafting against plain greedy
  timeout 300 $J bench mtp --dtype bfloat16 --batch-invariant --ks 3 --temperatures 0 --batch-sizes 1,8 --repeats 2 \
    --out "$OUT/binv" 2>&1 | grep -vE 'it/s|Writing|^\s*$' | tail -14
  ;;
quant)  # batch-1 TPOT through LLM(..., quantization=...) and the kernel table, both Qwen3 shapes
  timeout 330 $J bench quant --shapes qwen3-0.6b qwen3-4b --repeats 3 --out "$OUT/quant" 2>&1 | grep -E '^\[quant\]|Error' | tail -14
  ;;
profile)  # where the 0.6B's decode step goes, kernel by kernel (issue 30), at batch 1 ($PROFILE_BATCHES: others;
  # $PROFILE_SHAPE: another shape; $QUANT: int8 or int4 weights)
  for b in ${PROFILE_BATCHES:-1}; do
    timeout 120 $J bench profile --steps 20 --batch "$b" ${PROFILE_SHAPE:+--shape $PROFILE_SHAPE} \
      ${QUANT:+--quantization $QUANT} --out "$OUT/profile${PROFILE_SHAPE:+-$PROFILE_SHAPE}${QUANT:+-$QUANT}-b$b" 2>&1 | tail -12
  done
  ;;
mtps)  # the default drafting against plain as a server meets 1, 4, 8 and 32 concurrent users
  timeout ${MTPS_TIMEOUT:-300} $J bench mtp --dtype bfloat16 --ks 3 --streams ${STREAMS:-1,4,8,32} --temperatures ${TEMPS:-0,0.7} \
    --repeats ${REPEATS:-3} --out "$OUT/mtp-streams" > "$OUT/mtp-streams.log" 2>&1
  grep -E 'compiled while serving|Error' "$OUT/mtp-streams.log" | sort | uniq -c | head -12
  python3 -c "import json; g=json.load(open('$OUT/mtp-streams/result.json'))['generation']
for k, v in g.items(): print('[mtp]', k, v['tok_s']['median'], v['tok_s']['min'], v.get('speedup'), v.get('speedup_min'), v.get('speedup_paired'), v.get('chosen_k', ''))"
  ;;
ratio06)  # the 0.6B shape's k=3 step against its plain step, batch 1 (not batch-invariant)
  timeout 200 $J bench mtp --shape qwen3-0.6b --dtype bfloat16 --ks 3 --batch-sizes 1 ${DVS:+--draft-vocab-size $DVS} \
    --out "$OUT/ratio-q06${DVS:+-dvs$DVS}" 2>&1 \
    | grep -E '^(plain|k=)|Error' | tail -6
  ;;
steptiles)  # a step's product tiles chosen by timing the whole step: $SHAPE, k=$K (3: the verify's and draft heads'; 0: plain), $BATCH
  # $QUANT (int8, int4): quantized weights, their products tried; $TABLE=1: the gains written into this tree's
  # sm90 table (the table before kept as /tmp/table-before.tar for a following ab; the new one back as $FINAL/sm90.json)
  [ -n "${TABLE:-}" ] && [ ! -f /tmp/table-before.tar ] && tar -cf /tmp/table-before.tar engine/model/tiles/sm90.json
  timeout ${STEPTILES_TIMEOUT:-420} python3 tools/step_tiles_probe.py --shape ${SHAPE:-qwen3-0.6b} --k ${K:-3} \
    --batch ${BATCH:-1} ${QUANT:+--quantization $QUANT} ${TABLE:+--table engine/model/tiles/sm90.json} ${STEPKEYS:+--keys "$STEPKEYS"} \
    --out "$OUT/step-tiles-${SHAPE:-qwen3-0.6b}-k${K:-3}-b${BATCH:-1}${QUANT:+-$QUANT}/result.json" 2>&1 \
    | grep -E '^\[probe\]|^"|Error' | tail -40
  [ -n "${TABLE:-}" ] && cp engine/model/tiles/sm90.json "$FINAL/sm90.json"
  ;;
prefill)  # chunked prefill: the long prompt's TTFT against chunking off, the streams' ITL, by budget and by target
  timeout ${PREFILL_TIMEOUT:-480} $J bench prefill --budgets ${BUDGETS:-512,2048} --targets ${TARGETS:-6,7,8} \
    --repeats ${REPEATS:-3} --out "$OUT/prefill" > "$OUT/prefill.log" 2>&1
  grep -E 'Error|error' "$OUT/prefill.log" | tail -5
  python3 -c "import json; r=json.load(open('$OUT/prefill/result.json'))
for n, c in r['configs'].items(): print('[prefill]', n, 'TTFT', c['long_ttft_ms'], 'min', c['long_ttft_min_ms'], 'x', c.get('ttft_over_unchunked'),
  'ITL p50/p99 during', c['during_itl_p50_ms'], c['during_itl_p99_ms'], 'worst', c['during_itl_p99_worst_ms'], 'chunks', len(c.get('long_chunks') or []))
print('[prefill] recommended', r.get('recommended_budget'), r.get('recommended_target_ms'))"
  ;;
gputests)  # the GPU-marked tests of $TESTS (default: the CUDA graph tests), their log kept; $TEST_ARGS: more
  # of pytest's (--noconftest: a test file that needs none of the extras the image lacks)
  # --import-mode=append: the repository root (whose jetserve/ is the top package alone) after the link farm
  # the repository root after the link farm too: tests that start `python -m tests.…`
  PYTHONPATH=$PYTHONPATH:$PWD timeout 300 python3 -m pytest -q -p no:cacheprovider --import-mode=append \
    ${TESTS:-tests/engine/test_cuda_graphs.py} ${TEST_K:+-k "$TEST_K"} ${TEST_ARGS:-} > "$OUT/gpu-tests.log" 2>&1
  grep -E "passed|failed|Error" "$OUT/gpu-tests.log" | tail -8
  ;;
script)  # $SCRIPT (a file: one carried in .ab/, say) once for each of $SCRIPT_ARGS ("a b;c"), its output kept
  IFS=';' read -r -a RUNS <<<"${SCRIPT_ARGS:-}"
  for args in "${RUNS[@]:-}"; do
    # shellcheck disable=SC2086  # each run's arguments split as written
    timeout ${SCRIPT_TIMEOUT:-200} python3 "${SCRIPT:?a script to run}" $args 2>&1 | grep -vE 'Warning|warn' | tee -a "$OUT/script.txt"
  done
  ;;
pack)  # every stage packs (below); kept so older command lines still run
  ;;
start|start06)
  checkpoints
  specs=("qwen3-0.6b|--dtype bfloat16 --max-model-len 9216|--long-prompt 8000 --beside 8")
  [ "$stage" = start ] && specs+=("qwen3-4b|--dtype bfloat16|" "qwen3-4b|--dtype bfloat16 --quantization int4|")
  [ -n "${START:-}" ] && IFS=';' read -r -a specs <<<"$START"  # "shape|flags|extra;…" instead
  for spec in "${specs[@]}"; do
    IFS='|' read -r shape flags extra <<<"$spec"
    name=$shape$(echo "$flags" | grep -o 'int[48]' | sed 's/^/-/')$(echo "$flags" | grep -o 'max-step-latency-ms [0-9.]*' | sed 's/.* /-target/')
    timeout 420 $J bench startup --model "$W/ckpt/$shape" --serve-flags "$flags" $extra --work "$W/$name" \
      --out "$OUT/startup-$name" 2>&1 | grep -E '^\[startup\]|Error|error' ; cp "$W/$name"/serve-*.log "$OUT/startup-$name/" 2>/dev/null
  done
  ;;
spy)  # after start: a warm Qwen3-4B INT4 start under py-spy (its wheel in .whl/), where each process's seconds go
  timeout 150 /tmp/site/bin/py-spy record --subprocesses --nonblocking --rate 200 --format speedscope \
    -o "$OUT/spy-4b-int4.json" -- $J bench startup --model "$W/ckpt/qwen3-4b" --runs warm \
    --serve-flags "--dtype bfloat16 --quantization int4" --work "$W/qwen3-4b-int4" --out "$OUT/spy-startup" 2>&1 \
    | grep -E '^\[startup\]|Error|error' | tail -5
  ;;
tune)  # $TUNE: "shape|flags;shape|flags" (default: both shapes in bf16, INT8 and INT4)
  checkpoints
  IFS=';' read -r -a TUNES <<<"${TUNE:-qwen3-0.6b|;qwen3-4b|;qwen3-4b|--quantization int4;qwen3-4b|--quantization int8;qwen3-0.6b|--quantization int4;qwen3-0.6b|--quantization int8}"
  export JETSERVE_CACHE_DIR=$W/tuned TRITON_CACHE_DIR=$W/triton
  for spec in "${TUNES[@]}"; do
    IFS='|' read -r shape flags <<<"$spec"
    model=$W/ckpt/$shape
    began=$(date +%s)
    timeout 400 $J tune --model "$model" --dtype bfloat16 $flags --out "$OUT/tiles-$shape$(echo $flags | tr -d ' -' | sed 's/quantization/-/').json" \
      2>&1 | grep -E 'tuned in|tile table|Error' ; echo "[tune] $shape $flags: $(( $(date +%s) - began )) s"
  done
  cp "$JETSERVE_CACHE_DIR"/tiles/*.json "$OUT/" 2>/dev/null
  ;;
baseline)  # `bench decode` against transformers in the same run (issue 30): 0.6B at batch 1 and 32, 4B at batch 1; $RUNS runs
  checkpoints
  for run in $(seq 1 "${RUNS:-2}"); do
    timeout 280 $J bench decode --shapes qwen3-0.6b --batch-sizes 1,32 --hf-compile-batch-sizes 1,32 --steps 64 \
      --only ours_graphs_async --out "$OUT/decode-0.6b-r$run" 2>&1 | grep -E 'Error|error|tok/s|ms' | tail -8
    timeout 200 $J bench decode --shapes qwen3-4b --batch-sizes 1 --hf-compile-batch-sizes 1 --hf-compile-shapes qwen3-4b --steps 64 \
      --only ours_graphs_async --out "$OUT/decode-4b-r$run" 2>&1 | grep -E 'Error|error|tok/s|ms' | tail -6
  done
  ;;
ab)  # this tree against $AB_VARIANTS ("name=tar …"; default base=$AB_BASE), interleaved: this, each variant, this again
  read -r -a VARIANTS <<<"${AB_VARIANTS:-base=${AB_BASE:-}}"
  for v in "${VARIANTS[@]}"; do tar -tf "${v#*=}"; done | grep -v '/$' | sort -u | xargs tar -cf /tmp/ab-this.tar || exit 1
  IFS=';' read -r -a ABS <<<"${AB:-qwen3-0.6b|1,32|;qwen3-4b|1|}"
  for v in this "${VARIANTS[@]}" this2; do
    variant=${v%%=*}
    tar -xf /tmp/ab-this.tar; [ "$variant" = "$v" ] || tar -xf "${v#*=}"
    for spec in "${ABS[@]}"; do
      IFS='|' read -r shape sizes flags <<<"$spec"
      name=$shape-b${sizes//,/-}$(echo "$flags" | tr -d ' -' | sed 's/quantization/-/')-$variant
      timeout 200 $J bench decode --shapes "$shape" --batch-sizes "$sizes" --steps 64 --no-hf --only ours_graphs_async \
        $flags --out "$OUT/ab-$name" 2>&1 | grep -E 'Error|error'
      python3 -c "import json; r=json.load(open('$OUT/ab-$name/result.json'))['models']['$shape']['configs']['ours_graphs_async']
print('[ab] $name', ' '.join(f'b{b}: {r[b]:.4f} (min {r[\"min_ms\"][b]:.4f})' for b in '$sizes'.split(',')))"
    done
  done
  tar -xf /tmp/ab-this.tar
  ;;
stream)  # issues 29/30: do more weight bytes in flight (L2 prefetch, cp.async stages) make the products faster?
  timeout ${STREAM_TIMEOUT:-500} python3 tools/stream_probe.py "${STREAM_SHAPES:-qwen3-0.6b,qwen3-4b}" "${STREAM_ROWS:-1,16}" 2>&1 \
    | grep -vE 'Warning|warn' | tee "$OUT/stream.txt" | tail -80
  ;;
mma)  # issue 29: the quantized MMA kernel (model/mma_kernels.py) against the engine's products and bf16, 1-16 rows
  timeout ${MMA_TIMEOUT:-420} python3 tools/mma_probe.py "${MMA_SHAPES:-qwen3-0.6b,qwen3-4b}" "${MMA_ROWS:-1,2,4,8}" \
    "${MMA_FORMATS:-int4}" 2>&1 \
    | grep -vE 'Warning|warn' | tee "$OUT/mma.txt" | tail -60
  ;;
mmaquant)  # after mma: INT4 TPOT (`bench quant`) as the tree routes it, then with the probe's MMA wins in this
  # copy's sm90 table and every INT4 product in the span layout (tinygemm's route off), same machine
  timeout ${QUANT_TIMEOUT:-150} $J bench quant --shapes ${QUANT_SHAPES:-qwen3-0.6b qwen3-4b} --methods int4 --repeats 3 \
    --out "$OUT/quant-route" 2>&1 | grep -E '^\[quant\]|Error' | tail -8
  cp engine/model/tiles/sm90.json /tmp/sm90-before.json; cp engine/model/int4pack.py /tmp/int4pack-before.py
  python3 tools/table_from_stream.py "$OUT/mma.json" --rows "${TABLE_ROWS:-1,2,4,8}" 2>&1 | tail -40
  [ -n "${KEEP_ROUTE:-}" ] || sed -i 's/^MIN_WEIGHTS = 1 << 23$/MIN_WEIGHTS = 1 << 62/' engine/model/int4pack.py
  timeout ${QUANT_TIMEOUT:-150} $J bench quant --shapes ${QUANT_SHAPES:-qwen3-0.6b qwen3-4b} --methods int4 --repeats 3 \
    --out "$OUT/quant-mma" 2>&1 | grep -E '^\[quant\]|Error' | tail -8
  cp engine/model/tiles/sm90.json "$OUT/sm90-mma.json"
  cp /tmp/sm90-before.json engine/model/tiles/sm90.json; cp /tmp/int4pack-before.py engine/model/int4pack.py
  ;;
mmatable)  # after mma: its wins into this copy's sm90 table (the rows of $TABLE_ROWS), the table back as $OUT/sm90-mma.json
  python3 tools/table_from_stream.py "$OUT/mma.json" --rows "${TABLE_ROWS:-1,2,4,8}" 2>&1 | tail -40
  cp engine/model/tiles/sm90.json "$OUT/sm90-mma.json"
  ;;
gemlite)  # issue 29: GemLite's W4A16/W8A16 kernels (its wheel in .whl/) against tinygemm, the shipped path and cuBLAS
  timeout ${GEMLITE_TIMEOUT:-420} python3 tools/gemlite_probe.py "${GEMLITE_SHAPES:-qwen3-4b}" "${GEMLITE_ROWS:-1,8}" 2>&1 \
    | grep -vE 'Warning|warn' | tee "$OUT/gemlite.txt" | tail -60
  ;;
fromstream)  # the stream stage's wins into the table, its rows only; the table before kept for ab
  [ -f "$OUT/stream.json" ] || { echo "[fromstream] no stream.json: run the stream stage first"; exit 1; }
  tar -cf /tmp/table-before.tar engine/model/tiles/sm90.json
  python3 tools/table_from_stream.py "$OUT/stream.json" --rows "${STREAM_ROWS:?the rows to take}" \
    --source "stream probe rows $STREAM_ROWS" 2>&1 | tail -24
  cp engine/model/tiles/sm90.json "$FINAL/sm90-from-stream.json"
  ;;
decode)  # after tune: its tile cache is what "tuned" reads
  checkpoints
  export JETSERVE_CACHE_DIR=$W/tuned TRITON_CACHE_DIR=$W/triton
  # $TUNED_CACHE: a tile cache an earlier call's tune stage brought back, as "tuned" on a fresh machine
  [ -n "${TUNED_CACHE:-}" ] && mkdir -p "$JETSERVE_CACHE_DIR/tiles" && cp "$TUNED_CACHE" "$JETSERVE_CACHE_DIR/tiles/"
  for spec in ${DECODE:-"qwen3-0.6b|" "qwen3-4b|int4"}; do
    IFS='|' read -r shape q <<<"$spec"
    timeout 300 $J bench decode --model "$W/ckpt/$shape" --batch-sizes 1 --steps 64 --repeats 3 --no-hf --only ours_graphs \
      --tiles tuned shipped ${q:+--quantization $q} --out "$OUT/decode-$shape${q:+-$q}" 2>&1 | grep -E 'Error|error'
    python3 -c "import json,sys; r=json.load(open('$OUT/decode-$shape${q:+-$q}/result.json'))['models']['$shape']['configs'];
[print('[decode] $shape $q', k, 'TPOT median', v['1'], 'min', v['min_ms']['1'], 'replay', v.get('graph_replay_ms', {}).get('1')) for k, v in r.items() if k.startswith('ours')]"
  done
  cp "$JETSERVE_CACHE_DIR"/tiles/*.json "$OUT/" 2>/dev/null
  ;;
esac
(cd "$OUT" && tar czf "$FINAL/.results.tgz" . && mv "$FINAL/.results.tgz" "$FINAL/results.tgz")
done
