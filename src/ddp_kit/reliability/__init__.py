"""The step boundary and what it schedules: checkpoints, preemption, fail-fast, the watchdog, peer
loss, sync checks, numerics, metrics and the run folder."""
