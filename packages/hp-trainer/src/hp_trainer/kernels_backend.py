"""hp_dtensor's torch platform with its synchronous collectives on CPU groups of one host run by
:mod:`hp_kernels.comm` (shared memory) instead of gloo.

Everything else (groups, devices, ops hp_kernels does not have, groups spanning hosts) stays
torch's. An asynchronous request (``async_op=True``, as FSDP's prefetching all-gathers and
overlapped reduce-scatters make) runs at once and returns a finished handle: on CPU ranks
the shared-memory collective costs less than gloo's overlap saves (measured in
``benchmarks/RESULTS.md``). Turn it on for a job with the trainer option
``parallelism.collectives = "hp_kernels"``, or in any program with :func:`enable` before the
device mesh is built::

    from hp_trainer import kernels_backend
    kernels_backend.enable()          # CPU meshes now use it
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import hp_dtensor

__all__ = ["NAME", "enable", "make_platform"]

NAME = "torch+hp_kernels"
_DTYPES = {torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32}


class _Done:
    """A finished collective's handle (``wait`` returns at once)."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _c(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _copy_of(buf: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``buf`` holding ``t``'s values (``buf`` is ``t`` itself when ``t`` is contiguous)."""
    if buf is not t:
        buf.copy_(t)
    return buf


def _into(out: torch.Tensor, fn) -> None:
    """Run ``fn(o)`` on a contiguous ``o`` standing for ``out`` (``out`` itself when it is
    contiguous), then copy back."""
    o = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
    fn(o)
    if o is not out:
        out.copy_(o)


def enable() -> None:
    """Register the platform and make it the default for ``cpu`` meshes (idempotent)."""
    hp_dtensor.register_platform(NAME, f"{__name__}:make_platform", device_types=("cpu",))


def make_platform():
    """Build the platform: a subclass of hp_dtensor's torch platform (called by hp_dtensor)."""
    from hp_kernels import comm
    from hp_kernels.symm_mem import HostSpanError

    base = hp_dtensor.platform_class("torch")

    class KernelsPlatform(base):  # type: ignore[misc, valid-type]
        name = NAME

        def __init__(self) -> None:
            super().__init__()
            self._multi_host: set[int] = set()  # groups hp_kernels refused: torch serves them
            self.calls = 0  # collectives hp_kernels ran (for tests and logs)

        def _ours(self, group, async_op: bool, *tensors: torch.Tensor) -> bool:
            if id(group if group is not None else dist.group.WORLD) in self._multi_host:
                return False
            # device and dtype agree between ranks; contiguity may not (a size-1 dim of an
            # uneven shard), so it is handled by copies below, never by a per-rank fallback
            return all(t.device.type == "cpu" and t.dtype in _DTYPES for t in tensors)

        def _run(self, group, fn, fallback):
            try:
                fn()
            except HostSpanError:
                # every rank of the group got the same answer: all fall back together
                self._multi_host.add(id(group if group is not None else dist.group.WORLD))
                return fallback()
            self.calls += 1
            return _Done()

        def all_gather_into(self, out, inp, group, async_op=False):
            if not self._ours(group, async_op, out, inp):
                return super().all_gather_into(out, inp, group, async_op)
            return self._run(
                group,
                lambda: _into(out, lambda o: comm.all_gather_into_tensor(o, _c(inp), group=group)),
                lambda: super(KernelsPlatform, self).all_gather_into(out, inp, group, async_op),
            )

        def reduce_scatter_into(self, out, inp, op, group, async_op=False):
            if op not in ("sum", "avg", "max") or not self._ours(group, async_op, out, inp):
                return super().reduce_scatter_into(out, inp, op, group, async_op)
            return self._run(
                group,
                lambda: _into(
                    out, lambda o: comm.reduce_scatter_tensor(o, _c(inp), op, group=group)
                ),
                lambda: super(KernelsPlatform, self).reduce_scatter_into(
                    out, inp, op, group, async_op
                ),
            )

        def all_reduce(self, t, op, group, async_op=False):
            if op not in ("sum", "avg", "max") or not self._ours(group, async_op, t):
                return super().all_reduce(t, op, group, async_op)
            if op == "avg" and not t.is_floating_point():
                return super().all_reduce(t, op, group, async_op)
            return self._run(
                group,
                lambda: _into(t, lambda o: comm.all_reduce(_copy_of(o, t), op, group=group)),
                lambda: super(KernelsPlatform, self).all_reduce(t, op, group, async_op),
            )

        def all_to_all(self, out, inp, out_splits, in_splits, group, async_op=False):
            if not self._ours(group, async_op, out, inp) or inp.dim() == 0:
                return super().all_to_all(out, inp, out_splits, in_splits, group, async_op)
            return self._run(
                group,
                lambda: _into(
                    out,
                    lambda o: comm.all_to_all_single(
                        o, _c(inp), out_splits, in_splits, group=group
                    ),
                ),
                lambda: super(KernelsPlatform, self).all_to_all(
                    out, inp, out_splits, in_splits, group, async_op
                ),
            )

    return KernelsPlatform()
