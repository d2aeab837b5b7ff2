"""hp-trainer's public entry points reject bad input with a typed error (ConfigError, or
TrainerTypeError, which is a ConfigError and a TypeError) naming the argument and the fix,
before anything runs. Each row raised something untyped, or nothing, before the sweep."""

import pytest
import torch
import torch.nn as nn

import hp_trainer as ht
from hp_trainer import ConfigError, TrainerTypeError, models


def _tiny():
    return models.Transformer(models.get_config("llama3-tiny"))


ROWS = [
    # (call, error, regex naming the argument)
    (
        lambda: ht.parallelize_llama(nn.Linear(2, 2), parallel_dims=ht.ParallelDims()),
        TrainerTypeError,
        r"parallelize_llama: model=<object> is a Linear, not a Transformer",
    ),
    (
        lambda: ht.parallelize_llama(_tiny(), parallel_dims={"tp": 1}),
        TrainerTypeError,
        r"parallel_dims=<object> is a dict, not a ParallelDims",
    ),
    (
        lambda: ht.parallelize_llama(_tiny(), parallel_dims=ht.ParallelDims(), config={}),
        TrainerTypeError,
        r"config=<object> is a dict, not a ParallelizeConfig",
    ),
    (
        lambda: ht.pipeline_llama(
            nn.Linear(2, 2),
            parallel_dims=ht.ParallelDims(),
            mesh=None,
            schedule="1f1b",
            n_microbatches=2,
            loss_fn=None,
        ),
        TrainerTypeError,
        r"pipeline_llama: model=<object> is a Linear",
    ),
    (lambda: ht.ParallelDims(world_size=True), ConfigError, r"world_size=True"),
    (lambda: ht.ParallelDims(tp=True), ConfigError, r"tensor_parallel_degree=True"),
    (lambda: ht.preflight(ht.load_config(None, []), "4"), ConfigError, r"world_size='4'"),
    (
        lambda: ht.ParallelizeConfig(activation_checkpoint="fast"),
        ConfigError,
        r"activation_checkpoint='fast': use one of",
    ),
    (lambda: ht.ParallelizeConfig(cp_method="tree"), ConfigError, r"cp_method='tree'"),
    (
        lambda: ht.ParallelizeConfig(param_dtype="bf16"),
        TrainerTypeError,
        r"param_dtype='bf16': give a floating torch.dtype",
    ),
    (
        lambda: ht.ParallelizeConfig(reduce_dtype=torch.int32),
        TrainerTypeError,
        r"reduce_dtype=torch.int32",
    ),
    (lambda: ht.ParallelizeConfig(compile="yes"), TrainerTypeError, r"compile='yes' is a str"),
    (
        lambda: ht.ParallelizeConfig(sequence_parallel=1),
        TrainerTypeError,
        r"sequence_parallel=1 is a int, not a bool",
    ),
    (
        lambda: ht.ParallelizeConfig(reshard_after_forward=0),
        TrainerTypeError,
        r"reshard_after_forward=0",
    ),
    (lambda: ht.ParallelizeConfig(seq_len=0), ConfigError, r"seq_len=0: must be at least 1"),
    (lambda: ht.ParallelizeConfig(seq_len="128"), TrainerTypeError, r"seq_len='128'"),
    (
        lambda: ht.ParallelizeConfig(activation_plan="layers.0=swap"),
        TrainerTypeError,
        r"activation_plan='layers.0=swap' is a str, not a dict",
    ),
    (
        lambda: models.Transformer({"dim": 8}),
        TrainerTypeError,
        r"Transformer: cfg=<object> is a dict, not a TransformerConfig",
    ),
    (lambda: models.from_pretrained(3), TrainerTypeError, r"from_pretrained: path=3"),
    (lambda: ht.load_config(3), TrainerTypeError, r"load_config: path=3"),
    (
        lambda: ht.load_config(None, "--training.steps 3"),
        TrainerTypeError,
        r"overrides='--training.steps 3' is a str, not a list",
    ),
    (
        lambda: ht.load_config(None, ["--training.steps", 3]),
        TrainerTypeError,
        r"overrides\[1\]=3 is a int, not a str",
    ),
    (
        lambda: ht.LLMTrainer({"training": {}}),
        TrainerTypeError,
        r"LLMTrainer: config=<object> is a dict, not a JobConfig",
    ),
    (
        lambda: ht.LLMTrainer(ht.load_config(None, []), callbacks=object()),
        TrainerTypeError,
        r"callbacks=<object> is a object, not a list",
    ),
    (
        lambda: ht.LLMTrainer(ht.load_config(None, []), callbacks=[print]),
        TrainerTypeError,
        r"callbacks\[0\]=<object> .* not a Callback",
    ),
    (lambda: ht.LoggingCallback(log_freq=0), ConfigError, r"log_freq=0: must be at least 1"),
    (lambda: ht.LoggingCallback(log_freq="1"), TrainerTypeError, r"log_freq='1'"),
    (lambda: ht.MoeMonitorCallback(plot="no"), TrainerTypeError, r"plot='no' is a str"),
]


@pytest.mark.parametrize("call,error,pattern", ROWS, ids=[r[2][:40] for r in ROWS])
def test_bad_input_is_refused_by_name(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()


def test_the_type_errors_are_config_errors_and_type_errors():
    assert issubclass(TrainerTypeError, ConfigError) and issubclass(TrainerTypeError, TypeError)


def test_good_input_still_passes():
    ht.ParallelizeConfig(
        param_dtype=torch.bfloat16,
        seq_len=64,
        reshard_after_forward=2,
        activation_plan={"layers.0": "swap"},
    )
    ht.LoggingCallback(log_freq=1, tensorboard=False, plot=False)
    ht.load_config(None, ("--training.steps", "3"))
    assert isinstance(ht.parallelize_llama(_tiny(), parallel_dims=ht.ParallelDims()), nn.Module)
