#!/usr/bin/env bash
# The device command: the GPU acceptance check (bench/gpu_check.py) on a GPU machine as it is: its
# own Python (torch 2.11 on the lent H200), no `fire`, no package index. From this machine:
#
#   bash bench/fetch_wheels.sh                  # once: fire's and termcolor's wheels into .whl/ (git-ignored)
#   device run: command "bash bench/gpu_device.sh", carry [".whl"], timeout_s 420
#
# Missing packages travel as wheels: installed with pip --no-index --no-deps --target into a folder
# put on PYTHONPATH beside src/ (nothing is installed into the machine's Python). Every figure and
# log goes to $OUT as it goes (gpu_results.json, gpu_check.log); the whole ends within BUDGET_S.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-${TMPDIR:-/tmp}/ddp_kit_gpu_out}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
SITE=${DDP_KIT_SITE:-${TMPDIR:-/tmp}/ddp_kit_site}
BUDGET_S=${BUDGET_S:-330}
mkdir -p "$OUT"
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl \
        || echo "gpu_device: installing the wheels in $WHEELS failed; ddp_kit's commands will say what is missing" >&2
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
    echo "gpu_device: no wheels in $WHEELS (bash bench/fetch_wheels.sh makes them); using the Python as it is" >&2
fi
export PYTHONPATH="$PWD/src:$PYTHONPATH" PYTHONUNBUFFERED=1
# A hard stop a little past the budget: the driver cuts each part's limit to fit the budget itself.
timeout -k 10 $((BUDGET_S + 25)) "$PY" bench/gpu_check.py --out "$OUT" --budget_s "$BUDGET_S" 2>&1 | tee "$OUT/gpu_device.log"
exit "${PIPESTATUS[0]}"
