"""The pre-flight health gate: is every node of this job fit to train, before it costs the run?

    results.py  Result (one check on one host) and Report (every host's, the same on every rank)
    local.py    a folder writable with room for a checkpoint; the memory tier's tmpfs with room for its copies
    gpu.py      NVML health, memory a previous attempt still holds, a matmul with a known result (nvml.py: ctypes)
    peers.py    which ranks share a host, clocks against rank 0's host, the links between hosts timed
    gate.py     the plan and the run of every check (collective), for the service and the doctor
    leave.py    a failed host left out: SLURM's ExcNodeList at a requeue, an elastic torchrun agent leaving
    tier_room.py the memory tier's room per node, a lower bound: from the last checkpoint, or from the run's state

Used by services/health_gate.py (every attempt, `health_check`) and `python -m ddp_kit.doctor --preflight`. Nothing is imported here: results.py and leave.py are torch-free
and `status` reads them without torch."""
