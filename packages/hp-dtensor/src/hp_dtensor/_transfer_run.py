"""Running cross-mesh transfers, for every framework: a :class:`~hp_dtensor._transfer.TransferPlan`
carried out with batched point-to-point messages of exactly the planned boxes, through the
mesh's ``Platform`` (``batch_p2p``, ``all_reduce``, ``broadcast`` and the tensor factories), and
``transfer_state_dict`` for a whole model. What differs between frameworks stays in the
platforms: torch receives into slices of the output in place (its slices are views) and posts
one ``batch_isend_irecv``; MindSpore receives into buffers and, lacking point-to-point kernels
on CPU, sends each box as a two-rank broadcast in the plan's order. The autograd bindings of
the redistribution between two meshes over the same ranks is ``_transfer_torch``'s (torch
only, for now: MindSpore's DTensor refuses another mesh in ``redistribute``)."""

from __future__ import annotations

import hashlib

import numpy as np

from ._backend import get_platform
from ._json_comm import broadcast_json
from ._placement import Partial, Replicate, Shard, normalize_placements
from ._shard_math import local_shape_and_offset
from ._spec import DTensorSpec
from ._transfer import TransferPlan, _Side, plan_transfer
from .errors import HPDTensorTypeError, ShardingError

__all__ = ["TransferHandle", "across_mesh_plans", "run_transfer", "transfer_state_dict"]


def _index(base, offset, size) -> tuple[slice, ...]:
    """The slices of a piece starting at ``base`` (global) that hold the box (offset, size)."""
    return tuple(slice(o - b, o - b + s) for o, s, b in zip(offset, size, base))


def _coordinate(mesh, rank: int) -> tuple[int, ...]:
    return _Side(tuple(mesh.rank_list), tuple(mesh.shape), ()).coordinate(rank)


def _box(plan: TransferPlan, mesh, placements, rank: int):
    """(size, offset) of ``rank``'s piece on ``mesh``."""
    return local_shape_and_offset(plan.shape, mesh.shape, _coordinate(mesh, rank), placements)


def _platform(mesh):
    return get_platform(mesh.device_type)


def _device(mesh, local=None):
    """Where this rank's new tensors go: its piece's device, else the current device of the
    mesh's device type (torch; nothing is set current here); MindSpore places tensors by its
    context."""
    if mesh.framework != "torch":
        return mesh.device_type
    import torch

    if isinstance(local, torch.Tensor):
        return local.device
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _is_dtensor(x) -> bool:
    return isinstance(getattr(x, "_spec", None), DTensorSpec) and hasattr(x, "to_local")


def _local_of(local):
    return local.to_local() if _is_dtensor(local) else local


def _fingerprint(*plans: TransferPlan) -> int:
    """A number every rank computes alike from the plans' shapes, dtypes, layouts and ranks."""
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


def _agree(platform, ranks, problem: str, device, fingerprint: int = 0) -> None:
    """Every one of ``ranks`` learns whether any rank's arguments are wrong, or whether the
    ranks hold different plans (``fingerprint``), and all raise: one all-reduce, before any
    transfer."""
    from ._groups import new_group

    me = platform.get_rank()
    flags = np.zeros(len(ranks) + 2, dtype=np.int64)
    if problem:
        flags[ranks.index(me)] = 1
    flags[-2], flags[-1] = fingerprint, -fingerprint
    t = platform.from_numpy(flags, device)
    platform.all_reduce(t, "max", new_group(list(ranks)))
    values = platform.to_numpy(t).tolist()
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


def _problem(platform, plan: TransferPlan, local, me: int, what: str = "") -> str:
    """What is wrong with this rank's ``local`` for ``plan`` ('' if nothing)."""
    unsupported = platform.dtype_problem(plan.dtype, plan.src_mesh.device_type)
    if unsupported:
        return f"TransferPlan.run{what}: {unsupported}"
    if me in plan.src_mesh.rank_list:
        size, _ = _box(plan, plan.src_mesh, plan.src_placements, me)
        device_type = platform.tensor_device_type(local)
        if device_type is None:
            return (
                f"TransferPlan.run{what}: rank {me} is in the source mesh and passed "
                f"{type(local).__name__}: pass its local piece, a {plan.src_mesh.framework} "
                "tensor"
            )
        if device_type != plan.src_mesh.device_type:
            return (
                f"TransferPlan.run{what}: rank {me}'s piece is on {device_type!r}; the source "
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


def _post(platform, plan: TransferPlan, local, me: int, device, sends, recvs, snapshot: bool):
    """Append this rank's sends and receives of ``plan`` to ``sends`` / ``recvs`` and put its
    local parts in place. Returns (out, parts): a destination rank's output piece (None
    elsewhere) and the parts still to add or copy into it, in plan order (transfer, buffer).
    With ``snapshot`` every send and local part is a copy, so the caller may change its
    tensors before the transfer finishes."""
    base = None
    if me in plan.src_mesh.rank_list:
        _, base = _box(plan, plan.src_mesh, plan.src_placements, me)
    out = d_base = None
    if me in plan.dst_mesh.rank_list:
        d_size, d_base = _box(plan, plan.dst_mesh, plan.dst_placements, me)
        # the boxes tile the piece exactly: nothing to zero unless contributions are summed
        alloc = platform.zeros if plan.reduce else platform.empty
        out = alloc(tuple(d_size), plan.dtype, device)
    parts = []
    for t in plan.transfers:
        if t.src == me:
            region = local[_index(base, t.offset, t.size)]
            if t.dst == me:  # put in place once the messages are done, in plan order
                parts.append((t, platform.clone(region) if snapshot else region))
                continue
            piece = region.contiguous() if platform.slices_are_views else region
            if snapshot and piece is region:  # still the caller's memory
                piece = platform.clone(piece)
            sends.append((piece, t.dst))
        elif t.dst == me:
            if not plan.reduce and platform.slices_are_views:
                view = out[_index(d_base, t.offset, t.size)]
                if view.is_contiguous():  # received in place: no copy
                    recvs.append((view, t.src))
                    continue
            buf = platform.empty(tuple(t.size), plan.dtype, device)
            recvs.append((buf, t.src))
            parts.append((t, buf))
    return out, parts


def _assemble(plan: TransferPlan, me: int, out, parts):
    """This destination rank's DTensor: ``out`` with ``parts`` (all arrived) added, in plan
    order, or copied in."""
    from ._dtensor import DTensor

    _, d_base = _box(plan, plan.dst_mesh, plan.dst_placements, me)
    platform = _platform(plan.dst_mesh)
    for t, buf in parts:
        idx = _index(d_base, t.offset, t.size)
        if not plan.reduce:
            out[idx] = buf
        elif platform.slices_are_views:
            out[idx].add_(buf)
        else:
            out[idx] = out[idx] + buf
    return DTensor.from_local(
        out, plan.dst_mesh, plan.dst_placements, run_check=False, shape=plan.shape
    )


def _no_grad(platform):
    """torch's no_grad where the platform is torch's (the copies into the output are not part
    of any graph); MindSpore records nothing outside ``value_and_grad``."""
    if platform.framework == "torch":
        import torch

        return torch.no_grad()
    import contextlib

    return contextlib.nullcontext()


def run_transfer(plan: TransferPlan, local):
    """Run ``plan`` on this rank (see ``TransferPlan.run``)."""
    platform = _platform(plan.src_mesh)
    if not platform.is_initialized():
        raise ShardingError("TransferPlan.run needs the default process group: initialise it")
    me = platform.get_rank()
    if me not in plan.ranks:
        raise ShardingError(
            f"TransferPlan.run: rank {me} is in neither mesh ({plan.ranks}): do not call it here"
        )
    from ._groups import new_group

    local = _local_of(local)
    device = _device(plan.dst_mesh, local)
    _agree(platform, plan.ranks, _problem(platform, plan, local, me), device, _fingerprint(plan))
    sends: list = []
    recvs: list = []
    with _no_grad(platform):
        out, parts = _post(platform, plan, local, me, device, sends, recvs, False)
        for r in platform.batch_p2p(sends, recvs, new_group(list(plan.ranks))):
            r.wait()
        if me not in plan.dst_mesh.rank_list:
            return None
        return _assemble(plan, me, out, parts)


def across_mesh_plans(spec: DTensorSpec, device_mesh, placements):
    """(plan, back, dst_placements, grad_placements) for moving a DTensor of ``spec`` to
    ``device_mesh`` (the same ranks as its mesh, in another shape or order) with
    ``placements``: the forward plan, the plan that brings the gradient back, and the
    placements the gradient has on the source (a pending sum's gradient is the same
    everywhere: it goes back replicated there)."""
    if set(device_mesh.rank_list) != set(spec.mesh.rank_list):
        raise ShardingError(
            f"redistribute: device_mesh={device_mesh} holds other ranks than this tensor's mesh "
            f"{spec.mesh}: use plan_transfer(...).run for meshes over different ranks"
        )
    if placements is None:
        raise HPDTensorTypeError("redistribute: placements is required with another mesh")
    dst_pl = normalize_placements(placements, device_mesh.ndim, len(spec.shape))
    plan = plan_transfer(spec.mesh, spec.placements, device_mesh, dst_pl, spec.shape, spec.dtype)
    back_pl = tuple(Replicate() if isinstance(p, Partial) else p for p in spec.placements)
    back = plan_transfer(device_mesh, dst_pl, spec.mesh, back_pl, spec.shape, spec.dtype)
    return plan, back, dst_pl, back_pl


# --------------------------------------------------------------------------------------------
# whole state dicts
# --------------------------------------------------------------------------------------------


def _encode(p) -> str:
    if isinstance(p, Partial):
        return f"P:{p.reduce_op}"
    return "R" if isinstance(p, Replicate) else f"S{p.dim}"


def _decode(text: str):
    if text.startswith("P:"):
        return Partial(text[2:])
    return Replicate() if text == "R" else Shard(int(text[1:]))


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.").lower()


def _dtype(platform, name: str):
    """The platform's dtype called ``name`` (read as data: only dtypes are accepted)."""
    value = platform.dtype_from_name(name)
    if value is None:
        raise ShardingError(
            f"transfer_state_dict: dtype {name!r} is not a {platform.framework} dtype"
        )
    return value


class TransferHandle:
    """A state-dict transfer in flight (``transfer_state_dict(..., async_op=True)``): the
    sends and receives are posted; ``wait()`` finishes them and returns the destination's
    state dict (None on ranks outside the destination mesh)."""

    def __init__(self, requests, finish, buffers=()) -> None:
        self._requests, self._finish, self._result, self._done = requests, finish, None, False
        self._buffers = buffers  # the tensors in flight stay alive until wait()

    def wait(self):
        """Block until every transfer of this rank is done; the destination state dict."""
        if not self._done:
            for r in self._requests:
                r.wait()
            self._result, self._done = self._finish(), True
            self._buffers = ()
        return self._result


def transfer_state_dict(src_state_dict, dst_layouts, *, src_mesh, dst_mesh, async_op: bool = False):
    """Move a whole state dict of DTensors from ``src_mesh`` to ``dst_mesh`` (the meshes may
    share some ranks or none; torch or MindSpore, the same on both).

    Every rank of either mesh calls it. Source ranks pass ``src_state_dict`` ({name: DTensor
    on ``src_mesh``}), others None; destination ranks pass ``dst_layouts`` ({name: placements
    on ``dst_mesh``}, e.g. from the destination model's parameters), others None. The names,
    shapes and dtypes travel as JSON from the first rank of each side; then one plan per
    distinct (shape, dtype, layouts) and all transfers in one batch of point-to-point ops.
    Returns the destination's {name: DTensor} (None elsewhere), or with ``async_op`` a
    :class:`TransferHandle` whose ``wait()`` returns it, so a trainer can overlap the move
    with its next step: what the sources send is copied when the call returns, so their
    tensors may change right after. (On MindSpore the messages run when posted: the handle
    is already done.)"""
    from ._checks import check_bool, check_mesh
    from ._groups import new_group

    for arg, mesh in (("src_mesh", src_mesh), ("dst_mesh", dst_mesh)):
        check_mesh(mesh, arg, "transfer_state_dict")
    check_bool(async_op, "async_op", "transfer_state_dict")
    if src_mesh.framework != dst_mesh.framework or src_mesh.device_type != dst_mesh.device_type:
        raise ShardingError(
            f"transfer_state_dict: src_mesh holds {src_mesh.framework} tensors on "
            f"{src_mesh.device_type!r}, dst_mesh {dst_mesh.framework} ones on "
            f"{dst_mesh.device_type!r}: a transfer stays within one framework and device type"
        )
    platform = _platform(src_mesh)
    if not platform.is_initialized():
        raise ShardingError("transfer_state_dict needs the default process group: initialise it")
    me = platform.get_rank()
    src_ranks, dst_ranks = tuple(src_mesh.rank_list), tuple(dst_mesh.rank_list)
    ranks = tuple(sorted(set(src_ranks) | set(dst_ranks)))
    if me not in ranks:
        raise ShardingError(
            f"transfer_state_dict: rank {me} is in neither mesh ({ranks}): do not call it here"
        )
    device = _device(dst_mesh)
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
    _agree(platform, ranks, problem, device)
    group = new_group(list(ranks))
    src_meta = None
    if me == src_ranks[0]:
        src_meta = {
            name: {
                "shape": list(t.shape),
                "dtype": _dtype_name(t.dtype),
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
    src_meta = broadcast_json(src_meta, src_ranks[0], group, device=device, platform=platform)
    dst_meta = broadcast_json(dst_meta, dst_ranks[0], group, device=device, platform=platform)
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
            _dtype(platform, m["dtype"]),
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
    problems += [_problem(platform, plans[n], locals_[n], me, f" ({n!r})") for n in plans]
    _agree(
        platform, ranks, next((p for p in problems if p), ""), device, _fingerprint(*plans.values())
    )
    sends: list = []
    recvs: list = []
    with _no_grad(platform):  # the sends snapshot what they read: the caller may go on
        posted = {
            n: _post(platform, plans[n], locals_[n], me, device, sends, recvs, async_op)
            for n in plans
        }
    requests = platform.batch_p2p(sends, recvs, group)

    def finish():
        if me not in dst_ranks:
            return None
        with _no_grad(platform):
            return {n: _assemble(plans[n], me, *posted[n]) for n in plans}

    handle = TransferHandle(requests, finish, (sends, recvs))
    return handle if async_op else handle.wait()


def _side_problem(src_state_dict, dst_layouts, src_mesh, is_src: bool, is_dst: bool) -> str:
    """What is wrong with this rank's side of a ``transfer_state_dict`` call ('' if nothing):
    checked on every rank before the first exchange."""
    from ._placement import Placement

    if is_src:
        for name, t in src_state_dict.items():
            if not isinstance(name, str):
                return f"transfer_state_dict: src_state_dict key {name!r} is not a str"
            if not _is_dtensor(t) or t.device_mesh != src_mesh:
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
