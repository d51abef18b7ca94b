"""remat's plan inside FSDP2 and torch.compile: the recipe, runnable on CPU.

    python examples/fsdp2_native.py                 # 2 processes on this machine (gloo)
    torchrun --nproc-per-node 8 examples/fsdp2_native.py --device cuda --compile

The order matters, as in torchtitan: (1) ``remat.apply`` plans a selective-checkpoint
policy per block and wraps the blocks in place; (2) ``fully_shard`` each block, then the
root; (3) ``torch.compile``. Each rank plans on a FakeTensor copy of the model (no memory);
gradients are bitwise those of the same FSDP2 run without remat (the recomputation replays
dropout's random state), which ``tests/executors/sac/test_distributed.py`` checks.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import remat
from remat.models import TinyGPT


def train(rank: int, world: int, args: argparse.Namespace) -> None:
    if "RANK" not in os.environ:  # spawned by this script
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    else:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    device = torch.device(args.device, rank % max(1, torch.cuda.device_count()))
    if args.device == "cpu":
        device = torch.device("cpu")
    torch.manual_seed(0)
    model = TinyGPT(vocab=256, dim=128, heads=4, layers=4, seq=256).to(device)
    tokens = torch.randint(0, 256, (4, 256), device=device)

    # 1. Plan and wrap the blocks in place, for a bound on the step's peak.
    remat.apply(model, tokens, activation_budget_bytes=int(args.activation_budget_mb * 2**20))
    if rank == 0:
        print(remat.plan_of(model).summary())

    # 2. Shard each block, then the root.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)

    # 3. Compile (optional: cold compiles take a while on CPU).
    step_model = torch.compile(model) if args.compile else model

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        logits = step_model(tokens)
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()
        )
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--activation-budget-mb", type=float, default=60.0)
    parser.add_argument("--port", type=int, default=29531)
    args = parser.parse_args()
    if "RANK" in os.environ:
        train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
    else:
        mp.spawn(train, args=(2, args), nprocs=2)


if __name__ == "__main__":
    main()
