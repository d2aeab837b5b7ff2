"""Model specs: parameter counts exactly hp-trainer's (models built on the meta device), the
split of each block's parameters as the trainer's parallel styles place them, FLOPs per
token as hp-trainer counts them, and the unknown-model error."""

import subprocess
import sys

import pytest
import torch

from hp_autoparallel import LayerParams, PlanError, UnknownModelError, model_spec
from hp_trainer.models import CONFIGS, Transformer

TINY = [
    "llama3-tiny",
    "qwen3-tiny",
    "qwen3-moe-tiny",
    "deepseek-v3-tiny",
    "qwen3.5-tiny",
    "qwen3.5-moe-tiny",
]


def _meta(name: str) -> Transformer:
    with torch.device("meta"):
        return Transformer(CONFIGS[name])


def _count(model) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied weight once


@pytest.mark.parametrize("name", TINY)
def test_num_params_equals_the_trainers_model(name):
    spec = model_spec(name)
    assert spec.num_params() == _count(_meta(name))


@pytest.mark.parametrize("name", ["llama3-70b", "deepseek-v3-671b"])
def test_num_params_of_the_1024_gpu_models(name):
    spec = model_spec(name)
    model = _meta(name)
    assert spec.num_params() == _count(model)
    if name == "deepseek-v3-671b":  # with its MTP module; 671.03 B without
        assert spec.num_params() == 682_636_472_320
        with torch.device("meta"):
            no_mtp = Transformer(CONFIGS[name].replace(mtp_layers=0))
        assert model_spec(name, mtp_layers=0).num_params() == _count(no_mtp)
    else:
        assert spec.num_params() == 70_553_706_496


def _kind(name: str) -> str:
    """How hp_trainer.parallelize_llama places a block parameter (NOTE [Parameter classes]),
    written out by name here, independently of the spec's formulas."""
    if ".experts." in name:
        return "experts"
    if name.startswith("moe."):  # router, shared experts and their gate: whole on every tp rank
        return "replicated"
    module = name.rsplit(".", 1)[0]
    if "norm" in module.split(".")[-1]:
        return "replicated"
    if name in ("attention.wo.bias", "feed_forward.w2.bias"):
        return "replicated"
    if module in ("attention.wq_a", "attention.wkv_a"):  # MLA's latent projections
        return "replicated"
    return "tp"


@pytest.mark.parametrize("name", TINY)
def test_layer_params_split_as_the_trainer_places_them(name):
    spec = model_spec(name)
    model = _meta(name)
    for i, block in model.layers.items():
        got = {"tp": 0, "replicated": 0, "experts": 0}
        for pname, p in block.named_parameters():
            got[_kind(pname)] += p.numel()
        assert spec.layer_params(int(i)) == LayerParams(**got), (name, i)


def test_layer_params_by_hand_llama3_8b():
    # wq 4096 x 4096, wk / wv 4096 x 1024, wo 4096 x 4096; w1 / w3 14336 x 4096, w2; two norms
    p = model_spec("llama3-8b").layer_params(0)
    assert p.tp == 4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336 == 218_103_808
    assert p.replicated == 2 * 4096
    assert p.experts == 0


def test_deepseek_v3_moe_block_by_hand():
    spec = model_spec("deepseek-v3-671b")
    p = spec.layer_params(3)  # the first MoE block
    assert p.experts == 256 * 3 * 7168 * 2048 == 11_274_289_152
    # router 256 x 7168, one shared expert of 2048; MLA latents wq_a, q_norm, wkv_a, kv_norm
    mla_repl = 7168 * 1536 + 1536 + 7168 * (512 + 64) + 512
    assert p.replicated == 256 * 7168 + 3 * 7168 * 2048 + mla_repl + 2 * 7168
    assert spec.layer_params(0).experts == 0  # the three dense blocks
    assert not spec.layer_is_moe(2) and spec.layer_is_moe(3)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_flops_per_token_is_the_trainers(name):
    spec, cfg = model_spec(name), CONFIGS[name]
    for seq in (2048, 8192):
        assert spec.flops_per_token(seq) == cfg.flops_per_token(seq)
    assert spec.num_params(embeddings=False, active=True) == cfg.num_params(
        embeddings=False, active=True
    )


def test_unknown_model_names_the_nearest():
    with pytest.raises(UnknownModelError, match="did you mean 'llama3-70b'"):
        model_spec("llama3-70")
    with pytest.raises(UnknownModelError, match="--model 'gpt-9'"):
        model_spec("gpt-9")


def test_the_planning_core_imports_no_torch():
    code = (
        "import sys, hp_autoparallel as ap\n"
        "spec = ap.ModelSpec('m', 'llama', 1000, 256, 4, 8, 2, 32, 688)\n"
        "est = ap.estimate(spec, ap.Plan(1, 8, microbatches=2), ap.Workload(16, 512),\n"
        "                  ap.load_gpu('h200'), ap.load_cluster('h200'))\n"
        "assert est.time.total > 0 and est.memory.peak > 0\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "assert 'hp_trainer' not in sys.modules and 'hp_pipeline' not in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_mtp_layers_on_a_model_without_them_is_a_plan_error():
    from hp_trainer import ConfigError

    with pytest.raises(PlanError, match="--mtp-layers.*only deepseek_v3") as info:
        model_spec("llama3-8b", mtp_layers=1)
    assert not isinstance(info.value, ConfigError)
