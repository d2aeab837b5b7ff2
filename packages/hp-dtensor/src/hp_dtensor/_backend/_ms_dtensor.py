"""DTensor over MindSpore tensors: the same redistribution plans, executed on MindSpore.

``hp_dtensor.DTensor.from_local`` and ``hp_dtensor.distribute_tensor`` hand a MindSpore tensor
to this module (imported only then), on a mesh built with the MindSpore backend
(``HP_BACKEND=mindspore``). What is shared with the torch side, unchanged: placements,
``DTensorSpec``, the planner (``plan_redistribute``), the compiled forward/backward step lists
(``compile_plan``) and the step implementations in ``_redistribute`` (they use only the tensor
methods both frameworks have plus ``Platform.cat``/``clone``). What is MindSpore's: the
autograd binding. A redistribution is a ``nn.Cell`` whose ``bprop`` runs the adjoint step list,
so ``mindspore.value_and_grad`` differentiates through it with the gradient representation of
NOTE [Gradient representation] in ``_redistribute``.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from functools import lru_cache

import mindspore as ms
from mindspore import nn

from .._placement import Partial, Placement, Replicate, Shard, normalize_placements
from .._plan import plan_redistribute
from .._redistribute import _run, compile_plan
from .._spec import DTensorSpec, contiguous_strides, redistribute_target
from ..errors import PlacementError, ShardingError
from . import get_platform

__all__ = [
    "MSDTensor",
    "all_reduce_grad",
    "distribute_tensor",
    "is_mindspore_tensor",
    "partial_adapters",
]


def is_mindspore_tensor(t) -> bool:
    """True for a ``mindspore.Tensor`` (or Parameter)."""
    return isinstance(t, ms.Tensor)


def _check_mesh(mesh, what: str) -> None:
    framework = getattr(mesh, "framework", None)
    if framework != "mindspore":
        raise ShardingError(
            f"{what} is a MindSpore tensor but device_mesh was built for {framework!r}: a mesh "
            "serves one framework; build it with the MindSpore backend (HP_BACKEND=mindspore, "
            "under msrun) to hold MindSpore tensors"
        )


class _Redistribute(nn.Cell):
    """Forward: the plan's steps; backward (``bprop``): their adjoints, in reverse."""

    def __init__(self, mesh, fwd, bwd) -> None:
        super().__init__(auto_prefix=False)
        self._mesh, self._fwd, self._bwd = mesh, fwd, bwd

    def construct(self, x):
        return _run(self._fwd, x, self._mesh)

    def bprop(self, x, out, dout):
        return (_run(self._bwd, dout, self._mesh),)


class _ScaleGrad(nn.Cell):
    """Identity; the gradient is multiplied by ``scale`` (``Partial("avg")`` sources)."""

    def __init__(self, scale: float) -> None:
        super().__init__(auto_prefix=False)
        self._scale = scale

    def construct(self, x):
        return x

    def bprop(self, x, out, dout):
        return (dout * self._scale,)


class _AllReduceGrad(nn.Cell):
    """Identity; the gradient is summed over mesh dim 0 (Megatron's "f"): for a replicated
    input whose consumer's output is sharded, each rank's local gradient is a partial sum."""

    def __init__(self, mesh) -> None:
        super().__init__(auto_prefix=False)
        self._mesh = mesh

    def construct(self, x):
        return x

    def bprop(self, x, out, dout):
        platform = get_platform(self._mesh.device_type)
        g = platform.clone(dout)
        platform.all_reduce(g, "sum", self._mesh._groups[0])
        return (g,)


def all_reduce_grad(x, mesh):
    """``x`` unchanged; its gradient all-reduced (sum) over the 1-D ``mesh``."""
    return _AllReduceGrad(mesh)(x)


class _PartialExtremeGrad(nn.Cell):
    """Identity on a Partial(max/min) local value; in backward the gradient of the global
    extreme goes to the ranks whose local value attains it (split evenly on ties)."""

    def __init__(self, mesh, dims_ops) -> None:
        super().__init__(auto_prefix=False)
        self._mesh, self._dims_ops = mesh, dims_ops

    def construct(self, x):
        return x

    def bprop(self, x, out, dout):
        platform = get_platform(self._mesh.device_type)
        full = platform.clone(x)
        for d, op in self._dims_ops:
            platform.all_reduce(full, op, self._mesh._groups[d])
        mask = (x == full).astype(dout.dtype)
        count = platform.clone(mask)
        for d, _ in self._dims_ops:
            platform.all_reduce(count, "sum", self._mesh._groups[d])
        return (dout * mask / count.clip(1, None),)


def partial_adapters(local, mesh, placements, *, only=None):
    """``local`` behind the backward adapters its Partial(avg / max / min) placements need
    (NOTE [Gradient representation]); ``only`` limits them to those mesh dims."""
    scale, extreme = 1.0, []
    for d, p in enumerate(placements):
        if type(p) is not Partial or (only is not None and d not in only):
            continue
        if p.reduce_op == "avg":
            scale /= mesh.shape[d]
        elif p.reduce_op in ("max", "min"):
            extreme.append((d, p.reduce_op))
    if scale != 1.0:
        local = _ScaleGrad(scale)(local)
    if extreme:
        local = _PartialExtremeGrad(mesh, tuple(extreme))(local)
    return local


@lru_cache(maxsize=1024)
def _cell(mesh, src, dst, shape) -> _Redistribute:
    fwd, bwd = compile_plan(mesh, src, dst, shape)
    return _Redistribute(mesh, fwd, bwd)


class MSDTensor:
    """A global tensor split over a ``DeviceMesh`` of MindSpore ranks: this rank's piece (a
    ``mindspore.Tensor``) plus the placements. The same methods as ``hp_dtensor.DTensor``:
    ``from_local``, ``to_local``, ``redistribute``, ``full_tensor``, ``placements``,
    ``device_mesh``, ``shape``. Differentiable with ``mindspore.value_and_grad``: functions
    take and return local tensors and wrap them with ``from_local``/``to_local`` inside."""

    __slots__ = ("_local", "_spec")
    # the ops layer (``_ms_ops``), set once when it loads; every entry point that makes
    # MSDTensors (``hp_dtensor.DTensor``'s MindSpore path, the parallel styles, shard) loads it
    _ops = None

    def __init__(self, local, spec: DTensorSpec) -> None:
        self._local = local
        self._spec = spec

    @staticmethod
    def from_local(
        local_tensor,
        device_mesh=None,
        placements: Sequence[Placement] | None = None,
        *,
        run_check: bool = False,
        shape: Sequence[int] | None = None,
        stride: Sequence[int] | None = None,
    ) -> MSDTensor:
        """A DTensor whose piece on this rank is ``local_tensor`` (no copy); without ``shape``
        shards are assumed even. ``run_check`` (a collective) computes the global shape from
        every rank's local shape."""
        if device_mesh is None:
            raise PlacementError("device_mesh is required: pass the DeviceMesh the tensor lives on")
        _check_mesh(device_mesh, "local_tensor")
        placements = normalize_placements(
            placements if placements is not None else (), device_mesh.ndim, local_tensor.ndim
        )
        if run_check and shape is None:
            shape = _global_shape(local_tensor, device_mesh, placements)
        if shape is None:
            gshape = list(local_tensor.shape)
            for size, p in zip(device_mesh.shape, placements):
                if type(p) is Shard:
                    gshape[p.dim] *= size
            shape = gshape
        shape = tuple(int(s) for s in shape)
        if len(shape) != local_tensor.ndim:
            raise PlacementError(
                f"shape={shape} has {len(shape)} dims but local_tensor has {local_tensor.ndim}"
            )
        stride = tuple(stride) if stride is not None else contiguous_strides(shape)
        spec = DTensorSpec(device_mesh, placements, shape, stride, local_tensor.dtype)
        return MSDTensor(partial_adapters(local_tensor, device_mesh, placements), spec)

    def to_local(self):
        """This rank's piece (differentiable: its gradient is the local gradient)."""
        return self._local

    def redistribute(self, device_mesh=None, placements: Sequence[Placement] | None = None):
        """The same global tensor with other placements (differentiable), on its own mesh:
        another mesh is refused (use ``plan_transfer(...).run``)."""
        spec = self._spec
        if device_mesh is not None and device_mesh != spec.mesh:
            from .._checks import check_mesh

            check_mesh(device_mesh, "device_mesh", "redistribute")
            raise ShardingError(
                f"redistribute: device_mesh={device_mesh} is another mesh: on MindSpore, move "
                "the tensor with hp_dtensor.plan_transfer(...).run(local) (not differentiable "
                "yet) or transfer_state_dict"
            )
        placements = redistribute_target(spec, device_mesh, placements)
        mesh = spec.mesh
        target = spec.with_placements(placements)
        if placements == spec.placements:
            return self
        if plan_redistribute(mesh.shape, spec.placements, placements, spec.shape).is_noop:
            return MSDTensor(self._local, target)
        out = _cell(mesh, spec.placements, placements, spec.shape)(self._local)
        return MSDTensor(out, target)

    def full_tensor(self):
        """The whole tensor on every rank (a collective unless already replicated)."""
        return self.redistribute(placements=[Replicate()] * self._spec.mesh.ndim).to_local()

    @property
    def placements(self) -> tuple[Placement, ...]:
        """One placement per mesh dimension."""
        return self._spec.placements

    @property
    def device_mesh(self):
        """The mesh the tensor is split over."""
        return self._spec.mesh

    @property
    def shape(self) -> tuple[int, ...]:
        """The global shape."""
        return self._spec.shape

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return len(self._spec.shape)

    @property
    def dtype(self):
        """The MindSpore dtype."""
        return self._spec.dtype

    # -- ops: the sharding rules decide (``_ms_ops``, which sets ``_ops`` when it loads: this
    # module does not import it, the ops layer sits above); operands may be Python scalars --
    def __add__(self, other):
        return self._ops.call_op("add", operator.add, self, other)

    def __radd__(self, other):
        return self._ops.call_op("add", operator.add, other, self)

    def __sub__(self, other):
        return self._ops.call_op("sub", operator.sub, self, other)

    def __rsub__(self, other):
        return self._ops.call_op("sub", operator.sub, other, self)

    def __mul__(self, other):
        return self._ops.call_op("mul", operator.mul, self, other)

    def __rmul__(self, other):
        return self._ops.call_op("mul", operator.mul, other, self)

    def __truediv__(self, other):
        return self._ops.call_op("div", operator.truediv, self, other)

    def __rtruediv__(self, other):
        return self._ops.call_op("div", operator.truediv, other, self)

    def __pow__(self, other):
        return self._ops.call_op("pow", operator.pow, self, other)

    def __rpow__(self, other):
        return self._ops.call_op("pow", operator.pow, other, self)

    def __neg__(self):
        return self._ops.neg(self)

    def __matmul__(self, other):
        return self._ops.matmul(self, other)

    def __getitem__(self, key):
        return self._ops.call_op("__getitem__", operator.getitem, self, key)

    def reshape(self, *shape):
        """The same elements in global shape ``shape`` (local view when the split allows)."""
        return self._ops.reshape(self, _shape_arg(shape))

    def view(self, *shape):
        """As ``reshape``."""
        return self._ops.view(self, _shape_arg(shape))

    def transpose(self, dim0: int, dim1: int):
        """Swap two dimensions (placements follow)."""
        return self._ops.transpose(self, dim0, dim1)

    def sum(self, dim=None, keepdim: bool = False):
        """Sum over ``dim`` (all by default); a sharded dim gives a Partial(sum) result."""
        return self._ops.sum(self, dim, keepdim)

    def mean(self, dim=None, keepdim: bool = False):
        """Mean over ``dim`` (all by default); a sharded dim gives a Partial(avg) result."""
        return self._ops.mean(self, dim, keepdim)

    def __repr__(self) -> str:
        pl = ", ".join(str(p) for p in self._spec.placements)
        return f"MSDTensor(local={tuple(self._local.shape)}, placements=({pl}), shape={self.shape})"


def _shape_arg(shape) -> tuple[int, ...]:
    return tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape


def _global_shape(local, mesh, placements) -> tuple[int, ...]:
    """Every rank's local size on the sharded dims, gathered along the mesh dims."""
    import numpy as np

    platform = get_platform(mesh.device_type)
    shape = list(local.shape)
    for d, p in enumerate(placements):
        if type(p) is Shard and mesh.shape[d] > 1:
            mine = ms.Tensor(np.array([shape[p.dim]], dtype=np.int64))
            out = platform.zeros((mesh.shape[d],), ms.int64, None)
            platform.all_gather_into(out, mine, mesh._groups[d])
            shape[p.dim] = int(out.asnumpy().sum())
    return tuple(shape)


def distribute_tensor(tensor, device_mesh, placements=None, *, src_data_rank: int | None = 0):
    """Split a whole MindSpore tensor into an ``MSDTensor`` with ``placements``. With
    ``src_data_rank=k`` (default 0: the first rank) the values at index ``k`` along each mesh
    dimension are used everywhere (broadcast along each mesh dimension; ``hp_dtensor.
    distribute_tensor`` checks ``k``); with ``None`` every rank must pass equal values."""
    _check_mesh(device_mesh, "tensor")
    placements = normalize_placements(
        placements if placements is not None else (), device_mesh.ndim, tensor.ndim
    )
    platform = get_platform(device_mesh.device_type)
    full = tensor
    if src_data_rank is not None and device_mesh.get_coordinate() is not None:
        full = platform.clone(tensor)
        for d in range(device_mesh.ndim):
            if device_mesh.shape[d] > 1:
                root = device_mesh._line(d)[src_data_rank]
                platform.broadcast(full, root, device_mesh._groups[d])
    shape = tuple(full.shape)
    spec = DTensorSpec(device_mesh, placements, shape, contiguous_strides(shape), full.dtype)
    rep = (Replicate(),) * device_mesh.ndim
    fwd, _ = compile_plan(device_mesh, rep, placements, shape)
    local = _run(fwd, full, device_mesh)
    if local is tensor:
        local = platform.clone(local)  # never alias the caller's tensor
    return MSDTensor(local, spec)
