#!/usr/bin/env bash
# bench/defaults_cost.py on a lent GPU machine as it is (its own Python and torch, no `fire`, no
# package index): the defaults against everything off and the raw loop, one rank per GPU on NCCL,
# with the per-feature breakdown; then the CUDA tests of the sampled GPU spans. From this machine:
#
#   bash bench/fetch_wheels.sh                    # once: fire's and termcolor's wheels into .whl/ (git-ignored)
#   device run: command "bash bench/defaults_cost_gpu.sh", carry [".whl"], timeout_s 480
#
# $OUT/defaults_cost_gpu.json and .log come back. ROUNDS and STEPS override the bench's.
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
export PYTHONPATH="$PWD/src:$PYTHONPATH" PYTHONUNBUFFERED=1
{ nvidia-smi -L; "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } 2>&1 | tee "$OUT/defaults_cost_gpu.log"
"$PY" bench/defaults_cost.py --device cuda --rounds "${ROUNDS:-7}" --steps "${STEPS:-600}" --parts \
    --out "$OUT/defaults_cost_gpu.json" 2>&1 | tee -a "$OUT/defaults_cost_gpu.log"
rc=${PIPESTATUS[0]}
"$PY" -m pytest -q -p no:cacheprovider -m cuda tests/reliability/test_observability.py 2>&1 | tail -3 | tee -a "$OUT/defaults_cost_gpu.log"
exit "$rc"
