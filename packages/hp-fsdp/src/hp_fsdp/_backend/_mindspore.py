"""``fully_shard`` on MindSpore cells, and ``parallelize_value_and_grad``.

Imported only when ``fully_shard`` is given a MindSpore ``nn.Cell``. Each call forms one group,
as on torch, and shards the group's parameters on dim 0 over the 1-D mesh (split as
``torch.chunk`` splits them). Between steps the cell holds new Parameters with this rank's rows,
zero-padded to the same number of rows on every rank (the padding stays zero: its gradient is
zero), so a MindSpore optimizer built afterwards keeps 1/N of the states and updates shards.
A forward outside ``parallelize_value_and_grad`` (evaluation) gathers before each cell and
reshards after it.

MindSpore's autograd has no tensor hooks to re-gather a parameter in backward, and it caches a
Parameter's shape in the kernels that used it (one Parameter cannot change shape back and
forth), so the binding works per step, the way MindSpore training is written
(``value_and_grad``, then the optimizer):

- before a cell's forward, its group all-gathers every parameter as one flat buffer into the
  original Parameters (full shape) and swaps those into the cell; they stay there through
  backward;
- ``parallelize_value_and_grad(fn, weights=...)`` differentiates with respect to those gathered
  Parameters, reduce-scatters each group's gradients as one flat buffer (averaged over the
  ranks, times the group's gradient scaling factor, applied once before the reduction), swaps
  the shards back in and returns the sharded gradients in the order of ``weights``. Gradients
  of parameters outside every group are all-reduced (averaged), as data parallelism needs.

- after the step (and after an evaluation forward) the original Parameters release their
  storage: each holds a placeholder of its shape that MindSpore allocates only when read.

A runtime that differentiates several times per step (a pipeline stage's microbatches) uses
the cell's step interface instead, which is what ``parallelize_value_and_grad`` is built on:
``hold_gathered(True)`` makes every group of the cell's tree stay gathered from its first
forward through the step's other forwards; ``gathered_parameters(weights)`` gives the Parameters the
forwards use, to differentiate with respect to; ``reduce_gradients(weights, grads)`` turns
their whole gradients (summed over the microbatches) into this rank's shards, one
reduce-scatter per group; ``hold_gathered(False)`` reshards. hp-pipeline calls these by
name and imports nothing from hp-fsdp.

So optimizer states, reduced gradients and, between steps, parameters take 1/N per rank; during
a step every group's parameters are whole (MindSpore's autograd keeps what the forward used
until backward, with no hook to free and re-gather a parameter), and the gradients of one step
are whole until reduced.
"""

from __future__ import annotations

import weakref

import mindspore as ms
from mindspore.common.initializer import Zero

from hp_dtensor import chunk_size_and_offset, get_platform

from ..errors import FSDPError

__all__ = ["MSParamGroup", "fully_shard_cell", "parallelize_value_and_grad"]

# every group, in creation order (the order every rank reduces in); a group lives as long as
# its cell (which holds it and its hooks)
_GROUPS: list[weakref.ref] = []


def _groups() -> list[MSParamGroup]:
    _GROUPS[:] = [r for r in _GROUPS if r() is not None]
    return [r() for r in _GROUPS]


class MSParamGroup:
    """The parameters of one ``fully_shard`` call on a MindSpore cell.

    Each parameter becomes two Parameter objects of fixed shapes: a new one holding this rank's
    rows (in the cell between steps: the optimizer's) and the original one, which holds the
    gathered values and is swapped into the cell for the step. MindSpore caches a Parameter's
    shape in the kernels that used it, so one object cannot change shape back and forth.
    """

    def __init__(self, cell, mesh, params) -> None:
        self.cell, self.mesh = cell, mesh
        self.full_params = list(params)
        self.n = mesh.shape[0]
        self.rank = mesh.get_coordinate()[0]
        self.platform = get_platform(mesh.device_type)
        self.group = mesh._groups[0]
        self.grad_scale = 1.0
        self.shapes = [tuple(p.shape) for p in self.full_params]
        self.rest = []  # elements per row
        self.chunk_rows = []  # rows per rank in the padded layout
        for shape in self.shapes:
            rest = 1
            for s in shape[1:]:
                rest *= s
            self.rest.append(rest)
            self.chunk_rows.append(-(-shape[0] // self.n))
        self.padded = [c * r for c, r in zip(self.chunk_rows, self.rest)]
        self.total = sum(self.padded)
        self.unsharded = False
        self.held = 0  # > 0 during a step: forwards keep the parameters gathered
        self._live = []  # gathered tensors the full Parameters hold (set_data keeps no ref)
        # where each parameter sits: (cell, attribute) pairs, several for tied parameters
        self.owners = [[] for _ in self.full_params]
        index = {id(p): i for i, p in enumerate(self.full_params)}
        for _, sub in cell.cells_and_names():
            for attr, par in list(sub._params.items()):
                if par is not None and id(par) in index:
                    self.owners[index[id(par)]].append((sub, attr))
        self.shard_params = []
        for p, shape, chunk in zip(
            self.full_params, self.shapes, self.chunk_rows
        ):  # this rank's rows of its values, zero-padded to the same rows on every rank (a
            # parameter with fewer rows than ranks would otherwise leave a rank an empty one)
            rows, start = chunk_size_and_offset(shape[0], self.n, self.rank)
            mine = self.platform.clone(p[start : start + rows]) if rows else None
            if rows < chunk:
                pad = p.new_zeros((chunk - rows, *shape[1:]))
                mine = pad if mine is None else self.platform.cat([mine, pad], 0)
            self.shard_params.append(ms.Parameter(mine, name=p.name, requires_grad=p.requires_grad))
        self.ids = {id(p) for p in self.shard_params}
        self._place(self.shard_params)
        self._release()  # the whole values live on in the shards

    def _place(self, params) -> None:
        for owners, p in zip(self.owners, params):
            for sub, attr in owners:
                setattr(sub, attr, p)

    def _flat(self, tensors, dtype):
        """``(n, total)`` layout: each tensor's padded rows cut in ``n`` row-chunks, in order."""
        cols = []
        for t, shape, rows, rest in zip(tensors, self.shapes, self.chunk_rows, self.rest):
            t = t.reshape(shape[0], rest).astype(dtype)
            pad = self.n * rows - shape[0]
            if pad:
                t = self.platform.cat([t, t.new_zeros((pad, rest))], 0)
            cols.append(t.reshape(self.n, rows * rest))
        return self.platform.cat(cols, 1).reshape(-1)

    def unshard(self) -> None:
        """All-gather every parameter (one collective) and swap the gathered ones in."""
        if self.unsharded or not self.full_params:
            return
        dtype = self.full_params[0].dtype
        send = self.platform.cat([p.reshape(-1) for p in self.shard_params], 0)
        out = self.platform.zeros((self.n * self.total,), dtype, None)
        self.platform.all_gather_into(out, send, self.group)
        out = out.reshape(self.n, self.total)
        full, off = [], 0
        for p, shape, k, rows, rest in zip(
            self.full_params, self.shapes, self.padded, self.chunk_rows, self.rest
        ):
            block = out[:, off : off + k].reshape(self.n * rows, rest)[: shape[0]]
            t = self.platform.clone(block.reshape(shape))  # a tensor of its own
            p.set_data(t)
            full.append(t)
            off += k
        self._live = full
        self._place(self.full_params)
        self.unsharded = True

    def reshard(self) -> None:
        """Swap this rank's shards back in and release the gathered copies."""
        if not self.unsharded:
            return
        self._place(self.shard_params)
        self._release()
        self.unsharded = False

    def __repr__(self) -> str:
        return f"the {type(self.cell).__mro__[2].__name__} sharded by fully_shard"

    def hold(self) -> None:
        """Keep the parameters gathered through the forwards, once gathered (see ``held``)."""
        self.held += 1

    def release(self) -> None:
        """Undo one :meth:`hold`; the last one swaps the shards back in."""
        if self.held <= 0:
            raise FSDPError(
                f"{self!r}: released more often than held (hold_gathered(False) twice?)"
            )
        self.held -= 1
        if not self.held:
            self.reshard()

    def _release(self) -> None:
        """The full Parameters give their storage back: each gets a placeholder of its shape
        that MindSpore allocates only if it is read (``set_data`` keeps the shape, which the
        kernels that used the Parameter cached)."""
        for p, shape in zip(self.full_params, self.shapes):
            p.set_data(ms.Tensor(shape=shape, dtype=p.dtype, init=Zero()))
        self._live = []

    def reduce(self, grads):
        """Whole gradients (in parameter order) -> this rank's averaged shards."""
        dtype = grads[0].dtype
        send = self._flat(grads, dtype)
        if self.grad_scale != 1.0:
            send = send * self.grad_scale
        out = self.platform.zeros((self.total,), dtype, None)
        self.platform.reduce_scatter_into(out, send, "sum", self.group)
        out = out / self.n
        shards, off = [], 0
        for shape, k, rows in zip(self.shapes, self.padded, self.chunk_rows):
            piece = out[off : off + k].reshape((rows, *shape[1:]))  # padded like the shard
            shards.append(self.platform.clone(piece))
            off += k
        return shards


class MSHSDPCell:
    """Mixin a cell passed to ``fully_shard`` becomes an instance of (MindSpore)."""

    _hp_fsdp: MSParamGroup

    def set_gradient_scaling_factor(self, factor: float) -> None:
        """Multiply this group's gradients by ``factor`` once, before they are reduced."""
        self._hp_fsdp.grad_scale = float(factor)

    def unshard(self) -> None:
        """All-gather this group's parameters now."""
        self._hp_fsdp.unshard()

    def reshard(self) -> None:
        """Swap this rank's shards back in."""
        self._hp_fsdp.reshard()

    def _tree_groups(self) -> list[MSParamGroup]:
        """The groups of this cell and of the ``fully_shard`` cells under it, in creation
        order (the order every rank reduces in)."""
        ids = {id(c) for _, c in self.cells_and_names()}
        return [g for g in _groups() if id(g.cell) in ids]

    def hold_gathered(self, flag: bool) -> None:
        """``True``: from now on each group of this cell's tree, once its first forward has
        gathered it, stays gathered through the forwards until ``hold_gathered(False)``, which
        swaps the shards back in (a step of several forwards and backwards, e.g. a pipeline
        stage's microbatches: one gather per group per step)."""
        for g in self._tree_groups():
            g.hold() if flag else g.release()

    def gathered_parameters(self, weights) -> list:
        """Each of ``weights`` (this cell's parameters as the optimizer holds them: the shards)
        as the gathered Parameter the forwards use; a parameter outside every group as it is."""
        return _Slots(self._tree_groups(), weights).gathered

    def reduce_gradients(self, weights, grads) -> list:
        """The whole gradients ``grads`` of ``gathered_parameters(weights)`` -> this rank's
        gradients of ``weights``: one averaged reduce-scatter per group (times its gradient
        scaling factor); gradients of parameters outside every group averaged over the data-
        parallel ranks. Every group of the tree must be gathered (``hold_gathered(True)``)."""
        out = list(grads)
        _Slots(self._tree_groups(), weights).reduce(out)
        return out


def fully_shard_cell(cell, *, mesh, **unsupported):
    """``fully_shard`` for a MindSpore cell (see the module docstring)."""
    for name, value in unsupported.items():
        if value is not None:
            raise FSDPError(
                f"{name}={value!r} is not supported for MindSpore cells yet: leave it at None"
            )
    if mesh is None or getattr(mesh, "framework", None) != "mindspore":
        raise FSDPError(
            "fully_shard on a MindSpore cell needs mesh=, a DeviceMesh built with the MindSpore "
            "backend (HP_BACKEND=mindspore)"
        )
    if mesh.ndim != 1:
        raise FSDPError(
            f"mesh has {mesh.ndim} dims: MindSpore cells take a 1-D mesh (HSDP is torch-only yet)"
        )
    if isinstance(cell, MSHSDPCell):
        raise FSDPError(
            f"fully_shard was already applied to this {type(cell).__mro__[2].__name__}: apply "
            "it once per cell (bottom-up: blocks, then the root)"
        )
    owned = {pid for g in _groups() for pid in g.ids}
    params = list(dict.fromkeys(p for p in cell.get_parameters() if id(p) not in owned))
    scalars = [p.name for p in params if len(p.shape) == 0]
    if scalars:
        raise FSDPError(
            f"fully_shard on MindSpore: parameters {scalars} are scalars and cannot be sharded "
            "on dim 0; reshape them to (1,) or keep them out of this cell"
        )
    dtypes = {str(p.dtype) for p in params}
    if len(dtypes) > 1:
        raise FSDPError(
            f"fully_shard on MindSpore: parameters of one cell have several dtypes "
            f"{sorted(dtypes)} (one flat buffer per group); give them one dtype or shard them in "
            "separate cells"
        )
    group = MSParamGroup(cell, mesh, params)
    _GROUPS.append(weakref.ref(group))
    cell.__class__ = type(f"HSDP{type(cell).__name__}", (MSHSDPCell, type(cell)), {})
    cell._hp_fsdp = group

    def pre(c, inputs):
        if not group.held:
            group.reshard()  # outside a step: always gather the current shards
        group.unshard()

    def post(c, inputs, out):
        if not group.held:
            group.reshard()  # outside a step nothing reduces: back to the shards now

    cell.register_forward_pre_hook(pre)
    cell.register_forward_hook(post)
    return cell


class _Slots:
    """Where each of ``weights`` sits among ``groups``: decided once, used at every step."""

    def __init__(self, groups, weights) -> None:
        where = {id(sp): (g, i) for g in groups for i, sp in enumerate(g.shard_params)}
        whole = {id(fp) for g in groups for fp in g.full_params}
        for i, w in enumerate(weights):
            if id(w) in whole:
                raise FSDPError(
                    f"weights[{i}] ({w.name}) is a parameter as it was before fully_shard: take "
                    "the weights after fully_shard (e.g. net.trainable_params() then)"
                )
        # per group whose shards are among the weights: each parameter's index in weights
        # (None: not asked for)
        self.slots: dict[MSParamGroup, list[int | None]] = {}
        for i, w in enumerate(weights):
            if id(w) in where:
                g, k = where[id(w)]
                self.slots.setdefault(g, [None] * len(g.shard_params))[k] = i
        self.groups = [g for g in groups if g in self.slots]  # creation order: same everywhere
        self.gathered = [
            where[id(w)][0].full_params[where[id(w)][1]] if id(w) in where else w for w in weights
        ]

    def reduce(self, grads: list) -> None:
        """In place: grads of sharded weights -> reduced shards; the others -> averaged over
        the groups' data-parallel ranks."""
        done = set()
        for g in self.groups:
            idx = self.slots[g]
            if not g.unsharded:
                raise FSDPError(
                    f"reducing gradients: {g!r} did not run in the forward, on this rank at "
                    "least; every rank must call every sharded cell in a step"
                )
            whole = [
                grads[i] if i is not None else p.new_zeros(p.shape)
                for i, p in zip(idx, g.full_params)
            ]
            for i, shard in zip(idx, g.reduce(whole)):
                if i is not None:
                    grads[i] = shard
                    done.add(i)
        rest = [i for i in range(len(grads)) if i not in done]
        if rest and self.groups:  # averaged where the differentiated groups' ranks are
            platform, group = self.groups[0].platform, self.groups[0].group
            for i in rest:
                g = platform.clone(grads[i])
                platform.all_reduce(g, "avg", group)
                grads[i] = g


def parallelize_value_and_grad(fn, grad_position=None, weights=None, has_aux=False):
    """``mindspore.value_and_grad`` for a network whose cells went through ``fully_shard``:
    the returned function gives ``(value, grads)`` with the gradients of ``weights`` (the
    cells' parameters, i.e. this rank's shards) reduced to this rank's shards (see the module
    docstring), ready for the optimizer."""
    if weights is None and grad_position is None:
        raise FSDPError(
            "parallelize_value_and_grad: give weights= (the cells' parameters) and/or "
            "grad_position= (inputs to differentiate)"
        )
    wlist = list(weights) if weights is not None else []
    groups = _groups()
    slots = _Slots(groups, wlist)
    inner = ms.value_and_grad(
        fn,
        grad_position=grad_position,
        weights=slots.gathered if wlist else None,
        has_aux=has_aux,
    )

    def run(*args):
        # every group stays gathered through the step's forward (MindSpore's autograd keeps
        # the gathered values until backward); the ones not differentiated as well
        held = _groups()
        for g in held:
            g.hold()
        try:
            value, grads = inner(*args)
            if not wlist:
                return value, grads
            wgrads = list(grads if grad_position is None else grads[1])
            slots.reduce(wgrads)
        finally:
            for g in held:
                g.release()
        wgrads = tuple(wgrads)
        return value, (wgrads if grad_position is None else (grads[0], wgrads))

    return run
