"""The torch platform: CPU (gloo), CUDA (NCCL) and Ascend NPU (HCCL through torch_npu).

torch_npu is imported only when the NPU device type is asked for, never at import time.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import BackendError

__all__ = ["TorchPlatform"]

_NAMING = threading.Lock()  # new_group swaps torch's group-naming function while it runs

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}
_COMM = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl", "meta": "gloo"}


class TorchPlatform:
    """``Platform`` over torch and torch.distributed."""

    name = "torch"
    framework = "torch"

    def __init__(self) -> None:
        self._all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._reduce_scatter = (
            getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        )
        self._avg_ok: dict[str, bool] = {}

    # devices ----------------------------------------------------------------------------
    def _device_module(self, device_type: str):
        if device_type == "npu":
            try:
                importlib.import_module("torch_npu")
            except ImportError as e:
                raise BackendError(
                    "device_type='npu' needs torch_npu (with Ascend's CANN libraries): "
                    f"install it or use 'cuda'/'cpu' ({e})"
                ) from e
        return getattr(torch, device_type, None)

    def default_device_type(self) -> str:
        return "cuda" if torch.cuda.is_available() else "cpu"

    def device_for_rank(self, device_type: str) -> torch.device:
        if device_type in ("cpu", "meta"):
            return torch.device(device_type)
        mod = self._device_module(device_type)
        if mod is None or not mod.is_available():
            raise BackendError(f"device_type={device_type!r} is not available on this machine")
        idx = int(os.environ.get("LOCAL_RANK", "0")) % max(mod.device_count(), 1)
        mod.set_device(idx)
        return torch.device(device_type, idx)

    def default_comm_backend(self, device_type: str) -> str:
        try:
            return _COMM[device_type]
        except KeyError:
            raise BackendError(
                f"device_type={device_type!r} has no collective backend: use one of {sorted(_COMM)}"
            ) from None

    # process groups -----------------------------------------------------------------------
    def is_initialized(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def init_process_group(self, backend, timeout_s, device_type) -> None:
        if device_type == "npu":
            self._device_module("npu")
        dist.init_process_group(
            backend or self.default_comm_backend(device_type), timeout=timedelta(seconds=timeout_s)
        )

    def destroy_process_group(self, group=None) -> None:
        dist.destroy_process_group(group)

    def get_rank(self, group=None) -> int:
        return dist.get_rank(group)

    def get_world_size(self, group=None) -> int:
        return dist.get_world_size(group)

    def new_group(self, ranks, timeout_s=None, *, distinct=False):
        """A group of ``ranks``; only members take part (local synchronisation).

        torch names such a group after its ranks and the number of groups this process
        already has, so members that made different numbers of other groups (meshes over
        overlapping rank sets: [0, 1, 2] then [1, 2, 3] on four ranks) would meet under
        different names and wait for each other forever. The name here depends on the ranks
        and on how many times this process asked for them, which every member counts alike.
        """
        if len(ranks) == dist.get_world_size() and not distinct:
            return dist.group.WORLD
        kw = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
        key = tuple(int(r) for r in ranks)
        created = self.__dict__.setdefault("_created", {})
        c10d = dist.distributed_c10d
        if getattr(c10d, "_hash_ranks_to_str", None) is None:  # another torch: its own naming
            return dist.new_group(list(key), use_local_synchronization=True, **kw)
        with _NAMING:  # one renamed creation at a time; torch's function back afterwards
            n = created.get(key, 0)
            name = hashlib.sha1(f"hp_dtensor/{'_'.join(map(str, key))}/{n}".encode()).hexdigest()
            hashed = c10d._hash_ranks_to_str

            def ours(_ranks):
                return name

            c10d._hash_ranks_to_str = ours
            try:
                group = dist.new_group(list(key), use_local_synchronization=True, **kw)
            finally:
                if c10d._hash_ranks_to_str is ours:
                    c10d._hash_ranks_to_str = hashed
            created[key] = n + 1  # counted only once made, so a failed try is retried alike
            return group

    def forget_groups(self) -> None:
        """The process groups were destroyed: names start afresh, as torch's do."""
        self.__dict__.pop("_created", None)

    def group_ranks(self, group) -> list[int]:
        return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)

    def group_backend(self, group) -> str:
        return str(dist.get_backend(group))

    # collectives ----------------------------------------------------------------------------
    def _op(self, op: str):
        return _OPS[op]

    def all_gather_into(self, out, inp, group, async_op=False):
        return self._all_gather(out, inp, group=group, async_op=async_op)

    def reduce_scatter_into(self, out, inp, op, group, async_op=False):
        return self._reduce_scatter(out, inp, op=_OPS[op], group=group, async_op=async_op)

    def all_reduce(self, t, op, group, async_op=False):
        return dist.all_reduce(t, op=_OPS[op], group=group, async_op=async_op)

    def all_to_all(self, out, inp, out_splits, in_splits, group, async_op=False):
        return dist.all_to_all_single(
            out,
            inp,
            output_split_sizes=out_splits,
            input_split_sizes=in_splits,
            group=group,
            async_op=async_op,
        )

    def broadcast(self, t, src, group, async_op=False):
        return dist.broadcast(t, src=src, group=group, async_op=async_op)

    def barrier(self, group=None) -> None:
        dist.barrier(group)

    def batch_p2p(self, sends, recvs, group, tag=0):
        ops = [dist.P2POp(dist.isend, t, peer, group, tag) for t, peer in sends]
        ops += [dist.P2POp(dist.irecv, t, peer, group, tag) for t, peer in recvs]
        return dist.batch_isend_irecv(ops) if ops else []

    # tensor factories ------------------------------------------------------------------------
    def empty(self, shape, dtype, device):
        return torch.empty(shape, dtype=dtype, device=device)

    def zeros(self, shape, dtype, device):
        return torch.zeros(shape, dtype=dtype, device=device)

    def cat(self, tensors, dim):
        return torch.cat(tensors, dim)

    def clone(self, t):
        return t.clone()

    slices_are_views = True

    def tensor_device_type(self, obj):
        return obj.device.type if isinstance(obj, torch.Tensor) else None

    def from_numpy(self, array, device):
        return torch.from_numpy(array.copy()).to(device)

    def to_numpy(self, t):
        return t.detach().cpu().numpy()

    def dtype_problem(self, dtype, device_type):
        return ""

    def dtype_from_name(self, name):
        value = getattr(torch, name, None) if name.isidentifier() else None
        return value if isinstance(value, torch.dtype) else None

    # streams and events ------------------------------------------------------------------
    def new_stream(self, device):
        mod = self._device_module(torch.device(device).type)
        return mod.Stream(device) if hasattr(mod, "Stream") else None

    def current_stream(self, device):
        mod = self._device_module(torch.device(device).type)
        return mod.current_stream(device) if hasattr(mod, "current_stream") else None

    def new_event(self, device):
        mod = self._device_module(torch.device(device).type)
        return mod.Event() if hasattr(mod, "Event") else None

    def synchronize(self, device) -> None:
        mod = self._device_module(torch.device(device).type)
        if hasattr(mod, "synchronize"):
            mod.synchronize()
