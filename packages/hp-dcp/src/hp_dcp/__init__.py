"""hp_dcp: distributed checkpoints with resharding, async save, HuggingFace safetensors and an
offline conversion CLI (``hp-dcp``). See the package README for an example."""

from ._api import LoadPlanner, async_save, load, save
from ._convert import (
    consolidate,
    convert,
    export_hf,
    import_hf,
    inspect,
    parse_placements,
    reshard,
    save_hf,
    verify,
)
from ._meta import Chunk, Metadata, ObjectEntry, StoredObject, TensorEntry
from ._plan import ReadItem, SavePlanner, WriteItem
from ._state_dict import (
    ModelState,
    OptimizerState,
    RNGState,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from ._storage import (
    FileSystemReader,
    FileSystemWriter,
    SafetensorsReader,
    TorchDCPReader,
    open_checkpoint,
)
from .errors import (
    CheckpointError,
    CorruptCheckpointError,
    DCPTypeError,
    IncompleteCheckpointError,
    StateDictError,
)

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "Chunk",
    "CorruptCheckpointError",
    "DCPTypeError",
    "FileSystemReader",
    "FileSystemWriter",
    "IncompleteCheckpointError",
    "LoadPlanner",
    "Metadata",
    "ModelState",
    "ObjectEntry",
    "OptimizerState",
    "RNGState",
    "ReadItem",
    "SafetensorsReader",
    "SavePlanner",
    "StateDictError",
    "StoredObject",
    "TensorEntry",
    "TorchDCPReader",
    "WriteItem",
    "async_save",
    "consolidate",
    "convert",
    "export_hf",
    "get_optimizer_state_dict",
    "import_hf",
    "inspect",
    "load",
    "open_checkpoint",
    "parse_placements",
    "reshard",
    "save",
    "save_hf",
    "set_optimizer_state_dict",
    "verify",
]
