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
# Elastic (MIN:MAX nodes): starts once MIN nodes have joined; each node that joins later (up to MAX)
# restarts the job on more nodes, resumed from the checkpoint ddp_kit writes when torchrun stops it:
#   NNODES=1:4 RDZV_HOST=node1 launch/torchrun.sh configs/default.yaml   # node1 now, the others when they come
#
# Environment:
#   NPROC_PER_NODE  processes per node (default: number of visible GPUs, or 2 on a CPU-only machine)
#   NNODES          number of nodes, or MIN:MAX for an elastic job (default 1: standalone)
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
MIN_NODES=${NNODES%%:*}
MAX_NODES=${NNODES##*:}
case "$NNODES" in
    *[!0-9:]* | *:*:* | :* | *:) echo "ddp_kit: error: NNODES '$NNODES' is not a number of nodes or MIN:MAX (hint: NNODES=2, or NNODES=1:4 for an elastic job)" >&2; exit 2 ;;
esac
if [ "$MIN_NODES" -lt 1 ] || [ "$MIN_NODES" -gt "$MAX_NODES" ]; then
    echo "ddp_kit: error: NNODES '$NNODES': nodes must be at least 1, and MIN at most MAX (hint: e.g. NNODES=2, or NNODES=1:4)" >&2
    exit 2
fi

# Refuse a bad config before any worker starts, so the user sees our one-line error and not
# torchrun's ChildFailedError report: an elastic job checks every world size it may run at.
WORLD_SIZES=$((NPROC_PER_NODE * MIN_NODES))
for n in $(seq $((MIN_NODES + 1)) "$MAX_NODES"); do WORLD_SIZES="$WORLD_SIZES,$((NPROC_PER_NODE * n))"; done
"$PYTHON" -m ddp_kit.train "$@" --dry_run --preflight_world_size "$WORLD_SIZES" >/dev/null

# A separate store per worker group (torch's opt-out of the rendezvous store it shares with the
# workers) avoids two torch bugs: restarted workers handed stale addresses (pytorch#135712), and
# an elastic job that hangs when a node joins: with the shared store, torch 2.6 to 2.15 keep the
# first round's store address, so the rank-0 agent never publishes it for the next round and the
# joining agent waits for it until it times out (docs/launching.md, "Growing an elastic job").
# ddp_kit also namespaces its keys per restart.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}

if [ "$NNODES" = 1 ]; then
    exec "$PYTHON" -m torch.distributed.run --standalone --nnodes=1 --nproc_per_node="$NPROC_PER_NODE" \
        --max-restarts="$MAX_RESTARTS" -m ddp_kit.train "$@"
fi
RDZV_HOST=${RDZV_HOST:-${MASTER_ADDR:-$(hostname)}}
exec "$PYTHON" -m torch.distributed.run --nnodes="$NNODES" --nproc_per_node="$NPROC_PER_NODE" \
    --rdzv_backend=c10d --rdzv_endpoint="$RDZV_HOST:${RDZV_PORT:-29500}" --rdzv_id="${RDZV_ID:-${SLURM_JOB_ID:-ddp_kit}}" \
    ${RDZV_CONF:+--rdzv_conf="$RDZV_CONF"} --max-restarts="$MAX_RESTARTS" -m ddp_kit.train "$@"
