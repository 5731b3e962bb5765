# ddp_kit rank shim under torchrun --no-python (python -m ddp_kit.launch k8s embeds it):
#   torchrun ... --no-python sh -c "<this script>" ddp_kit-rank python -m ddp_kit.train ARGS...
# torchrun reports any failed worker as its own exit 1, so a rank that exits 75 (preempted) or 2 (not
# retryable: a user error, the same failure at the same step twice) leaves its code in a mark for pod.sh.
# torchrun signals a worker's whole process group: the trap keeps this shell alive until the rank has
# checkpointed and exited (a trap handler, unlike an ignored signal, is not inherited by the rank).
trap : TERM INT HUP
"$@"
rc=$?
case "$rc" in 75|2) echo "$rc" >"${DDP_KIT_PREEMPT_MARK:-/tmp/ddp_kit.preempted}" ;; esac
exit "$rc"
