"""ColwiseParallel and RowwiseParallel on MindSpore cells (``nn.Dense``; ``nn.Embedding`` for
ColwiseParallel), applied through ``parallelize_module`` like on torch modules.

MindSpore has no tensor-subclass dispatch, so a style does not turn parameters into DTensors
that route every op: it keeps this rank's shard as the cell's parameter (a plain MindSpore
Parameter, so optimizers and ``value_and_grad`` see local tensors), lets the cell compute
locally, and redistributes at its boundaries with the shared plans (``MSDTensor``), in forward
hooks:

- Colwise: the input is redistributed from ``input_layouts`` to Replicate and its gradient
  all-reduced (each rank's local gradient is a partial sum); the local output is Shard(-1),
  redistributed to ``output_layouts``.
- Rowwise: the input is redistributed to Shard(-1); the local product is a partial sum,
  reduced to ``output_layouts`` (all-reduce for Replicate, reduce-scatter for a shard); the
  bias, kept whole, is added after the reduction (its gradient all-reduced when the output is
  a shard).

Outputs are always local tensors (``use_local_output=True``): model code on MindSpore works
on plain tensors.
"""

from __future__ import annotations

import mindspore as ms
from mindspore import nn

from .._hooks import input_hook, output_hook
from .._placement import Partial, Replicate, Shard
from ..errors import HPDTensorTypeError, PlacementError
from . import _ms_ops  # noqa: F401  (the DTensor ops this module's tensors use)
from ._ms_dtensor import MSDTensor, all_reduce_grad, distribute_tensor

__all__ = [
    "apply_linear_style",
    "apply_prepare_input",
    "apply_prepare_output",
    "apply_sequence_parallel",
    "as_msdtensor",
    "validate_linear_style",
]


def _split_size(cell, kind: str) -> tuple[str, int]:
    if isinstance(cell, nn.Embedding):
        return "embedding_size", cell.embedding_size
    if kind == "colwise":
        return "out_channels", cell.out_channels
    return "in_channels", cell.in_channels


def validate_linear_style(style, cell, mesh, path: str, kind: str) -> None:
    """Check, without communicating, that ``style`` fits the MindSpore ``cell``."""
    name = type(style).__name__
    where = repr(path) if path else f"the {type(cell).__name__} given"  # mesh checked by caller
    if not isinstance(cell, (nn.Dense, nn.Embedding)):
        raise HPDTensorTypeError(
            f"{name} applies to MindSpore nn.Dense and nn.Embedding; {where} is a "
            f"{type(cell).__name__}"
        )
    if kind == "rowwise" and isinstance(cell, nn.Embedding):
        raise HPDTensorTypeError(
            f"RowwiseParallel on a MindSpore nn.Embedding ({where}) is not supported yet: use "
            "ColwiseParallel (embedding dim split) for it"
        )
    attr, size = _split_size(cell, kind)
    if size % mesh.size():
        raise PlacementError(
            f"{where}: {attr}={size} does not divide by the tensor-parallel "
            f"degree {mesh.size()}: choose a degree that divides it"
        )
    out_pl = _one(style.output_layouts, None)
    if kind == "rowwise" and cell.has_bias and isinstance(out_pl, Partial):
        raise PlacementError(
            f"RowwiseParallel(output_layouts={out_pl}) on {where}: a Partial output would "
            "count the bias once per rank; give Replicate() or a Shard of a non-feature dim"
        )
    if kind == "rowwise" and cell.has_bias and isinstance(out_pl, Shard) and out_pl.dim == -1:
        raise PlacementError(
            f"RowwiseParallel(output_layouts={out_pl}) on {where}: the bias is added whole, so "
            "the output may be sharded on a dim other than its features, or replicated"
        )
    if kind == "colwise" and isinstance(cell, nn.Embedding):
        in_pl = _one(style.input_layouts, None)
        if in_pl is not None and not isinstance(in_pl, (Replicate, Shard)):
            raise PlacementError(
                f"ColwiseParallel(input_layouts={in_pl}) on {where}: token ids are replicated "
                "or sharded, not partial"
            )


def as_msdtensor(x, mesh, layout, desired):
    """A cell input as an ``MSDTensor`` with ``desired`` placement: plain tensors are this
    rank's piece laid out as ``layout``; DTensors are redistributed (``desired`` None: kept).
    With ``layout`` None the value is left alone, as on torch."""
    if layout is None or not isinstance(x, (ms.Tensor, MSDTensor)):
        return x
    if not isinstance(x, MSDTensor):
        x = MSDTensor.from_local(x, mesh, [layout])
    if desired is not None and x.placements != (desired,):
        x = x.redistribute(mesh, [desired])
    return x


def _shard_param(cell, name: str, mesh, placement) -> None:
    p = getattr(cell, name)
    local = distribute_tensor(p, mesh, [placement]).to_local().contiguous()
    setattr(cell, name, ms.Parameter(local, name=p.name, requires_grad=p.requires_grad))


def _one(p, default):
    p = default if p is None else p
    if isinstance(p, (tuple, list)) and len(p) == 1:
        p = p[0]
    return p


def apply_linear_style(style, cell, mesh, kind: str):
    """Shard ``cell``'s parameters in place and register the boundary hooks; returns ``cell``."""
    validate_linear_style(style, cell, mesh, type(cell).__name__, kind)
    embedding = isinstance(cell, nn.Embedding)
    colwise = kind == "colwise"
    if embedding:
        _shard_param(cell, "embedding_table", mesh, Shard(1))
        cell.embedding_size //= mesh.size()  # its construct shapes the output with it
    elif colwise:
        _shard_param(cell, "weight", mesh, Shard(0))
        if cell.has_bias:
            _shard_param(cell, "bias", mesh, Shard(0))
    else:
        _shard_param(cell, "weight", mesh, Shard(1))
    bias = None
    if not colwise and cell.has_bias:
        bias = cell.bias
        cell.has_bias = False  # the cell computes the partial product; the bias comes after
    in_pl = _one(style.input_layouts, Replicate() if colwise else Shard(-1))
    out_pl = _one(style.output_layouts, Shard(-1) if colwise else Replicate())
    desired = Replicate() if colwise else Shard(-1)

    def pre(c, inputs):
        if embedding:  # the ids, replicated, are looked up in the local columns of the table
            if isinstance(in_pl, Replicate) and not isinstance(inputs[0], MSDTensor):
                return None
            ids = as_msdtensor(inputs[0], mesh, in_pl, Replicate())
            return (ids.to_local(), *inputs[1:])
        x = as_msdtensor(inputs[0], mesh, in_pl, desired).to_local()
        if colwise:
            x = all_reduce_grad(x, mesh)
        return (x, *inputs[1:])

    def post(c, inputs, out):
        if colwise:
            y = MSDTensor.from_local(out, mesh, [Shard(out.ndim - 1)])
        else:
            y = MSDTensor.from_local(out, mesh, [Partial()])
        if isinstance(out_pl, Shard) and out_pl.dim % out.ndim == out.ndim - 1 and bias is not None:
            raise PlacementError(
                f"RowwiseParallel(output_layouts={out_pl}) shards the output's features, to "
                "which the whole bias is added: shard another dim or replicate the output"
            )
        y = y.redistribute(mesh, [out_pl])
        if bias is None:
            return y.to_local() if style.use_local_output else y
        local = y.to_local() + (all_reduce_grad(bias, mesh) if isinstance(out_pl, Shard) else bias)
        if style.use_local_output:
            return local
        return MSDTensor.from_local(local, mesh, [out_pl], shape=y.shape)

    cell.register_forward_pre_hook(pre)
    cell.register_forward_hook(post)
    return cell


# -- SequenceParallel, PrepareModuleInput / PrepareModuleOutput on cells ------------------------
_MISSING = object()


def apply_sequence_parallel(style, cell, mesh):
    """The cell (a norm, dropout...) computes on the local sequence shard; its parameters, and
    those of its sub-cells, stay whole and each forward reads them through an all-reduce of
    their gradient (each rank saw part of the sequence, so its gradient is a partial sum).
    Output: Shard(sequence_dim) DTensors, or their local tensors with ``use_local_output``."""
    seq = Shard(style.sequence_dim)
    owners = [
        (sub, n)
        for _, sub in cell.cells_and_names()
        for n, p in sub._params.items()
        if p is not None and p.requires_grad
    ]
    calls: list = []  # per forward in flight: shadowed attributes, input global/local shape

    def pre(c, inputs):
        saved = []
        for sub, n in owners:  # this forward reads the parameter through the adapter
            saved.append((sub, n, sub.__dict__.get(n, _MISSING)))
            sub.__dict__[n] = all_reduce_grad(sub._params[n], mesh)
        x = as_msdtensor(inputs[0], mesh, seq, seq)
        shapes = (x.shape, tuple(x.to_local().shape)) if isinstance(x, MSDTensor) else None
        calls.append((saved, shapes))
        return (x.to_local() if isinstance(x, MSDTensor) else x, *inputs[1:])

    def wrap(o, shapes):
        if not isinstance(o, ms.Tensor):
            return o
        if shapes is not None and tuple(o.shape) == shapes[1]:  # same shape: same split
            y = MSDTensor.from_local(o, mesh, [seq], shape=shapes[0])
        else:  # the global shape from every rank's piece (uneven splits too)
            y = MSDTensor.from_local(o, mesh, [seq], run_check=True)
        return y.to_local() if style.use_local_output else y

    def post(c, inputs, out):
        saved, shapes = calls.pop() if calls else ((), None)
        for sub, n, old in saved:  # runs when construct raised too (always_call)
            if old is _MISSING:
                sub.__dict__.pop(n, None)
            else:
                sub.__dict__[n] = old
        if isinstance(out, tuple):
            return tuple(wrap(o, shapes) for o in out)
        return wrap(out, shapes)

    cell.register_forward_pre_hook(pre)
    cell.register_forward_hook(post, always_call=True)
    return cell


def apply_prepare_input(style, cell, mesh):
    """Inputs (and keyword inputs) annotated with their layouts and redistributed to the
    desired ones; returned as local tensors with ``use_local_output``."""
    use_local = style.use_local_output

    def convert(x, layout, desired):
        out = as_msdtensor(x, mesh, layout, desired)
        return out.to_local() if use_local and isinstance(out, MSDTensor) else out

    cell.register_forward_pre_hook(input_hook(style, convert), with_kwargs=True)
    return cell


def apply_prepare_output(style, cell, mesh):
    """Outputs annotated with ``output_layouts`` and redistributed to the desired ones;
    returned as local tensors with ``use_local_output``."""
    use_local = style.use_local_output

    def convert(o, layout, desired):
        o = as_msdtensor(o, mesh, layout, desired)
        return o.to_local() if use_local and isinstance(o, MSDTensor) else o

    cell.register_forward_hook(output_hook(style, convert))
    return cell
