"""HyperParallel demo: data + tensor parallel training of a small MLP with DTensor.

Run on 4 CPU ranks (a 2 x 2 mesh of data-parallel x tensor-parallel):

    torchrun --standalone --nproc_per_node=4 examples/dtensor_demo.py

The model code is plain single-device PyTorch. Parallelism is applied from the outside by giving
each parameter placements (Megatron's column- then row-parallel MLP) and sharding the batch over
the data-parallel axis. Every step is checked against the same model trained in one process;
the script exits non-zero if they differ.
"""

from __future__ import annotations

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import hp_dtensor as hp
from hp_dtensor import Layout, Replicate, Shard


class MLP(nn.Module):
    """Plain model code: no parallelism in here."""

    def __init__(self, dim: int = 16, hidden: int = 64) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def parallelize(model: MLP, layout: Layout) -> MLP:
    """Column-parallel fc1, row-parallel fc2 over "tp"; parameters replicated over "dp"."""
    plan = {
        "fc1.weight": layout("tp", "None"),  # split output features
        "fc1.bias": layout("tp"),
        "fc2.weight": layout("None", "tp"),  # split input features
        "fc2.bias": layout("None"),
    }
    for name, lay in plan.items():
        mod_name, _, pname = name.rpartition(".")
        mod = model.get_submodule(mod_name)
        setattr(mod, pname, nn.Parameter(hp.distribute_tensor(getattr(mod, pname).data, lay)))
    return model


def main() -> int:
    hp.init_process_group()
    layout = Layout((2, 2), ("dp", "tp"))
    mesh = hp.mesh_from_layout(layout)
    rank = mesh.get_rank()
    torch.manual_seed(0)
    ref = MLP()
    model = parallelize(MLP(), layout)
    with torch.no_grad():  # same initial values as the reference
        for p, q in zip(model.parameters(), ref.parameters()):
            p.copy_(hp.distribute_tensor(q.detach(), mesh, p.placements))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1)
    worst = 0.0
    for step in range(5):
        x, y = torch.randn(8, 16, generator=data), torch.randn(8, 16, generator=data)
        # the batch is split over dp and replicated over tp
        dx = hp.distribute_tensor(x, layout("dp", "None"))
        dy = hp.distribute_tensor(y, layout("dp", "None"))
        loss = ((model(dx) - dy) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref_loss = F.mse_loss(ref(x), y)
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        got = loss.full_tensor().item()
        worst = max(worst, abs(got - ref_loss.item()))
        if rank == 0:
            print(
                f"step {step}: loss {got:.6f}  single-process {ref_loss.item():.6f}  "
                f"(loss placements {tuple(str(p) for p in loss.placements)})"
            )
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        err = (p.full_tensor() - q.detach()).abs().max().item()
        worst = max(worst, err)
        if rank == 0:
            print(
                f"  {name:10s} {str(p.layout.tensor_map):22s} local {tuple(p.to_local().shape)}"
                f"  max |diff| {err:.2e}"
            )
    if rank == 0:
        plan = hp.plan_redistribute(
            mesh.shape, (Shard(0), Shard(1)), (Replicate(), Shard(0)), (8, 16)
        )
        print(f"a redistribution plan: {plan}")
        print("demo OK" if worst < 1e-4 else f"demo FAILED: max difference {worst:.3e}")
    hp.destroy_process_group()
    return 0 if worst < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
