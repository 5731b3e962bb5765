"""Two ranks on one GPU (gloo; NCCL refuses two ranks on a device), rank 1's GPU slowed on purpose with
torch.cuda._sleep inside its forward: the straggler check must name rank 1 from the GPU's own time
(on the host both ranks only queue kernels and look alike). Run by bench/gpu_check.py:

    torchrun --standalone --nproc_per_node=2 bench/gpu_straggler.py [--sleep_cycles 20000000]
"""
import fire
import torch
import torchvision

import ddp_kit


def main(sleep_cycles: int = 20_000_000, steps: int = 60):
    run = ddp_kit.init(device="cuda:0", backend="gloo", log_every=10, hang_timeout_s=0)
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64 * 2 * steps, 3, 32, 32), torch.randint(0, 10, (64 * 2 * steps,)))
    model, loader = run.prepare(torchvision.models.resnet18(num_classes=10),
                                torch.utils.data.DataLoader(data, batch_size=128, shuffle=True, drop_last=True))
    if run.rank == 1:  # queued inside the forward (after DDP's buffer broadcast): the GPU, not the host, is slow
        run.unwrap(model).register_forward_pre_hook(lambda *_: torch.cuda._sleep(sleep_cycles))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, fused=True)
    for x, y in loader:
        x, y = x.to(run.device, non_blocking=True), y.to(run.device, non_blocking=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        run.step(loss)
    run.close()


if __name__ == "__main__":
    fire.Fire(main)
