#!/usr/bin/env bash
# hp-autoparallel on one GPU (issue 29), one call of at most ~9 minutes: measure a calibration
# file, then compare the planner's predictions with real hp-trainer runs under the shipped
# h200 calibration and under the measured one (one set of runs, two tables).
#   OUT=/some/folder bash benchmarks/autoparallel/gpu_validate.sh
# Writes to $OUT: calibrate.txt, h200_measured.toml, validate.txt, validate.json, nvidia-smi.txt
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$(ls -d "$PWD"/packages/*/src | tr '\n' ':')${PYTHONPATH:-}"
OUT="${OUT:-/tmp/hp-autoparallel-validate}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
"$PY" -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))" | tee "$OUT/env.txt"

timeout 180 "$PY" -m hp_autoparallel calibrate --out "$OUT/h200_measured.toml" 2>&1 | tee "$OUT/calibrate.txt"
cals=(--calibration h200)
if [ -s "$OUT/h200_measured.toml" ]; then
    cals+=(--calibration "$OUT/h200_measured.toml")
else
    echo "calibrate failed: validating with the shipped h200 file only" | tee -a "$OUT/calibrate.txt"
fi
timeout 380 "$PY" benchmarks/autoparallel/validate_1gpu.py --device cuda "${cals[@]}" \
    --out "$OUT/validate.json" 2>&1 | tee "$OUT/validate.txt"
echo "exit statuses: ${PIPESTATUS[*]}"
ls -l "$OUT"
