"""hp_testing: run a test body on N ranks (processes with a torch.distributed process group).

Development only; never a runtime dependency of a HyperParallel package.
"""

from ._errors import RankFailure, RankTimeout
from ._helpers import assert_close, seed_all
from ._launch import run_ranks
from ._pool import RankPool

__all__ = [
    "RankFailure",
    "RankPool",
    "RankTimeout",
    "assert_close",
    "run_ranks",
    "seed_all",
]
