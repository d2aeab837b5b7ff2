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


def enable() -> None:
    """Register the platform and make it the default for ``cpu`` meshes (idempotent)."""
    hp_dtensor.register_platform(NAME, f"{__name__}:make_platform", device_types=("cpu",))


def make_platform():
    """Build the platform: a subclass of hp_dtensor's torch platform (called by hp_dtensor)."""
    from hp_kernels import comm

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
            return all(
                t.device.type == "cpu" and t.is_contiguous() and t.dtype in _DTYPES for t in tensors
            )

        def _run(self, group, fn, fallback):
            try:
                fn()
            except ValueError as exc:
                if "more than one host" not in str(exc):
                    raise
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
                lambda: comm.all_gather_into_tensor(out, inp, group=group),
                lambda: super(KernelsPlatform, self).all_gather_into(out, inp, group, async_op),
            )

        def reduce_scatter_into(self, out, inp, op, group, async_op=False):
            if op not in ("sum", "avg", "max") or not self._ours(group, async_op, out, inp):
                return super().reduce_scatter_into(out, inp, op, group, async_op)
            return self._run(
                group,
                lambda: comm.reduce_scatter_tensor(out, inp, op, group=group),
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
                lambda: comm.all_reduce(t, op, group=group),
                lambda: super(KernelsPlatform, self).all_reduce(t, op, group, async_op),
            )

        def all_to_all(self, out, inp, out_splits, in_splits, group, async_op=False):
            if not self._ours(group, async_op, out, inp) or inp.dim() == 0:
                return super().all_to_all(out, inp, out_splits, in_splits, group, async_op)
            return self._run(
                group,
                lambda: comm.all_to_all_single(out, inp, out_splits, in_splits, group=group),
                lambda: super(KernelsPlatform, self).all_to_all(
                    out, inp, out_splits, in_splits, group, async_op
                ),
            )

    return KernelsPlatform()
