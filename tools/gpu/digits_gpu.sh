#!/bin/bash
# Issue 31 section 3 + "Startup", on a GPU: the default digits job (seeds 0-3, default precision; seed 0 with
# --precision auto), import/startup times, and a cProfile of one run. Run from the repo root, PYTHONPATH=src set.
# Writes JSON lines to "$OUT/digits_gpu.jsonl" and prints a summary. ~150 s on an H100 (each command under timeout).
#   DEV=cpu EXTRA="--epochs 1" bash digits_gpu.sh   # the same commands on a CPU, shortened (a dry run)
set -u -o pipefail
PY=${PYTHON:-python}
DEV=${DEV:-cuda}
EXTRA=${EXTRA:-}
OUT=${OUT:-/tmp/digits_gpu_out}
BUDGET=${BUDGET:-150}
mkdir -p "$OUT"
J="$OUT/digits_gpu.jsonl"
: > "$J"
RUNS=$(mktemp -d /tmp/digits_runs.XXXXXX)
T0=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
git rev-parse --short HEAD 2>/dev/null | sed 's/^/commit /'
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1

# 1. startup: the first import compiles vitkit's sources (a fresh copy has no __pycache__), then a warm one
for kind in cold warm; do
  s=$(date +%s.%N)
  timeout 60 $PY -X importtime -c 'import vitkit.cli' 2> "$OUT/importtime_$kind.txt"
  e=$(date +%s.%N)
  top=$(sort -t'|' -k2 -n "$OUT/importtime_$kind.txt" | tail -5 | awk -F'|' '{gsub(/ /,"",$2); gsub(/^ +/,"",$3); printf "%s%s:%s", (NR>1?",":""), $3, $2}')
  echo "{\"what\": \"import_vitkit_cli\", \"kind\": \"$kind\", \"wall_s\": $(awk "BEGIN{printf \"%.3f\", $e - $s}"), \"top5_us\": \"$top\"}" >> "$J"
done
timeout 60 $PY - "$DEV" >> "$J" <<'PYEOF'
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
dev = sys.argv[1]
torch.zeros(1, device=dev)
if dev == "cuda":
    torch.cuda.synchronize()
t2 = time.perf_counter()
import vitkit.cli  # noqa: F401
from vitkit.cli import build_parser
build_parser()
t3 = time.perf_counter()
print(json.dumps({"what": "startup", "import_torch_s": round(t1 - t0, 3), "zeros_on_device_s": round(t2 - t1, 3),
                  "vitkit_cli_and_parser_s": round(t3 - t2, 3)}))
PYEOF
s=$(date +%s.%N); timeout 60 $PY -m vitkit eval --help > /dev/null; e=$(date +%s.%N)
echo "{\"what\": \"eval_help\", \"wall_s\": $(awk "BEGIN{printf \"%.3f\", $e - $s}")}" >> "$J"

# 2. the default job: train seconds (the run's own clock), process wall, test accuracy
train() {  # seed precision [extra args...]
  local seed=$1 prec=$2; shift 2
  local out="$RUNS/s$seed-$prec$*"; out=${out// /_}
  local s e rc log
  s=$(date +%s.%N)
  log=$(timeout 90 $PY -m vitkit train --quiet --seed "$seed" --set "device=$DEV" ${prec:+--precision $prec} \
        --out "$out" $EXTRA "$@" 2>&1); rc=$?
  e=$(date +%s.%N)
  local acc secs
  acc=$(echo "$log" | sed -n 's/.*accuracy: \([0-9.]*\)%.*/\1/p' | tail -1)
  secs=$(echo "$log" | sed -n 's/.*steps, \([0-9.]*\) s).*/\1/p' | tail -1)
  echo "{\"what\": \"train\", \"seed\": $seed, \"precision\": \"${prec:-default}\", \"extra\": \"$*\", \"rc\": $rc, \"train_s\": ${secs:-null}, \"wall_s\": $(awk "BEGIN{printf \"%.3f\", $e - $s}"), \"top1\": ${acc:-null}}" >> "$J"
  [ $rc -eq 0 ] || echo "$log" | tail -5
}
train 0 ""
train 0 auto
for seed in 1 2 3; do
  [ "$(left)" -gt 20 ] && train $seed ""
done
# 3. where a run's time goes (cProfile of seed 0, default precision), if time is left
if [ "$(left)" -gt 25 ]; then
  timeout 60 $PY -m cProfile -o "$OUT/train_seed0.prof" -m vitkit train --quiet --seed 0 --set "device=$DEV" \
    --out "$RUNS/profile" $EXTRA > /dev/null 2>&1
  $PY -c "import pstats,sys; pstats.Stats(sys.argv[1]).sort_stats('tottime').print_stats(25)" \
    "$OUT/train_seed0.prof" > "$OUT/train_seed0_profile.txt" 2>&1
fi
rm -rf "$RUNS"

# summary
$PY - "$J" <<'PYEOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for r in rows:
    if r["what"] != "train":
        print(r)
t = [r for r in rows if r["what"] == "train"]
for r in t:
    print(f"seed {r['seed']} precision {r['precision']:8s} rc {r['rc']}  train {r['train_s']} s  wall {r['wall_s']:.1f} s  top-1 {r['top1']}%")
d = [r["top1"] for r in t if r["precision"] == "default" and r["top1"] is not None]
if d:
    print(f"default precision: mean top-1 {sum(d) / len(d):.2f}% over {len(d)} seeds (goal >= 99.0 over seeds 0-3);"
          f" train s max {max(r['train_s'] or 0 for r in t):.1f} (goal <= 10)")
PYEOF
[ -f "$OUT/train_seed0_profile.txt" ] && head -45 "$OUT/train_seed0_profile.txt" | tail -32
echo "total $(( $(date +%s) - T0 )) s"
