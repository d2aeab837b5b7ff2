"""hp_fsdp's framework bindings other than torch, each imported only when its framework's
modules are given (``_mindspore``: ``fully_shard`` on MindSpore cells)."""
