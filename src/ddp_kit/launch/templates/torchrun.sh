#!/usr/bin/env bash
# Launch the ddp_kit training job with torchrun, on one node or on several.
#
# One node (standalone rendezvous, free port chosen by the kernel):
#   launch/torchrun.sh [CONFIG.yaml] [--key value ...]
#   NPROC_PER_NODE=4 launch/torchrun.sh configs/cifar10_resnet18.yaml --epochs 3
#
# Several nodes (c10d rendezvous on the first node; run the same line on every node):
#   NNODES=2 RDZV_HOST=node1 launch/torchrun.sh configs/default.yaml
#
# Environment:
#   NPROC_PER_NODE  processes per node (default: number of visible GPUs, or 2 on a CPU-only machine)
#   NNODES          number of nodes (default 1: standalone)
#   RDZV_HOST       host of the c10d rendezvous (multi-node; default MASTER_ADDR, or this host)
#   RDZV_PORT       its port (default 29500)
#   RDZV_ID         job id shared by all nodes (default: SLURM_JOB_ID, or "ddp_kit")
#   RDZV_CONF       extra --rdzv_conf for multi-node (e.g. join_timeout=60)
#   MAX_RESTARTS    worker-group restarts after a failure (default 0)
#   PYTHON          interpreter (default: python)
# Everything after the script name goes to `python -m ddp_kit.train` unchanged.
set -euo pipefail

PYTHON=${PYTHON:-python}
if [ -z "${NPROC_PER_NODE:-}" ]; then
    NPROC_PER_NODE=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    [ "${NPROC_PER_NODE:-0}" -gt 0 ] || NPROC_PER_NODE=2
fi
NNODES=${NNODES:-1}
MAX_RESTARTS=${MAX_RESTARTS:-0}

# Refuse a bad config before any worker starts, so the user sees our one-line error and not
# torchrun's ChildFailedError report.
"$PYTHON" -m ddp_kit.train "$@" --dry_run --preflight_world_size "$((NPROC_PER_NODE * NNODES))" >/dev/null

# torchrun's shared rendezvous store can hand restarted workers stale addresses
# (pytorch#135712); a separate store per worker group avoids it. ddp_kit also namespaces its
# keys per restart, so this is belt and braces.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}

if [ "$NNODES" = 1 ]; then
    exec "$PYTHON" -m torch.distributed.run --standalone --nnodes=1 --nproc_per_node="$NPROC_PER_NODE" \
        --max-restarts="$MAX_RESTARTS" -m ddp_kit.train "$@"
fi
RDZV_HOST=${RDZV_HOST:-${MASTER_ADDR:-$(hostname)}}
exec "$PYTHON" -m torch.distributed.run --nnodes="$NNODES" --nproc_per_node="$NPROC_PER_NODE" \
    --rdzv_backend=c10d --rdzv_endpoint="$RDZV_HOST:${RDZV_PORT:-29500}" --rdzv_id="${RDZV_ID:-${SLURM_JOB_ID:-ddp_kit}}" \
    ${RDZV_CONF:+--rdzv_conf="$RDZV_CONF"} --max-restarts="$MAX_RESTARTS" -m ddp_kit.train "$@"
