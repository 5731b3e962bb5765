"""A user's script whose rank 1 meets a broken connection at step 6 on every attempt, as when its node's
network fails at the same point after each restart:

    torchrun --nproc_per_node 2 --max-restarts 1 comm_fault.py RUN_DIR

The error is the text NCCL raises when a peer's connection breaks (DistBackendError: ... remote process
exited or there was a network error), raised by the script: a CPU test cannot break a NIC, and gloo's own
text names a port that changes at every attempt. Everything after it is real: the post in the
rendezvous store, rank 0's fail-fast thread, the ledger's end lines, the repeat rule, torchrun's restart."""
import sys

import torch
import torch.distributed as tdist
import torch.nn.functional as F

import ddp_kit

run = ddp_kit.init(run_dir=sys.argv[1], ckpt_every=4, log_every=2)
torch.manual_seed(0)
model = run.prepare(torch.nn.Linear(4, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
done = run.resume(optimizer=optimizer)
for _ in range(done, 12):
    loss = F.mse_loss(model(torch.randn(8, 4)), torch.zeros(8, 2))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if run.step(loss) == 6 and run.rank == 1:
        raise tdist.DistBackendError("NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:275, remote "
                                     "process exited or there was a network error, NCCL version 2.21.5")
