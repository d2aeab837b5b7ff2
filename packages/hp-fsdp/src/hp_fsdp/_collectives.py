"""The data movement of a group: copy-in and copy-out of the flat all-gather buffer, packing
of the flat reduce-scatter buffer, and the side-stream helpers (no-ops on CPU).

Every function takes the group's ``FSDPParam`` list and returns buffers; none keeps state.
"""

from __future__ import annotations

import contextlib

import torch

import hp_dtensor as hp

from ._param import FSDPParam, local

__all__ = [
    "copy_in",
    "copy_out",
    "on",
    "pack_gradients",
    "record",
    "wait_event",
]


def preserve_version(t: torch.Tensor):
    """Refilling an unsharded parameter must not look like an in-place change to autograd."""
    return torch.autograd._unsafe_preserve_version_counter(t)


# -- streams -------------------------------------------------------------------------------------


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def on(stream):
    """``torch.cuda.stream(stream)``, or nothing when ``stream`` is None (CPU)."""
    return torch.cuda.stream(stream) if stream is not None else _Null()


def record(stream):
    return stream.record_event() if stream is not None else None


def wait_event(event, buf) -> None:
    """Make the current stream wait for a side-stream event; ``buf``, allocated there, is now
    used on the current stream too."""
    if event is not None:
        cur = torch.cuda.current_stream(buf.device)
        cur.wait_event(event)
        buf.record_stream(cur)


# -- all-gather ------------------------------------------------------------------------------------


def copy_in(params: list[FSDPParam], n: int, me: int, total: int, dtype, dev):
    """The ``(n * total,)`` receive buffer with this rank's shards copied (and cast) into its
    slot, and that slot (the in-place all-gather's input). One multi-tensor copy for all
    parameters; padding zeroed."""
    recv = torch.empty(n * total, dtype=dtype, device=dev)
    send = recv[me * total : (me + 1) * total]
    off = 0
    dsts, srcs = [], []
    with torch.no_grad():
        for e in params:
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
        if dsts:  # none when this rank holds no rows of any parameter
            torch._foreach_copy_(dsts, srcs, non_blocking=True)
    return recv, send


def copy_out(params: list[FSDPParam], recv: torch.Tensor, n: int, dtype, dev) -> None:
    """Copy a gathered flat buffer ``(n, total)`` (each parameter split in ``n`` chunks on
    its sharded dim) into the unsharded parameters."""
    if params and all(e.even(n) for e in params):  # the usual case: one launch
        outs = [e.fresh_unsharded(dtype, dev) for e in params]
        with contextlib.ExitStack() as stack, torch.no_grad():
            for t in outs:
                stack.enter_context(preserve_version(t))
            torch.split_with_sizes_copy(
                recv,
                [e.padded for e in params],
                dim=1,
                out=[t.view(n, e.padded) for t, e in zip(outs, params)],
            )
        return
    off = 0
    for e in params:
        chunk = -(-e.shape[0] // n) if e.shape[0] else 0
        padded = chunk * e.rest
        src = recv[:, off : off + padded]
        off += padded
        t = e.fresh_unsharded(dtype, dev)
        with torch.no_grad(), preserve_version(t):
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


# -- reduce-scatter --------------------------------------------------------------------------------


def pack_gradients(
    params: list[FSDPParam], n: int, total: int, has: list[bool], dtype, scale: float, dev, stream
):
    """The ``(n, total + len(params))`` reduce-scatter input: each gradient in its columns
    (cast to ``dtype``, times ``scale``), then one flag per parameter saying this rank had its
    gradient (the reduction tells every rank where some rank had one). The unsharded gradients
    are released once copied."""
    fused = _pack_fused(params, n, total, has, dtype, scale, dev, stream)
    if fused is not None:
        return fused
    send = torch.empty(n, total + len(params), dtype=dtype, device=dev)
    if all(has):  # the common case: no host-to-device copy
        send[:, total:].fill_(1.0)
    else:
        send[:, total:] = torch.tensor([float(h) for h in has], dtype=dtype)
    off = 0
    with torch.no_grad():
        for e, h in zip(params, has):
            col = send[:, off : off + e.padded]
            off += e.padded
            g = g0 = local(e.unsharded).grad if e.unsharded is not None else None
            if g is None or not h:
                col.zero_()
                continue
            if scale != 1.0:
                g = g * scale
            if e.dim:
                g = g.movedim(e.dim, 0)
            flat = g.reshape(-1)
            if e.shape[0] == n * e.chunk:
                col.copy_(flat.view(n, e.padded))
            else:
                col.zero_()
                for r in range(n):
                    rows, start = hp.chunk_size_and_offset(e.shape[0], n, r)
                    if rows:
                        k = rows * e.rest
                        col[r, :k].copy_(flat[start * e.rest : start * e.rest + k])
            if stream is not None:
                g0.record_stream(stream)  # read on the side stream: keep it until then
            local(e.unsharded).grad = None  # copied into the send buffer: free it
    return send.view(-1)


def _pack_fused(params, n, total, has, dtype, scale, dev, stream):
    """The buffer as one ``_chunk_cat`` (plus one cast) when every parameter has a gradient
    and is sharded evenly on dim 0; None otherwise (``_chunk_cat`` refuses empty tensors)."""
    if not all(has) or not all(e.even(n) for e in params):
        return None
    grads = [local(e.unsharded).grad for e in params]
    dt = grads[0].dtype
    if any(g.dtype != dt or not g.is_contiguous() for g in grads):
        return None
    with torch.no_grad():
        # one kernel: each gradient's n row-chunks into its column of the (n, total + flags)
        # buffer, cast to the reduce dtype on the way (FSDP2's copy-in does the same)
        flags = torch.ones(n * len(grads), dtype=dt, device=dev)
        send = torch.empty(n, total + len(grads), dtype=dtype, device=dev)
        torch._chunk_cat(grads + [flags], dim=0, num_chunks=n, out=send)
        if scale != 1.0:
            send[:, : -len(grads)].mul_(scale)
    for e, g in zip(params, grads):
        if stream is not None:
            g.record_stream(stream)  # read on the side stream: keep it until then
        local(e.unsharded).grad = None  # copied into the send buffer: free it
    return send.view(-1)


def unpack_gradients(params: list[FSDPParam], out: torch.Tensor, has: list[bool]) -> None:
    """This rank's reduced flat shard into the sharded parameters' ``.grad`` (as a view of the
    buffer where layouts agree, as FSDP2 does; accumulated when a gradient is there already)."""
    off = 0
    for e, h in zip(params, has):
        piece = out[off : off + e.padded].view((e.chunk,) + e.shape[1:])[: e.rows]
        off += e.padded
        if not h:
            continue
        if e.dim:
            piece = piece.movedim(0, e.dim)
        target = e.sharded.to_local()
        if target.grad is None:
            if (
                piece.dtype == target.dtype
                and piece.device == target.device
                and piece.shape == target.shape
                and piece.stride() == target.stride()
            ):
                target.grad = piece
            else:
                target.grad = torch.empty_like(target, dtype=e.sharded.dtype).copy_(piece)
        else:
            target.grad.add_(piece.to(target.device))
