"""parallelize_llama on 4 CPU ranks against one process on the same data and seed: the first 10
losses within 1e-4 relative (FSDP 2 x TP 2 with sequence parallelism, HSDP 2 x 2), for Llama 3
and Qwen3 (tied embeddings, per-head q/k norms), Qwen3.5 (Gated DeltaNet heads split by
tensor parallelism) and DeepSeek-V3 (MLA's heads split, its latents and shared rotated key
whole; MoE blocks whole on each tensor-parallel rank)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hp_optim import AdamW
from hp_testing.pytest_plugin import rank_pool_fixture
from hp_trainer import ParallelDims, ParallelizeConfig, parallelize_llama
from hp_trainer.models import Transformer, get_config

pool = rank_pool_fixture(4)

STEPS, B, S = 10, 8, 16


def _batch(step):
    """Learnable sequences: arithmetic progressions modulo the vocabulary."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, 256, (B, 1), generator=g)
    stride = torch.randint(1, 4, (B, 1), generator=g)
    ids = (start + stride * torch.arange(S + 1)) % 256
    return ids[:, :-1], ids[:, 1:]


# DeepSeek-V3's MLA (without multi-token prediction, which refuses tensor parallelism): with
# query compression, and without it (DeepSeek-V2-Lite's form)
VARIANTS = {
    "deepseek-v3-tiny": ("deepseek-v3-tiny", {"mtp_layers": 0}),
    "deepseek-v3-tiny-no-q-lora": ("deepseek-v3-tiny", {"mtp_layers": 0, "q_lora_rank": None}),
    "deepseek-v3-tiny-bias": ("deepseek-v3-tiny", {"mtp_layers": 0, "attention_bias": True}),
}


def _model(name):
    torch.manual_seed(0)
    base, overrides = VARIANTS.get(name, (name, {}))
    model = Transformer(get_config(base, max_seq_len=S, **overrides))
    if name.startswith(("qwen3.5", "deepseek-v3-tiny")):  # every DeepSeek variant: a MoE router
        # Gated DeltaNet's decay gradients are tiny sums of large cancelling terms: float32
        # rounding (a different reduction order, as any sharding brings) moves them ~1e-3
        # relative, and AdamW turns that into different steps. In float64 rounding is gone,
        # so the comparison tests the parallel math, not the noise. The same holds for a MoE
        # router's near-ties (float32 rounding flips a top-k choice after some steps).
        model = model.double()
    return model


def _reference(name):
    model = _model(name)
    opt = AdamW(model.parameters(), lr=1e-2)
    out = []
    for step in range(STEPS):
        x, y = _batch(step)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def _parallel(name, dims, sp):
    pd = ParallelDims(**dims, world_size=dist.get_world_size())
    mesh = pd.build_mesh("cpu")
    model = parallelize_llama(
        _model(name), parallel_dims=pd, mesh=mesh, config=ParallelizeConfig(sequence_parallel=sp)
    )
    if pd.dp_replicate > 1 and pd.dp_shard * pd.cp == 1:  # replication, as torchtitan's
        whole = [n for n, p in model.named_parameters() if p.to_local().shape == p.shape]
        assert whole == [n for n, _ in model.named_parameters()], "sharded over dp_replicate"
    names, coord = mesh.mesh_dim_names, mesh.get_coordinate()
    rep = coord[names.index("dp_replicate")] if "dp_replicate" in names else 0
    shard = coord[names.index("dp_shard")] if "dp_shard" in names else 0
    dp_rank = rep * pd.dp_shard + shard
    mine = slice(dp_rank * B // pd.dp, (dp_rank + 1) * B // pd.dp)
    opt = AdamW(model.parameters(), lr=1e-2)
    out = []
    for step in range(STEPS):
        x, y = _batch(step)
        loss = F.cross_entropy(model(x[mine]).flatten(0, 1), y[mine].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)  # tensor-parallel ranks hold the same loss
        out.append(total.item() / dist.get_world_size())
    return out


@pytest.mark.parametrize(
    "name,dims,sp",
    [
        ("llama3-tiny", {"tp": 2}, True),
        ("qwen3-tiny", {"tp": 2}, True),
        ("qwen3.5-tiny", {"tp": 2}, True),  # Gated DeltaNet heads split, FSDP 2 x TP 2
        ("llama3-tiny", {"tp": 2}, False),
        ("llama3-tiny", {"dp_replicate": 2}, True),
        ("llama3-tiny", {"dp_replicate": 4}, True),  # dp_shard 1: whole parameters
        ("deepseek-v3-tiny", {"tp": 2}, True),  # MLA: heads split, latents whole
        ("deepseek-v3-tiny-no-q-lora", {"tp": 2}, False),
    ],
    ids=[
        "fsdp2xtp2-sp-llama",
        "fsdp2xtp2-sp-qwen3",
        "fsdp2xtp2-sp-qwen3.5",
        "fsdp2xtp2-llama",
        "hsdp2x2-llama",
        "replicate4-llama",
        "fsdp2xtp2-sp-deepseek-mla",
        "fsdp2xtp2-deepseek-mla-no-q-lora",
    ],
)
def test_first_losses_match_one_process(pool, name, dims, sp):
    expected = _reference(name)
    # it learns, by far more than the tolerance: the comparison is not vacuous (a tiny MoE at
    # this learning rate falls unevenly: the best loss, not the last)
    assert min(expected[1:]) < expected[0] - 0.05
    for got in pool.run(_parallel, name, dims, sp):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=0)


def _first_gradients(name, dims=None, sp=True):
    """Every parameter's gradient after one forward and backward on the first batch (one
    process when ``dims`` is None), gathered whole."""
    model = _model(name)
    x, y = _batch(0)
    if dims is not None:
        pd = ParallelDims(**dims, world_size=dist.get_world_size())
        mesh = pd.build_mesh("cpu")
        model = parallelize_llama(
            model, parallel_dims=pd, mesh=mesh, config=ParallelizeConfig(sequence_parallel=sp)
        )
        names, coord = mesh.mesh_dim_names, mesh.get_coordinate()
        shard = coord[names.index("dp_shard")] if "dp_shard" in names else 0
        mine = slice(shard * B // pd.dp, (shard + 1) * B // pd.dp)
        x, y = x[mine], y[mine]
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    return {
        n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
        for n, p in model.named_parameters()
    }


@pytest.mark.parametrize(
    "name,sp",
    [
        ("deepseek-v3-tiny-no-q-lora", True),
        ("deepseek-v3-tiny-bias", False),  # latent projections' and wo's biases
    ],
)
def test_mla_tensor_parallel_gradients_equal_one_process(pool, name, sp):
    """Losses alone would hide a constant factor on one tensor's gradient (AdamW normalises
    it away): every gradient of MLA under FSDP 2 x TP 2 against one process, in float64."""
    expected = _first_gradients(name)
    for got in pool.run(_first_gradients, name, {"tp": 2}, sp):
        assert got.keys() == expected.keys()
        for k, g in expected.items():
            torch.testing.assert_close(got[k], g, rtol=1e-9, atol=1e-12, msg=k)


CP_S = 32  # context-parallel runs: 4 tokens per chunk at CP 4 with load balancing


def _cp_batch(step):
    g = torch.Generator().manual_seed(2000 + step)
    start = torch.randint(0, 256, (4, 1), generator=g)
    stride = torch.randint(1, 4, (4, 1), generator=g)
    ids = (start + stride * torch.arange(CP_S + 1)) % 256
    return ids[:, :-1], ids[:, 1:]


def _cp_run(name, dims=None, lb=True, method="ring", steps=5):
    """Losses of ``steps`` AdamW steps and the first step's gradients (gathered whole), with
    context parallelism when ``dims`` (tokens and targets sharded along the sequence)."""
    from hp_dtensor.parallel import context_parallel_shard

    torch.manual_seed(0)
    base, overrides = VARIANTS.get(name, (name, {}))
    model = Transformer(get_config(base, max_seq_len=CP_S, **overrides)).double()
    for m in model.modules():
        if hasattr(m, "delta_rule"):
            m.chunk = 4  # each rank's pieces span several recurrence chunks
    cp_mesh = None
    if dims is not None:
        pd = ParallelDims(**dims, world_size=dist.get_world_size())
        mesh = pd.build_mesh("cpu")
        cp_mesh = mesh["cp"]
        conf = ParallelizeConfig(cp_method=method, cp_load_balance=lb, seq_len=CP_S)
        model = parallelize_llama(model, parallel_dims=pd, mesh=mesh, config=conf)
    opt = AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], None
    for step in range(steps):
        x, y = _cp_batch(step)
        if cp_mesh is not None:
            x, y = (context_parallel_shard(t, cp_mesh, 1, load_balance=lb) for t in (x, y))
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        if step == 0:
            grads = {
                n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                for n, p in model.named_parameters()
            }
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(total)  # each context-parallel rank's tokens' mean: average them
            total /= dist.get_world_size()
        losses.append(total.item())
    return losses, grads


@pytest.mark.parametrize(
    "name,dims,lb,method",
    [
        ("qwen3.5-tiny", {"cp": 2, "dp_shard": 2}, True, "ring"),  # Gated DeltaNet + gated attn
        ("qwen3.5-tiny", {"cp": 4, "dp_shard": 1}, True, "allgather"),
        ("qwen3.5-tiny", {"cp": 2, "tp": 2, "dp_shard": 1}, False, "ring"),
        ("qwen3.5-tiny", {"cp": 2, "tp": 2, "dp_shard": 1}, True, "ulysses"),
        ("llama3-tiny", {"cp": 4, "dp_shard": 1}, True, "ring"),
        ("deepseek-v3-tiny-no-q-lora", {"cp": 2, "dp_shard": 2}, True, "ring"),  # MLA, MoE
    ],
    ids=[
        "qwen3.5-cp2xfsdp2",
        "qwen3.5-cp4",
        "qwen3.5-cp2xtp2-no-lb",
        "qwen3.5-cp2xtp2-ulysses",
        "llama-cp4",
        "deepseek-mla-cp2xfsdp2",
    ],
)
def test_context_parallel_equals_one_process(pool, name, dims, lb, method):
    """Float64, 5 AdamW steps: the losses and the first step's every gradient against one
    process. Qwen3.5's Gated DeltaNet layers pass their recurrent state between the ranks."""
    ref_losses, ref_grads = _cp_run(name)
    for losses, grads in pool.run(_cp_run, name, dims, lb, method):
        torch.testing.assert_close(losses, ref_losses, rtol=1e-9, atol=0)
        for k, g in ref_grads.items():
            torch.testing.assert_close(grads[k], g, rtol=1e-8, atol=1e-12, msg=k)


def _cp_guards():
    """Under CP the rotary tables follow the layout even after init_buffers rebuilt them
    whole; a batch of another length, and a second application, are refused."""
    from hp_dtensor.parallel import context_parallel_shard
    from hp_trainer import apply_context_parallel

    pd = ParallelDims(cp=2, dp_shard=2, world_size=4)
    mesh = pd.build_mesh("cpu")
    torch.manual_seed(0)
    model = parallelize_llama(
        Transformer(get_config("llama3-tiny", max_seq_len=CP_S)),
        parallel_dims=pd,
        mesh=mesh,
        config=ParallelizeConfig(seq_len=CP_S),
    )
    x, _ = _cp_batch(0)
    xl = context_parallel_shard(x, mesh["cp"], 1)
    with torch.no_grad():
        before = model(xl)
        model.init_buffers()  # whole tables again: re-sharded at the next forward
        after = model(xl)
    out = {"rebuilt": torch.equal(before, after)}
    try:
        model(xl[:, :8])
        out["length"] = False
    except ValueError as e:
        out["length"] = "set up for sequences of 32 tokens (16 per rank)" in str(e)
    try:
        apply_context_parallel(model, mesh["cp"], seq_len=CP_S)
        out["twice"] = False
    except ValueError as e:
        out["twice"] = "context-parallel already" in str(e)
    return out


def test_context_parallel_guards(pool):
    for res in pool.run(_cp_guards):
        assert all(res.values()), res


def _with_kernels(name, dims, sp):
    """The same run with hp_dtensor's CPU collectives on hp_kernels' shared memory."""
    import hp_dtensor
    from hp_trainer import kernels_backend

    kernels_backend.enable()
    losses = _parallel(name, dims, sp)
    platform = hp_dtensor.get_platform("cpu")
    return losses, platform.name, platform.calls


def test_hp_kernels_collectives_match_one_process():
    from hp_testing import run_ranks

    expected = _reference("llama3-tiny")
    for got, platform, calls in run_ranks(
        _with_kernels, 4, args=("llama3-tiny", {"tp": 2}, True), timeout=300
    ):
        assert platform == "torch+hp_kernels" and calls > 100  # TP's collectives went through it
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=0)
