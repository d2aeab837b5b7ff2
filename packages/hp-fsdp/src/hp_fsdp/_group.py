"""One ``fully_shard`` parameter group: its hooks, all-gather and reshard, reduce-scatter.

Per-parameter state is ``FSDPParam`` (``_param``), the data movement is in ``_collectives``,
and what spans the groups of a model is the root's ``FSDPContext`` (``_state``; see NOTE [Root
context]). A group knows its module, mesh and parameters, and where its collectives stand.
"""

from __future__ import annotations

import itertools

import torch

import hp_dtensor as hp
from hp_dtensor import DTensor

from . import _collectives as col
from ._param import FSDPParam, local, shard_param
from ._state import FSDPContext, hook_inputs, tree_map_tensors

__all__ = ["ParamGroup"]

# creation order: a fixed key, the same on every rank, for reductions that need an order
_CREATED = itertools.count()


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
        self.index = next(_CREATED)
        self.module = module
        self.mesh = mesh
        self.device = mesh.device  # where unsharded parameters and collectives live
        self.offload = offload
        self.shard_dim = mesh.ndim - 1
        self.rep_dim = 0 if mesh.ndim == 2 else None
        self.n = mesh.shape[self.shard_dim]
        self.mp = mp
        self.platform = hp.get_platform(mesh.device_type)
        self.ctx = FSDPContext()
        self.ctx.adopt(self)
        self.entries: list[FSDPParam] = []
        self.orig_ids = {id(p) for _s, _n, _f, p in entries}  # the tensors this group replaced
        dims = dims or {}
        for sub, pname, fqn, p in entries:
            k = dims.get(id(p), 0) if not isinstance(p, DTensor) else 0
            sp, inner, shape = shard_param(p, fqn, mesh, placements, k, offload)
            more = (aliases or {}).get(id(p), [])
            for m, nm in [(sub, pname)] + more:
                m._parameters[nm] = sp
            self.entries.append(FSDPParam(sub, pname, fqn, sp, shape, self.n, inner, k, more))
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
        self._ag = None  # a started all-gather: (work, recv, send, total, device, event)
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
        # a started reduce-scatter: (work, out, send, has-grad mask); work and send go once
        # the next group's reduce-scatter starts (_launch_allreduce)
        self._rs = None
        self._rs_event = None
        self._ar = None  # HSDP all-reduce: None (not started), True (none needed), or its work
        self._fwd_calls = 0  # forward calls (with grad) since the last backward
        self._kept = False  # the root kept its unsharded parameters after forward
        self._left = 0  # of those, module backwards not yet finished in this backward

    def adopt_into(self, parent: ParamGroup) -> None:
        """This group now sits inside ``parent``'s module: it shares ``parent``'s context (see
        NOTE [Root context]) and is no longer a root."""
        parent.ctx.adopt(self)
        self.is_root = False

    # -- queries -----------------------------------------------------------------------------
    def sharded_params(self) -> list:
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
        ordered = self.ctx.ag_ordered
        stream = self.ctx.side_stream(dev, "all_gather", follow=not (in_pass and dev in ordered))
        ordered.add(dev)
        with col.on(stream):
            # copy-in straight into this rank's slot of the output, then an in-place
            # collective; on CUDA on a side stream, so a prefetch overlaps current compute
            me = self.mesh.get_local_rank(self.shard_dim)
            recv, send = col.copy_in(self.entries, self.n, me, self.total, self.param_dtype, dev)
            work = self.platform.all_gather_into(
                recv, send, self.mesh._groups[self.shard_dim], async_op=True
            )
            event = col.record(stream)
        self._ag = (work, recv, send, self.total, dev, event)
        if not async_op:
            self.wait_unshard()

    def wait_unshard(self) -> None:
        """Finish a started all-gather: wait, then copy out into the unsharded parameters."""
        if self._ag is None:
            return
        work, recv, _send, total, dev, event = self._ag
        self._ag = None
        col.wait_event(event, recv)
        if work is not None:
            work.wait()
        self._copy_out(recv.view(self.n, total), self.n, dev)
        self.unsharded = True

    def _copy_out(self, recv, n: int, dev) -> None:
        col.copy_out(self.entries, recv, n, self.param_dtype, dev)

    # -- resharding to a smaller group after forward ------------------------------------
    def _keep_post_forward_shard(self) -> None:
        """``reshard_after_forward=k``: keep this rank's 1/k of every parameter (split within
        its sub-group of k consecutive ranks) and free the rest; backward gathers inside the
        sub-group (e.g. within a node) instead of the whole shard group."""
        k, j = self.raf_k, self.raf_index
        pieces = []
        for e in self.entries:
            t = local(e.unsharded).detach()
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
            e.free()
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
        order = self.ctx.forward_order
        if self.is_root or not torch.is_grad_enabled() or not order or self in order:
            # the first forward of a pass (every root's forward starts one): the sharded
            # parameters may have changed since the last all-gather (optimizer step, loading),
            # so the next all-gather waits for the compute stream
            self.ctx.ag_ordered.clear()
        if self._kept:  # kept after a forward whose backward never came: gather afresh
            self.free_unsharded()
        self.unshard(in_pass=True)
        self.swap_in()
        for g in self.forward_prefetch:
            g.unshard(async_op=True, in_pass=True)
        if self.mp.param_dtype is not None and self.mp.cast_forward_inputs:
            dt = self.param_dtype
            args, kwargs = tree_map_tensors(
                lambda t: t.to(dt) if t.is_floating_point() and t.dtype != dt else t,
                (args, kwargs),
            )
        if torch.is_grad_enabled():
            if self in order:  # a new forward pass (no backward in between)
                order.clear()
            order.append(self)
            self._fwd_calls += 1
            args, kwargs = hook_inputs(self, args, kwargs)
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
            out = tree_map_tensors(lambda t: t.to(dt) if t.is_floating_point() else t, out)
        return out

    def _pre_backward(self, grad):
        if self._pf is not None:
            self._unshard_from_post_forward()
        self.unshard(in_pass=True)
        # the module holds its unsharded parameters during its backward, as during forward:
        # activation checkpointing runs the forward again in there
        self.swap_in()
        prefetch = self.backward_prefetch
        order = self.ctx.forward_order
        if not prefetch and self in order:
            # implicitly: the group whose forward ran just before this one's
            k = order.index(self)
            prefetch = [order[k - 1]] if k > 0 else []
        for g in prefetch:
            g.unshard(async_op=True, in_pass=True)
        self.ctx.backward_started(self)

    def module_backward_done(self) -> None:
        """Gradients reached the inputs of one forward call of the module; after the last one
        every parameter gradient of the group is accumulated: start the reduce-scatter now, so
        it runs while backward computes the earlier groups."""
        self._left -= 1
        if self._left == 0 and self.swapped_in:
            self.swap_out()
        if self._left == 0 and self.sync and self in self.ctx.pending and self._rs is None:
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
        # which parameters have a gradient here goes along with the data (see pack_gradients)
        has = [e.has_grad() for e in self.entries]
        dev = self.device
        stream = self.ctx.side_stream(dev, "reduce_scatter")
        with col.on(stream):
            # the groups reduced before: done with their inputs (let go of here, before this
            # one is packed, so one packed input is alive at a time, as in FSDP2); under HSDP
            # their all-reduce starts now, overlapping this reduce-scatter
            for g in self.ctx.launched:
                g._launch_allreduce()
            send = col.pack_gradients(
                self.entries,
                self.n,
                self.total,
                has,
                self.reduce_dtype,
                self.grad_scale,
                dev,
                stream,
            )
            out = torch.empty(self.total + len(self.entries), dtype=self.reduce_dtype, device=dev)
            op = "avg" if self.avg_in_collective else "sum"
            work = self.platform.reduce_scatter_into(
                out, send, op, self.mesh._groups[self.shard_dim], async_op=True
            )
            self._rs_event = col.record(stream)
        self._rs = (work, out, send, has)
        self._ar = None
        self.ctx.launched.append(self)

    def _launch_allreduce(self) -> None:
        """After this group's reduce-scatter: all-reduce across replicas (HSDP), async."""
        if self._rs is None or self._ar is not None:
            return
        work, out, _send, has = self._rs
        col.wait_event(self._rs_event, out)
        if work is not None:
            work.wait()  # on NCCL a stream dependency, not a host wait
        # the reduce-scatter is done with its input (the unsharded gradients, packed): let it
        # go now, before the next group packs, not at the end of backward (FSDP2 does the
        # same); it was made on the reduce-scatter's stream, so the allocator reuses it only
        # after the collective
        self._rs = (None, out, None, has)
        if self.rep_dim is not None and self.mesh.shape[self.rep_dim] > 1:
            op = "avg" if self.avg_in_collective else "sum"
            rep = self.mesh._groups[self.rep_dim]
            self._ar = self.platform.all_reduce(out, op, rep, async_op=True) or True
        else:
            self._ar = True

    def _finish_reduce(self) -> None:
        self._launch_allreduce()
        _work, out, _send, mine = self._rs
        self._rs = None
        if self._ar is not True and self._ar is not None:
            self._ar.wait()
        self._ar = None
        if not all(mine):  # only then read the flags (a device-to-host sync on GPUs)
            has = [x > 0 for x in out[self.total :].tolist()]  # some rank had this gradient
        else:
            has = mine
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
        col.unpack_gradients(self.entries, out, has)
