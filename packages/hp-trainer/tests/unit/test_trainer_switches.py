"""The trainer's switches on one process: bf16 mixed precision (autocast, fp32 master weights),
``training.compile`` against eager, ``training.on_nonfinite`` ("skip" leaves the state as it
was, "stop" writes the last good step's checkpoint), plain progress lines in a log file, and
settings that cannot apply refused rather than ignored."""

import copy

import pytest
import torch
import torch.nn as nn

from hp_trainer import (
    Callback,
    ConfigError,
    LLMTrainer,
    LoggingCallback,
    NonFiniteError,
    load_config,
)

FAST = ["--training.seq_len", "32", "--training.global_batch_size", "4"]
QUIET = ["--metrics.tensorboard", "false", "--metrics.plot", "false"]


def _cfg(tmp_path, steps, *extra, name="run", ckpt=False):
    args = [*FAST, *QUIET, "--job.dump_folder", str(tmp_path / name)]
    args += ["--training.steps", str(steps), "--checkpoint.enable", str(ckpt).lower(), *extra]
    return load_config(None, args)


def test_bf16_on_one_process_is_autocast_with_fp32_master_weights(tmp_path):
    fp32 = LLMTrainer(_cfg(tmp_path, 4, name="a")).train()
    trainer = LLMTrainer(_cfg(tmp_path, 4, "--training.mixed_precision_param", "bfloat16"))
    seen = []
    for m in trainer.model.modules():
        if isinstance(m, nn.Linear):
            m.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    bf16 = trainer.train()
    assert seen and set(seen) == {torch.bfloat16}  # every matmul ran in bf16
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    assert all(
        v.dtype == torch.float32
        for st in trainer.optimizer.state.values()
        for k, v in st.items()
        if k in ("exp_avg", "exp_avg_sq")
    )
    assert bf16 != fp32  # honoured, not ignored ...
    assert max(abs(a - b) for a, b in zip(bf16, fp32)) < 0.05  # ... and close to fp32


def test_settings_with_nothing_to_act_on_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="mixed_precision_reduce='bfloat16'.*no data parallel"):
        LLMTrainer(_cfg(tmp_path, 1, "--training.mixed_precision_reduce", "bfloat16"))
    with pytest.raises(ConfigError, match="training.on_nonfinite='maybe'"):
        _cfg(tmp_path, 1, "--training.on_nonfinite", "maybe")
    with pytest.raises(ConfigError, match="comm.train_timeout_s=0.0"):
        _cfg(tmp_path, 1, "--comm.train_timeout_s", "0")
    from hp_trainer import preflight

    for extra in (
        ["--parallelism.tensor_parallel_degree", "2"],
        ["--parallelism.context_parallel_degree", "2"],
    ):
        with pytest.raises(ConfigError, match="training.compile=true"):
            preflight(_cfg(tmp_path, 1, "--training.compile", "true", *extra), 2)


def test_compile_matches_eager(tmp_path):
    from torch._dynamo.utils import counters

    eager = LLMTrainer(_cfg(tmp_path, 3, name="eager")).train()
    counters.clear()
    compiled = LLMTrainer(_cfg(tmp_path, 3, "--training.compile", "true")).train()
    assert counters["stats"]["unique_graphs"] >= 1  # the blocks did go through torch.compile
    assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-5)


class _Watch(Callback):
    """Per step: the compiled graphs so far and each MoE layer's token counts and drops."""

    def __init__(self):
        self.graphs, self.moe = [], []

    def on_step_end(self, trainer, step, metrics):
        from torch._dynamo.utils import counters

        self.graphs.append(counters["stats"]["unique_graphs"])
        self.moe.append([(st["tokens"], st["dropped"]) for st in metrics.get("moe", [])])


def test_compile_traces_moe_layers_without_a_graph_per_routing(tmp_path):
    """A MoE model (no expert parallelism) in fp32 with compiled blocks: the same losses as
    eager and no new graph after the second step, whatever the routing (tracing the routing
    once made 21 graphs in 4 steps of this model, one per step's counts); the recomputation
    check is read before the call. (The traced MoE layer is checked under autocast below.)
    In fp32 the experts
    have no grouped GEMM, and the MoE layer runs eagerly as a whole (the one break: with the
    loop of matmuls breaking the graph inside the traced layer, an H200 lost most of the
    layer's gradient). Each step's token counts per layer are eager's, also with full
    recomputation (each forward counted once, the recomputation not at all)."""
    from torch._dynamo.utils import counters

    from hp_moe import MoE

    moe = ["--model.name", "deepseek-v3-tiny"]
    for extra in ([], ["--activation_checkpoint.mode", "full"]):
        ref = _Watch()
        eager = LLMTrainer(_cfg(tmp_path, 5, *moe, *extra, name="eager"), callbacks=[ref])
        eager = eager.train()
        torch._dynamo.reset()
        counters.clear()
        seen = _Watch()
        trainer = LLMTrainer(
            _cfg(tmp_path, 5, *moe, *extra, "--training.compile", "true"), callbacks=[seen]
        )
        compiled = trainer.train()
        assert seen.graphs[0] >= 2 and seen.graphs[1:] == [seen.graphs[1]] * 4, seen.graphs
        breaks = {str(k) for k in counters["graph_break"]}
        assert breaks and all("MoE.forward" in b for b in breaks), breaks
        assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-5)
        assert seen.moe == ref.moe and seen.moe[0], (seen.moe, ref.moe)
        layers = [m for m in trainer.model.modules() if isinstance(m, MoE)]
        assert layers and all(m._recomputing is None for m in layers)


@pytest.mark.parametrize("aux", ["sequence", "global"])
def test_compile_leaves_moe_layers_with_an_auxiliary_loss_eager(tmp_path, aux):
    """A MoE layer with an auxiliary loss stays eager inside its compiled block: with full
    recomputation (its loss asks whether the recomputation is non-reentrant) and with the
    "global" loss over two micro-steps (its weights read a buffer the step updates) the
    losses and token counts are eager's."""
    moe = ["--model.name", "deepseek-v3-tiny", "--moe.aux_loss_coeff", "0.01"]
    moe += ["--moe.aux_loss_type", aux, "--training.local_batch_size", "2"]
    moe += ["--activation_checkpoint.mode", "full"]
    ref, seen = _Watch(), _Watch()
    eager = LLMTrainer(_cfg(tmp_path, 3, *moe, name="eager"), callbacks=[ref]).train()
    torch._dynamo.reset()
    trainer = LLMTrainer(_cfg(tmp_path, 3, *moe, "--training.compile", "true"), callbacks=[seen])
    compiled = trainer.train()
    assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-6)
    assert seen.moe == ref.moe
    from hp_moe import MoE

    assert all("forward" in m.__dict__ for m in trainer.model.modules() if isinstance(m, MoE))


def test_compile_mode_is_honoured_or_refused(tmp_path, monkeypatch):
    """training.compile_mode reaches torch.compile for every block; set without compile, or a
    CUDA-graph mode on several processes, or a name torch does not have, it is refused."""
    from hp_trainer import preflight

    modes = []
    real = torch.compile

    def spy(fn, **kw):
        modes.append(kw.get("mode"))
        return real(fn, **{**kw, "mode": "default"})

    monkeypatch.setattr(torch, "compile", spy)
    cfg = _cfg(
        tmp_path,
        1,
        "--training.compile",
        "true",
        "--training.compile_mode",
        "max-autotune-no-cudagraphs",
    )
    trainer = LLMTrainer(cfg)
    assert modes and set(modes) == {"max-autotune-no-cudagraphs"}
    assert len(modes) == len(list(trainer.model.layers.values()))
    with pytest.raises(ConfigError, match="compile_mode='reduce-overhead'.*needs training.compile"):
        _cfg(tmp_path, 1, "--training.compile_mode", "reduce-overhead")
    with pytest.raises(ConfigError, match="compile_mode='fast'"):
        _cfg(tmp_path, 1, "--training.compile", "true", "--training.compile_mode", "fast")
    cuda_graphs = _cfg(
        tmp_path, 1, "--training.compile", "true", "--training.compile_mode", "reduce-overhead"
    )
    with pytest.raises(ConfigError, match="captures CUDA graphs.*one process"):
        preflight(cuda_graphs, 2)
    preflight(cuda_graphs, 1)
    recomputed = _cfg(
        tmp_path,
        1,
        "--training.compile",
        "true",
        "--training.compile_mode",
        "max-autotune",
        "--activation_checkpoint.mode",
        "full",
    )
    with pytest.raises(ConfigError, match="captures CUDA graphs.*activation checkpointing"):
        preflight(recomputed, 1)
    for ac in (
        ["--activation_checkpoint.mode", "selective"],
        ["--activation_checkpoint.plan", "layers.0=selective"],
    ):
        selective = _cfg(tmp_path, 1, "--training.compile", "true", *ac)
        with pytest.raises(ConfigError, match="compile=true with selective recomputation"):
            preflight(selective, 1)


class _Poison:
    """Make the model's forward return NaN logits on its ``at``-th call."""

    def __init__(self, trainer, at):
        self.calls, self.at = 0, at
        inner = trainer.model.forward

        def forward(*args, **kwargs):
            self.calls += 1
            out = inner(*args, **kwargs)
            return out * float("nan") if self.calls == self.at else out

        trainer.model.forward = forward


def _snapshot(trainer):
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


@pytest.mark.parametrize("model", ["llama3-tiny", "deepseek-v3-tiny"])
def test_skip_leaves_the_state_as_it_was(tmp_path, model, capsys):
    t = LLMTrainer(_cfg(tmp_path, 4, "--model.name", model, "--training.on_nonfinite", "skip"))
    _Poison(t, at=2)
    t.train_step()
    before, opt_before = _snapshot(t), copy.deepcopy(t.optimizer.state_dict())
    lr = t.optimizer.param_groups[0]["lr"]
    out = t.train_step()
    assert out["skipped"] and out["loss"] != out["loss"]  # NaN, logged
    after = _snapshot(t)
    assert all(torch.equal(before[k], after[k]) for k in before)  # expert_bias included
    assert t.optimizer.state_dict()["state"].keys() == opt_before["state"].keys()
    for k, st in t.optimizer.state_dict()["state"].items():
        assert torch.equal(st["step"], opt_before["state"][k]["step"])
    assert t.optimizer.param_groups[0]["lr"] == lr  # the schedule did not move
    if model == "deepseek-v3-tiny":  # the skipped step's counts are not carried over
        assert all(
            m.tokens_per_expert.sum() == 0
            for m in t.model.modules()
            if hasattr(m, "tokens_per_expert")
        )
    assert t.step == 2 and "step 2: loss nan" in capsys.readouterr().out
    nxt = t.train_step()
    assert not nxt.get("skipped") and nxt["loss"] == nxt["loss"]


def test_stop_writes_the_last_good_step(tmp_path):
    cfg = _cfg(tmp_path, 6, "--checkpoint.interval", "100", ckpt=True)
    t = LLMTrainer(cfg)
    _Poison(t, at=3)
    with pytest.raises(NonFiniteError, match=r"step 3: loss nan.*step-2"):
        t.train()
    good = LLMTrainer(_cfg(tmp_path, 6, name="good")).train()  # never poisoned
    resumed = LLMTrainer(cfg)  # picks up the checkpoint of step 2
    assert resumed.step == 2 and resumed.losses == good[:2]
    assert resumed.train() == good  # the state was step 2's, untouched by step 3


def test_log_file_gets_plain_lines_not_a_progress_bar(tmp_path, capsys):
    log = LoggingCallback(log_freq=2, tensorboard=False, plot=False)
    LLMTrainer(_cfg(tmp_path, 4), callbacks=[log]).train()
    assert log.bar is None  # pytest's captured stderr is no terminal
    out = capsys.readouterr()
    assert [ln.split()[:2] for ln in out.out.splitlines() if ln.startswith("step")] == [
        ["step", "1"],
        ["step", "2"],
        ["step", "4"],
    ]
    assert "\r" not in out.out + out.err


def _count_calls(module, counter, key):
    module.register_forward_hook(lambda mod, args, out: counter.__setitem__(key, counter[key] + 1))


def test_swap_and_per_layer_plans_keep_the_losses(tmp_path):
    plain = LLMTrainer(_cfg(tmp_path, 3, name="plain")).train()
    swap = LLMTrainer(_cfg(tmp_path, 3, "--activation_checkpoint.mode", "swap", name="swap"))
    out = [swap.train_step() for _ in range(3)]
    assert [o["loss"] for o in out] == plain  # swapped out and back: the same bits
    assert all(o["swapped_gib"] > 0 for o in out)  # and they did leave
    for plan, kinds in (("layers.0=swap", ("swap", "full")), ("layers.1=none", ("full", "none"))):
        t = LLMTrainer(
            _cfg(
                tmp_path,
                3,
                "--activation_checkpoint.mode",
                "full",
                "--activation_checkpoint.plan",
                plan,
                name=plan,
            )
        )
        calls = dict.fromkeys(kinds, 0)
        for key, block in zip(kinds, t.model.layers.values()):
            _count_calls(block.attention, calls, key)
        assert t.train() == plain
        # one forward per step, but two where the block is recomputed in backward ("full")
        assert calls == {k: 6 if k == "full" else 3 for k in kinds}, plan


def test_bad_activation_plans_and_offload_without_fsdp_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="plan: entry 'layers.0'"):
        _cfg(tmp_path, 1, "--activation_checkpoint.plan", "layers.0")
    with pytest.raises(ConfigError, match="plan: entry 'layers.0=fast'"):
        _cfg(tmp_path, 1, "--activation_checkpoint.plan", "layers.0=fast")
    with pytest.raises(ConfigError, match="pattern 'layers.9' matches no module"):
        LLMTrainer(_cfg(tmp_path, 1, "--activation_checkpoint.plan", "layers.9=swap"))
    with pytest.raises(ConfigError, match="fsdp_cpu_offload=true.*no data parallelism"):
        LLMTrainer(_cfg(tmp_path, 1, "--parallelism.fsdp_cpu_offload", "true"))
    with pytest.raises(ConfigError, match="compile=true with swapped activations"):
        LLMTrainer(
            _cfg(tmp_path, 1, "--training.compile", "true", "--activation_checkpoint.mode", "swap")
        )


def test_async_tp_refuses_what_it_cannot_fuse(tmp_path):
    from hp_trainer import preflight

    tp2 = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.async_tp", "true"]
    for extra, message in [
        (["--parallelism.async_tp", "true"], "needs tensor_parallel_degree > 1"),
        ([*tp2, "--parallelism.sequence_parallel", "false"], "sequence_parallel = true"),
        ([*tp2, "--activation_checkpoint.mode", "selective"], "selective recomputation"),
        ([*tp2, "--activation_checkpoint.plan", "layers.0=selective"], "selective"),
        ([*tp2, "--training.seq_len", "33"], r"sequence \(33 tokens\) must divide"),
    ]:
        with pytest.raises(ConfigError, match=message):
            preflight(_cfg(tmp_path, 1, *extra), 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("name", ["deepseek-v3-tiny", "qwen3-moe-tiny"])
def test_compiled_moe_model_gradients_on_cuda_equal_eager(name, autocast):
    """On CUDA: one forward and backward of a MoE model through parallelize_llama with
    compile, against eager. fp32 (the MoE layers eager): every parameter's gradient within
    1e-4 relative (with the loop of matmuls as a graph break inside a traced MoE layer, an
    H200 kept the forward's values and lost 95% of the gradient's norm). bf16 autocast (the
    MoE layers traced, the grouped GEMM): bf16 routing near-ties move gradients by 10-30%, so
    each gradient's norm within 30% of eager's (a lost gradient is 5%)."""
    import torch.nn.functional as F

    from hp_trainer import ParallelDims, ParallelizeConfig, parallelize_llama
    from hp_trainer.models import Transformer, get_config

    torch.manual_seed(0)
    base = Transformer(get_config(name, max_seq_len=128)).cuda()
    x = torch.randint(0, 256, (4, 128), device="cuda")
    y = torch.randint(0, 256, (4, 128), device="cuda")
    grads = []
    for comp in (False, True):
        torch._dynamo.reset()
        m = copy.deepcopy(base)
        dtype = torch.bfloat16 if autocast else None
        cfg = ParallelizeConfig(compile=comp, param_dtype=dtype)
        parallelize_llama(m, parallel_dims=ParallelDims(world_size=1), config=cfg)
        F.cross_entropy(m(x).flatten(0, 1).float(), y.flatten()).backward()
        grads.append({n: p.grad for n, p in m.named_parameters()})
    for n, g in grads[0].items():
        if autocast:
            ratio = (grads[1][n].norm() / g.norm().clamp_min(1e-30)).item()
            assert 0.7 < ratio < 1.3, (n, ratio)
        else:
            rel = ((g - grads[1][n]).norm() / g.norm().clamp_min(1e-30)).item()
            assert rel < 1e-4, (n, rel)


def test_compile_traces_moe_layers_under_autocast(tmp_path):
    """bf16 autocast over fp32 parameters (the one-process trainer's mixed precision): the
    experts compute in bf16 and take the grouped GEMM, so the MoE layers are traced with their
    blocks: no graph break, no new graph after the second step, and each step's token counts
    as eager's routing gives them (bf16 near-ties may route a copy differently: the losses
    within 2%)."""
    from torch._dynamo.utils import counters

    moe = ["--model.name", "deepseek-v3-tiny", "--training.mixed_precision_param", "bfloat16"]
    ref = _Watch()
    eager = LLMTrainer(_cfg(tmp_path, 4, *moe, name="eager"), callbacks=[ref]).train()
    torch._dynamo.reset()
    counters.clear()
    seen = _Watch()
    compiled = LLMTrainer(
        _cfg(tmp_path, 4, *moe, "--training.compile", "true"), callbacks=[seen]
    ).train()
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert seen.graphs[0] >= 2 and seen.graphs[1:] == [seen.graphs[1]] * 3, seen.graphs
    assert compiled == pytest.approx(eager, rel=2e-2)

    def routed(watch):  # copies routed per step, all layers (each forward counted once)
        return [sum(sum(tokens) for tokens, _ in step) for step in watch.moe]

    assert routed(seen) == routed(ref) and routed(ref)[0] > 0
