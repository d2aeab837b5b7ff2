"""Distributed random numbers.

NOTE [Random guarantee]: after ``manual_seed(seed, device_mesh)``, a random op on a DTensor
(``uniform_``, ``normal_``, ``bernoulli_``, ``rand_like``, ``dropout``, and the ``nn.init``
functions built on them) gives each rank exactly the slice that the same op on the whole tensor
gives in a single process after ``torch.manual_seed(seed)``, op for op; replicated tensors get
identical values on every rank; in-place random ops return ``self``.

How: every rank of the mesh seeds the device's default generator with the same seed, and a random
op on a DTensor draws the whole tensor and keeps its slice, so all generators advance together.
The cost is drawing the whole tensor on every rank, which is fine for initialisation and small
masks. Code that draws random numbers on some ranks only must use its own ``torch.Generator``.
"""

from __future__ import annotations

import torch

from ._backend import get_platform
from ._checks import check_mesh
from ._mesh import DeviceMesh
from .errors import ShardingError

__all__ = ["manual_seed"]


def manual_seed(seed: int, device_mesh: DeviceMesh) -> None:
    """Seed every rank of ``device_mesh`` identically (see NOTE [Random guarantee]).

    Raises ``ShardingError`` on every rank when the ranks passed different seeds.
    """
    if not isinstance(seed, int):
        raise ShardingError(f"seed={seed!r} must be an int")
    check_mesh(device_mesh, "device_mesh", "manual_seed")
    coord = device_mesh.get_coordinate()
    if coord is None:
        return
    platform = get_platform(device_mesh.device_type)
    dev = device_mesh.device
    lo = torch.tensor([seed], dtype=torch.int64, device=dev)
    hi = torch.tensor([-seed], dtype=torch.int64, device=dev)
    for d in range(device_mesh.ndim):
        if device_mesh.shape[d] > 1:
            platform.all_reduce(lo, "min", device_mesh._groups[d])
            platform.all_reduce(hi, "min", device_mesh._groups[d])
    if int(lo) != seed or -int(hi) != seed:
        raise ShardingError(
            f"manual_seed: ranks of the mesh passed different seeds (this rank {seed}, range "
            f"[{int(lo)}, {-int(hi)}]): pass the same seed on every rank"
        )
    torch.manual_seed(seed)
