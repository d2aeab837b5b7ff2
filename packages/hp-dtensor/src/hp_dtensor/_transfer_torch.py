"""The torch binding of cross-mesh transfers: a :class:`~hp_dtensor._transfer.TransferPlan` run
with batched point-to-point sends of exactly the planned boxes, and the differentiable
redistribution between two meshes over the same ranks built on it."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._placement import Partial, Replicate
from ._transfer import TransferPlan, _Side, plan_transfer
from .errors import HPDTensorTypeError, ShardingError

__all__ = ["TransferHandle", "redistribute_across_meshes", "run_transfer", "transfer_state_dict"]


def _region(t: torch.Tensor, base: tuple[int, ...], offset, size) -> torch.Tensor:
    for d, (o, s, b) in enumerate(zip(offset, size, base)):
        t = t.narrow(d, o - b, s)
    return t


def _coordinate(mesh, rank: int) -> tuple[int, ...]:
    return _Side(tuple(mesh.rank_list), tuple(mesh.shape), ()).coordinate(rank)


def _fingerprint(*plans: TransferPlan) -> int:
    """A number every rank computes alike from the plans' shapes, dtypes, layouts and ranks."""
    import hashlib

    text = repr(
        [
            (
                p.shape,
                str(p.dtype),
                p.src_placements,
                p.dst_placements,
                p.ranks,
                tuple(p.src_mesh.rank_list),
                tuple(p.dst_mesh.rank_list),
            )
            for p in plans
        ]
    )
    return int.from_bytes(hashlib.sha1(text.encode()).digest()[:7], "little")


def _agree(ranks: tuple[int, ...], problem: str, device, fingerprint: int = 0) -> None:
    """Every one of ``ranks`` learns whether any rank's arguments are wrong, or whether the
    ranks hold different plans (``fingerprint``), and all raise: one all-reduce, before any
    transfer."""
    from ._groups import new_group

    me = dist.get_rank()
    flags = torch.zeros(len(ranks) + 2, dtype=torch.int64, device=device)
    if problem:
        flags[ranks.index(me)] = 1
    flags[-2], flags[-1] = fingerprint, -fingerprint
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=new_group(ranks))
    values = flags.tolist()
    bad = [r for r, f in zip(ranks, values) if f]
    if bad:
        raise ShardingError(
            problem or f"transfer: rank(s) {bad} passed invalid arguments (see theirs)"
        )
    if values[-2] != -values[-1]:
        raise ShardingError(
            "transfer: the ranks planned different transfers (shapes, dtypes, placements or "
            "meshes differ between them): build the plan from the same arguments everywhere"
        )


def _problem(plan: TransferPlan, local, me: int, what: str = "") -> str:
    """What is wrong with this rank's ``local`` for ``plan`` ('' if nothing)."""
    if me in plan.src_mesh.rank_list:
        from ._shard_math import local_shape_and_offset

        size, _ = local_shape_and_offset(
            plan.shape, plan.src_mesh.shape, _coordinate(plan.src_mesh, me), plan.src_placements
        )
        if not isinstance(local, torch.Tensor):
            return (
                f"TransferPlan.run{what}: rank {me} is in the source mesh and passed "
                f"{type(local).__name__}: pass its local piece"
            )
        if local.device.type != plan.src_mesh.device_type:
            return (
                f"TransferPlan.run{what}: rank {me}'s piece is on {local.device}; the source "
                f"mesh is on {plan.src_mesh.device_type!r}: move it there"
            )
        if tuple(local.shape) != tuple(size) or local.dtype != plan.dtype:
            return (
                f"TransferPlan.run{what}: rank {me}'s piece is {tuple(local.shape)} "
                f"{local.dtype}; the plan expects {tuple(size)} {plan.dtype}: pass this rank's "
                "local piece of the planned tensor"
            )
    elif local is not None:
        return (
            f"TransferPlan.run{what}: rank {me} is not in the source mesh but passed a piece: "
            "pass None"
        )
    return ""


def _post(plan: TransferPlan, local, me: int, device, ops: list, group, snapshot: bool):
    """Append this rank's sends and receives of ``plan`` to ``ops`` (peers in ``group``: the
    ranks of both meshes) and put its local parts in place. Returns (out, parts): a
    destination rank's output piece (None elsewhere) and the parts still to add or copy into
    it, in plan order (transfer, buffer). With ``snapshot`` every send and local part is a
    copy, so the caller may change its tensors before the transfer finishes."""
    from ._shard_math import local_shape_and_offset

    base = None
    if me in plan.src_mesh.rank_list:
        _, base = local_shape_and_offset(
            plan.shape, plan.src_mesh.shape, _coordinate(plan.src_mesh, me), plan.src_placements
        )
    out = d_base = None
    if me in plan.dst_mesh.rank_list:
        d_size, d_base = local_shape_and_offset(
            plan.shape, plan.dst_mesh.shape, _coordinate(plan.dst_mesh, me), plan.dst_placements
        )
        # the boxes tile the piece exactly: nothing to zero unless contributions are summed
        alloc = torch.zeros if plan.reduce else torch.empty
        out = alloc(d_size, dtype=plan.dtype, device=device)
    parts = []
    for t in plan.transfers:
        if t.src == me:
            region = _region(local, base, t.offset, t.size)
            if t.dst == me:
                if plan.reduce:  # summed with the others in plan order, the same everywhere
                    parts.append((t, region.clone() if snapshot else region))
                else:
                    _region(out, d_base, t.offset, t.size).copy_(region)
                continue
            piece = region.contiguous()
            if snapshot and piece.data_ptr() == region.data_ptr():
                piece = piece.clone()
            ops.append(dist.P2POp(dist.isend, piece, t.dst, group))
        elif t.dst == me:
            view = _region(out, d_base, t.offset, t.size)
            if not plan.reduce and view.is_contiguous():  # received in place: no copy
                ops.append(dist.P2POp(dist.irecv, view, t.src, group))
                continue
            buf = torch.empty(t.size, dtype=plan.dtype, device=device)
            ops.append(dist.P2POp(dist.irecv, buf, t.src, group))
            parts.append((t, buf))
    return out, parts


def _assemble(plan: TransferPlan, me: int, out, parts):
    """This destination rank's DTensor: ``out`` with ``parts`` (all arrived) added, in plan
    order, or copied in."""
    from ._dtensor import DTensor
    from ._shard_math import local_shape_and_offset

    _, d_base = local_shape_and_offset(
        plan.shape, plan.dst_mesh.shape, _coordinate(plan.dst_mesh, me), plan.dst_placements
    )
    for t, buf in parts:
        _put(out, d_base, t, buf, plan.reduce)
    return DTensor.from_local(
        out, plan.dst_mesh, plan.dst_placements, run_check=False, shape=plan.shape
    )


def _local_of(local):
    from ._dtensor import DTensor

    return local.to_local() if isinstance(local, DTensor) else local


def run_transfer(plan: TransferPlan, local):
    """Run ``plan`` on this rank (see ``TransferPlan.run``)."""
    from ._groups import new_group

    if not dist.is_initialized():
        raise ShardingError("TransferPlan.run needs the default process group: initialise it")
    me = dist.get_rank()
    if me not in plan.ranks:
        raise ShardingError(
            f"TransferPlan.run: rank {me} is in neither mesh ({plan.ranks}): do not call it here"
        )
    local = _local_of(local)
    _agree(plan.ranks, _problem(plan, local, me), _device(plan), _fingerprint(plan))
    device = local.device if isinstance(local, torch.Tensor) else _device(plan)
    ops: list = []
    with torch.no_grad():
        out, parts = _post(plan, local, me, device, ops, new_group(plan.ranks), False)
        for r in dist.batch_isend_irecv(ops) if ops else []:
            r.wait()
        if me not in plan.dst_mesh.rank_list:
            return None
        return _assemble(plan, me, out, parts)


def _put(out, base, t, values, add: bool) -> None:
    target = _region(out, base, t.offset, t.size)
    if add:
        target.add_(values)
    else:
        target.copy_(values)


def _device(plan: TransferPlan) -> torch.device:
    dev = plan.dst_mesh.device_type
    if dev == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(dev)


class _AcrossMeshes(torch.autograd.Function):
    """Local piece on the source mesh -> local piece on the destination mesh (same ranks);
    backward runs the reverse plan on the gradient."""

    @staticmethod
    def forward(ctx, local, plan: TransferPlan, back: TransferPlan):
        ctx.back = back
        return run_transfer(plan, local).to_local()

    @staticmethod
    def backward(ctx, grad):
        return run_transfer(ctx.back, grad.contiguous()).to_local(), None, None


def redistribute_across_meshes(x, device_mesh, placements):
    """``x`` (a DTensor) on ``device_mesh`` (the same ranks as ``x``'s mesh, in another shape
    or order) with ``placements``: a differentiable transfer."""
    from ._dtensor import DTensor
    from ._placement import normalize_placements

    spec = x._spec
    if set(device_mesh.rank_list) != set(spec.mesh.rank_list):
        raise ShardingError(
            f"redistribute: device_mesh={device_mesh} holds other ranks than this tensor's mesh "
            f"{spec.mesh}: use plan_transfer(...).run for meshes over different ranks"
        )
    if placements is None:
        raise HPDTensorTypeError("redistribute: placements is required with another mesh")
    dst_pl = normalize_placements(placements, device_mesh.ndim, len(spec.shape))
    plan = plan_transfer(spec.mesh, spec.placements, device_mesh, dst_pl, spec.shape, spec.dtype)
    # the gradient of a pending sum is the same everywhere: it goes back replicated there
    back_pl = [Replicate() if isinstance(p, Partial) else p for p in spec.placements]
    back = plan_transfer(device_mesh, dst_pl, spec.mesh, back_pl, spec.shape, spec.dtype)
    local = x.to_local(grad_placements=back_pl)
    out = _AcrossMeshes.apply(local, plan, back)
    return DTensor.from_local(out, device_mesh, dst_pl, run_check=False, shape=spec.shape)


def _encode(p) -> str:
    if isinstance(p, Partial):
        return f"P:{p.reduce_op}"
    return "R" if isinstance(p, Replicate) else f"S{p.dim}"


def _decode(text: str):
    from ._placement import Shard

    if text.startswith("P:"):
        return Partial(text[2:])
    return Replicate() if text == "R" else Shard(int(text[1:]))


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(value, torch.dtype):
        raise ShardingError(f"transfer_state_dict: dtype {name!r} is not a torch dtype")
    return value


def _broadcast_json(value, src: int, group, device):
    """``value`` (JSON data) from rank ``src`` to every rank of ``group``: data, not code."""
    import json

    me = dist.get_rank()
    blob = json.dumps(value).encode() if me == src else b""
    n = torch.tensor([len(blob)], dtype=torch.int64, device=device)
    dist.broadcast(n, src, group=group)
    buf = (
        torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(device)
        if me == src
        else torch.empty(int(n.item()), dtype=torch.uint8, device=device)
    )
    dist.broadcast(buf, src, group=group)
    return json.loads(bytes(buf.cpu().tolist()).decode())


class TransferHandle:
    """A state-dict transfer in flight (``transfer_state_dict(..., async_op=True)``): the
    sends and receives are posted; ``wait()`` finishes them and returns the destination's
    state dict (None on ranks outside the destination mesh)."""

    def __init__(self, requests, finish, ops=()) -> None:
        self._requests, self._finish, self._result, self._done = requests, finish, None, False
        self._ops = ops  # the buffers in flight stay alive until wait()

    def wait(self):
        """Block until every transfer of this rank is done; the destination state dict."""
        if not self._done:
            for r in self._requests:
                r.wait()
            self._result, self._done = self._finish(), True
            self._ops = ()
        return self._result


def transfer_state_dict(src_state_dict, dst_layouts, *, src_mesh, dst_mesh, async_op: bool = False):
    """Move a whole state dict of DTensors from ``src_mesh`` to ``dst_mesh`` (the meshes may
    share some ranks or none).

    Every rank of either mesh calls it. Source ranks pass ``src_state_dict`` ({name: DTensor
    on ``src_mesh``}), others None; destination ranks pass ``dst_layouts`` ({name: placements
    on ``dst_mesh``}, e.g. from the destination model's parameters), others None. The names,
    shapes and dtypes travel as JSON from the first rank of each side; then one plan per
    distinct (shape, dtype, layouts) and all transfers in one batch of point-to-point ops.
    Returns the destination's {name: DTensor} (None elsewhere), or with ``async_op`` a
    :class:`TransferHandle` whose ``wait()`` returns it, so a trainer can overlap the move
    with its next step: what the sources send is copied when the call returns, so their
    tensors may change right after."""
    from ._checks import check_bool, check_mesh
    from ._groups import new_group

    for arg, mesh in (("src_mesh", src_mesh), ("dst_mesh", dst_mesh)):
        check_mesh(mesh, arg, "transfer_state_dict")
    check_bool(async_op, "async_op", "transfer_state_dict")
    if not dist.is_initialized():
        raise ShardingError("transfer_state_dict needs the default process group: initialise it")
    me = dist.get_rank()
    src_ranks, dst_ranks = tuple(src_mesh.rank_list), tuple(dst_mesh.rank_list)
    ranks = tuple(sorted(set(src_ranks) | set(dst_ranks)))
    if me not in ranks:
        raise ShardingError(
            f"transfer_state_dict: rank {me} is in neither mesh ({ranks}): do not call it here"
        )
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if (src_mesh.device_type == "cuda")
        else torch.device(src_mesh.device_type)
    )
    problem = ""
    if me in src_ranks and not isinstance(src_state_dict, dict):
        problem = f"transfer_state_dict: rank {me} is a source: pass src_state_dict (a dict)"
    elif me not in src_ranks and src_state_dict is not None:
        problem = f"transfer_state_dict: rank {me} is not a source: pass src_state_dict=None"
    elif me in dst_ranks and not isinstance(dst_layouts, dict):
        problem = f"transfer_state_dict: rank {me} is a destination: pass dst_layouts (a dict)"
    elif me not in dst_ranks and dst_layouts is not None:
        problem = f"transfer_state_dict: rank {me} is not a destination: pass dst_layouts=None"
    else:
        problem = _side_problem(
            src_state_dict, dst_layouts, src_mesh, me in src_ranks, me in dst_ranks
        )
    _agree(ranks, problem, device)
    group = new_group(ranks)
    src_meta = None
    if me == src_ranks[0]:
        src_meta = {
            name: {
                "shape": list(t.shape),
                "dtype": str(t.dtype).removeprefix("torch."),
                "placements": [_encode(p) for p in t.placements],
            }
            for name, t in src_state_dict.items()
        }
    dst_meta = None
    if me == dst_ranks[0]:
        dst_meta = {
            name: [_encode(p) for p in (pl if isinstance(pl, (list, tuple)) else [pl])]
            for name, pl in dst_layouts.items()
        }
    src_meta = _broadcast_json(src_meta, src_ranks[0], group, device)
    dst_meta = _broadcast_json(dst_meta, dst_ranks[0], group, device)
    if sorted(src_meta) != sorted(dst_meta):
        missing = sorted(set(src_meta) ^ set(dst_meta))
        raise ShardingError(
            f"transfer_state_dict: the two sides name different tensors ({missing[:5]}): give "
            "dst_layouts one entry per source tensor"
        )
    plans = {}
    for name in sorted(src_meta):
        m = src_meta[name]
        plans[name] = plan_transfer(
            src_mesh,
            [_decode(p) for p in m["placements"]],
            dst_mesh,
            [_decode(p) for p in dst_meta[name]],
            m["shape"],
            _dtype(m["dtype"]),
        )
    problems = []
    if me in src_ranks and set(src_state_dict) != set(src_meta):
        problems.append(
            f"transfer_state_dict: rank {me}'s src_state_dict names other tensors than rank "
            f"{src_ranks[0]}'s: every source rank passes the same keys"
        )
    if me in dst_ranks and set(dst_layouts) != set(dst_meta):
        problems.append(
            f"transfer_state_dict: rank {me}'s dst_layouts names other tensors than rank "
            f"{dst_ranks[0]}'s: every destination rank passes the same keys"
        )
    locals_ = {n: _local_of(src_state_dict.get(n)) if me in src_ranks else None for n in plans}
    problems += [_problem(plans[n], locals_[n], me, f" ({n!r})") for n in plans]
    _agree(ranks, next((p for p in problems if p), ""), device, _fingerprint(*plans.values()))
    ops: list = []
    with torch.no_grad():  # the sends snapshot what they read: the caller may go on
        posted = {n: _post(plans[n], locals_[n], me, device, ops, group, async_op) for n in plans}
    requests = dist.batch_isend_irecv(ops) if ops else []

    def finish():
        if me not in dst_ranks:
            return None
        with torch.no_grad():
            return {n: _assemble(plans[n], me, *posted[n]) for n in plans}

    handle = TransferHandle(requests, finish, ops)
    return handle if async_op else handle.wait()


def _side_problem(src_state_dict, dst_layouts, src_mesh, is_src: bool, is_dst: bool) -> str:
    """What is wrong with this rank's side of a ``transfer_state_dict`` call ('' if nothing):
    checked on every rank before the first exchange."""
    from ._dtensor import DTensor
    from ._placement import Placement

    if is_src:
        for name, t in src_state_dict.items():
            if not isinstance(name, str):
                return f"transfer_state_dict: src_state_dict key {name!r} is not a str"
            if not isinstance(t, DTensor) or t.device_mesh != src_mesh:
                return (
                    f"transfer_state_dict: src_state_dict[{name!r}] is not a DTensor on "
                    "src_mesh: distribute it there first"
                )
    if is_dst:
        for name, pl in dst_layouts.items():
            items = pl if isinstance(pl, (list, tuple)) else [pl]
            if not isinstance(name, str) or not all(isinstance(p, Placement) for p in items):
                return (
                    f"transfer_state_dict: dst_layouts[{name!r}]={pl!r}: give a str key and a "
                    "list of placements such as [Shard(1)]"
                )
    return ""
