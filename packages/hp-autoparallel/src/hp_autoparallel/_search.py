"""The N-D strategy search: enumerate configurations hp-train can run on N GPUs, drop what
hp-trainer refuses or what does not fit, score the rest with the cost models, re-score the
best with hp-pipeline's simulator, and rank.

NOTE [Search]
1. Families: every (tp, cp, pp) whose product divides N, then every (dp_replicate, ep, etp)
   with them. Not generated (the trainer refuses them, ``hp_trainer.ParallelDims``): ep > 1
   with cp > 1 or dp_replicate > 1, etp other than 1 or tp, dp_replicate > 1 with tp > 1.
   Bounds of the search (reported by ``--why``): tp within one node, cp <= ``max_cp``.
   Replication alone (dp_shard x cp = 1: the trainer's HSDP over a shard group of one, whole
   parameters, gradients all-reduced) is a family like the others.
2. A family is checked with hp-trainer's own ``ParallelDims`` and ``check_model`` (heads,
   layers, experts, batch and sequence divisibility, MTP) and its pipeline rules (tied
   embeddings, float32 pipelines without FSDP), then by memory at its leanest (one-sequence
   microbatches, full recomputation, 1F1B): a family that does not fit then is rejected with
   the GiB it lacks.
3. Variants: each schedule (gpipe, 1f1b, interleaved_1f1b, zbv; their stages per rank are the
   vpp), each microbatch count (pipeline microbatches, or gradient-accumulation micro-steps),
   each recompute mode. Without recomputation a variant is faster than with it, so when
   ``none`` fits the others are skipped; larger microbatches only need more memory, so the
   microbatch loop stops at the first size nothing fits.
4. The fastest variant of each design (degrees, schedule and recompute mode; the
   replicate x shard split and the microbatch count are the variant's) is kept; the best
   ``2 x top`` designs (at least 20) are scored again with the simulator (NOTE [Two passes
   over schedules]) and ranked by predicted step time.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from . import _pipeline as P
from ._estimate import Estimate, Evaluator
from ._hardware import GIB, Cluster, GpuCalibration
from ._plan import SCHEDULES, Plan, Workload
from ._spec import ModelSpec
from .errors import NoPlanError, check_int

__all__ = ["Rejection", "SearchResult", "nearest_gpu_count", "search"]

#: seconds of simulation per search; candidates left then keep their closed-form times
SIMULATION_BUDGET_S = 8.0


@dataclass(frozen=True)
class Rejection:
    """A family (or a whole range of degrees) the search dropped: every reason hp-trainer or
    the search gave, and a per-family detail (how far out of memory)."""

    family: str
    reasons: tuple[str, ...]
    detail: str = ""

    @property
    def reason(self) -> str:
        """The reasons as one line."""
        return "; ".join(self.reasons)

    def __str__(self) -> str:
        return f"{self.family}: {self.reason}"


_NUMBER = re.compile(r"\d+(?:\.\d+)?")


@dataclass
class SearchResult:
    """What :func:`search` found: ``ranked`` best first (:class:`Estimate` s, at most ``top``),
    ``rejected`` one entry per dropped family, counts, and the wall time in seconds."""

    spec: ModelSpec
    gpus: int
    work: Workload
    gpu: GpuCalibration
    cluster: Cluster
    ranked: list[Estimate]
    rejected: list[Rejection]
    families: int
    evaluated: int
    feasible: int
    elapsed: float
    simulated: int = 0

    @property
    def best(self) -> Estimate:
        """The fastest configuration."""
        return self.ranked[0]

    def table(self) -> str:
        """The ranked table (config, step time, tokens/s/GPU, MFU, peak GiB, biggest cost)."""
        head = ("#", "config", "step s", "tok/s/GPU", "MFU", "peak GiB", "biggest cost")
        rows = [head]
        for i, e in enumerate(self.ranked, 1):
            name, share = e.time.biggest_overhead()
            closed = e.plan.pp > 1 and not e.time.simulated
            rows.append(
                (
                    str(i),
                    str(e.plan),
                    f"{e.time.total:.2f}" + ("*" if closed else ""),
                    f"{e.tokens_per_s_per_gpu:,.0f}",
                    f"{100 * e.mfu:.1f}%",
                    f"{e.memory.peak / GIB:.1f}",
                    f"{name} {100 * share:.0f}%",
                )
            )
        widths = [max(len(r[k]) for r in rows) for k in range(len(head))]
        lines = []
        for j, r in enumerate(rows):
            cells = [
                c.ljust(w) if k in (1, 6) else c.rjust(w) for k, (c, w) in enumerate(zip(r, widths))
            ]
            lines.append("  ".join(cells).rstrip())
            if j == 0:
                lines.append("  ".join("-" * w for w in widths))
        if any(e.plan.pp > 1 and not e.time.simulated for e in self.ranked):
            lines.append("* pipeline timed by the closed form (not simulated)")
        return "\n".join(lines)

    def why(self) -> str:
        """Why each rejected family was rejected: families grouped by the kind of reason
        (the same messages up to their numbers), each group headed by one family's full
        reasons, then its families (with how far out of memory each is)."""
        groups: dict[tuple, list[Rejection]] = {}
        for r in self.rejected:
            key = tuple(sorted({_NUMBER.sub("N", x) for x in r.reasons}))
            groups.setdefault(key, []).append(r)
        lines = []
        for members in sorted(groups.values(), key=lambda g: (-len(g), g[0].reason)):
            lines.append(f"- {members[0].reason}")
            names = [m.family + (f" ({m.detail})" if m.detail else "") for m in members]
            shown = "; ".join(names[:8])
            if len(names) > 8:
                shown += f"; ... ({len(names) - 8} more)"
            lines.append(f"    {len(names)} famil{'y' if len(names) == 1 else 'ies'}: {shown}")
        return "\n".join(lines)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _family_label(dp_rep, dp_shard, tp, pp, cp, ep=1, etp=1) -> str:
    out = f"dp {dp_rep}x{dp_shard} tp {tp}"
    if cp > 1:
        out += f" cp {cp}"
    if ep > 1 or etp > 1:
        out += f" ep {ep}" + (f" etp {etp}" if etp > 1 else "")
    if pp > 1:
        out += f" pp {pp}"
    return out


def _trainer_check(spec: ModelSpec, work: Workload, gpus: int, plan: Plan, vpp: int, low: bool):
    """hp-trainer's own verdict on the degrees (``ParallelDims`` + ``check_model``), as
    ``hp_trainer.preflight`` would give it, and its pipeline rules (``low``: training in a
    16-bit dtype); None when it accepts them."""
    from hp_trainer import ConfigError, ParallelDims

    try:
        pd = ParallelDims(
            dp_replicate=plan.dp_replicate,
            dp_shard=plan.dp_shard,
            cp=plan.cp,
            tp=plan.tp,
            pp=plan.pp,
            ep=plan.ep,
            etp=plan.etp,
            world_size=gpus,
        )
        pd.check_model(
            n_heads=spec.n_heads,
            n_kv_heads=spec.n_kv_heads,
            n_layers=spec.n_layers,
            ffn_hidden=spec.ffn_hidden,
            num_experts=spec.num_experts if spec.is_moe else None,
            expert_hidden=spec.expert_hidden if spec.is_moe else None,
            linear_heads=(
                (spec.linear_num_key_heads, spec.linear_num_value_heads)
                if spec.architecture == "qwen3_5"
                else None
            ),
            global_batch_size=work.global_batch,
            seq_len=work.seq_len,
            stages_per_rank=vpp if plan.pp > 1 else 1,
            mtp_layers=spec.mtp_layers,
            cp_load_balance=True,
            conv_kernel=spec.linear_conv_kernel if spec.architecture == "qwen3_5" else None,
        )
    except ConfigError as e:
        return tuple(line.strip() for line in str(e).splitlines() if line.strip())
    if plan.pp > 1 and spec.tie_word_embeddings:
        return ("tied embeddings cannot be pipelined (hp-trainer): pp must be 1",)
    if plan.pp > 1 and not plan.fsdp and low:
        return (
            "a pipeline without data parallelism trains in float32 (hp-trainer casts "
            "stages to bfloat16 through FSDP only): not searched",
        )
    return None


def _design(p: Plan) -> tuple:
    """What the table tells apart: plans that differ only in how data parallelism splits into
    replicate x shard, or in the microbatch count, are one design (the fastest is kept)."""
    return (p.tp, p.cp, p.pp, p.ep, p.etp, p.schedule, p.recompute)


class _Best:
    """The fastest estimate of each design seen."""

    def __init__(self) -> None:
        self.by: dict[tuple, Estimate] = {}

    def push(self, e: Estimate) -> None:
        key = _design(e.plan)
        old = self.by.get(key)
        if old is None or e.time.total < old.time.total:
            self.by[key] = e

    def sorted(self) -> list[Estimate]:
        return sorted(self.by.values(), key=lambda e: (e.time.total, str(e.plan)))


def _microbatch_options(per_rank: int, plan_pp: int, schedule: str) -> list[int]:
    """Microbatch counts to try, leanest first (more microbatches: smaller ones)."""
    if plan_pp == 1:
        return sorted(_divisors(per_rank), reverse=True)  # micro-steps; many = small batches
    opts = [m for m in _divisors(per_rank) if m >= plan_pp]
    if schedule == "interleaved_1f1b":
        opts = [m for m in opts if m % plan_pp == 0]
    return sorted(opts, reverse=True)


def search(
    spec: ModelSpec,
    gpus: int,
    gpu: GpuCalibration,
    cluster: Cluster,
    work: Workload,
    *,
    top: int = 10,
    max_cp: int = 16,
    simulate: bool = True,
) -> SearchResult:
    """Rank the configurations of ``spec`` on ``gpus`` GPUs (NOTE [Search]).

    Every returned plan uses exactly ``gpus`` ranks, passes hp-trainer's degree checks and is
    predicted to fit ``gpu``'s memory. Raises :class:`NoPlanError` when none does, naming the
    nearest GPU count that has one.

    Example::

        result = search(model_spec("llama3-70b"), 1024, load_gpu("h200"),
                        load_cluster("h200"), Workload(4096, 8192))
        print(result.table())
    """
    check_int(gpus, "gpus", "search")
    check_int(top, "top", "search")
    check_int(max_cp, "max_cp", "search")
    t0 = time.perf_counter()
    found = _run(spec, gpus, gpu, cluster, work, top=top, max_cp=max_cp, simulate=simulate)
    found.elapsed = time.perf_counter() - t0
    if not found.ranked:
        near = nearest_gpu_count(spec, gpus, gpu, cluster, work, max_cp=max_cp)
        if near:
            hint = f"the nearest GPU count with a plan is --gpus {near}"
        else:
            hint = "no nearby GPU count has one either"
        reasons = found.why() or "no configuration was generated"
        raise NoPlanError(
            f"--gpus {gpus}: no configuration of {spec.name} for global batch "
            f"{work.global_batch} x seq {work.seq_len} fits {gpus} x {gpu.name}; {hint} "
            f"(or change --global-batch / --seq). Why each family was rejected:\n{reasons}"
        )
    return found


def _families(spec, gpus, work, cluster, max_cp, rejected):
    """Yield (Plan without variant choices, label) for each generated family; record the ranges
    the search bounds leave out."""
    g = cluster.gpus_per_node
    for tp in _divisors(gpus):
        if tp > g:
            why = f"tensor parallelism across nodes ({g} GPUs per node): not searched"
            rejected.append(Rejection(f"tp {tp}", (why,)))
            continue
        for cp in _divisors(gpus // tp):
            if cp > max_cp:
                why = f"context parallelism above the search bound max_cp={max_cp}"
                rejected.append(Rejection(f"tp {tp} cp {cp}", (why,)))
                continue
            for pp in _divisors(gpus // (tp * cp)):
                dp = gpus // (tp * cp * pp)
                if work.global_batch % dp:
                    why = (
                        f"training.global_batch_size={work.global_batch} is not divisible by "
                        f"the data parallel degree {dp}"
                    )
                    rejected.append(Rejection(_family_label(1, dp, tp, pp, cp), (why,)))
                    continue
                for rep in _divisors(dp):
                    shard = dp // rep
                    if rep > 1 and tp > 1:
                        continue  # ParallelDims: dp_replicate > 1 with tp > 1 (NOTE [Search] 1)
                    eps = [1]
                    if spec.is_moe and cp == 1 and rep == 1:
                        eps += [e for e in _divisors(shard) if e > 1 and spec.num_experts % e == 0]
                    for ep in eps:
                        etps = [1] + ([tp] if spec.is_moe and tp > 1 else [])
                        for etp in etps:
                            if ep > 1 and etp > 1 and shard != ep:
                                continue  # ParallelDims: etp > 1 with ep needs dp_shard = ep
                            sched = "1f1b" if pp > 1 else "none"  # a placeholder
                            yield Plan(
                                rep, shard, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, schedule=sched
                            )


def _run(spec, gpus, gpu, cluster, work, *, top, max_cp, simulate, feasibility_only=False):
    rejected: list[Rejection] = []
    ev = Evaluator(spec, work, gpu, cluster)
    keep = _Best()
    families = evaluated = feasible = 0
    for fam in _families(spec, gpus, work, cluster, max_cp, rejected):
        families += 1
        label = _family_label(
            fam.dp_replicate, fam.dp_shard, fam.tp, fam.pp, fam.cp, fam.ep, fam.etp
        )
        schedules = ["none"] if fam.pp == 1 else list(SCHEDULES)
        valid = []
        reasons = []
        for sched in schedules:
            vpp = SCHEDULES.get(sched, 1)
            why = _trainer_check(spec, work, gpus, fam, vpp, gpu.act_bytes < 4)
            if why is None:
                valid.append(sched)
            else:
                reasons.append(why)
        if not valid:
            rejected.append(Rejection(label, reasons[0]))
            continue
        per_rank = work.global_batch // fam.dp
        # the leanest variant: one-sequence microbatches, full recomputation
        lean_sched = "1f1b" if "1f1b" in valid else valid[0]
        lean_m = _microbatch_options(per_rank, fam.pp, lean_sched)
        if not lean_m:
            why = (
                f"{per_rank} sequences per data-parallel rank cannot make pp = {fam.pp} "
                "pipeline microbatches"
            )
            rejected.append(Rejection(label, (why,)))
            continue
        lean = _variant(fam, lean_sched, lean_m[0], "full")
        est = ev.estimate(lean)
        evaluated += 1
        if not est.fits(gpu):
            rejected.append(
                Rejection(
                    label,
                    (
                        "out of memory even at its leanest (one-sequence microbatches, full "
                        "recomputation)",
                    ),
                    _over(est, gpu),
                )
            )
            continue
        if feasibility_only:
            return True
        host_short = None  # the first swap variant over the host memory per GPU
        for sched in valid:
            for m in _microbatch_options(per_rank, fam.pp, sched):
                fitted = False
                for mode in ("none", "selective", "full", "swap"):
                    plan = _variant(fam, sched, m, mode)
                    e = ev.estimate(plan)
                    evaluated += 1
                    if host_short is None and not e.fits_host(gpu):
                        host_short = e
                    if e.fits(gpu):
                        fitted = True
                        feasible += 1
                        keep.push(e)
                        if mode == "none":
                            break
                if not fitted:
                    break  # larger microbatches need more memory still
        if host_short is not None:
            why = (
                f"swap ({host_short.plan}) needs {host_short.memory.host / GIB:.1f} GiB of host "
                f"memory per GPU for its swapped activations, over the calibration's "
                f"host_memory_gib = {gpu.host_memory / GIB:.1f}"
            )
            rejected.append(Rejection(f"{label} swap", (why,)))
    if feasibility_only:
        return False
    best = keep.sorted()[: max(2 * top, 20)]
    simulated = 0
    if simulate:
        best, simulated, dropped = _rescore(ev, best)
        rejected.extend(dropped)
    best.sort(key=lambda e: (e.time.total, str(e.plan)))
    return SearchResult(
        spec=spec,
        gpus=gpus,
        work=work,
        gpu=gpu,
        cluster=cluster,
        ranked=best[:top],
        rejected=rejected,
        families=families,
        evaluated=evaluated,
        feasible=feasible,
        elapsed=0.0,
        simulated=simulated,
    )


def _over(est: Estimate, gpu: GpuCalibration) -> str:
    """``by X GiB (peak P of C GiB)``."""
    peak = est.memory.peak / GIB
    return f"by {peak - gpu.memory / GIB:.1f} GiB: {peak:.1f} of {gpu.memory / GIB:.0f}"


def _variant(fam: Plan, schedule: str, m: int, mode: str) -> Plan:
    return Plan(
        fam.dp_replicate,
        fam.dp_shard,
        tp=fam.tp,
        pp=fam.pp,
        cp=fam.cp,
        ep=fam.ep,
        etp=fam.etp,
        schedule=schedule,
        microbatches=m,
        recompute=mode,
    )


def _rescore(ev: Evaluator, best: list[Estimate]):
    """Pipeline candidates again, with hp-pipeline's simulator (NOTE [Two passes over
    schedules]); those that no longer fit are dropped (and reported)."""
    out, dropped, n = [], [], 0
    t0 = time.perf_counter()
    for e in best:
        plan = e.plan
        late = time.perf_counter() - t0 > SIMULATION_BUDGET_S
        if plan.pp == 1 or plan.pp > P.SIMULATE_MAX_PP or late:
            out.append(e)
            continue
        fwd, bi, bw, comm = ev.stage_costs(plan, e.layout)
        span, held = P.simulate_pipeline(
            plan.schedule, plan.pp, plan.microbatches, fwd, bi, bw, comm
        )
        n += 1
        again = ev.estimate(plan, layout=e.layout, held=held, pipeline_time=span)
        if again.fits(ev.gpu):
            out.append(again)
        else:
            dropped.append(
                Rejection(
                    str(plan),
                    ("out of memory with the simulator's in-flight microbatches",),
                    _over(again, ev.gpu),
                )
            )
    return out, n, dropped


def nearest_gpu_count(
    spec: ModelSpec,
    gpus: int,
    gpu: GpuCalibration,
    cluster: Cluster,
    work: Workload,
    *,
    max_cp: int = 16,
    budget_s: float = 10.0,
) -> int | None:
    """The GPU count nearest to ``gpus`` (fewer first on ties) for which some configuration
    fits, searched outwards for up to ``budget_s`` seconds; None when none was found."""
    t0 = time.perf_counter()
    for delta in range(1, max(gpus, 64) + 1):
        for n in (gpus - delta, gpus + delta):
            if n < 1:
                continue
            if _run(
                spec,
                n,
                gpu,
                cluster,
                work,
                top=1,
                max_cp=max_cp,
                simulate=False,
                feasibility_only=True,
            ):
                return n
        if time.perf_counter() - t0 > budget_s:
            return None
    return None
