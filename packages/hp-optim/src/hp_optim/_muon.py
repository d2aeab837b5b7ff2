"""Muon with whole-matrix Newton-Schulz work spread over the ranks that hold the shards."""

from __future__ import annotations

import math

import torch

import hp_dtensor as hp
from hp_dtensor import DTensor

from ._checks import check_bool, check_int, check_number, check_params
from .errors import OptimError, OptimTypeError

__all__ = ["Muon", "zeropower_via_newtonschulz5", "orthogonalize"]


def zeropower_via_newtonschulz5(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Approximately orthogonalise a 2-D matrix (Keller Jordan's quintic Newton-Schulz)."""
    _check_matrix(g, "g", "zeropower_via_newtonschulz5")
    check_int(steps, "steps", "zeropower_via_newtonschulz5")
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.float()
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.T
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return (x.T if transposed else x).to(g.dtype)


def _check_matrix(g, arg: str, fn: str) -> None:
    if not isinstance(g, torch.Tensor):
        raise OptimTypeError(f"{fn}: {arg} is a {type(g).__name__}: give a 2-D tensor")
    if g.ndim != 2:
        raise OptimError(
            f"{fn}: {arg} has shape {tuple(g.shape)} ({g.ndim}-D): give a 2-D matrix "
            "(Newton-Schulz orthogonalises matrices only)"
        )
    if not (g.is_floating_point() or g.is_complex()):
        raise OptimError(f"{fn}: {arg} has dtype {g.dtype}: give a floating-point matrix")


def _coords(shape, index):
    out = []
    for s in reversed(shape):
        out.append(index % s)
        index //= s
    return tuple(reversed(out))


def orthogonalize(updates: list, steps: int = 5, *, naive: bool = False) -> list:
    """Newton-Schulz of each 2-D update (plain tensor or DTensor); returns local results.

    A sharded matrix needs its whole value. Instead of every rank all-gathering every matrix
    (``naive=True``: per rank, receive sum(M) (N-1)/N elements and run all K matrices), matrix
    ``j`` is owned by rank ``j mod N`` of its mesh: one all-to-all sends every rank's shards to
    the owners, each owner orthogonalises its whole matrices, one all-to-all returns every shard.
    Per rank that sends and receives about sum(M)(N-1)/N^2 elements each way (2 sum(M)/N in all,
    against sum(M)(N-1)/N for the naive all-gather) and runs K/N orthogonalisations instead of K,
    so communication and compute both shrink with N; two collectives per mesh, not per matrix.
    """
    fn = "orthogonalize"
    if isinstance(updates, torch.Tensor) or not isinstance(updates, (list, tuple)):
        raise OptimTypeError(
            f"{fn}: updates is a {type(updates).__name__}: give a list of 2-D tensors/DTensors"
        )
    for i, u in enumerate(updates):  # all checked before the first exchange
        _check_matrix(u, f"updates[{i}]", fn)
    check_int(steps, "steps", fn)
    check_bool(naive, "naive", fn)
    out: list = [None] * len(updates)
    by_mesh: dict = {}
    for i, u in enumerate(updates):
        if not isinstance(u, DTensor):
            out[i] = zeropower_via_newtonschulz5(u, steps)
        elif naive:
            full = zeropower_via_newtonschulz5(u.full_tensor(), steps)
            shape, off = u._spec.local_shape_and_offset()
            out[i] = full[off[0] : off[0] + shape[0], off[1] : off[1] + shape[1]]
        else:
            by_mesh.setdefault(u.device_mesh, []).append(i)
    for mesh, idx in by_mesh.items():  # one exchange each way per mesh, for all its matrices
        for i, o in zip(idx, _owner_orthogonalize_batch(mesh, [updates[i] for i in idx], steps)):
            out[i] = o
    return out


def _owner_orthogonalize_batch(mesh, us: list, steps: int) -> list:
    """Matrix j goes to owner j mod N: every rank sends all its shards in one all-to-all, owners
    orthogonalise whole matrices, one all-to-all sends every shard of the results back."""
    ranks = mesh.rank_list
    n = len(ranks)
    if n == 1:
        return [zeropower_via_newtonschulz5(u.to_local(), steps) for u in us]
    group = hp.new_group(ranks)
    slot = [torch.distributed.get_group_rank(group, r) for r in ranks]  # position -> group rank
    pos_of_slot = {s: k for k, s in enumerate(slot)}
    me = ranks.index(mesh.get_rank())
    pieces = [
        [
            hp.local_shape_and_offset(
                tuple(u.shape), mesh.shape, _coords(mesh.shape, k), u.placements
            )
            for k in range(n)
        ]
        for u in us
    ]
    owner = [j % n for j in range(len(us))]
    sample = us[0].to_local()
    # forward: to each owner (in group-rank order), my shards of the matrices it owns
    send, in_splits = [], []
    for s in range(n):
        k = pos_of_slot[s]
        chunk = [us[j].to_local().reshape(-1) for j in range(len(us)) if owner[j] == k]
        in_splits.append(sum(c.numel() for c in chunk))
        send.extend(chunk)
    out_splits = []
    for s in range(n):
        k = pos_of_slot[s]
        out_splits.append(sum(math.prod(pieces[j][k][0]) for j in range(len(us)) if owner[j] == me))
    recv = sample.new_empty(sum(out_splits))
    buf = torch.cat(send) if send else sample.new_empty(0)
    torch.distributed.all_to_all_single(recv, buf, out_splits, in_splits, group=group)
    # owners rebuild, orthogonalise, and cut the results per destination
    mine = [j for j in range(len(us)) if owner[j] == me]
    fulls = {j: sample.new_empty(tuple(us[j].shape)) for j in mine}
    off = 0
    for s in range(n):
        k = pos_of_slot[s]
        for j in mine:
            shp, o = pieces[j][k]
            m = math.prod(shp)
            if m:
                fulls[j][o[0] : o[0] + shp[0], o[1] : o[1] + shp[1]] = recv[off : off + m].view(shp)
            off += m
    results = {j: zeropower_via_newtonschulz5(fulls[j], steps) for j in mine}
    back, b_in = [], []
    for s in range(n):
        k = pos_of_slot[s]
        total = 0
        for j in mine:
            shp, o = pieces[j][k]
            if math.prod(shp):
                back.append(results[j][o[0] : o[0] + shp[0], o[1] : o[1] + shp[1]].reshape(-1))
                total += math.prod(shp)
        b_in.append(total)
    b_out = []
    for s in range(n):
        k = pos_of_slot[s]
        b_out.append(sum(math.prod(pieces[j][me][0]) for j in range(len(us)) if owner[j] == k))
    got = sample.new_empty(sum(b_out))
    torch.distributed.all_to_all_single(
        got, torch.cat(back) if back else sample.new_empty(0), b_out, b_in, group=group
    )
    res: list = [None] * len(us)
    off_by_slot = []
    acc = 0
    for s in range(n):
        off_by_slot.append(acc)
        acc += b_out[s]
    for s in range(n):
        k = pos_of_slot[s]
        off = off_by_slot[s]
        for j in range(len(us)):
            if owner[j] != k:
                continue
            shp = pieces[j][me][0]
            m = math.prod(shp)
            res[j] = got[off : off + m].view(shp)
            off += m
    return res


def _adjusted_lr(lr: float, shape, mode: str) -> float:
    rows, cols = shape
    if mode == "spectral":  # keep the update's RMS independent of the aspect ratio
        return lr * max(1.0, rows / cols) ** 0.5
    if mode == "match_rms_adamw":  # Moonlight: RMS 0.2, like AdamW's typical update
        return lr * 0.2 * math.sqrt(max(rows, cols))
    if mode == "none":
        return lr
    raise OptimError(f"adjust_lr={mode!r}: use 'spectral', 'match_rms_adamw' or 'none'")


class Muon(torch.optim.Optimizer):
    """Muon: momentum, then Newton-Schulz orthogonalisation of each 2-D update.

    Args:
        params: 2-D parameters only (chain with ``AdamW`` for embeddings, norms, biases and the
            head: ``ChainedOptimizer``); anything else raises ``OptimError``.
        lr, momentum, nesterov, ns_steps, weight_decay: as in the Muon paper/code.
        adjust_lr: "spectral" (default), "match_rms_adamw" or "none".

    Sharded (DTensor) matrices, by FSDP, TP or both, are orthogonalised whole by one owner rank
    each (see ``orthogonalize`` for the communication volume); the result equals Muon on the
    unsharded model.
    """

    def __init__(
        self,
        params,
        lr=0.02,
        momentum=0.95,
        nesterov=True,
        ns_steps=5,
        weight_decay=0.0,
        adjust_lr="spectral",
    ):
        fn = "Muon"
        check_params(params, fn)
        check_number(lr, "lr", fn, tensor_ok=True)
        check_number(momentum, "momentum", fn, high=1.0, high_open=True)
        check_bool(nesterov, "nesterov", fn)
        check_int(ns_steps, "ns_steps", fn)
        check_number(weight_decay, "weight_decay", fn)
        _adjusted_lr(1.0, (1, 1), adjust_lr)
        defaults = dict(
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            weight_decay=weight_decay,
            adjust_lr=adjust_lr,
        )
        super().__init__(params, defaults)
        for g in self.param_groups:
            for p in g["params"]:
                if p.ndim != 2:
                    raise OptimError(
                        f"Muon got a {p.ndim}-D parameter of shape {tuple(p.shape)}: give it only "
                        "2-D matrices and put the others in an AdamW (ChainedOptimizer)"
                    )
            _adjusted_lr(1.0, (1, 1), g["adjust_lr"])

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for g in self.param_groups:
            params = [p for p in g["params"] if p.grad is not None]
            updates = []
            for p in params:
                grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                st = self.state[p]
                if "momentum_buffer" not in st:
                    st["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = st["momentum_buffer"]
                lbuf = buf.to_local() if isinstance(buf, DTensor) else buf
                lbuf.mul_(g["momentum"]).add_(grad)
                u = grad.add(lbuf, alpha=g["momentum"]) if g["nesterov"] else lbuf.clone()
                if isinstance(p, DTensor):
                    u = DTensor.from_local(
                        u, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
                    )
                updates.append(u)
            for p, o in zip(params, orthogonalize(updates, g["ns_steps"])):
                local = p.to_local() if isinstance(p, DTensor) else p
                if g["weight_decay"]:
                    local.mul_(1 - g["lr"] * g["weight_decay"])
                local.add_(o, alpha=-_adjusted_lr(g["lr"], tuple(p.shape), g["adjust_lr"]))
        return loss
