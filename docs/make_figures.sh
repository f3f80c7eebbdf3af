#!/usr/bin/env bash
# Regenerate docs/figures/ and the digits eval / few-shot numbers in docs/evaluation.md.
#
#   docs/make_figures.sh [RUN_DIR]
#
# Without RUN_DIR it first trains the default digits model (`vitkit train`, into runs/digits or the next
# free name) and uses the newest run folder under runs/. Python: $PYTHON, default .venv/bin/python (see README).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
vitkit() { "$PY" -m vitkit "$@"; }

run_dir="${1:-}"
if [ -z "$run_dir" ]; then
    vitkit train --quiet
    run_dir="$(ls -td runs/*/ | head -1)"
fi
run_dir="${run_dir%/}"
echo "model: $run_dir"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p docs/figures

# accuracy, per class, confusion matrix on the digits test split: saved model/, EMA and raw weights
vitkit eval "$run_dir" --data digits --out "$work/eval"
vitkit eval "$run_dir" --data digits --ema --out "$work/eval-ema"
vitkit eval "$run_dir" --data digits --no-ema --out "$work/eval-raw"
cp "$work/eval-ema/confusion.png" docs/figures/digits_confusion.png
cp "$work/eval-ema/metrics.json" docs/figures/digits_eval_metrics.json

# the paper's few-shot linear probe on the EMA weights: 1/5/10/25 shots x 5 seeds, l2 fixed (big_vision's
# 2^10) and chosen on held-out training examples
vitkit fewshot "$run_dir" --data digits --ema --seeds 5 --out docs/figures/digits_fewshot.json
vitkit fewshot "$run_dir" --data digits --ema --seeds 5 --l2 auto --out docs/figures/digits_fewshot_auto.json

# baseline: the same architecture and preprocessing, untrained (official initialisation, seed 0)
"$PY" - "$run_dir" "$work/untrained" <<'PYEOF'
import sys

import torch

import vitkit

loaded = vitkit.load_checkpoint(sys.argv[1])
torch.manual_seed(0)
model = vitkit.create_model(loaded.model.cfg)
vitkit.save_pretrained(model, sys.argv[2], preprocess=loaded.meta.preprocess, class_names=loaded.meta.class_names)
PYEOF
vitkit fewshot "$work/untrained" --data digits --seeds 5 --out docs/figures/digits_fewshot_untrained.json

# figures 6, 7 and 11 on the EMA weights: attention averaged over the whole test split, 6 overlays
vitkit analyze "$run_dir" --data digits --ema --num-images 359 --max-overlays 6 --out "$work/analyze"
for f in patch_embedding_pca position_embedding_similarity attention_distance attention_rollout; do
    cp "$work/analyze/$f.png" "docs/figures/digits_$f.png"
done
cp "$work"/analyze/attention_layer*.png docs/figures/digits_attention_last_layer.png
cp "$work/analyze/summary.json" docs/figures/digits_analyze_summary.json
ls -la docs/figures
