"""hp_pipeline's framework bindings other than torch, each imported only when
``hp_dtensor.framework_of`` says a stage's module is of its framework (``_mindspore``: stages
over MindSpore cells). A binding imports none of the front ends that call it (``_stage``,
``_runtime``): it gets the errors from ``hp_pipeline._errors`` and the schedules from the
framework-neutral ``_schedules`` and ``_sim``."""
