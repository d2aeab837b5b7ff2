"""hp_offload's framework bindings other than torch, each imported only when
``hp_dtensor.framework_of`` says its framework's cell or tensor was given (``_mindspore``:
checkpoint and swap on MindSpore cells). A binding imports none of the front ends that call it
(``_checkpoint``, ``_swap``, ``_plan``): it gets the errors from ``hp_offload.errors`` and the
policy and manager objects as arguments."""
