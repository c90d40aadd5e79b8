"""apex's own FP16_Optimizer + DistributedDataParallel example
(examples/FP16_Optimizer_simple/distributed_apex/distributed_data_parallel.py in
NVIDIA/apex), ported to mpfp16 by changing its two imports, and run on the embedded
synthetic images instead of random tensors. docs/APEX.md shows the diff.

    torchrun --nproc_per_node 2 examples/apex_port.py
    python examples/apex_port.py                     # one process
"""

import argparse
import os
import socket

import torch
import torch.distributed

import mpfp16.distributed
from mpfp16.compat.apex import DistributedDataParallel as DDP  # was: from apex.parallel import ...
from mpfp16.compat.apex import FP16_Optimizer                  # was: from apex.fp16_utils import ...
from mpfp16.train.data import synthetic_images


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--local_rank", default=0, type=int, help="ignored: torchrun sets LOCAL_RANK (default: 0)")
    parser.add_argument("--steps", type=int, default=500, help="training steps (default: 500, as apex's example)")
    parser.add_argument("--lr", type=float, default=1e-2, help="SGD learning rate (default: 0.01)")
    args = parser.parse_args()

    if "WORLD_SIZE" not in os.environ:  # one process without torchrun
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.distributed.init_process_group(backend="nccl" if cuda else "gloo", init_method="env://")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()

    # The example's N x D_in inputs and N x D_out targets: here this rank's 64 embedded
    # 32x32 images, flattened, and their one-hot labels.
    N, D_out = 64, 10
    images, labels = synthetic_images(N * world, 32, D_out, seed=1)
    images, labels = images[rank * N:(rank + 1) * N], labels[rank * N:(rank + 1) * N]
    x = ((images.float() / 255 - 0.5) / 0.25).reshape(N, -1).to(device, torch.half)
    y = torch.nn.functional.one_hot(labels, D_out).to(device, torch.half)

    torch.manual_seed(0)
    model = torch.nn.Linear(x.shape[1], D_out).to(device).half()
    model = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    optimizer = FP16_Optimizer(optimizer, verbose=False)
    loss_fn = torch.nn.MSELoss()

    first = None
    for _ in range(args.steps):
        optimizer.zero_grad()
        y_pred = model(x)
        loss = loss_fn(y_pred.float(), y.float())
        optimizer.backward(loss)
        optimizer.step()
        first = loss.item() if first is None else first

    mpfp16.distributed.check_replicas(model)  # raises on every rank if the replicas differ
    if rank == 0:
        print(f"final loss {loss.item():.4f} (from {first:.4f}); replicas identical on {world} process(es)")
    del model, optimizer
    mpfp16.distributed.teardown()


if __name__ == "__main__":
    main()
