"""One process: round trips, crash safety, checksums, error messages, HuggingFace and PyTorch DCP
interop, the CLI and async_save."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import hp_dcp
from hp_dcp import (
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    LoadPlanner,
    StateDictError,
)
from hp_dcp._cli import main as cli
from hp_testing.models import TinyLlama


def _values():
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(5, 3, generator=g),
        "nested": {
            "bf16": torch.randn(7, generator=g).bfloat16(),
            "list": [torch.arange(6).view(2, 3), torch.tensor(2.5), "text"],
            "empty": torch.zeros(0, 4),
        },
        "t_view": torch.randn(4, 6, generator=g).t(),  # not contiguous
        "flag": torch.tensor([True, False, True]),
        "step": 17,
        "meta": {"lr": 0.1, "name": "run", "pos": (3, 4)},
    }


def _blank(v):
    if isinstance(v, torch.Tensor):
        return torch.zeros_like(v) if v.dtype != torch.bool else torch.zeros_like(v)
    if isinstance(v, dict):
        return {k: _blank(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_blank(x) for x in v]
    return None


def _assert_same(a, b, path=""):
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}.{i}")
    else:
        assert a == b, path


def test_roundtrip_nested(tmp_path):
    src = _values()
    md = hp_dcp.save(src, checkpoint_id=tmp_path / "c")
    assert set(md.tensors) == {
        "a",
        "nested.bf16",
        "nested.list.0",
        "nested.list.1",
        "nested.empty",
        "t_view",
        "flag",
    }
    assert set(md.objects) == {"nested.list.2", "step", "meta.lr", "meta.name", "meta.pos"}
    dst = _blank(src)
    hp_dcp.load(dst, checkpoint_id=tmp_path / "c")
    _assert_same(src, dst)
    assert sorted(os.listdir(tmp_path)) == ["c"]  # no partial folder left behind


def test_overwrite_replaces_atomically(tmp_path):
    hp_dcp.save({"w": torch.ones(3)}, checkpoint_id=tmp_path / "c")
    hp_dcp.save({"w": torch.full((3,), 2.0)}, checkpoint_id=tmp_path / "c")
    out = {"w": torch.zeros(3)}
    hp_dcp.load(out, checkpoint_id=tmp_path / "c")
    assert torch.equal(out["w"], torch.full((3,), 2.0))
    assert sorted(os.listdir(tmp_path)) == ["c"]


_KILLER = textwrap.dedent(
    """
    import os, signal, sys, torch, hp_dcp
    path, value = sys.argv[1], float(sys.argv[2])

    class Dies(hp_dcp.FileSystemWriter):
        def write(self, rank, items):
            items = list(items)
            super().write(rank, items[:1])  # some bytes reach the disk, then the process dies
            os.kill(os.getpid(), signal.SIGKILL)

    sd = {"w": torch.full((1000,), value), "v": torch.full((10,), value)}
    hp_dcp.save(sd, checkpoint_id=path, storage_writer=Dies(path) if value < 0 else None)
    """
)


def test_killed_mid_save_keeps_previous_and_refuses_partial(tmp_path):
    path = tmp_path / "ckpt"

    def run(value):
        return subprocess.run([sys.executable, "-c", _KILLER, str(path), str(value)])

    assert run(1.0).returncode == 0
    assert run(-1.0).returncode == -signal.SIGKILL
    partial = tmp_path / ".ckpt.partial"
    assert (partial / "data_00000.bin").exists()
    out = {"w": torch.zeros(1000), "v": torch.zeros(10)}
    hp_dcp.load(out, checkpoint_id=path)  # the previous checkpoint is intact
    assert torch.equal(out["w"], torch.ones(1000))
    with pytest.raises(IncompleteCheckpointError, match="not a committed checkpoint"):
        hp_dcp.load(out, checkpoint_id=partial)
    # a first save killed: nothing at the path, and the error points at the partial folder
    path = tmp_path / "fresh"
    assert run(-1.0).returncode == -signal.SIGKILL
    with pytest.raises(CheckpointError, match="partial save exists.*did not finish"):
        hp_dcp.load(out, checkpoint_id=path)
    # the next successful save into a path cleans its partial folder up
    assert run(3.0).returncode == 0
    assert sorted(os.listdir(tmp_path)) == [".ckpt.partial", "ckpt", "fresh"]


def test_flipped_byte_is_reported(tmp_path):
    hp_dcp.save({"a": torch.randn(64), "b": torch.randn(32, 8)}, checkpoint_id=tmp_path / "c")
    md = hp_dcp.open_checkpoint(tmp_path / "c").metadata
    chunk = md.tensors["b"].chunks[0]
    f = tmp_path / "c" / chunk.file
    raw = bytearray(f.read_bytes())
    raw[chunk.offset + 100] ^= 0x10
    f.write_bytes(bytes(raw))
    with pytest.raises(
        CorruptCheckpointError, match=r"checksum mismatch in .*data_00000\.bin.*for 'b'"
    ):
        hp_dcp.load({"b": torch.zeros(32, 8)}, checkpoint_id=tmp_path / "c")
    out = {"a": torch.zeros(64)}
    hp_dcp.load(out, checkpoint_id=tmp_path / "c")  # the other tensor is fine
    problems = hp_dcp.verify(tmp_path / "c")
    assert len(problems) == 1 and "'b'" in problems[0] and "data_00000.bin" in problems[0]
    assert cli(["verify", str(tmp_path / "c")]) == 1


def test_load_errors_name_the_tensor(tmp_path):
    hp_dcp.save({"layer.weight": torch.ones(4, 3), "step": 1}, checkpoint_id=tmp_path / "c")
    with pytest.raises(StateDictError, match=r"lacks 'layer.wieght' \(did you mean 'layer.weight'"):
        hp_dcp.load({"layer.wieght": torch.zeros(4, 3)}, checkpoint_id=tmp_path / "c")
    with pytest.raises(
        StateDictError, match=r"shape mismatch for 'layer.weight'.*\(4, 3\).*\(3, 4\)"
    ):
        hp_dcp.load({"layer.weight": torch.zeros(3, 4)}, checkpoint_id=tmp_path / "c")
    with pytest.raises(StateDictError, match="'step' \\(stored as a non-tensor value\\)"):
        hp_dcp.load({"step": torch.zeros(())}, checkpoint_id=tmp_path / "c")
    out = {"layer.weight": torch.zeros(4, 3), "other": torch.zeros(2)}
    hp_dcp.load(out, checkpoint_id=tmp_path / "c", planner=LoadPlanner(allow_partial_load=True))
    assert torch.equal(out["layer.weight"], torch.ones(4, 3)) and torch.equal(
        out["other"], torch.zeros(2)
    )
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        hp_dcp.load(out, checkpoint_id=tmp_path / "nope")
    with pytest.raises(
        StateDictError, match="key .f.: value: a builtins.function cannot be stored as data"
    ):
        hp_dcp.save({"f": lambda: 1}, checkpoint_id=tmp_path / "d")
    with pytest.raises(StateDictError, match="must be a dict"):
        hp_dcp.save([torch.ones(1)], checkpoint_id=tmp_path / "d")
    assert not (tmp_path / "d").exists()


def test_model_optimizer_rng_resume(tmp_path):
    def make(seed):
        torch.manual_seed(seed)
        m = TinyLlama()
        return m, torch.optim.AdamW(m.parameters(), lr=1e-2)

    def step(m, opt):
        ids = torch.randint(0, 37, (2, 8))  # drawn from the RNG: resumes only if RNG resumes
        loss = torch.nn.functional.cross_entropy(m(ids).flatten(0, 1), ids.roll(1, 1).flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    m, opt = make(0)
    step(m, opt)
    state = {
        "model": hp_dcp.ModelState(m),
        "optim": hp_dcp.OptimizerState(m, opt),
        "rng": hp_dcp.RNGState(),
        "step": 1,
    }
    hp_dcp.save(state, checkpoint_id=tmp_path / "c")
    expected = [step(m, opt) for _ in range(2)]
    m2, opt2 = make(5)
    state2 = {
        "model": hp_dcp.ModelState(m2),
        "optim": hp_dcp.OptimizerState(m2, opt2),
        "rng": hp_dcp.RNGState(),
        "step": 0,
    }
    hp_dcp.load(state2, checkpoint_id=tmp_path / "c")
    assert state2["step"] == 1
    assert [step(m2, opt2) for _ in range(2)] == expected
    for p, q in zip(m.parameters(), m2.parameters()):
        assert torch.equal(p, q)


# --------------------------------------------------------------------------------------------
# HuggingFace
# --------------------------------------------------------------------------------------------

HF_MAP = {
    r"tok\.weight": "model.embed_tokens.weight",
    r"norm\.weight": "model.norm.weight",
    r"out\.weight": "lm_head.weight",
    r"layers\.(\d+)\.attention_norm\.weight": r"model.layers.\1.input_layernorm.weight",
    r"layers\.(\d+)\.ffn_norm\.weight": r"model.layers.\1.post_attention_layernorm.weight",
    r"layers\.(\d+)\.wq\.weight": r"model.layers.\1.self_attn.q_proj.weight",
    r"layers\.(\d+)\.wk\.weight": r"model.layers.\1.self_attn.k_proj.weight",
    r"layers\.(\d+)\.wv\.weight": r"model.layers.\1.self_attn.v_proj.weight",
    r"layers\.(\d+)\.wo\.weight": r"model.layers.\1.self_attn.o_proj.weight",
    r"layers\.(\d+)\.w1\.weight": r"model.layers.\1.mlp.gate_proj.weight",
    r"layers\.(\d+)\.w3\.weight": r"model.layers.\1.mlp.up_proj.weight",
    r"layers\.(\d+)\.w2\.weight": r"model.layers.\1.mlp.down_proj.weight",
    r"layers\.(\d+)\.w2\.bias": None,  # HF Llama has no down_proj bias: zeroed below, dropped
}


def _hf_pair(tmp_path):
    torch.manual_seed(0)
    model = TinyLlama(vocab=37, dim=24, layers=2, heads=4, kv_heads=2, hidden=42, seq=8)
    with torch.no_grad():
        for layer in model.layers:
            layer.w2.bias.zero_()
    hp_dcp.save(model.state_dict(), checkpoint_id=tmp_path / "dcp")
    return model


def test_export_hf_loads_in_safetensors_and_transformers(tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, LlamaConfig

    model = _hf_pair(tmp_path)
    index = hp_dcp.export_hf(
        tmp_path / "dcp", tmp_path / "hf", name_map=HF_MAP, max_shard_bytes=20_000
    )
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1  # sharded
    sd = model.state_dict()
    seen = 0
    for f in files:
        with safe_open(str(tmp_path / "hf" / f), framework="pt") as st:
            for name in st.keys():
                ours = next(k for k in sd if hp_dcp._convert._renamer(HF_MAP)(k) == name)
                assert torch.equal(st.get_tensor(name), sd[ours]), name
                seen += 1
    assert seen == len(sd) - 2  # the two biases dropped
    LlamaConfig(
        vocab_size=37,
        hidden_size=24,
        intermediate_size=42,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ).save_pretrained(tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    ids = torch.randint(0, 37, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), rtol=1e-5, atol=1e-5)
    # and back: import with the inverse map gives the same tensors
    inverse = {
        "model\\.embed_tokens\\.weight": "tok.weight",
        "model\\.norm\\.weight": "norm.weight",
        "lm_head\\.weight": "out.weight",
        r"model\.layers\.(\d+)\.input_layernorm\.weight": r"layers.\1.attention_norm.weight",
        r"model\.layers\.(\d+)\.post_attention_layernorm\.weight": r"layers.\1.ffn_norm.weight",
        r"model\.layers\.(\d+)\.self_attn\.q_proj\.weight": r"layers.\1.wq.weight",
        r"model\.layers\.(\d+)\.self_attn\.k_proj\.weight": r"layers.\1.wk.weight",
        r"model\.layers\.(\d+)\.self_attn\.v_proj\.weight": r"layers.\1.wv.weight",
        r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight": r"layers.\1.wo.weight",
        r"model\.layers\.(\d+)\.mlp\.gate_proj\.weight": r"layers.\1.w1.weight",
        r"model\.layers\.(\d+)\.mlp\.up_proj\.weight": r"layers.\1.w3.weight",
        r"model\.layers\.(\d+)\.mlp\.down_proj\.weight": r"layers.\1.w2.weight",
    }
    hp_dcp.convert(tmp_path / "hf", tmp_path / "back", to="dcp", name_map=inverse)
    fresh = TinyLlama()
    back = {k: v for k, v in fresh.state_dict().items() if not k.endswith("w2.bias")}
    hp_dcp.load(back, checkpoint_id=tmp_path / "back")
    for k, v in back.items():
        assert torch.equal(v, sd[k]), k


def test_load_directly_from_safetensors_by_byte_range(tmp_path):
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    tensors = {"x": torch.randn(10, 6, generator=g), "y": torch.randn(5, generator=g).half()}
    save_file(tensors, str(tmp_path / "m.safetensors"))
    part = {"x": torch.zeros(10, 6), "y": torch.zeros(5, dtype=torch.float16)}
    hp_dcp.load(part, checkpoint_id=tmp_path / "m.safetensors")
    assert torch.equal(part["x"], tensors["x"]) and torch.equal(part["y"], tensors["y"])
    reader = hp_dcp.open_checkpoint(tmp_path)
    e = reader.metadata.tensors["x"]
    item = hp_dcp.ReadItem(e.chunks[0], (3, 2), (4, 3))
    dest = torch.zeros(4, 3)
    assert reader.read_into("x", e, item, dest) == 4 * 6 * 4  # only rows 3..6 read
    assert torch.equal(dest, tensors["x"][3:7, 2:5])


# --------------------------------------------------------------------------------------------
# PyTorch DCP as a source
# --------------------------------------------------------------------------------------------


def test_loads_torch_dcp_checkpoint(tmp_path):
    import torch.distributed.checkpoint as tdcp

    torch.manual_seed(0)
    m = TinyLlama()
    src = {"model": m.state_dict(), "extra": {"step": 5, "note": "x"}}
    tdcp.save(src, checkpoint_id=str(tmp_path / "t"), no_dist=True)
    assert hp_dcp.open_checkpoint(tmp_path / "t").metadata.source == "torch-dcp"
    dst = {"model": TinyLlama().state_dict(), "extra": {"step": 0, "note": None}}
    hp_dcp.load(dst, checkpoint_id=tmp_path / "t")
    _assert_same(src, dst)
    hp_dcp.convert(tmp_path / "t", tmp_path / "ours", to="dcp")
    dst2 = {"model": TinyLlama().state_dict(), "extra": {"step": 0, "note": None}}
    hp_dcp.load(dst2, checkpoint_id=tmp_path / "ours")
    _assert_same(src, dst2)
    assert hp_dcp.verify(tmp_path / "ours") == []


# --------------------------------------------------------------------------------------------
# offline tools and CLI
# --------------------------------------------------------------------------------------------


def test_cli_inspect_convert_consolidate_reshard(tmp_path, capsys):
    from safetensors.torch import load_file

    torch.manual_seed(0)
    m = TinyLlama()
    hp_dcp.save({"model": m.state_dict(), "step": 3}, checkpoint_id=tmp_path / "c")
    assert cli(["inspect", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "model.layers.0.w1.weight" in out and "42x24" in out and "step" in out
    (tmp_path / "map.json").write_text(json.dumps({r"model\.(.*)": r"\1", "step": None}))
    assert (
        cli(
            [
                "convert",
                str(tmp_path / "c"),
                str(tmp_path / "hf"),
                "--to",
                "hf",
                "--name-map",
                str(tmp_path / "map.json"),
                "--dtype",
                "bfloat16",
            ]
        )
        == 0
    )
    hf = {}
    for f in (tmp_path / "hf").glob("*.safetensors"):
        hf.update(load_file(str(f)))
    assert hf.keys() == m.state_dict().keys()
    assert all(v.dtype == torch.bfloat16 for v in hf.values())
    assert torch.equal(hf["tok.weight"], m.tok.weight.detach().bfloat16())
    assert cli(["consolidate", str(tmp_path / "c"), str(tmp_path / "one.safetensors")]) == 0
    one = load_file(str(tmp_path / "one.safetensors"))
    assert torch.equal(one["model.out.weight"], m.out.weight.detach())
    assert (
        cli(
            [
                "reshard",
                str(tmp_path / "c"),
                str(tmp_path / "r"),
                "--mesh",
                "2,2",
                "--placements",
                "S(0)S(1)",
                "--rule",
                "*norm*=RR",
            ]
        )
        == 0
    )
    md = hp_dcp.open_checkpoint(tmp_path / "r").metadata
    assert md.world_size == 4 and len(os.listdir(tmp_path / "r")) == 5
    assert len(md.tensors["model.layers.0.w1.weight"].chunks) == 4
    assert len(md.tensors["model.norm.weight"].chunks) == 1  # replicated: written once
    back = {"model": TinyLlama().state_dict(), "step": 0}
    hp_dcp.load(back, checkpoint_id=tmp_path / "r")
    _assert_same({"model": m.state_dict(), "step": 3}, back)
    assert cli(["verify", str(tmp_path / "r")]) == 0
    with pytest.raises(ValueError, match="placements 'S0'"):
        hp_dcp.reshard(tmp_path / "c", tmp_path / "bad", mesh_shape=(2,), placements="S0")


# --------------------------------------------------------------------------------------------
# async
# --------------------------------------------------------------------------------------------


def test_async_save_snapshots_at_call_time(tmp_path):
    w = torch.randn(256, 64)
    snap = w.clone()
    fut = hp_dcp.async_save({"w": w, "n": 1}, checkpoint_id=tmp_path / "a")
    w.add_(1.0)  # training goes on while the background thread writes
    fut2 = hp_dcp.async_save({"w": w, "n": 2}, checkpoint_id=tmp_path / "b")  # waits for the first
    assert fut.done()
    fut2.result()
    out = {"w": torch.zeros(256, 64), "n": 0}
    hp_dcp.load(out, checkpoint_id=tmp_path / "a")
    assert torch.equal(out["w"], snap) and out["n"] == 1
    hp_dcp.load(out, checkpoint_id=tmp_path / "b")
    assert torch.equal(out["w"], snap + 1) and out["n"] == 2


def test_async_save_failure_surfaces_in_future(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="exists and is not a folder"):
        hp_dcp.async_save({"w": torch.ones(2)}, checkpoint_id=tmp_path / "file").result()


def test_model_state_loads_values_that_are_not_its_storage():
    m = torch.nn.Linear(3, 2)
    state = hp_dcp.ModelState(m)
    own = state.state_dict()
    state.load_state_dict(own)  # its own tensors: nothing to do
    new = {"weight": torch.ones(2, 3), "bias": own["bias"]}
    state.load_state_dict(new)
    assert torch.equal(m.weight, torch.ones(2, 3))
