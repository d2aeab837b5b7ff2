"""``hp-plan calibrate --quick`` on the CPU: the written file reads back with the package's own
loader, every field of the shipped format is there and positive, and each says how it was
obtained; the planning core still imports no torch."""

import subprocess
import sys
from importlib import resources

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

import pytest

from hp_autoparallel import CalibrationError, GpuCalibration, load_gpu
from hp_autoparallel.cli import main

FIELDS = {
    "gpu": ("memory_gib", "peak_tflops"),
    "rates": (
        "matmul_tflops",
        "attention_tflops",
        "grouped_gemm_tflops",
        "memory_gbps",
        "elementwise_gbps",
        "host_link_gbps",
        "optimizer_gbps",
    ),
    "overheads": (
        "selective_ms_per_layer",
        "swap_ms_per_layer",
        "cp_step_us",
        "cp_merge_bytes_per_element",
        "host_us_per_op",  # on the CPU only (CUDA's host runs ahead of its kernels)
    ),
    "memory": ("fragmentation", "runtime_reserve_gib", "host_memory_gib"),
}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("cal") / "sub" / "cpu_measured.toml"
    assert main(["calibrate", "--quick", "--device", "cpu", "--out", str(out)]) == 0
    return out


def test_quick_file_loads_and_every_field_is_positive(written, capsys):
    cal = GpuCalibration.from_toml(written)
    assert load_gpu(str(written)) == cal
    assert cal.name == "cpu" and cal.compute_dtype == "float32"
    assert cal.rms_norm == "decomposed"  # torch's composite F.rms_norm on the CPU
    doc = tomllib.loads(written.read_text())
    shipped = tomllib.loads(
        resources.files("hp_autoparallel").joinpath("data/gpus/h200.toml").read_text()
    )
    for section, keys in shipped.items():  # every field of the shipped format is written
        assert set(keys) <= set(doc[section]), section
    for section, keys in FIELDS.items():
        for key in keys:
            v = doc[section][key]
            assert isinstance(v, (int, float)) and v > 0, f"{section}.{key} = {v}"
    for value in (
        cal.matmul_flops,
        cal.attention_flops,
        cal.grouped_gemm_flops,
        cal.memory_bandwidth,
        cal.host_bandwidth,
        cal.optimizer_rate,
        cal.memory,
        cal.runtime_reserve,
        cal.host_memory,
    ):
        assert value > 0
    assert cal.fragmentation >= 1.0


def test_every_field_says_how_it_was_obtained(written):
    lines = written.read_text().splitlines()
    for i, line in enumerate(lines):
        key = line.split(" = ")[0]
        if any(key in keys for keys in FIELDS.values()):
            comment = lines[i - 1]
            assert comment.startswith("#"), key
            block = " ".join(x for x in lines[max(0, i - 4) : i] if x.startswith("#"))
            assert any(w in block for w in ("measured", "copied", "datasheet")), key


def test_estimate_uses_the_measured_optimizer_rate(written, tmp_path):
    from hp_autoparallel import Plan, Workload, estimate, load_cluster, model_spec

    cal = GpuCalibration.from_toml(written)
    text = written.read_text().replace("optimizer_gbps = ", "optimizer_gbps = 1e-3\n# was: ")
    slow = tmp_path / "slow.toml"
    slow.write_text(text)
    slow_cal = GpuCalibration.from_toml(slow)
    args = (model_spec("llama3-tiny"), Plan(1, 1), Workload(2, 64))
    a = estimate(*args, cal, load_cluster("cpu")).time.optimizer
    b = estimate(*args, slow_cal, load_cluster("cpu")).time.optimizer
    assert b > a * 10


def test_estimate_uses_the_measured_elementwise_rate(written, tmp_path):
    from hp_autoparallel import Plan, Workload, estimate, load_cluster, model_spec

    cal = GpuCalibration.from_toml(written)
    assert cal.elementwise_bandwidth and cal.elementwise_rate == cal.elementwise_bandwidth
    text = written.read_text().replace("elementwise_gbps = ", "elementwise_gbps = 1e-3\n# was: ")
    slow = tmp_path / "slow.toml"
    slow.write_text(text)
    args = (model_spec("llama3-tiny"), Plan(1, 1), Workload(2, 64))
    a = estimate(*args, cal, load_cluster("cpu")).time.compute
    b = estimate(*args, GpuCalibration.from_toml(slow), load_cluster("cpu")).time.compute
    assert b > a * 10
    # a file without the field falls back to the memory bandwidth
    bare = tmp_path / "bare.toml"
    bare.write_text(
        "\n".join(ln for ln in text.splitlines() if not ln.startswith("elementwise_gbps"))
    )
    old = GpuCalibration.from_toml(bare)
    assert old.elementwise_bandwidth is None and old.elementwise_rate == old.memory_bandwidth


def test_elementwise_rate_is_bytes_over_the_two_kernels_time(monkeypatch):
    """silu(a) * b moves 5 operands' bytes (silu 2, the product 3), the fp32 add 3."""
    pytest.importorskip("torch")
    import dataclasses

    import torch

    from hp_autoparallel import _calibrate as C

    times = iter([1.0, 3.0])  # seconds: the SwiGLU kernels, then the add
    monkeypatch.setattr(C, "_median_time", lambda *a, **k: next(times))
    sizes = dataclasses.replace(C._SIZES[("cpu", True)], copy_bytes=1 << 20)
    cal = C.Calibration("x", "bfloat16", "cpu")
    C._elementwise(cal, sizes, torch.device("cpu"), torch.bfloat16)
    n, m = (1 << 19) // 2, (1 << 19) // 4  # bf16 and fp32 elements of each operand
    expect = (5 * n * 2 + 3 * m * 4) / 4.0 / 1e9
    assert cal.fields[("rates", "elementwise_gbps")].value == pytest.approx(expect)


def test_bad_arguments_are_named():
    from hp_autoparallel._calibrate import calibrate

    with pytest.raises(CalibrationError, match="device='tpu'"):
        calibrate(device="tpu")
    with pytest.raises(CalibrationError, match="ranks=0"):
        calibrate(device="cpu", ranks=0, quick=True)


def test_core_import_stays_torch_free():
    code = (
        "import sys, hp_autoparallel, hp_autoparallel.cli; "
        "assert 'torch' not in sys.modules and 'hp_autoparallel._calibrate' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_matmul_rate_counts_each_shape_as_often_as_a_step_runs_it(monkeypatch):
    """The rate is FLOPs over time with each GEMM weighted by its count a step: a fast GEMM
    that runs once cannot set the rate of the many slower ones."""
    pytest.importorskip("torch")
    import dataclasses

    import torch

    from hp_autoparallel import _calibrate as C

    times = iter([1.0, 4.0])  # seconds for the two shapes, in order
    monkeypatch.setattr(C, "_median_time", lambda *a, **k: next(times))
    sizes = dataclasses.replace(C._SIZES[("cpu", True)], matmuls=((8, 8, 8, 3), (16, 16, 16, 1)))
    cal = C.Calibration("x", "float32", "cpu")
    C._matmul(cal, sizes, torch.device("cpu"), torch.float32)
    flops = 3 * 2 * 8**3 + 1 * 2 * 16**3
    want = flops / (3 * 1.0 + 1 * 4.0) / 1e12
    assert cal.fields[("rates", "matmul_tflops")].value == pytest.approx(want)


def test_cluster_out_measures_the_ranks_together(tmp_path, capsys):
    """``--cluster-out`` on 2 gloo ranks (quick sizes): a cluster file the package's loader
    reads, every collective's latency and bandwidth measured and said so, the overlap in
    [0, 1]; the calibration's rates are the ranks' median, measured at once."""
    from hp_autoparallel import Cluster

    cal_path, cl_path = tmp_path / "cpu.toml", tmp_path / "sub" / "cluster.toml"
    argv = ["calibrate", "--quick", "--device", "cpu", "--ranks", "2", "--out", str(cal_path)]
    assert main([*argv, "--cluster-out", str(cl_path)]) == 0
    assert f"wrote {cl_path}" in capsys.readouterr().out
    cl = Cluster.from_toml(cl_path)
    assert cl.backend == "gloo" and cl.gpus_per_node == 2 and 0.0 <= cl.overlap <= 1.0
    text = cl_path.read_text()
    for kind in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "p2p"):
        assert cl.intra.alpha(kind) >= 0 and cl.intra.bw(kind) > 0
        assert f"# measured: {kind} (" in text
    assert "not measured (one host)" in text
    cal = GpuCalibration.from_toml(cal_path)
    assert cal.host_per_op > 0
    assert "the median over 2 ranks measuring at once" in cal_path.read_text()


def test_a_rank_that_dies_is_a_calibration_error(tmp_path, capsys, monkeypatch):
    """A rank killed (a signal, the OOM killer) or raising is exit 2 with a message, no
    traceback."""
    import torch.multiprocessing as mp

    def dies(*args, **kwargs):
        raise mp.ProcessExitedException(
            "process 1 terminated with signal SIGKILL", 1, 4242, -9, "SIGKILL"
        )

    monkeypatch.setattr(mp, "start_processes", dies)
    argv = ["calibrate", "--quick", "--device", "cpu", "--ranks", "2"]
    assert main([*argv, "--cluster-out", str(tmp_path / "c.toml")]) == 2
    err = capsys.readouterr().err
    assert "a rank failed while measuring" in err and "SIGKILL" in err


def test_cluster_out_needs_two_ranks(tmp_path, capsys):
    argv = ["calibrate", "--quick", "--device", "cpu", "--ranks", "1"]
    assert main([*argv, "--cluster-out", str(tmp_path / "c.toml")]) == 2
    assert "needs --ranks >= 2" in capsys.readouterr().err
    assert not (tmp_path / "c.toml").exists()


@pytest.mark.parametrize(
    "kind", ["all_gather", "reduce_scatter", "all_reduce", "all_to_all", "p2p"]
)
def test_the_fit_recovers_the_alpha_beta_line(kind):
    """Two points on NOTE [Collectives]' line give back its latency and bandwidth; a large
    message timed faster than a small one (noise) still gives a positive bandwidth."""
    from hp_autoparallel._calibrate_ranks import _fit
    from hp_autoparallel._hardware import Cluster, Link

    alpha, bw, n = 300e-6, 2e9, 4
    link = Link(alpha, bw, bw, bw, bw, bw)
    cl = Cluster("t", n, link, link)
    sizes = (4096, 4 << 20)
    if kind == "p2p":
        times = tuple(cl.p2p(2, 1, m) for m in sizes)
    else:
        times = tuple(cl.collective(kind, n, 1, m) for m in sizes)
    a, b = _fit(kind, n, sizes, times)
    assert a == pytest.approx(alpha) and b == pytest.approx(bw)
    a, b = _fit(kind, n, sizes, (times[1], times[0]))
    assert a >= 0 and b > 0
