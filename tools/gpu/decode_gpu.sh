#!/bin/bash
# issue 31 section 2 on the lent H100: --decode cpu against --decode gpu (nvImageCodec), B/16, batch 256, 8,192
# photo JPEGs (2,048 files of ~500x375, hard links), end to end; vitkit bench's fast path for the denominator;
# where an eval's last second goes (the workers' shutdown, interpreter exit).
# Run from the repo root (branch dec) with .nvw/ (nvidia_nvimgcodec_cu13-*.whl, nvidia_nvjpeg-13*.whl) and, as last
# session, .whl/ (simplejpeg) carried. Writes JSON lines to $OUT/decode_gpu.jsonl; budget ~200 s.
set -o pipefail
OUT=${OUT:-/tmp/decode_out}; mkdir -p "$OUT"
J="$OUT/decode_gpu.jsonl"; : > "$J"
W=${DECODE_WORK:-/tmp/dg}; mkdir -p "$W"
PY=${PYTHON:-python3}
jl() { echo "$1" >> "$J"; echo "$1"; }
wheels=$(ls .nvw/nvidia_nvimgcodec_cu13-*.whl .nvw/nvidia_nvjpeg-13*.whl .whl/*.whl 2>/dev/null)
if [ -n "$wheels" ]; then
  timeout 60 $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site2 $wheels \
    || jl '{"step": "pip", "rc": 4}'
fi
export PYTHONPATH=/tmp/site2:$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export PYTHONPYCACHEPREFIX=/tmp/pyc-dg  # every timed process finds compiled bytecode (written by the first)
nvidia-smi -L 2>/dev/null | head -1; nproc

# 1. nvImageCodec imports, finds nvJPEG (GPU backends only) and decodes a photo like Pillow
cat > "$W/check.py" <<'EOF'
import io, json, sys, time
import numpy as np
from PIL import Image
sys.path.insert(0, "benchmarks")
import batch_inference as bi
from pathlib import Path
res = {"step": "check"}
try:
    from nvidia import nvimgcodec as m
    res["version"] = getattr(m, "__version__", "?")
    p = bi.make_photos(Path(sys.argv[1]) / "one", 1)[0]
    data = p.read_bytes()
    t = time.perf_counter()
    dec = m.Decoder(backends=[m.Backend(m.BackendKind.GPU_ONLY), m.Backend(m.BackendKind.HYBRID_CPU_GPU)])
    res["decoder_s"] = round(time.perf_counter() - t, 3)
    img = dec.decode([data], params=m.DecodeParams(color_spec=m.ColorSpec.SRGB, apply_exif_orientation=False))[0]
    import torch
    x = torch.as_tensor(img, device="cuda").cpu().numpy() if img is not None else None
    ref = np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).astype(np.int16)
    res["decoded"] = x is not None
    if x is not None:
        d = np.abs(x.astype(np.int16) - ref)
        res.update(shape=list(x.shape), max_diff_vs_pillow=int(d.max()), mean_diff_vs_pillow=round(float(d.mean()), 4))
except Exception as e:
    res["error"] = f"{type(e).__name__}: {e}"[:400]
print(json.dumps(res))
EOF
timeout 60 $PY "$W/check.py" "$W" >> "$J" 2>"$OUT/check.err"; tail -1 "$J"

# 2. the data, the checkpoint, the denominator
timeout 90 $PY - "$W" <<'EOF' || jl '{"step": "setup", "rc": 1}'
import sys; from pathlib import Path
import batch_inference as bi
W = Path(sys.argv[1])
photos = bi.make_photos(W / "p2048", 2048)
bi.link_copies(photos, W / "p8192" / "test", 8192)
bi.make_checkpoint("B/16", W / "ck")
EOF
timeout 60 $PY -m vitkit bench "$W/ck" --device cuda --batch-size 256 --precision bf16 --no-latency --repeats 5 \
  --json "$W/bench.json" --overwrite > "$OUT/bench.log" 2>&1
$PY - "$W/bench.json" >> "$J" <<'EOF'
import json, sys
try:
    r = [r for r in json.load(open(sys.argv[1]))["results"] if r["impl"] == "vitkit-fast"][0]
    print(json.dumps({"step": "bench", "model": "B/16", "img_s": r["img_per_s"]}))
except Exception as e:
    print(json.dumps({"step": "bench", "error": str(e)[:300]}))
EOF
tail -1 "$J"

# 3. eval end to end, --decode cpu / gpu, 8,192 then 2,048 images (the difference: steady state)
cat > "$W/exitprobe.py" <<'EOF'
"""vitkit's CLI with timestamps: the last forward, DataLoader._shutdown_workers, main's return, the atexit
handlers; the caller adds the process's end."""
import atexit, json, sys, time
marks = {"t0": time.time()}
atexit.register(lambda: marks.__setitem__("atexit_last", time.time()) or print("EXITPROBE " + json.dumps(marks), file=sys.stderr, flush=True))
import torch.utils.data.dataloader as DL
sd = DL._MultiProcessingDataLoaderIter._shutdown_workers
def timed(self):
    t = time.time(); sd(self); marks["shutdown_s"] = marks.get("shutdown_s", 0) + time.time() - t
DL._MultiProcessingDataLoaderIter._shutdown_workers = timed
import vitkit.inference.engine as E
fwd = E.InferenceEngine.forward
def forward(self, *a, **k):
    out = fwd(self, *a, **k); marks["last_forward"] = time.time(); return out
E.InferenceEngine.forward = forward
from vitkit.cli import main
rc = main(sys.argv[1:])
marks["main_returned"] = time.time()
atexit.register(lambda: marks.__setitem__("atexit_first", time.time()))
sys.exit(rc)
EOF
run() {  # tag n cmd...
  local tag=$1 n=$2; shift 2
  local s e rc
  s=$(date +%s.%N)
  timeout 60 "$@" > "$OUT/$tag.out" 2> "$OUT/$tag.err"; rc=$?
  e=$(date +%s.%N)
  $PY - "$tag" "$n" "$s" "$e" "$rc" "$OUT/$tag.err" >> "$J" <<'EOF'
import json, sys
tag, n, s, e, rc, err = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
text = open(err, errors="replace").read()
notes = [l for l in text.splitlines() if l.startswith("note:")][:3]
res = {"step": tag, "images": n, "rc": rc, "s": round(e - s, 2), "img_s": round(n / (e - s), 1), "notes": notes}
probe = [l for l in text.splitlines() if l.startswith("EXITPROBE ")]
if probe:
    m = json.loads(probe[-1][10:])
    lf = m.get("last_forward", s)
    res["phases_s"] = {"start_to_last_forward": round(lf - s, 2), "shutdown_workers": round(m.get("shutdown_s", 0), 3),
                       "last_forward_to_main_return": round(m["main_returned"] - lf, 2),
                       "atexit_handlers": round(m["atexit_last"] - m.get("atexit_first", m["main_returned"]), 3),
                       "after_atexit_to_process_end": round(e - m["atexit_last"], 2)}
if rc:
    res["err"] = text[-400:]
print(json.dumps(res))
EOF
  tail -1 "$J"
}
$PY -c "import torch, vitkit.cli, vitkit.commands.evaluate, vitkit.data.gpu_decode" 2>/dev/null  # bytecode cache
E="eval $W/ck --batch-size 256 --device cuda"
for d in cpu gpu; do
  run "eval8192_$d" 8192 $PY -m vitkit $E --data "$W/p8192" --decode $d --out "$W/ev-$d"
done
for d in cpu gpu; do
  run "eval2048_$d" 2048 $PY -m vitkit $E --data "$W/p2048" --decode $d --out "$W/ev2-$d"
done
run "eval8192_gpu_probe" 8192 $PY "$W/exitprobe.py" $E --data "$W/p8192" --decode gpu --out "$W/ev-gp"
run "eval8192_cpu_probe" 8192 $PY "$W/exitprobe.py" $E --data "$W/p8192" --decode cpu --out "$W/ev-cp"
run "eval8192_auto" 8192 $PY -m vitkit $E --data "$W/p8192" --out "$W/ev-auto"
# agreement: top-1 of the two decodes (metrics.json per class is all there is without labels that mean anything)
$PY - "$W" >> "$J" <<'EOF'
import json, sys
from pathlib import Path
W = Path(sys.argv[1])
try:
    a, b = (json.loads((W / f"ev-{d}" / "metrics.json").read_text()) for d in ("cpu", "gpu"))
    print(json.dumps({"step": "metrics", "top1_cpu": a.get("top1"), "top1_gpu": b.get("top1"),
                      "notes_gpu": b.get("notes")}))
except Exception as e:
    print(json.dumps({"step": "metrics", "error": str(e)[:300]}))
EOF
tail -1 "$J"
