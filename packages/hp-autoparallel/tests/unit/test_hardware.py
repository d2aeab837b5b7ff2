"""Calibration and cluster files: what the shipped ones hold, the typed error naming each
missing or bad field, and the alpha-beta collective times against hand-computed values."""

import math

import pytest

from hp_autoparallel import (
    CalibrationError,
    Cluster,
    ClusterFileError,
    GpuCalibration,
    UnknownGpuError,
    load_cluster,
    load_gpu,
    shipped_gpus,
)

CLUSTER = """
[cluster]
name = "test"
gpus_per_node = 8

[intra_node]
bandwidth_gbps = 200.0
all_reduce_gbps = 250.0
latency_us = 10.0

[inter_node]
bandwidth_gbps = 40.0
latency_us = 20.0
"""


def _cluster(tmp_path, text=CLUSTER) -> Cluster:
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return Cluster.from_toml(path)


def test_shipped_calibrations():
    assert shipped_gpus() == ["cpu", "h200"]
    h200 = load_gpu("h200")
    assert h200.matmul_flops == 681.1e12 and h200.peak_flops == 989.4e12
    assert h200.attention_flops == 550e12 and h200.grouped_gemm_flops == 567.5e12
    assert h200.host_bandwidth == 55e9 and h200.act_bytes == 2
    assert h200.fragmentation == 1.096 and h200.memory == 139 * 2**30
    cpu = load_gpu("cpu")
    assert cpu.act_bytes == 4 and cpu.compute_dtype == "float32"
    assert load_cluster("h200").gpus_per_node == 8


def test_unknown_gpu_names_the_nearest():
    with pytest.raises(UnknownGpuError, match="did you mean 'h200'"):
        load_gpu("h100")


@pytest.mark.parametrize(
    "section,key",
    [
        ("intra_node", "bandwidth_gbps"),
        ("intra_node", "latency_us"),
        ("inter_node", "bandwidth_gbps"),
        ("inter_node", "latency_us"),
    ],
)
def test_cluster_missing_field_is_named(tmp_path, section, key):
    lines, inside = [], None
    for line in CLUSTER.splitlines():
        if line.startswith("["):
            inside = line.strip("[]")
        if inside == section and line.startswith(key):
            continue
        lines.append(line)
    with pytest.raises(ClusterFileError, match=rf"{section}\.{key} is missing: add it"):
        _cluster(tmp_path, "\n".join(lines))


def test_cluster_file_errors(tmp_path):
    with pytest.raises(ClusterFileError, match="cluster.gpus_per_node is missing"):
        _cluster(tmp_path, CLUSTER.replace("gpus_per_node = 8", ""))
    with pytest.raises(ClusterFileError, match="the \\[inter_node\\] table is missing"):
        _cluster(tmp_path, CLUSTER.split("[inter_node]")[0])
    with pytest.raises(ClusterFileError, match="must be a number"):
        _cluster(tmp_path, CLUSTER.replace("latency_us = 20.0", 'latency_us = "fast"'))
    with pytest.raises(ClusterFileError, match="must be > 0"):
        _cluster(tmp_path, CLUSTER.replace("bandwidth_gbps = 40.0", "bandwidth_gbps = 0"))
    with pytest.raises(ClusterFileError, match="did you mean 'all_gather_gbps'"):
        _cluster(tmp_path, CLUSTER.replace("all_reduce_gbps", "allgather_gbps"))
    with pytest.raises(ClusterFileError, match="no such file"):
        Cluster.from_toml(tmp_path / "nope.toml")
    (tmp_path / "bad.toml").write_text("[cluster\n")
    with pytest.raises(ClusterFileError, match="not valid TOML"):
        Cluster.from_toml(tmp_path / "bad.toml")


def test_calibration_missing_field_is_named(tmp_path):
    with open(_shipped("h200")) as f:
        text = f.read()
    path = tmp_path / "gpu.toml"
    path.write_text(text.replace("matmul_tflops = 681.1", ""))
    with pytest.raises(CalibrationError, match=r"rates\.matmul_tflops is missing"):
        GpuCalibration.from_toml(path)
    path.write_text(text.replace("fragmentation = 1.096", "fragmentation = 0.9"))
    with pytest.raises(CalibrationError, match=r"memory\.fragmentation = 0.9 must be >= 1"):
        GpuCalibration.from_toml(path)


def test_kernel_and_backend_fields(tmp_path):
    # what F.rms_norm runs (CUDA's fused kernel, the CPU's composite) and the cluster's backend
    assert load_gpu("h200").rms_norm == "fused" and not load_gpu("h200").decomposed_norm
    assert load_gpu("cpu").rms_norm == "decomposed" and load_gpu("cpu").decomposed_norm
    assert load_cluster("cpu").backend == "gloo" and load_cluster("cpu").holds_sends
    assert load_cluster("h200").backend == "nccl" and not load_cluster("h200").holds_sends
    assert _cluster(tmp_path).backend == "nccl"  # the default
    with pytest.raises(ClusterFileError, match="cluster.backend = 'mpi'"):
        _cluster(
            tmp_path, CLUSTER.replace("gpus_per_node = 8", 'gpus_per_node = 8\nbackend = "mpi"')
        )
    with open(_shipped("h200")) as f:
        text = f.read()
    path = tmp_path / "gpu.toml"
    path.write_text(
        text.replace('compute_dtype = "bfloat16"', 'compute_dtype = "bfloat16"\nrms_norm = "x"')
    )
    with pytest.raises(CalibrationError, match="gpu.rms_norm = 'x'"):
        GpuCalibration.from_toml(path)


def _shipped(kind: str) -> str:
    from importlib import resources

    return str(resources.files("hp_autoparallel") / "data" / "gpus" / f"{kind}.toml")


def test_alpha_beta_by_hand(tmp_path):
    c = _cluster(tmp_path)
    m = 2**30
    # 8 ranks of one node: alpha * log2(8) + (7/8) M / bw
    assert c.collective("all_gather", 8, 1, m) == pytest.approx(3 * 10e-6 + 7 / 8 * m / 200e9)
    # all-reduce: twice the latency steps and twice the bus bytes, its own bandwidth
    assert c.collective("all_reduce", 8, 1, m) == pytest.approx(
        2 * 3 * 10e-6 + 2 * 7 / 8 * m / 250e9
    )
    # 16 ranks one per node (stride 8): each drives its own NIC
    assert c.collective("reduce_scatter", 16, 8, m) == pytest.approx(4 * 20e-6 + 15 / 16 * m / 40e9)
    # 32 ranks 2 apart: 4 per node drive 4 NICs, min(200, 4 x 40) GB/s
    assert c.collective("all_gather", 32, 2, m) == pytest.approx(5 * 20e-6 + 31 / 32 * m / 160e9)
    # 16 ranks 1 apart over 2 nodes: 8 NICs would give 320 > 200: NVLink bound
    assert c.collective("all_gather", 16, 1, m) == pytest.approx(4 * 20e-6 + 15 / 16 * m / 200e9)
    # all-to-all across 4 nodes of 8: only (32 - 8) / 32 of the bytes leave the node
    assert c.collective("all_to_all", 32, 1, m) == pytest.approx(5 * 20e-6 + 24 / 32 * m / 40e9)
    # groups of one, or nothing to move, cost nothing
    assert c.collective("all_gather", 1, 1, m) == 0.0
    assert c.collective("all_gather", 8, 1, 0) == 0.0
    # point to point: between pipeline stages 64 ranks apart, across nodes
    assert c.p2p(4, 64, m) == pytest.approx(20e-6 + m / 40e9)
    assert c.p2p(2, 2, m) == pytest.approx(10e-6 + m / 200e9)
    assert math.isclose(c.intra.bw("p2p"), 200e9)  # falls back to bandwidth_gbps


def test_unknown_cluster_kind_names_cluster_and_the_nearest():
    with pytest.raises(ClusterFileError, match="--cluster 'h20'.*did you mean 'h200'") as info:
        load_cluster("h20")
    assert "shipped clusters: cpu, h200" in str(info.value)


def test_per_collective_latency_and_overlap(tmp_path):
    """A collective's own ``<kind>_latency_us`` replaces the link's latency for it alone;
    ``cluster.overlap`` defaults to 1 and must lie in [0, 1]; an unknown [cluster] key is named
    with the nearest known one."""
    text = CLUSTER.replace(
        "latency_us = 10.0", "latency_us = 10.0\nreduce_scatter_latency_us = 30.0"
    )
    cl = _cluster(tmp_path, text)
    assert cl.overlap == 1.0
    assert cl.collective("reduce_scatter", 4, 1, 1e-30) == pytest.approx(2 * 30e-6)
    assert cl.collective("all_gather", 4, 1, 1e-30) == pytest.approx(2 * 10e-6)
    assert cl.p2p(2, 1, 1e-30) == pytest.approx(10e-6)
    cl = _cluster(tmp_path, text.replace('name = "test"', 'name = "test"\noverlap = 0.25'))
    assert cl.overlap == 0.25
    for bad in ("1.5", "-0.1", '"none"', "true"):
        with pytest.raises(ClusterFileError, match=r"cluster\.overlap .* must be a number in"):
            _cluster(tmp_path, CLUSTER.replace('name = "test"', f'name = "test"\noverlap = {bad}'))
    with pytest.raises(ClusterFileError, match=r"cluster\.overlp is not a known field.*'overlap'"):
        _cluster(tmp_path, CLUSTER.replace('name = "test"', 'name = "test"\noverlp = 0.5'))
    with pytest.raises(ClusterFileError, match=r"intra_node\.all_gather_latency_us = -1"):
        _cluster(
            tmp_path,
            CLUSTER.replace("latency_us = 10.0", "all_gather_latency_us = -1\nlatency_us = 10.0"),
        )


def test_shipped_cpu_cluster_is_measured():
    """The shipped CPU cluster is `hp-plan calibrate --cluster-out`'s: gloo, the overlap it
    measured, a latency per collective."""
    cl = load_cluster("cpu")
    assert cl.backend == "gloo" and cl.gpus_per_node == 4 and 0.0 <= cl.overlap <= 1.0
    assert {name for name, _ in cl.intra.latencies} == {
        "all_gather",
        "reduce_scatter",
        "all_reduce",
        "all_to_all",
        "p2p",
    }
