#!/usr/bin/env bash
# The memory tier on a lent GPU machine as it is (its own torch, no `fire`, no package index):
# a save's blocking time with the state on the GPU (page-locked device-to-host copy), then a killed
# worker resumed from its node's memory on the GPU, bit-identical to an uninterrupted run.
#
#   bash bench/fetch_wheels.sh                    # once: fire's wheels into .whl/ (git-ignored)
#   device run: command "bash bench/mem_tier_gpu.sh", carry [".whl"], timeout_s 300
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-${TMPDIR:-/tmp}/ddp_kit_gpu_out}
PY=${PYTHON:-python3}
SITE=${DDP_KIT_SITE:-${TMPDIR:-/tmp}/ddp_kit_site}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src:$PYTHONPATH" PYTHONUNBUFFERED=1 DDP_KIT_MEM_DIR=/dev/shm/ddp_kit_gpu_check
log="$OUT/mem_tier_gpu.log"
{ nvidia-smi -L; "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } 2>&1 | tee "$log"
"$PY" bench/mem_tier.py blocking --device cuda 2>&1 | tail -25 | tee -a "$log"
cp bench/mem_tier_results.json "$OUT/" 2>/dev/null
args=(--epochs 2 --ckpt_every 10 --progress false --log_every 5 --device cuda --deterministic true)
run() { "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 "$@"; }
run -m ddp_kit.train "${args[@]}" --run_dir "$OUT/ref" > "$OUT/ref.log" 2>&1
run --max-restarts=1 -m ddp_kit.train "${args[@]}" --mem_ckpt_every 3 --inject "slow:rank=0:step=12:ms=100,kill:rank=0:step=14" \
    --run_dir "$OUT/killed" > "$OUT/killed.log" 2>&1
grep -h "ddp_kit: resumed\|memory tier\|error" "$OUT/killed.log" | tee -a "$log"
"$PY" - "$OUT" <<'PY' 2>&1 | tee -a "$log"
import json, sys
out = sys.argv[1]
ref, got = (json.load(open(f"{out}/{d}/summary.json")) for d in ("ref", "killed"))
print("resumed_from_step", got.get("resumed_from_step"), "bit-identical", ref["param_sha256"] == got["param_sha256"])
PY
