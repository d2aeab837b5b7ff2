"""Hardware descriptions, read from TOML files (``tomllib``: data only, nothing runs):

- a GPU calibration file per GPU kind (``data/gpus/<kind>.toml``; ``h200`` and ``cpu`` ship):
  usable memory, the datasheet rate MFU divides by, measured compute rates (matmul, attention,
  grouped GEMM), memory and host-link bandwidths, the overheads of recomputation, swap and
  context parallelism, and the allocator's fragmentation factor;
- a cluster file (``data/clusters/<kind>.toml`` by default, or ``--cluster``): GPUs per node
  and an alpha-beta description of the intra-node and inter-node links.

Collective times follow the alpha-beta model of NOTE [Collectives].
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

from .errors import CalibrationError, ClusterFileError, PlanTypeError, UnknownGpuError, nearest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = [
    "Cluster",
    "GpuCalibration",
    "Link",
    "load_cluster",
    "load_gpu",
    "shipped_clusters",
    "shipped_gpus",
]

GIB = 2**30


def _read(path: Path, error: type[Exception], what: str) -> dict:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise error(f"{what} {str(path)!r}: no such file") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise error(f"{what} {str(path)!r}: not valid TOML ({e})") from None


def _number(doc: dict, section: str, key: str, where: str, error, *, low=0.0, strict=True, hint=""):
    """``doc[section][key]`` as a float > ``low`` (>= with ``strict=False``)."""
    table = doc.get(section)
    if not isinstance(table, dict):
        raise error(f"{where}: the [{section}] table is missing: add it with {key} = ... {hint}")
    if key not in table:
        raise error(f"{where}: {section}.{key} is missing: add it to [{section}] {hint}".rstrip())
    v = table[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise error(f"{where}: {section}.{key} = {v!r} must be a number {hint}".rstrip())
    if v < low or (strict and v == low):
        sign = ">" if strict else ">="
        raise error(f"{where}: {section}.{key} = {v!r} must be {sign} {low}")
    return float(v)


# -- GPU calibration ------------------------------------------------------------------------------

#: what ``F.rms_norm`` can run as (``GpuCalibration.rms_norm``)
_RMS_NORMS = ("fused", "decomposed")
#: communication backends a cluster file may name (``Cluster.backend``)
_BACKENDS = ("nccl", "gloo")


@dataclass(frozen=True)
class GpuCalibration:
    """One GPU kind's measured figures (a calibration file; see ``data/gpus/h200.toml``).

    Rates are in FLOP/s and bytes/s, times in seconds, memory in bytes. ``compute_dtype`` is
    the training dtype of parameters in compute and of activations (``"bfloat16"`` on GPUs,
    ``"float32"`` on CPU ranks); ``fragmentation`` multiplies the allocated peak to give what
    the caching allocator reserves, and ``runtime_reserve`` is device memory the planner never
    hands out (CUDA context, communicator buffers, library workspaces); ``host_memory`` is
    the host RAM per GPU that swapped activations may take (None: not checked).

    Placeholders (no measurement behind them yet; the shipped files say so field by field):
    ``fragmentation``, ``runtime_reserve`` and ``host_memory`` in both shipped files, and on
    ``"cpu"`` the grouped-GEMM rate (taken as the matmul rate). The rates and overheads of
    ``"h200"`` come from benchmarks/RESULTS.md or the anchors in docs/autoparallel.md.
    """

    name: str
    memory: float
    peak_flops: float
    compute_dtype: str
    matmul_flops: float
    attention_flops: float
    grouped_gemm_flops: float
    memory_bandwidth: float
    host_bandwidth: float
    selective_overhead: float
    swap_overhead: float
    cp_step_overhead: float
    cp_merge_bytes: float
    fragmentation: float
    runtime_reserve: float
    host_memory: float | None = None  # host RAM per GPU for swapped activations; None: unchecked
    #: bytes/s of the optimizer step at the planner's 32 bytes per parameter (AdamW and
    #: clipping, as hp-train runs them); None: ``memory_bandwidth`` (the file has no
    #: ``rates.optimizer_gbps``)
    optimizer_bandwidth: float | None = None
    #: bytes/s the memory-bound kernels of a step reach (norms, RoPE, SwiGLU, casts, residual
    #: adds, the loss; NOTE [Element-wise traffic] in ``_layers``); None: ``memory_bandwidth``
    #: (the file has no ``rates.elementwise_gbps``)
    elementwise_bandwidth: float | None = None
    #: what ``F.rms_norm`` runs on this device (``gpu.rms_norm``): ``"fused"`` (CUDA's kernel,
    #: which saves its input and an fp32 rstd for backward) or ``"decomposed"`` (the CPU's
    #: composite of a cast to fp32, pow / mean / rsqrt and two muls, which saves its input in
    #: fp32 and also the normalised fp32 ``x * rstd``)
    rms_norm: str = "fused"
    #: host seconds per aten op dispatched (``overheads.host_us_per_op``), where the device is
    #: the host's own cores and this time adds to the step's (CPU ranks); 0 where host work
    #: runs ahead of the device (CUDA: not modelled)
    host_per_op: float = 0.0

    @property
    def decomposed_norm(self) -> bool:
        """Whether ``F.rms_norm`` is torch's composite here (``rms_norm = "decomposed"``):
        it saves its input upcast to fp32 and the fp32 ``x * rstd`` (NOTE [Saved activations]
        in ``_layers``)."""
        return self.rms_norm == "decomposed"

    @property
    def act_bytes(self) -> int:
        """Bytes per element of activations and of parameters in compute."""
        return 2 if self.compute_dtype in ("bfloat16", "float16") else 4

    @classmethod
    def from_toml(cls, path: str | Path) -> GpuCalibration:
        """Read a calibration file; :class:`CalibrationError` names a missing or bad field."""
        path = Path(path)
        where = f"GPU calibration file {str(path)!r}"
        doc = _read(path, CalibrationError, "GPU calibration file")
        e = CalibrationError

        def num(section, key, **kw):
            return _number(doc, section, key, where, e, **kw)

        gpu = doc.get("gpu", {})
        name = gpu.get("name") if isinstance(gpu, dict) else None
        if not isinstance(name, str) or not name:
            raise e(f'{where}: gpu.name is missing: add name = "<kind>" to [gpu]')
        dtype = gpu.get("compute_dtype", "bfloat16")
        if dtype not in ("bfloat16", "float16", "float32"):
            raise e(f"{where}: gpu.compute_dtype = {dtype!r}: use bfloat16, float16 or float32")
        frag = num("memory", "fragmentation", low=1.0, strict=False)
        norm = gpu.get("rms_norm", "fused")
        if norm not in _RMS_NORMS:
            raise e(f"{where}: gpu.rms_norm = {norm!r}: use one of {list(_RMS_NORMS)}")
        return cls(
            name=name,
            memory=num("gpu", "memory_gib") * GIB,
            peak_flops=num("gpu", "peak_tflops") * 1e12,
            compute_dtype=dtype,
            matmul_flops=num("rates", "matmul_tflops") * 1e12,
            attention_flops=num("rates", "attention_tflops") * 1e12,
            grouped_gemm_flops=num("rates", "grouped_gemm_tflops") * 1e12,
            memory_bandwidth=num("rates", "memory_gbps") * 1e9,
            host_bandwidth=num("rates", "host_link_gbps") * 1e9,
            selective_overhead=num("overheads", "selective_ms_per_layer", strict=False) * 1e-3,
            swap_overhead=num("overheads", "swap_ms_per_layer", strict=False) * 1e-3,
            cp_step_overhead=num("overheads", "cp_step_us", strict=False) * 1e-6,
            cp_merge_bytes=num("overheads", "cp_merge_bytes_per_element", strict=False),
            fragmentation=frag,
            runtime_reserve=num("memory", "runtime_reserve_gib", strict=False) * GIB,
            host_memory=(
                num("memory", "host_memory_gib") * GIB
                if "host_memory_gib" in (doc.get("memory") or {})
                else None
            ),
            optimizer_bandwidth=(
                num("rates", "optimizer_gbps") * 1e9
                if "optimizer_gbps" in (doc.get("rates") or {})
                else None
            ),
            elementwise_bandwidth=(
                num("rates", "elementwise_gbps") * 1e9
                if "elementwise_gbps" in (doc.get("rates") or {})
                else None
            ),
            rms_norm=norm,
            host_per_op=(
                num("overheads", "host_us_per_op", strict=False) * 1e-6
                if "host_us_per_op" in (doc.get("overheads") or {})
                else 0.0
            ),
        )

    @property
    def optimizer_rate(self) -> float:
        """Bytes/s of the optimizer step (``optimizer_bandwidth``, else ``memory_bandwidth``)."""
        return self.optimizer_bandwidth or self.memory_bandwidth

    @property
    def elementwise_rate(self) -> float:
        """Bytes/s of memory-bound kernels (``elementwise_bandwidth``, else
        ``memory_bandwidth``)."""
        return self.elementwise_bandwidth or self.memory_bandwidth


def _data(kind: str) -> resources.abc.Traversable:
    return resources.files("hp_autoparallel") / "data" / kind


def shipped_gpus() -> list[str]:
    """The GPU kinds with a shipped calibration file (``h200``, ``cpu``)."""
    return sorted(p.name[:-5] for p in _data("gpus").iterdir() if p.name.endswith(".toml"))


@lru_cache(maxsize=16)
def load_gpu(kind: str) -> GpuCalibration:
    """The calibration of a shipped GPU kind (``"h200"``, ``"cpu"``) or of a calibration file
    given by path. Raises :class:`UnknownGpuError` naming the nearest shipped kind."""
    if not isinstance(kind, str):
        raise PlanTypeError(f"load_gpu: kind={kind!r} is a {type(kind).__name__}: give a str")
    shipped = shipped_gpus()
    if kind.lower() in shipped:
        with resources.as_file(_data("gpus") / f"{kind.lower()}.toml") as p:
            return GpuCalibration.from_toml(p)
    if kind.endswith(".toml") or Path(kind).exists():
        return GpuCalibration.from_toml(kind)
    hint = nearest(kind.lower(), shipped)
    did = f"did you mean {hint!r}? " if hint else ""
    raise UnknownGpuError(
        f"--gpu {kind!r} has no calibration file: {did}shipped kinds: {', '.join(shipped)} "
        "(or give the path of a calibration TOML)"
    )


# -- cluster ------------------------------------------------------------------------------------

# NOTE [Collectives]
# Alpha-beta per link. A collective over n ranks moving a tensor of M bytes (the gathered
# output for all-gather, the input for reduce-scatter and all-reduce, what a rank sends for
# all-to-all) takes
#     alpha * ceil(log2 n) + bus_bytes / bw
# where bus_bytes is NCCL's bus traffic per rank, (n-1)/n * M for all-gather / reduce-scatter /
# all-to-all and 2 (n-1)/n * M for all-reduce, and bw is the link's bus bandwidth (what
# nccl-tests report as busbw) for that collective. A point-to-point transfer takes alpha + M / bw.
# A group whose ranks all sit on one node uses the intra-node link. A group that spans nodes
# with g of its ranks on each node drives g NICs in parallel (NCCL's rings cross nodes on every
# GPU's own NIC), so its bandwidth is min(intra, g x inter); an all-to-all sends (n - g)/n of
# its bytes off the node through the ranks' own NICs. The log2 latency term stands for NCCL's
# tree / PAT algorithms at scale; contention between collectives of different groups on one
# link is not modelled. alpha is the link's ``latency_us`` unless the file gives a collective
# its own (``<collective>_latency_us``: gloo's reduce-scatter takes 1.2-1.9x its all-gather's
# on a shared host, as `hp-plan calibrate --cluster-out` measures).
#
# ``cluster.overlap`` is the fraction of a collective that runs hidden behind compute issued
# meanwhile (FSDP's prefetched all-gathers, its reduce-scatters under the next backward): 1 for
# NCCL on its own SMs and copy engines (the default); on CPU ranks that share their cores
# (more ranks than cores) gloo's thread competes with the compute, and `hp-plan calibrate
# --cluster-out` measures about 0 there.

_COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "p2p")


@dataclass(frozen=True)
class Link:
    """One kind of link: its latency (seconds) and bus bandwidth (bytes/s) per collective;
    ``latencies`` gives a collective its own latency (seconds) where it differs."""

    latency: float
    all_gather: float
    reduce_scatter: float
    all_reduce: float
    all_to_all: float
    p2p: float
    latencies: tuple[tuple[str, float], ...] = ()

    def bw(self, collective: str) -> float:
        """Bus bandwidth of ``collective`` on this link."""
        return getattr(self, collective)

    def alpha(self, collective: str) -> float:
        """Latency (seconds per message, per log2 step) of ``collective`` on this link."""
        for name, value in self.latencies:
            if name == collective:
                return value
        return self.latency


@dataclass(frozen=True)
class Cluster:
    """GPUs per node and the two links (see NOTE [Collectives]). Ranks are numbered node by
    node; the trainer's mesh puts ``tp`` innermost, then ``cp``, ``dp_shard``,
    ``dp_replicate`` and ``pp`` outermost."""

    name: str
    gpus_per_node: int
    intra: Link
    inter: Link
    #: the process group's backend (``cluster.backend``): ``"nccl"`` or ``"gloo"``
    backend: str = "nccl"
    #: the fraction of a collective hidden behind compute issued meanwhile (NOTE [Collectives])
    overlap: float = 1.0

    @property
    def holds_sends(self) -> bool:
        """Whether a point-to-point send's work reports completion only once waited (gloo's
        does; NCCL's once the transfer is done): hp-pipeline then lets go of what it sent only
        at the end of the step, not at the next compute step."""
        return self.backend == "gloo"

    @classmethod
    def from_toml(cls, path: str | Path) -> Cluster:
        """Read a cluster file; :class:`ClusterFileError` names a missing or bad field."""
        path = Path(path)
        where = f"cluster file {str(path)!r}"
        doc = _read(path, ClusterFileError, "cluster file")
        table = doc.get("cluster")
        if not isinstance(table, dict) or "gpus_per_node" not in table:
            raise ClusterFileError(
                f"{where}: cluster.gpus_per_node is missing: add it to [cluster] "
                "(GPUs per node, e.g. 8)"
            )
        g = table["gpus_per_node"]
        if isinstance(g, bool) or not isinstance(g, int) or g < 1:
            raise ClusterFileError(f"{where}: cluster.gpus_per_node = {g!r} must be an int >= 1")
        backend = table.get("backend", "nccl")
        if backend not in _BACKENDS:
            raise ClusterFileError(
                f"{where}: cluster.backend = {backend!r}: use one of {list(_BACKENDS)}"
            )
        overlap = table.get("overlap", 1.0)
        if (
            isinstance(overlap, bool)
            or not isinstance(overlap, (int, float))
            or not (0.0 <= overlap <= 1.0)
        ):
            raise ClusterFileError(
                f"{where}: cluster.overlap = {overlap!r} must be a number in [0, 1] (the "
                "fraction of a collective hidden behind compute; 1 for NCCL)"
            )
        links = {}
        for section in ("intra_node", "inter_node"):
            latency = _number(
                doc,
                section,
                "latency_us",
                where,
                ClusterFileError,
                strict=False,
                hint="(microseconds per message)",
            )
            base = _number(
                doc,
                section,
                "bandwidth_gbps",
                where,
                ClusterFileError,
                hint="(GB/s of bus bandwidth per GPU)",
            )
            bw = {}
            for c in _COLLECTIVES:
                key = f"{c}_gbps"
                bw[c] = (
                    _number(doc, section, key, where, ClusterFileError)
                    if key in doc[section]
                    else base
                ) * 1e9
            lat = tuple(
                (
                    c,
                    _number(doc, section, f"{c}_latency_us", where, ClusterFileError, strict=False)
                    * 1e-6,
                )
                for c in _COLLECTIVES
                if f"{c}_latency_us" in doc[section]
            )
            known = [
                "latency_us",
                "bandwidth_gbps",
                *(f"{c}_gbps" for c in _COLLECTIVES),
                *(f"{c}_latency_us" for c in _COLLECTIVES),
            ]
            unknown = set(doc[section]) - set(known)
            if unknown:
                key = sorted(unknown)[0]
                hint = nearest(key, known)
                did = f" (did you mean {hint!r}?)" if hint else ""
                raise ClusterFileError(f"{where}: {section}.{key} is not a known field{did}")
            links[section] = Link(latency * 1e-6, **bw, latencies=lat)
        known = ["name", "gpus_per_node", "backend", "overlap"]
        unknown = set(table) - set(known)
        if unknown:
            key = sorted(unknown)[0]
            hint = nearest(key, known)
            did = f" (did you mean {hint!r}?)" if hint else ""
            raise ClusterFileError(f"{where}: cluster.{key} is not a known field{did}")
        return cls(
            name=str(table.get("name", path.stem)),
            gpus_per_node=g,
            intra=links["intra_node"],
            inter=links["inter_node"],
            backend=backend,
            overlap=float(overlap),
        )

    # -- placement ----------------------------------------------------------------------------
    def _span(self, size: int, stride: int) -> tuple[Link, int]:
        """The link a group of ``size`` ranks ``stride`` apart uses, and how many of its ranks
        share a node."""
        g = self.gpus_per_node
        if stride * size <= g and g % (stride * size) == 0:
            return self.intra, size
        per_node = max(1, min(size, g // stride)) if stride < g else 1
        return self.inter, per_node

    def collective(self, kind: str, size: int, stride: int, nbytes: float) -> float:
        """Seconds for collective ``kind`` (``all_gather``, ``reduce_scatter``, ``all_reduce``,
        ``all_to_all``) of ``nbytes`` over a group of ``size`` ranks ``stride`` apart."""
        if size <= 1 or nbytes <= 0:
            return 0.0
        link, per_node = self._span(size, stride)
        frac = (size - 1) / size
        if link is self.intra:
            bw = link.bw(kind)
        elif kind == "all_to_all":
            bw = link.bw(kind)
            frac = (size - per_node) / size
        else:
            bw = min(self.intra.bw(kind), per_node * link.bw(kind))
        steps = math.ceil(math.log2(size))
        alpha = link.alpha(kind)
        if kind == "all_reduce":
            return 2 * alpha * steps + 2 * frac * nbytes / bw
        return alpha * steps + frac * nbytes / bw

    def p2p(self, size: int, stride: int, nbytes: float) -> float:
        """Seconds for one transfer of ``nbytes`` between neighbours of a group of ``size``
        ranks ``stride`` apart (a pipeline's stages): the slowest pair's link."""
        if size <= 1 or nbytes <= 0:
            return 0.0
        link, _ = self._span(size, stride)
        return link.alpha("p2p") + nbytes / link.bw("p2p")

    def describe(self) -> str:
        """One line: GPUs per node and the two links' bandwidth and latency."""
        i, o = self.intra, self.inter
        return (
            f"{self.name}: {self.gpus_per_node} GPUs/node, intra-node "
            f"{i.bw('all_gather') / 1e9:.0f} GB/s {i.latency * 1e6:.0f} us, inter-node "
            f"{o.bw('all_gather') / 1e9:.0f} GB/s {o.latency * 1e6:.0f} us"
        )


@lru_cache(maxsize=16)
def load_cluster(path_or_kind: str) -> Cluster:
    """A cluster file by path, or the shipped default of a GPU kind (``"h200"``: 8 GPUs per
    node on NVLink, InfiniBand between nodes; ``"cpu"``: gloo ranks on one host)."""
    if not isinstance(path_or_kind, str):
        raise PlanTypeError(
            f"load_cluster: {path_or_kind!r} is a {type(path_or_kind).__name__}: give a path"
        )
    shipped = _data("clusters") / f"{path_or_kind.lower()}.toml"
    if not path_or_kind.endswith(".toml") and shipped.is_file():
        with resources.as_file(shipped) as p:
            return Cluster.from_toml(p)
    if not Path(path_or_kind).exists():
        kinds = shipped_clusters()
        hint = nearest(path_or_kind.lower(), kinds)
        did = f"did you mean {hint!r}? " if hint else ""
        raise ClusterFileError(
            f"--cluster {path_or_kind!r} is neither a shipped cluster nor an existing file: "
            f"{did}shipped clusters: {', '.join(kinds)} (or give the path of a cluster TOML)"
        )
    return Cluster.from_toml(path_or_kind)


def shipped_clusters() -> list[str]:
    """The cluster kinds shipped with the package."""
    return sorted(
        f.name[: -len(".toml")] for f in _data("clusters").iterdir() if f.name.endswith(".toml")
    )
