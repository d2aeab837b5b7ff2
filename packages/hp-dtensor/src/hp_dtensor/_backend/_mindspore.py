"""The MindSpore platform: collectives through ``mindspore.communication`` (HCCL on Ascend,
MCCL on CPU), tensor factories, and the process-group calls hp_dtensor needs.

Imported only when asked for (``HP_BACKEND=mindspore`` or a mesh whose device type is served by
it); importing it without MindSpore raises ``ImportError``, which ``get_platform`` turns into a
message naming the package to install.

MindSpore on CPU has all-reduce (sum only), all-gather, broadcast and barrier but no
reduce-scatter, all-to-all or point-to-point kernels, and its all-gather and broadcast serve
the world group only: there reduce-scatter, all-to-all and the max/min all-reduce are built
from all-reduce and all-gather, all-gather and broadcast in smaller groups from an all-reduce
of zero-padded values, and point-to-point messages from broadcasts in two-rank groups
(correct, more traffic); on Ascend the native operators run. Groups are MindSpore
group names (strings); ``None`` means the world group.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import communication as comm
from mindspore import ops

from ..errors import BackendError

__all__ = ["MindSporePlatform"]


class _Done:
    """Handle of a collective that already ran (MindSpore's run synchronously here)."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _ascend() -> bool:
    return ms.get_context("device_target") == "Ascend"


def _nothing(t):
    """What a rank adds to a copy-by-sum (``_copy_sum``) where it holds nothing: -0.0 for
    float32, which leaves every value as it is, a -0.0 too (x + -0.0 == x); zeros else (those
    travel as bytes)."""
    if t.dtype == ms.float32:
        return ops.full(tuple(t.shape), -0.0, dtype=ms.float32)
    return ops.zeros(tuple(t.shape), t.dtype)


def _into(out, value) -> None:
    """Write ``value`` into the existing tensor ``out`` (the ``*_into`` contract)."""
    if tuple(out.shape) != tuple(value.shape):
        value = value.reshape(out.shape)
    out.assign_value(value.astype(out.dtype))


class MindSporePlatform:
    """``Platform`` over MindSpore."""

    name = "mindspore"
    framework = "mindspore"
    launch_env: tuple[str, ...] = ()  # msrun's variables; mindspore.communication checks them

    def __init__(self) -> None:
        self._initialized = False
        self._groups: dict[tuple[int, ...], str] = {}
        self._ranks: dict[str, list[int]] = {}

    # devices ----------------------------------------------------------------------------
    def default_device_type(self) -> str:
        return "npu" if _ascend() else "cpu"

    def device_for_rank(self, device_type: str):
        target = {"cpu": "CPU", "npu": "Ascend", "cuda": "GPU"}.get(device_type)
        if target is None:
            raise BackendError(f"device_type={device_type!r} has no MindSpore device target")
        ms.set_device(target)
        return device_type

    def default_comm_backend(self, device_type: str) -> str:
        return "hccl" if device_type == "npu" else "mccl"

    # process groups -----------------------------------------------------------------------
    def is_initialized(self) -> bool:
        return self._initialized

    def init_process_group(self, backend, timeout_s, device_type) -> None:
        self.device_for_rank(device_type)
        comm.init()  # msrun (or the Ascend launcher) provides the rendezvous
        self._initialized = True

    def destroy_process_group(self, group=None) -> None:
        if group is None and self._initialized:
            comm.release()
            self._initialized = False

    def _group(self, group) -> str:
        return comm.GlobalComm.WORLD_COMM_GROUP if group is None else group

    def get_rank(self, group=None) -> int:
        return comm.get_rank(self._group(group))

    def get_world_size(self, group=None) -> int:
        return comm.get_group_size(self._group(group))

    def new_group(self, ranks, timeout_s=None, *, distinct=False):
        ranks = tuple(int(r) for r in ranks)
        if len(ranks) == self.get_world_size() and not distinct:
            return None
        name = self._groups.get(ranks)
        if name is None:
            # named by the ranks alone: members that made different numbers of other groups
            # (meshes over overlapping rank sets) still meet under one name
            name = f"hp_group_{'_'.join(map(str, ranks))}"
            if comm.get_rank() in ranks:
                comm.create_group(name, list(ranks))
            self._groups[ranks] = name
            self._ranks[name] = list(ranks)
        return name

    def group_ranks(self, group) -> list[int]:
        if group is None:
            return list(range(self.get_world_size()))
        return list(self._ranks[group])

    def group_backend(self, group) -> str:
        return "hccl" if _ascend() else "mccl"

    # collectives ----------------------------------------------------------------------------
    _REDUCE = {"sum": "sum", "max": "max", "min": "min", "avg": "sum"}

    def _gather(self, t, group):
        """Every rank's ``t`` stacked along dim 0. On CPU MindSpore's all-gather serves the
        world group only: in a smaller group each rank writes its block into zeros and the
        blocks are summed (exact: every element is one value plus zeros)."""
        if group is None or _ascend():
            return ops.AllGather(group=self._group(group))(t)
        n, r = self.get_world_size(group), self.get_rank(group)
        parts = [t if p == r else _nothing(t) for p in range(n)]
        return self._copy_sum(ops.concat(parts, axis=0), group)

    @staticmethod
    def _copy_sum(t, group):
        """The all-reduce sum of tensors in which each element is nonzero on one rank at most:
        a copy from that rank. CPU all-reduce takes float32 only: other dtypes travel as their
        bytes, each byte a float32 (exact), and come back bit for bit (float32 goes as it is,
        the other ranks adding -0.0: exact too)."""
        group = comm.GlobalComm.WORLD_COMM_GROUP if group is None else group
        if t.dtype == ms.float32:
            return ops.AllReduce(op=ops.ReduceOp.SUM, group=group)(t)
        a = t.asnumpy()
        data = np.frombuffer(np.ascontiguousarray(a).tobytes(), dtype=np.uint8)
        summed = ops.AllReduce(op=ops.ReduceOp.SUM, group=group)(ms.Tensor(data.astype(np.float32)))
        raw = np.rint(summed.asnumpy()).astype(np.uint8).tobytes()
        return ms.Tensor(np.frombuffer(raw, dtype=a.dtype).reshape(a.shape))

    def _all_reduce_value(self, t, op: str, group):
        if op not in self._REDUCE:
            raise BackendError(
                f"reduce op {op!r} is not supported: use one of {sorted(self._REDUCE)}"
            )
        red = {"sum": ops.ReduceOp.SUM, "max": ops.ReduceOp.MAX, "min": ops.ReduceOp.MIN}
        if op in ("max", "min") and not _ascend():
            # CPU all-reduce sums only: gather every rank's tensor and reduce here
            stacked = self._gather(t.reshape((1, *t.shape)), group)
            return stacked.max(axis=0) if op == "max" else stacked.min(axis=0)
        out = ops.AllReduce(op=red[self._REDUCE[op]], group=self._group(group))(t)
        if op == "avg":
            out = out / self.get_world_size(group)
        return out

    def all_gather_into(self, out, inp, group, async_op=False):
        _into(out, self._gather(inp, group))
        return _Done() if async_op else None

    def reduce_scatter_into(self, out, inp, op, group, async_op=False):
        n = self.get_world_size(group)
        if _ascend() and op in ("sum", "max", "min"):
            red = {"sum": ops.ReduceOp.SUM, "max": ops.ReduceOp.MAX, "min": ops.ReduceOp.MIN}
            value = ops.ReduceScatter(op=red[op], group=self._group(group))(inp)
        else:  # CPU: no reduce-scatter kernel; all-reduce, keep this rank's block
            full = self._all_reduce_value(inp, op, group)
            rows = inp.shape[0] // n
            r = self.get_rank(group)
            value = full[r * rows : (r + 1) * rows]
        _into(out, value)
        return _Done() if async_op else None

    def all_reduce(self, t, op, group, async_op=False):
        _into(t, self._all_reduce_value(t, op, group))
        return _Done() if async_op else None

    def all_to_all(self, out, inp, out_splits, in_splits, group, async_op=False):
        """Rows of ``inp`` (dim 0) split by ``in_splits`` go to the ranks; ``out`` gathers theirs.
        On CPU: the split sizes travel in one all-gather, then every rank's input padded to the
        largest in another, and each rank keeps the rows sent to it."""
        n = self.get_world_size(group)
        r = self.get_rank(group)
        in_splits = list(in_splits) if in_splits else [inp.shape[0] // n] * n
        out_splits = list(out_splits) if out_splits else [out.shape[0] // n] * n
        sizes = self._gather(
            ms.Tensor(np.array([in_splits], dtype=np.int64)), group
        ).asnumpy()  # [n, n]: sizes[p][q] rows p sends to q
        rows = int(sizes.sum(axis=1).max())
        pad = rows - inp.shape[0]
        x = inp
        if pad:
            x = ops.concat([inp, ops.zeros((pad, *inp.shape[1:]), inp.dtype)], axis=0)
        everyone = self._gather(x, group)  # [n * rows, ...]
        pieces = []
        for p in range(n):
            start = p * rows + int(sizes[p][:r].sum())
            count = int(sizes[p][r])
            if count != out_splits[p]:
                raise BackendError(
                    f"all_to_all: rank {p} sends {count} rows to rank {r}, whose out_splits[{p}] "
                    f"is {out_splits[p]}"
                )
            if count:
                pieces.append(everyone[start : start + count])
        value = ops.concat(pieces, axis=0) if pieces else out
        _into(out, value)
        return _Done() if async_op else None

    def broadcast(self, t, src, group, async_op=False):
        ranks = self.group_ranks(group)
        root = ranks.index(src) if group is not None else src
        if not _ascend() and (group is not None or t.dtype not in (ms.float32, ms.int32)):
            # CPU broadcasts float32 and int32 in the world group only: elsewhere the others
            # add zeros to the root's
            if self.get_rank() == src:  # the root keeps its tensor as it is
                self._copy_sum(t, group)
            else:
                _into(t, self._copy_sum(_nothing(t), group))
            return _Done() if async_op else None
        (value,) = ops.Broadcast(root, group=self._group(group))((t,))
        _into(t, value)
        return _Done() if async_op else None

    def barrier(self, group=None) -> None:
        from mindspore import mint

        mint.distributed.barrier(group=self._group(group))

    def batch_p2p(self, sends, recvs, group, tag=0):
        """MindSpore has no point-to-point kernels on CPU: each message is a broadcast in the
        group of its two ranks. Every rank runs its messages in one order all agree on
        (sender, receiver, position among that pair's messages), so the earliest unfinished
        message always has both of its ranks waiting on it and none waits forever. Messages
        run when posted (the handles are done): ``tag`` needs no matching here. (Ascend's
        Send/Receive are not used yet: this path is the one tested; it makes one communicator
        per pair of ranks that exchange.)"""
        me = self.get_rank()
        count: dict[tuple[int, int], int] = {}
        ordered = []
        for sending, items in ((True, sends), (False, recvs)):
            for t, peer in items:
                pair = (me, int(peer)) if sending else (int(peer), me)
                k = count.get(pair, 0)
                count[pair] = k + 1
                ordered.append(((*pair, k), t))
        ordered.sort(key=lambda item: item[0])
        for (src, dst, _), t in ordered:
            self.broadcast(t, src, self._pair_group(src, dst))
        return [_Done()]

    def _pair_group(self, a: int, b: int):
        """The group of ranks ``a`` and ``b`` (the same one ``new_group`` gives: one
        communicator per pair), made by them alone when first needed."""
        return self.new_group(sorted((a, b)))

    # tensor factories ------------------------------------------------------------------------
    def empty(self, shape, dtype, device):
        return ops.zeros(tuple(shape), dtype)

    def zeros(self, shape, dtype, device):
        return ops.zeros(tuple(shape), dtype)

    def cat(self, tensors, dim):
        return ops.cat(list(tensors), dim)

    def clone(self, t):
        # Tensor.clone has no CPU kernel in MindSpore 2.10, assign_value would share storage
        # and copy_ refuses a view of a larger buffer
        return ops.deepcopy(t)

    slices_are_views = False  # t[index] is a new tensor

    def tensor_device_type(self, obj):
        return self.default_device_type() if isinstance(obj, ms.Tensor) else None

    def from_numpy(self, array, device):
        return ms.Tensor(np.ascontiguousarray(array))

    def to_numpy(self, t):
        return t.asnumpy()

    def dtype_problem(self, dtype, device_type):
        if device_type == "cpu" and dtype in (ms.bfloat16, ms.float16):
            return (
                f"MindSpore on CPU has no kernels to copy {dtype} slices (setitem, deepcopy): "
                "cast the tensors to float32 for the move, and back"
            )
        return ""

    def dtype_from_name(self, name):
        value = getattr(ms, name, None) if name.isidentifier() else None
        return value if isinstance(value, ms.dtype.Type) else None

    # streams and events: MindSpore's runtime streams on a device (Ascend, GPU); on CPU it has
    # none (ms.runtime.Stream raises there) and orders work itself: None --------------------------
    @staticmethod
    def _has_streams() -> bool:
        return ms.get_context("device_target") != "CPU" and hasattr(ms, "runtime")

    def new_stream(self, device):
        return ms.runtime.Stream() if self._has_streams() else None

    def current_stream(self, device):
        return ms.runtime.current_stream() if self._has_streams() else None

    def new_event(self, device):
        return ms.runtime.Event() if self._has_streams() else None

    def synchronize(self, device) -> None:
        ms.runtime.synchronize() if hasattr(ms, "runtime") else None
