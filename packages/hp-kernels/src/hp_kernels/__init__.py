"""hp_kernels: compiled kernels for HyperParallel.

- :mod:`hp_kernels.symm_mem`: one buffer per rank of a host's group, mapped into every peer,
  with put/get, counted signals and barriers;
- :mod:`hp_kernels.comm`: one-sided ``all_gather_into_tensor``, ``all_to_all_single``,
  ``reduce_scatter_tensor`` and ``all_reduce`` on it (low-precision wire with float32
  accumulation);
- :mod:`hp_kernels.mc2`: ``all_gather_matmul`` and ``matmul_reduce_scatter``, overlapped;
- :mod:`hp_kernels.moe`: ``permute_tokens`` / ``unpermute_tokens``.

The compiled module ``hp_kernels._C`` takes raw addresses and sizes and does not link against
libtorch. It is imported on first use; :func:`is_built` says whether it is there.
"""

from . import comm, mc2, moe, symm_mem
from ._ext import KernelsNotBuiltError, is_built

__version__ = "0.1.0"

__all__ = ["KernelsNotBuiltError", "comm", "is_built", "mc2", "moe", "symm_mem"]
