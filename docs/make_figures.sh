#!/usr/bin/env bash
# Regenerate docs/figures/ and the digits eval / few-shot numbers in BENCHMARKS.md.
#
#   docs/make_figures.sh [RUN_DIR]
#
# Without RUN_DIR it first trains the default digits model with `vitkit train` and uses the newest run
# folder under runs/. Needs vitkit installed in .venv (see README).
set -euo pipefail
cd "$(dirname "$0")/.."
vitkit() { .venv/bin/vitkit "$@"; }

run_dir="${1:-}"
if [ -z "$run_dir" ]; then
    vitkit train
    run_dir="$(ls -td runs/*/ | head -1)"
fi
run_dir="${run_dir%/}"
echo "model: $run_dir"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p docs/figures

# accuracy, per class, confusion matrix on the digits test split
vitkit eval "$run_dir" --data digits --split test --out "$work/eval" --device cpu
cp "$work/eval/confusion.png" docs/figures/digits_confusion.png
cp "$work/eval/metrics.json" docs/figures/digits_eval_metrics.json

# the paper's few-shot linear probe: 1/5/10/25 shots x 5 seeds, fixed l2 (big_vision) and l2 on held-out data
vitkit fewshot "$run_dir" --data digits --shots 1,5,10,25 --seeds 5 --out docs/figures/digits_fewshot.json
vitkit fewshot "$run_dir" --data digits --shots 1,5,10,25 --seeds 5 --l2 auto \
    --out docs/figures/digits_fewshot_auto.json

# figures 6, 7 and 11: attention averaged over the whole test split, 6 overlays
vitkit analyze "$run_dir" --data digits --split test --num-images 359 --max-overlays 6 --out "$work/analyze"
for f in patch_embedding_pca position_embedding_similarity attention_distance attention_rollout; do
    cp "$work/analyze/$f.png" "docs/figures/digits_$f.png"
done
cp "$work/analyze"/attention_layer*.png docs/figures/digits_attention_last_layer.png
cp "$work/analyze/summary.json" docs/figures/digits_analyze_summary.json
ls -la docs/figures
