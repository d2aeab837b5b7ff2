"""Pipeline facts the planner needs, from hp-pipeline's public API: the stage split
(``balance_stages``), and per schedule the microbatches each rank holds at its peak and the
step's makespan (``build_schedule`` + ``simulate``).

NOTE [Two passes over schedules]
Simulating a schedule costs 0.01-1.5 s on this 2-core machine (pp 16, 128 microbatches:
about 1 s), too slow for every candidate. The search therefore ranks with closed forms
(:func:`inflight` and :func:`makespan`, which the tests check against ``simulate`` for every
schedule with pp <= 8) and then re-scores its best candidates with the simulator itself, with
each stage's own forward / backward / weight-gradient times and the transfer time: their
memory uses the simulator's peak in-flight counts, their step time its makespan.
"""

from __future__ import annotations

from functools import lru_cache

from ._spec import ModelSpec

__all__ = [
    "SIMULATE_MAX_PP",
    "inflight",
    "makespan",
    "simulate_pipeline",
    "simulated_microbatches",
    "stage_ranges",
]


def inflight(schedule: str, pp: int, m: int, rank: int) -> int:
    """Microbatch-stages whose forward ran and whose backward has not, at ``rank``'s peak,
    under ``schedule`` with ``pp`` ranks and ``m`` microbatches (hp-pipeline's
    ``SimResult.peak_inflight``; closed forms of its generators)."""
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(m, pp - rank)
    if schedule == "interleaved_1f1b":  # v = 2: warm-up (v - 1) pp + 2 (pp - 1 - r), plus one
        return min(2 * m, 2 * (pp - rank - 1) + pp + 1)
    if schedule == "zbv":
        return min(2 * pp, m + rank + 1, 2 * m)
    raise ValueError(f"unknown schedule {schedule!r}")  # pragma: no cover - Plan checks it


def makespan(schedule: str, pp: int, m: int, f: float, b: float, comm: float = 0.0) -> float:
    """Closed-form time of one step's pipeline: ``f`` and ``b`` are the slowest rank's forward
    and backward (input plus weight gradient) time per microbatch over all its stages, ``comm``
    one activation transfer. GPipe and 1F1B: ``(m + pp - 1)(f + b)``; interleaved with v = 2:
    ``m (f + b) + (pp - 1)(f + b) / 2``; ZBV: ``m (f + b) + (pp - 1) f / 2``, twice that while
    ``m < 2 pp``; each plus the transfers of one pass down and back up."""
    v = 2 if schedule in ("interleaved_1f1b", "zbv") else 1
    transfers = 2 * (pp * v - 1) * comm
    if schedule in ("gpipe", "1f1b"):
        return (m + pp - 1) * (f + b) + transfers
    if schedule == "interleaved_1f1b":
        return m * (f + b) + (pp - 1) * (f + b) / v + transfers
    if schedule == "zbv":
        return m * (f + b) + (pp - 1) * (f / v) * (2 if m < 2 * pp else 1) + transfers
    raise ValueError(f"unknown schedule {schedule!r}")  # pragma: no cover


def _trainer_costs(spec: ModelSpec, seq: int) -> list[float]:
    """Per-block costs as hp-trainer's pipeline split weighs them: 6 x the block's parameters
    (a MoE block's active ones) + 12 d seq, the output projection on the last block."""
    n, d = spec.n_layers, spec.dim
    block = (spec.num_params(embeddings=False) - d) / n
    costs = [6 * block + 12 * d * seq] * n
    if spec.is_moe:
        f = spec.ffn_hidden
        dense_ffn = 3 * d * f + (2 * f + d if spec.mlp_bias else 0)
        # the model with every feed-forward dense (and without MTP), per block
        dense_block = sum(spec.mixer_params(i).total + dense_ffn for i in range(n)) / n
        moe = spec.ffn_params(spec.moe_layers[0])
        active = moe.replicated + moe.experts // spec.num_experts * spec.top_k
        swap = active - 3 * d * f
        costs = [
            6 * (dense_block + (swap if spec.layer_is_moe(i) else 0)) + 12 * d * seq
            for i in range(n)
        ]
    costs[-1] += 6 * spec.vocab_size * d
    return costs


@lru_cache(maxsize=256)
def stage_ranges(spec: ModelSpec, n_stages: int, seq: int) -> tuple[tuple[int, int], ...]:
    """Block ranges of ``n_stages`` pipeline stages, split as hp-trainer splits them for
    ``seq``-token sequences: ``hp_pipeline.balance_stages`` over its per-block costs (no memory
    limit: the trainer balances time)."""
    from hp_pipeline import balance_stages

    costs = _trainer_costs(spec, seq)
    plan = balance_stages(costs, [0] * len(costs), n_stages)
    return tuple(tuple(b) for b in plan.boundaries)


@lru_cache(maxsize=64)
def _schedule(name: str, pp: int, m: int):
    from hp_pipeline import build_schedule

    return build_schedule(name, pp, m)


#: the simulator is run only up to this pipeline degree (ZBV's generator alone takes ~19 s
#: at pp 32 on this machine); beyond it the closed forms stand
SIMULATE_MAX_PP = 16


def simulated_microbatches(name: str, pp: int, m: int) -> int:
    """How many microbatches :func:`simulate_pipeline` runs for an ``m``-microbatch step:
    ``m``, or ``2 pp`` (a multiple of ``pp``) when smaller; from there on every rank's peak
    in-flight count has saturated (GPipe's, ``m``, is known) and each further microbatch
    adds one steady-state period."""
    return m if name == "gpipe" and m <= 4 * pp else min(m, 2 * pp)


@lru_cache(maxsize=256)
def simulate_pipeline(
    name: str,
    pp: int,
    m: int,
    forward: tuple[float, ...],
    backward_input: tuple[float, ...],
    backward_weight: tuple[float, ...],
    comm: float,
) -> tuple[float, tuple[int, ...]]:
    """``(makespan, peak in-flight per rank)`` of schedule ``name`` from hp-pipeline's
    simulator, with stage ``s`` costing ``forward[s]`` per microbatch forward,
    ``backward_input[s]`` per input-gradient pass (B) and ``backward_weight[s]`` per
    weight-gradient pass (W; a FULL_B costs both) and every transfer ``comm`` seconds.

    Long steps are simulated on :func:`simulated_microbatches` microbatches and extended by
    the slowest rank's per-microbatch time for each one more (the steady state of every
    schedule here runs one microbatch per period on the busiest rank): within 0.5% of the
    whole simulation for GPipe, 1F1B and ZBV and 1.5% for interleaved 1F1B on the tests'
    uneven stages, never below it."""
    from hp_pipeline import MetaStepType, simulate

    ms = simulated_microbatches(name, pp, m)
    steps, placement = _schedule(name, pp, ms)
    T = MetaStepType

    def cost(step) -> float:
        s = step.stage
        if step.type is T.F:
            return forward[s]
        if step.type is T.B:
            return backward_input[s]
        if step.type is T.W:
            return backward_weight[s]
        if step.type is T.FULL_B:
            return backward_input[s] + backward_weight[s]
        return sum(cost(p) for p in step.parts())  # fused steps (none are generated here)

    result = simulate(steps, placement, ms, costs=cost, comm_cost=comm)
    span = result.makespan
    held = tuple(result.peak_inflight[r] for r in range(pp))
    if ms < m:
        per_rank = [0.0] * pp
        for s, r in placement.items():
            per_rank[r] += forward[s] + backward_input[s] + backward_weight[s]
        v = len(placement) // pp  # transfers on the critical path per period: one per chunk
        span += (m - ms) * (max(per_rank) + v * comm)
        if name == "gpipe":
            held = tuple(m for _ in range(pp))
    return span, held
