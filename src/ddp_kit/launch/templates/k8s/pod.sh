# ddp_kit pod entrypoint: PID 1 of the training container (python -m ddp_kit.launch k8s embeds it).
#   sh -c "<this script>" ddp_kit-pod PREEMPTED_EXIT RETRYABLE_OFFSET COMMAND [ARGS...]
# Runs COMMAND, forwards SIGTERM (eviction, preemption, kubectl delete) to it, and exits PREEMPTED_EXIT
# when ddp_kit checkpointed and exited 75, so that the engine's restart policy can tell "restart me"
# from a failure, and 2 when a rank under torchrun exited 2 (not retryable; torchrun itself exits 1).
# With RETRYABLE_OFFSET > 0 (an engine that retries only codes >= 128), the retryable failures 1 (crashed,
# a lost peer, infrastructure) and 3 (hung) exit RETRYABLE_OFFSET + code. Every other code passes through.
preempted_exit=$1
retryable_offset=$2
shift 2
mark=${DDP_KIT_PREEMPT_MARK:-/tmp/ddp_kit.preempted}  # left by rank.sh when a rank under torchrun exits 75 (torchrun itself exits 1)
rm -f "$mark"
# A shell that is PID 1 ignores SIGTERM unless it traps it: the trap forwards it to the command.
trap 'kill -TERM "$child" 2>/dev/null' TERM INT
"$@" &
child=$!
while :; do
    wait "$child"
    rc=$?
    kill -0 "$child" 2>/dev/null || break  # wait also returns after the trap ran; the command still runs then
done
marked=$(cat "$mark" 2>/dev/null || true)
if [ "$rc" -ne 0 ] && [ "$marked" = 2 ]; then
    echo "ddp_kit: pod: a rank exited 2 (not retryable: a user error, or the same failure at the same step twice); exiting 2 so that the engine does not restart this pod" >&2
    exit 2
fi
if [ "$rc" -eq 75 ] || [ -e "$mark" ] && [ "$marked" != 2 ]; then
    echo "ddp_kit: pod: the ranks checkpointed and exited 75 (preempted); exiting $preempted_exit so that the engine restarts this pod" >&2
    exit "$preempted_exit"
fi
if [ "$retryable_offset" -gt 0 ] && { [ "$rc" -eq 1 ] || [ "$rc" -eq 3 ]; }; then
    echo "ddp_kit: pod: exit $rc is retryable (a restart resumes from the last checkpoint); exiting $((retryable_offset + rc)) so that the engine restarts this pod" >&2
    exit $((retryable_offset + rc))
fi
exit "$rc"
