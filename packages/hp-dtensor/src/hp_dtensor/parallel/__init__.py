"""Declarative tensor, sequence and loss parallelism on top of ``hp_dtensor``.

Styles are immutable values applied to submodules chosen by path patterns::

    from hp_dtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(block, tp_mesh, {
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
    })
"""

from ._api import parallelize_module
from ._collective_matmul import UNFUSED, CollectiveMatmul
from ._context import (
    AsyncContextParallel,
    ContextParallel,
    context_parallel_attention,
    context_parallel_loss,
    context_parallel_shard,
    context_parallel_unshard,
)
from ._loss import loss_parallel
from ._style import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

__all__ = [
    "UNFUSED",
    "AsyncContextParallel",
    "CollectiveMatmul",
    "ColwiseParallel",
    "ContextParallel",
    "ParallelStyle",
    "PrepareModuleInput",
    "PrepareModuleInputOutput",
    "PrepareModuleOutput",
    "RowwiseParallel",
    "SequenceParallel",
    "context_parallel_attention",
    "context_parallel_loss",
    "context_parallel_shard",
    "context_parallel_unshard",
    "loss_parallel",
    "parallelize_module",
]
