"""One ``fully_shard`` parameter group: flat all-gather, swap-in, reshard, reduce-scatter."""

from __future__ import annotations

import contextlib
import itertools
import weakref

import torch
import torch.nn as nn
from torch.autograd import Variable

import hp_dtensor as hp
from hp_dtensor import DTensor, Shard

__all__ = ["ParamGroup"]

_COUNTER = itertools.count()
_PENDING: list = []  # groups whose backward started; reduced at the end of backward
_FORWARD_ORDER: list = []  # groups in the order their forward ran (for backward prefetch)
_LAUNCHED: list = []  # groups whose reduce-scatter started in this backward, in order


def _preserve_version(t: torch.Tensor):
    """Refilling an unsharded parameter must not look like an in-place change to autograd."""
    return torch.autograd._unsafe_preserve_version_counter(t)


class _Entry:
    __slots__ = (
        "module",
        "name",
        "fqn",
        "sharded",
        "unsharded",
        "shape",
        "rest",
        "chunk",
        "padded",
        "rows",
        "inner",
        "dim",
        "places",
    )

    def __init__(
        self, module, name, fqn, sharded: nn.Parameter, shape, n, inner=None, dim=0, aliases=()
    ):
        self.module, self.name, self.fqn, self.sharded = module, name, fqn, sharded
        #: every (module, attribute) holding this parameter (tied weights share one entry)
        self.places = [(module, name)] + list(aliases)
        #: the sharded dim; the flat-buffer arithmetic below sees it moved to the front
        self.dim = dim
        if dim:
            shape = (shape[dim],) + tuple(s for i, s in enumerate(shape) if i != dim)
        self.unsharded: nn.Parameter | None = None
        #: for a parameter already sharded by tensor parallelism: (tp mesh, tp placements,
        #: global shape); ``shape`` is then this rank's tensor-parallel piece
        self.inner = inner
        self.shape = tuple(shape)
        self.rest = 1
        for s in self.shape[1:]:
            self.rest *= s
        self.chunk = -(-self.shape[0] // n) if self.shape[0] else 0
        self.padded = self.chunk * self.rest
        self.rows = sharded.to_local().shape[dim]


class ParamGroup:
    """State of one ``fully_shard`` call (see ``hp_fsdp._api``)."""

    def __init__(
        self,
        module,
        mesh,
        entries,
        placements,
        reshard_after_forward,
        mp,
        offload=None,
        dims=None,
        aliases=None,
    ):
        self.index = next(_COUNTER)
        self.module = module
        self.mesh = mesh
        self.device = mesh.device  # where unsharded parameters and collectives live
        self.offload = offload
        self.shard_dim = mesh.ndim - 1
        self.rep_dim = 0 if mesh.ndim == 2 else None
        self.n = mesh.shape[self.shard_dim]
        self.mp = mp
        self.platform = hp.get_platform(mesh.device_type)
        self.entries: list[_Entry] = []
        self.orig_ids = {id(p) for _s, _n, _f, p in entries}  # the tensors this group replaced
        for sub, pname, fqn, p in entries:
            if isinstance(p, DTensor):  # tensor parallel inside: shard its local piece further
                sp, inner = self._shard_tp_param(p, fqn)
                shape = p.to_local().shape
            else:
                k = (dims or {}).get(id(p), 0)
                pl = [Shard(k) if isinstance(q, Shard) else q for q in placements]
                dt = hp.distribute_tensor(p.detach(), mesh, pl, src_data_rank=None)
                sp, inner, shape = nn.Parameter(dt, requires_grad=p.requires_grad), None, p.shape
            if offload is not None:  # sharded parameter (and so grads, optimizer states) on CPU
                sp = self._to_cpu(sp, offload.pin_memory)
            more = (aliases or {}).get(id(p), [])
            for m, nm in [(sub, pname)] + more:
                m._parameters[nm] = sp
            k = (dims or {}).get(id(p), 0) if inner is None else 0
            self.entries.append(_Entry(sub, pname, fqn, sp, shape, self.n, inner, k, more))
        self.orig_dtype = self.entries[0].sharded.dtype if self.entries else torch.float32
        self.param_dtype = mp.param_dtype or self.orig_dtype
        self.reduce_dtype = mp.reduce_dtype or self.param_dtype
        # None (the default): reshard after forward unless this is the root group, whose
        # parameters backward needs first (as FSDP2 does); True/False/int: as given
        self.auto_raf = reshard_after_forward is None
        if reshard_after_forward is None:
            reshard_after_forward = True
        self.is_root = True  # until fully_shard is applied to a module containing this one
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_backward = True
        self.sync = True
        self.grad_scale = 1.0
        self.forward_prefetch: list[ParamGroup] = []
        self.backward_prefetch: list[ParamGroup] = []
        self.is_last_backward = True
        self.unsharded = False
        self.swapped_in = False
        self._ag = None  # a started all-gather: (work, recv, send, total, device)
        self._pf = None  # this rank's post-forward shard when resharding to a smaller group
        self.raf_k = None
        if not isinstance(reshard_after_forward, bool):
            k = int(reshard_after_forward)
            ranks = hp.get_process_group_ranks(mesh._groups[self.shard_dim])
            me = mesh.get_local_rank(self.shard_dim)
            first = (me // k) * k
            self.raf_k, self.raf_index = k, me - first
            self.raf_group = hp.new_group(ranks[first : first + k])
            self.reshard_after_forward = True
        self.total = sum(e.padded for e in self.entries)  # elements per rank in the flat buffers
        # NCCL averages inside the collective (as FSDP2 does): no separate pass dividing the
        # reduced shard afterwards; other libraries (gloo has no AVG) sum and then divide
        self.avg_in_collective = all(
            self.platform.group_backend(mesh._groups[d]) == "nccl" for d in range(mesh.ndim)
        )
        self._rs = None  # a started reduce-scatter: (work, out, send, has-grad mask)
        self._rs_event = None
        self._ar = None  # HSDP all-reduce: None (not started), True (none needed), or its work
        self._fwd_calls = 0  # forward calls (with grad) since the last backward
        self._kept = False  # the root kept its unsharded parameters after forward
        self._left = 0  # of those, module backwards not yet finished in this backward
        _ALIVE.add(self)

    @staticmethod
    def _to_cpu(sp: nn.Parameter, pin: bool) -> nn.Parameter:
        local = sp.to_local().detach().to("cpu")
        if pin and torch.cuda.is_available():
            local = local.pin_memory()
        dt = DTensor.from_local(
            local, sp.device_mesh, sp.placements, shape=sp.shape, stride=sp.stride()
        )
        return nn.Parameter(dt, requires_grad=sp.requires_grad)

    def _shard_tp_param(self, p: DTensor, fqn: str):
        """A (tp-sharded) DTensor parameter, sharded further on dim 0 over the data-parallel
        mesh: a DTensor on the (tp, dp) mesh with placements (tp placement, Shard(0)) -- the
        tensor-parallel split first, then each tp piece split over dp."""
        from hp_dtensor import DeviceMesh

        tp_mesh, dp_mesh = p.device_mesh, self.mesh
        key = (tp_mesh, dp_mesh)
        mesh2 = _TP_DP_MESHES.get(key)
        if mesh2 is None:
            grid = _tp_dp_grid(tp_mesh, dp_mesh)
            names = ((tp_mesh.mesh_dim_names or ("tp",))[0], (dp_mesh.mesh_dim_names or ("dp",))[0])
            mesh2 = DeviceMesh(tp_mesh.device_type, grid, mesh_dim_names=names)
            _TP_DP_MESHES[key] = mesh2
        local = p.to_local().detach()
        length, start = hp.chunk_size_and_offset(
            local.shape[0], dp_mesh.size(), dp_mesh.get_local_rank()
        )
        piece = local.narrow(0, start, length).clone()
        dt = DTensor.from_local(
            piece, mesh2, (p.placements[0], hp.Shard(0)), shape=p.shape, stride=p.stride()
        )
        return nn.Parameter(dt, requires_grad=p.requires_grad), (tp_mesh, p.placements, p.shape)

    # -- queries -----------------------------------------------------------------------------
    def sharded_params(self) -> list[nn.Parameter]:
        return [e.sharded for e in self.entries]

    def refresh_params(self) -> None:
        """Pick up parameters replaced in the module (``load_state_dict(assign=True)``)."""
        self.discard_prefetch()
        for e in self.entries:
            e.sharded = e.module._parameters[e.name]
            for m, nm in e.places[1:]:
                m._parameters[nm] = e.sharded
            e.unsharded = None
        self.unsharded = False

    def discard_prefetch(self) -> None:
        """Drop an all-gather started for a backward or forward that did not use it (its values
        would be stale after the optimizer step)."""
        if self._ag is not None:
            work = self._ag[0]
            self._ag = None
            if work is not None:
                work.wait()

    # -- all-gather ------------------------------------------------------------------------------
    def unshard(self, async_op: bool = False, *, in_pass: bool = False) -> None:
        """All-gather every parameter of the group as one flat buffer (copy-in, one collective,
        copy-out). With ``async_op`` the collective is only started; ``wait_unshard`` (called
        by the next forward/backward of the group) finishes it: that is how prefetching
        overlaps the next group's all-gather with this group's compute.

        ``in_pass``: called by the hooks inside a forward/backward pass whose first
        all-gather already ordered the all-gather stream after the last update of the sharded
        parameters (the optimizer step); then the copy-in does not wait for the compute
        stream again, so all-gathers run ahead of compute, as far as prefetching allows."""
        if self._pf is not None and not self.unsharded:  # resharded to a smaller group
            self._unshard_from_post_forward()
            return
        if self.unsharded or self._ag is not None or not self.entries:
            if not async_op:
                self.wait_unshard()
            return
        dev = self.device
        total = self.total
        stream = _side_stream(dev, "all_gather", follow=not (in_pass and dev in _AG_ORDERED))
        _AG_ORDERED.add(dev)
        with _on(stream):
            # copy-in straight into this rank's slot of the output: one cast-copy per parameter
            # and an in-place collective (no separate send buffer, no self-copy); on CUDA this
            # runs on a side stream, so a prefetch overlaps the current group's compute
            recv = torch.empty(self.n * total, dtype=self.param_dtype, device=dev)
            me = self.mesh.get_local_rank(self.shard_dim)
            send = recv[me * total : (me + 1) * total]
            off = 0
            dsts, srcs = [], []
            with torch.no_grad():
                for e in self.entries:
                    loc = e.sharded.to_local()
                    if e.dim:
                        loc = loc.movedim(e.dim, 0)
                    k = loc.numel()
                    if k:
                        dsts.append(send[off : off + k])
                        srcs.append(loc.reshape(-1))
                    if k < e.padded:
                        send[off + k : off + e.padded].zero_()
                    off += e.padded
                # one multi-tensor launch for all parameters (cast included), not one each;
                # none when this rank holds no rows of any of them
                if dsts:
                    torch._foreach_copy_(dsts, srcs, non_blocking=True)
            work = self.platform.all_gather_into(
                recv, send, self.mesh._groups[self.shard_dim], async_op=True
            )
            event = _record(stream)
        self._ag = (work, recv, send, total, dev, event)
        if not async_op:
            self.wait_unshard()

    def wait_unshard(self) -> None:
        """Finish a started all-gather: wait, then copy out into the unsharded parameters."""
        if self._ag is None:
            return
        work, recv, _send, total, dev, event = self._ag
        self._ag = None
        _wait(event, recv)
        if work is not None:
            work.wait()
        self._copy_out(recv.view(self.n, total), self.n, dev)
        self.unsharded = True

    def _copy_out(self, recv, n: int, dev) -> None:
        """Copy a gathered flat buffer ``(n, total)`` (each parameter split in ``n`` chunks on
        its sharded dim) into the unsharded parameters."""
        if self._copy_out_fused(recv, n, dev):
            return
        off = 0
        for e in self.entries:
            chunk = -(-e.shape[0] // n) if e.shape[0] else 0
            padded = chunk * e.rest
            src = recv[:, off : off + padded]
            off += padded
            t = self._fresh_unsharded(e, dev)
            with torch.no_grad(), _preserve_version(t):
                # the flat layout has the sharded dim first; other dims go through a buffer
                dst = t if not e.dim else torch.empty(e.shape, dtype=t.dtype, device=t.device)
                flat = dst.view(-1)
                if e.shape[0] == n * chunk:  # even: one strided copy
                    flat.view(n, padded).copy_(src)
                else:  # uneven: each rank's rows
                    for r in range(n):
                        rows, start = hp.chunk_size_and_offset(e.shape[0], n, r)
                        if rows:
                            k = rows * e.rest
                            flat[start * e.rest : start * e.rest + k].copy_(src[r, :k])
                if e.dim:
                    t.copy_(dst.movedim(0, e.dim))

    def _fresh_unsharded(self, e, dev) -> torch.Tensor:
        """The local tensor of ``e``'s unsharded parameter, with storage, created once."""
        if e.unsharded is None:
            t = torch.empty(_unmoved(e.shape, e.dim), dtype=self.param_dtype, device=dev)
            if e.inner is not None:
                tp_mesh, tp_pl, gshape = e.inner
                t = DTensor.from_local(t, tp_mesh, tp_pl, shape=gshape)
            e.unsharded = nn.Parameter(t, requires_grad=e.sharded.requires_grad)
        elif e.unsharded.requires_grad != e.sharded.requires_grad:  # (un)frozen since
            e.unsharded.requires_grad_(e.sharded.requires_grad)
        t = _local(e.unsharded)
        nbytes = t.numel() * t.element_size()
        if t.untyped_storage().size() != nbytes:
            t.untyped_storage().resize_(nbytes)
        return t

    def _copy_out_fused(self, recv, n: int, dev) -> bool:
        """Copy-out as one ``split_with_sizes_copy`` launch when every parameter is sharded
        evenly on dim 0 (the usual case); False to take the per-parameter path."""
        if not self.entries or any(
            e.dim or e.shape[0] != n * e.chunk or not e.padded for e in self.entries
        ):
            return False
        outs = [self._fresh_unsharded(e, dev) for e in self.entries]
        with contextlib.ExitStack() as stack, torch.no_grad():
            for t in outs:
                stack.enter_context(_preserve_version(t))
            torch.split_with_sizes_copy(
                recv,
                [e.padded for e in self.entries],
                dim=1,
                out=[t.view(n, e.padded) for t, e in zip(outs, self.entries)],
            )
        return True

    # -- resharding to a smaller group after forward ------------------------------------
    def _keep_post_forward_shard(self) -> None:
        """``reshard_after_forward=k``: keep this rank's 1/k of every parameter (split within
        its sub-group of k consecutive ranks) and free the rest; backward gathers inside the
        sub-group (e.g. within a node) instead of the whole shard group."""
        k, j = self.raf_k, self.raf_index
        pieces = []
        for e in self.entries:
            t = _local(e.unsharded).detach()
            if e.dim:
                t = t.movedim(e.dim, 0)
            chunk = -(-e.shape[0] // k) if e.shape[0] else 0
            rows, start = hp.chunk_size_and_offset(e.shape[0], k, j)
            piece = t.narrow(0, start, rows).reshape(-1)
            if rows < chunk:
                piece = torch.cat([piece, piece.new_zeros((chunk - rows) * e.rest)])
            pieces.append(piece)
        self._pf = torch.cat(pieces) if pieces else None
        self.free_unsharded()

    def _unshard_from_post_forward(self) -> None:
        send, self._pf = self._pf, None
        recv = torch.empty(self.raf_k * send.numel(), dtype=send.dtype, device=send.device)
        self.platform.all_gather_into(recv, send, self.raf_group)
        self._copy_out(recv.view(self.raf_k, send.numel()), self.raf_k, send.device)
        self.unsharded = True

    def free_unsharded(self) -> None:
        """Release the unsharded storage (the tensors stay, for autograd to refill later)."""
        self._kept = False
        for e in self.entries:
            if e.unsharded is not None:
                _local(e.unsharded).untyped_storage().resize_(0)
        self.unsharded = False

    def swap_in(self) -> None:
        for e in self.entries:
            for m, nm in e.places:
                m._parameters[nm] = e.unsharded
        self.swapped_in = True

    def swap_out(self) -> None:
        for e in self.entries:
            for m, nm in e.places:
                m._parameters[nm] = e.sharded
        self.swapped_in = False

    def reshard(self) -> None:
        if self.swapped_in:
            self.swap_out()
        self.discard_prefetch()
        self._pf = None
        self.free_unsharded()

    # -- hooks -------------------------------------------------------------------------------
    def register_hooks(self) -> None:
        self.module.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
        self.module.register_forward_hook(self._post_forward)

    def _pre_forward(self, module, args, kwargs):
        if (
            self.is_root
            or not torch.is_grad_enabled()
            or not _FORWARD_ORDER
            or self in _FORWARD_ORDER
        ):
            # the first forward of a pass (every root's forward starts one): the sharded
            # parameters may have changed since the last all-gather (optimizer step, loading),
            # so the next all-gather waits for the compute stream
            _AG_ORDERED.clear()
        if self._kept:  # kept after a forward whose backward never came: gather afresh
            self.free_unsharded()
        self.unshard(in_pass=True)
        self.swap_in()
        for g in self.forward_prefetch:
            g.unshard(async_op=True, in_pass=True)
        if self.mp.param_dtype is not None and self.mp.cast_forward_inputs:
            args, kwargs = _tree_map_tensors(
                lambda t: (
                    t.to(self.param_dtype)
                    if t.is_floating_point() and t.dtype != self.param_dtype
                    else t
                ),
                (args, kwargs),
            )
        if torch.is_grad_enabled():
            if self in _FORWARD_ORDER:  # a new forward pass (no backward in between)
                _FORWARD_ORDER.clear()
            _FORWARD_ORDER.append(self)
            self._fwd_calls += 1
            # when gradients reach this call's inputs, the module's backward is done (the
            # parameters' gradient accumulation runs first): the same moment on every rank
            args, kwargs = _hook_inputs(self, args, kwargs)
        return args, kwargs

    def _post_forward(self, module, args, out):
        self.swap_out()
        tensors = []
        if torch.is_grad_enabled():
            tensors = [
                t
                for t in torch.utils._pytree.tree_leaves(out)
                if isinstance(t, torch.Tensor) and t.requires_grad
            ]
        if self.raf_k is not None and torch.is_grad_enabled():
            self._keep_post_forward_shard()
        elif self.reshard_after_forward:
            if self.auto_raf and self.is_root and tensors:
                # the root keeps its parameters for the backward that comes next; if none
                # comes, the next forward drops them first (the sharded ones may have changed)
                self._kept = True
            else:
                self.free_unsharded()
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, self._pre_backward, mode="any")
        if self.mp.output_dtype is not None:
            dt = self.mp.output_dtype
            out = _tree_map_tensors(lambda t: t.to(dt) if t.is_floating_point() else t, out)
        return out

    def _pre_backward(self, grad):
        if self._pf is not None:
            self._unshard_from_post_forward()
        self.unshard(in_pass=True)
        # the module holds its unsharded parameters during its backward, as during forward:
        # activation checkpointing runs the forward again in there
        self.swap_in()
        prefetch = self.backward_prefetch
        if not prefetch and self in _FORWARD_ORDER:
            # implicitly: the group whose forward ran just before this one's
            k = _FORWARD_ORDER.index(self)
            prefetch = [_FORWARD_ORDER[k - 1]] if k > 0 else []
        for g in prefetch:
            g.unshard(async_op=True, in_pass=True)
        if not _PENDING:
            Variable._execution_engine.queue_callback(_end_of_backward)
        if self not in _PENDING:
            self._left = self._fwd_calls
            _PENDING.append(self)

    def module_backward_done(self) -> None:
        """Gradients reached the inputs of one forward call of the module; after the last one
        every parameter gradient of the group is accumulated: start the reduce-scatter now, so
        it runs while backward computes the earlier groups."""
        self._left -= 1
        if self._left == 0 and self.swapped_in:
            self.swap_out()
        if self._left == 0 and self.sync and self in _PENDING and self._rs is None:
            self._start_reduce()
            if self.reshard_after_backward:
                self.free_unsharded()

    # -- reduce-scatter --------------------------------------------------------------------
    def post_backward(self) -> None:
        """End of backward: finish (or do) the reduction, then reshard."""
        if self.swapped_in:
            self.swap_out()
        if self.sync and self.entries:
            if self._rs is None:
                self._start_reduce()
            self._finish_reduce()
        self._fwd_calls = 0
        self._kept = False  # the backward it was kept for has run
        if self.reshard_after_backward:
            self.free_unsharded()

    def _start_reduce(self) -> None:
        dev = self.device
        total = self.total
        # copy-in: each gradient goes straight into its column of the (ranks, total) buffer,
        # cast to reduce_dtype by the same copy. Which parameters have a gradient here is
        # appended to every rank's segment, so the reduction also tells each rank where some
        # rank had one (frozen or unused parameters keep None), with no collective of its own
        has = [
            e.unsharded is not None and _local(e.unsharded).grad is not None for e in self.entries
        ]
        n_params = len(self.entries)
        stream = _side_stream(dev, "reduce_scatter")
        with _on(stream):
            work, out, send, has = self._pack_and_reduce(dev, total, has, n_params, stream)
            event = _record(stream)
        self._rs_event = event
        self._rs = (work, out, send, has)
        self._ar = None
        _LAUNCHED.append(self)

    def _pack_and_reduce(self, dev, total, has, n_params, stream):
        """Copy gradients into the (ranks, total + flags) buffer and start the reduce-scatter."""
        fused = self._pack_fused(dev, has, stream)
        if fused is not None:
            send = fused
        else:
            send = self._pack_each(dev, total, has, n_params, stream)
        out = torch.empty(total + n_params, dtype=self.reduce_dtype, device=dev)
        # HSDP: the all-reduce of the previous group starts now, overlapping this reduce-scatter
        for g in _LAUNCHED:
            g._launch_allreduce()
        op = "avg" if self.avg_in_collective else "sum"
        work = self.platform.reduce_scatter_into(
            out, send, op, self.mesh._groups[self.shard_dim], async_op=True
        )
        return work, out, send, has

    def _pack_fused(self, dev, has, stream):
        """The (ranks, total + flags) buffer as one ``cat`` (plus one cast) when every
        parameter has a gradient and is sharded evenly on dim 0; None otherwise."""
        n = self.n
        if not all(has) or any(
            e.dim or e.shape[0] != n * e.chunk or not e.padded for e in self.entries
        ):  # (_chunk_cat refuses empty tensors)
            return None
        grads = [_local(e.unsharded).grad for e in self.entries]
        dt = grads[0].dtype
        if any(g.dtype != dt or not g.is_contiguous() for g in grads):
            return None
        with torch.no_grad():
            # one kernel: each gradient's n row-chunks into its column of the (n, total + flags)
            # buffer, cast to reduce_dtype on the way (FSDP2's copy-in does the same)
            flags = torch.ones(n * len(grads), dtype=dt, device=dev)
            send = torch.empty(n, self.total + len(grads), dtype=self.reduce_dtype, device=dev)
            torch._chunk_cat(grads + [flags], dim=0, num_chunks=n, out=send)
            if self.grad_scale != 1.0:
                send[:, : -len(grads)].mul_(self.grad_scale)
        for e, g in zip(self.entries, grads):
            if stream is not None:
                g.record_stream(stream)  # read on the side stream: keep it until then
            _local(e.unsharded).grad = None  # copied into the send buffer: free it
        return send.view(-1)

    def _pack_each(self, dev, total, has, n_params, stream):
        """The (ranks, total + flags) buffer parameter by parameter (uneven or moved dims,
        missing gradients)."""
        send = torch.empty(self.n, total + n_params, dtype=self.reduce_dtype, device=dev)
        if all(has):  # the common case: no host-to-device copy
            send[:, total:].fill_(1.0)
        else:
            send[:, total:] = torch.tensor([float(h) for h in has], dtype=self.reduce_dtype)
        off = 0
        with torch.no_grad():
            for e, h in zip(self.entries, has):
                col = send[:, off : off + e.padded]
                off += e.padded
                g = g0 = _local(e.unsharded).grad if e.unsharded is not None else None
                if g is None or not h:
                    col.zero_()
                    continue
                if self.grad_scale != 1.0:
                    g = g * self.grad_scale
                if e.dim:
                    g = g.movedim(e.dim, 0)
                flat = g.reshape(-1)
                if e.shape[0] == self.n * e.chunk:
                    col.copy_(flat.view(self.n, e.padded))
                else:
                    col.zero_()
                    for r in range(self.n):
                        rows, start = hp.chunk_size_and_offset(e.shape[0], self.n, r)
                        if rows:
                            k = rows * e.rest
                            col[r, :k].copy_(flat[start * e.rest : start * e.rest + k])
                if stream is not None:
                    g0.record_stream(stream)  # read on the side stream: keep it until then
                _local(e.unsharded).grad = None  # copied into the send buffer: free it
        return send.view(-1)

    def _launch_allreduce(self) -> None:
        """After this group's reduce-scatter: all-reduce across replicas (HSDP), async."""
        if self._rs is None or self._ar is not None:
            return
        work, out, _send, has = self._rs
        _wait(self._rs_event, out)
        if work is not None:
            work.wait()  # on NCCL a stream dependency, not a host wait
        self._rs = (None, out, _send, has)
        if self.rep_dim is not None and self.mesh.shape[self.rep_dim] > 1:
            self._ar = (
                self.platform.all_reduce(
                    out,
                    "avg" if self.avg_in_collective else "sum",
                    self.mesh._groups[self.rep_dim],
                    async_op=True,
                )
                or True
            )
        else:
            self._ar = True

    def _finish_reduce(self) -> None:
        self._launch_allreduce()
        _work, out, _send, _mine = self._rs
        self._rs = None
        if self._ar is not True and self._ar is not None:
            self._ar.wait()
        self._ar = None
        if not all(_mine):  # only then read the flags (a device-to-host sync on GPUs)
            has = [x > 0 for x in out[self.total :].tolist()]  # some rank had this gradient
        else:
            has = _mine
        out = out[: self.total]
        if not self.avg_in_collective:
            divide = self.n
            if self.rep_dim is not None:
                divide *= self.mesh.shape[self.rep_dim]
            out.div_(divide)
        if self.offload is not None and out.device.type != "cpu":
            # one copy of the whole reduced shard to the CPU, then views per parameter
            host = torch.empty(out.shape, dtype=out.dtype, pin_memory=self.offload.pin_memory)
            out = host.copy_(out)
        off = 0
        for e, h in zip(self.entries, has):
            local = out[off : off + e.padded].view((e.chunk,) + e.shape[1:])[: e.rows]
            off += e.padded
            if not h:
                continue
            if e.dim:
                local = local.movedim(0, e.dim)
            target = e.sharded.to_local()
            if target.grad is None:
                if (
                    local.dtype == target.dtype
                    and local.device == target.device
                    and local.shape == target.shape
                    and local.stride() == target.stride()
                ):
                    target.grad = local  # a view of the reduced buffer: no copy (as FSDP2)
                else:
                    target.grad = torch.empty_like(target, dtype=e.sharded.dtype).copy_(local)
            else:
                target.grad.add_(local.to(target.device))


_TP_DP_MESHES: dict = {}
_STREAMS: dict = {}
# devices whose all-gather stream has waited for the compute stream in the current pass (FSDP2
# likewise orders its all-gather streams once per forward, after the optimizer step)
_AG_ORDERED: set = set()


def _side_stream(dev, kind, follow: bool = True):
    """A side stream per (CUDA device, purpose); with ``follow`` it first waits for the current
    stream (its inputs were produced there). None on CPU, where collectives are ordered anyway."""
    if dev.type != "cuda":
        return None
    s = _STREAMS.get((dev, kind))
    if s is None:
        s = _STREAMS[(dev, kind)] = torch.cuda.Stream(dev)
    if follow:
        s.wait_stream(torch.cuda.current_stream(dev))
    return s


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _on(stream):
    return torch.cuda.stream(stream) if stream is not None else _Null()


def _record(stream):
    return stream.record_event() if stream is not None else None


def _wait(event, buf) -> None:
    """Make the current stream wait for a side-stream event; ``buf``, allocated there, is now
    used on the current stream too."""
    if event is not None:
        cur = torch.cuda.current_stream(buf.device)
        cur.wait_event(event)
        buf.record_stream(cur)


_ALIVE: weakref.WeakSet = weakref.WeakSet()


def _unmoved(shape, dim):
    """The parameter's own shape from the flat-buffer shape (sharded dim first)."""
    if not dim:
        return shape
    rest = list(shape[1:])
    return tuple(rest[:dim] + [shape[0]] + rest[dim:])


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _tp_dp_grid(tp_mesh, dp_mesh) -> list[list[int]]:
    """The (tp, dp) rank grid that ``tp_mesh`` and ``dp_mesh`` (1-D sub-meshes of one mesh,
    e.g. ``mesh['tp']`` and ``mesh['dp_shard']``) span around this rank: the other dimensions
    of that mesh (a pipeline dimension, say) stay at this rank's coordinates. A flattened
    ``dp`` (``dp_shard_cp``) counts its dimensions in row-major order."""
    root = tp_mesh._root
    if root is not dp_mesh._root or tp_mesh.ndim != 1 or dp_mesh.ndim != 1:
        raise ValueError(
            "composing fully_shard with tensor parallelism needs 1-D sub-meshes mesh['dp'] "
            "and mesh['tp'] of one DeviceMesh"
        )
    tp_dims, dp_dims = tp_mesh._root_dims[0], dp_mesh._root_dims[0]
    if set(tp_dims) & set(dp_dims):
        raise ValueError("the tp and dp meshes of fully_shard overlap: give disjoint dimensions")
    shape, ranks, me = root.shape, root.rank_list, root.get_coordinate()

    def coords(dims, index):  # row-major over the (possibly flattened) dims
        out = {}
        for d in reversed(dims):
            out[d] = index % shape[d]
            index //= shape[d]
        return out

    def rank_at(coord):
        flat = 0
        for d, c in enumerate(coord):
            flat = flat * shape[d] + c
        return ranks[flat]

    grid = []
    for t in range(tp_mesh.size()):
        row = []
        for i in range(dp_mesh.size()):
            c = list(me)
            for d, v in {**coords(tp_dims, t), **coords(dp_dims, i)}.items():
                c[d] = v
            row.append(rank_at(c))
        grid.append(row)
    return grid


def _end_of_backward() -> None:
    # started reductions finish in launch order; the rest start in a fixed order: both are the
    # same on every rank, as collectives require
    started = list(dict.fromkeys(g for g in _LAUNCHED if g in _PENDING))
    rest = sorted((g for g in _PENDING if g not in started), key=lambda g: -g.index)
    _PENDING.clear()
    _FORWARD_ORDER.clear()
    _AG_ORDERED.clear()  # the optimizer step comes next
    try:
        for g in started + rest:
            g.post_backward()
    finally:
        _LAUNCHED.clear()
        for g in list(_ALIVE):  # all-gathers prefetched for a backward that did not come
            g.discard_prefetch()
            g._fwd_calls = 0


def reduce_now(groups: list[ParamGroup]) -> None:
    """Reduce the gradients the groups accumulated with sync off, outside any backward: all
    reduce-scatters start (in a fixed order, the same on every rank), then all finish."""
    order = sorted((g for g in groups if g.entries), key=lambda g: -g.index)
    try:
        for g in order:
            if g._rs is None:
                g._start_reduce()
        for g in order:
            g._finish_reduce()
    finally:
        _LAUNCHED.clear()


class _PostBackward(torch.autograd.Function):
    """Identity on a forward call's inputs; its backward tells the group the call is done."""

    @staticmethod
    def forward(ctx, group, *tensors):
        ctx.group = group
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.group.module_backward_done()
        return (None, *grads)


def _hook_inputs(group, args, kwargs):
    flat, spec = torch.utils._pytree.tree_flatten((args, kwargs))
    idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not idx:
        return args, kwargs
    outs = _PostBackward.apply(group, *[flat[i] for i in idx])
    for i, o in zip(idx, outs):
        flat[i] = o
    return torch.utils._pytree.tree_unflatten(flat, spec)


def _tree_map_tensors(fn, tree):
    return torch.utils._pytree.tree_map(lambda x: fn(x) if isinstance(x, torch.Tensor) else x, tree)


_ = DTensor
