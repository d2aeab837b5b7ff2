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

Errors (:mod:`hp_kernels.errors`): a bad argument raises a :class:`KernelsError`, either a
:class:`KernelsValueError` (also a ``ValueError``) or a :class:`KernelsTypeError` (also a
``TypeError``); :class:`~hp_kernels.symm_mem.HostSpanError` (a ``ValueError``) and
:class:`~hp_kernels.symm_mem.PeerError` (a ``RuntimeError``) are ``KernelsError`` too.
"""

from . import comm, mc2, moe, symm_mem
from ._ext import KernelsNotBuiltError, is_built
from .errors import KernelsError, KernelsTypeError, KernelsValueError
from .symm_mem import HostSpanError, PeerError

__version__ = "0.1.0"

__all__ = [
    "HostSpanError",
    "KernelsError",
    "KernelsNotBuiltError",
    "KernelsTypeError",
    "KernelsValueError",
    "PeerError",
    "comm",
    "is_built",
    "mc2",
    "moe",
    "symm_mem",
]
