"""Corpus simulator (§5 "Configuration simulator"): replay VRSP and TAP over every GBS window.

Imports only ``libra_megatron.plan`` and ``libra_megatron.config``. All times are per attention layer, forward
then backward as the runtime runs them (``plan.exchange.plan_layer_timing``: every rank's op list priced with the
peers coupled, the backward in the pool's save mode); the ``forward_*`` keys keep the forward-only Pipeliner
timeline (``StepTimeModel.worker_seconds``, each worker alone) over the forward-only bound. Definitions (every
number is a mean over windows unless noted):

window      GBS consecutive packed sequences of the corpus (packing order); a trailing partial window
            is dropped. With ``max_windows`` N only the first N*GBS sequences are packed (megatron
            packing; best_fit must pack the whole corpus, see ``plan.packing``). A window runs as
            GA = GBS/DP steps; pool k of an order runs at GA step k*P // DP on DP ranks (k % (DP/P))*P + j
            (``plan.sequences.assign_to_ranks``).
inter-pool  R - 1 = max/mean - 1 of pool loads sum_i F_i (Eq. 2/4) for the contiguous (sampler) order,
            Algorithm 1, and the configured ``--sequence-placement``; ``lower_bound`` is the same ratio for
            ``workload.pool_lower_bound_counting`` (no grouping can beat it); ``eq3`` is Eq. 3 with the
            window's CV of F_i and D = GBS.
intra-pool  max/mean - 1 of Eq. 6 worker loads after tile placement, mean over pool instances.
straggler   (per instance) per step, max over the DP*CP workers of their forward plus max over them of their
            backward (each compute + exposed comm), as if every pool waited for every other after each
            microbatch; a candidate's ``estimated_step_seconds`` is its mean over all steps of all windows --
            the objective the recommendation minimises. ``straggler_vs_ulysses`` = sum of Libra step
            stragglers / sum of Ulysses' (forward + backward, ``sim.baselines``; < 1 is faster);
            ``straggler_vs_lower_bound`` divides by the perfectly balanced, communication-free step: the
            window's forward + backward compute at peak rate / (GA*DP*CP) (``balanced_layer_seconds``,
            backward = 2.5 x forward FLOPs). ``forward_*``: the same with the forward-only figures.
sync        the same pools under the synchronisation model (``sim.sync``, ``plan.sequences.sync``): lanes, EP ties,
            pipelines (--pp/--vpp), DP at step end; ``sync_*``, ``lane_imbalance``, ``pipeline_bubble_fraction*``.
bytes       per pool instance and layer forward (remote only), split Q / KV / O (``ExchangePlan`` totals).
variants    tap       contiguous order + Algorithm 2 (Libra "TAP")
            tap_vrsp  Algorithm 1 + Algorithm 2 (Libra "TAP+VRSP", the paper's full placement)
            libra     --sequence-placement + --tile-placement (the candidate's headline numbers)
            distca    one pool of P = DP per GA step (contiguous order) with --tile-placement, same H, B
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from ..config import PackingMode, SequencePlacement, TilePlacement
from ..plan.layout import TokenLayout
from ..plan.model import clt_expected_imbalance, imbalance, pool_lower_bound_counting, sequence_flops
from ..plan.packing import num_packed_upper_bound, pack_documents
from ..plan.sequences import SequenceStats, place_sequences, pool_loads, priced_lanes_apply
from .baselines import sequence_pair_heads, ulysses_layer_seconds, ulysses_worker_seconds, wlb_repack
from .hybrid_cp import HybridCpBaseline, HybridCpDims
from .pools import PoolEvaluator, PoolKnobs, PoolResult, SaveRule
from .result import Candidate, SimResult, WorstStep, _merge_window, _Steps, _worst_seconds
from .spec import (DTYPE_BYTES, MAX_TILES_PER_POOL, MIN_SEQ_LEN, MODEL_PRESETS, ModelDims, SimSpec, _num_windows,
                   check_jobs, check_run_cost, chunks_for_split)
from .sync import score_orders

__all__ = ["ModelDims", "SimSpec", "Candidate", "SimResult", "run_simulation", "check_run_cost", "check_jobs",
           "MODEL_PRESETS", "DTYPE_BYTES", "MIN_SEQ_LEN", "MAX_TILES_PER_POOL"]

@dataclass(frozen=True)
class _Corpus:
    """Packed corpus (the sequences the run replays): segments, Eq. 2 loads F_i and Eq. 6 pair-heads."""

    segments: List[np.ndarray]
    flops: np.ndarray  # float64 (num_packed,)
    pair_heads: np.ndarray  # float64 (num_packed,)
    num_documents: int
    num_sequences: int  # of the whole corpus; > num_packed when max_windows stopped megatron packing early


def _pack_corpus(doc_lens: np.ndarray, spec: SimSpec) -> _Corpus:
    """Pack (only the sequences ``max_windows`` needs) and count the whole corpus' sequences."""
    max_sequences = None if spec.max_windows is None else spec.max_windows * spec.global_batch_size
    if spec.packing is PackingMode.MEGATRON:  # stops early; the whole corpus' count is tokens // L
        segments = pack_documents(doc_lens, spec.seq_len, spec.packing, spec.seed, max_sequences)
        total = num_packed_upper_bound(doc_lens, spec.seq_len, spec.packing)
    else:  # best_fit packs everything anyway (plan.packing): count it, then keep what the windows need
        segments = pack_documents(doc_lens, spec.seq_len, spec.packing, spec.seed)
        total, segments = len(segments), segments[:max_sequences]
    return _Corpus(segments, sequence_flops(segments), sequence_pair_heads(segments, spec.dims.num_q_heads),
                   int(np.count_nonzero(doc_lens)), total)


def _pool_positions(num_pools: int, pool_size: int, dp: int) -> Tuple[np.ndarray, np.ndarray]:
    """(GA step, first DP rank) of every pool k of a GA-major, pool-minor order (Fig. 7)."""
    k = np.arange(num_pools, dtype=np.int64)
    return k * pool_size // dp, (k % (dp // pool_size)) * pool_size


@dataclass
class _OrderRun:
    """One placement variant on one window: per-step stragglers and the pools that ran.

    ``step_seconds`` / ``step_compute`` [GA]: the whole layer (forward straggler + backward straggler, and their
    compute); ``forward_seconds`` / ``forward_compute``: the forward-only Pipeliner figures; ``phases``: each
    phase's straggler seconds and compute under the event model (``_Steps.phases`` keys)."""

    step_seconds: np.ndarray
    pools: List[PoolResult]
    pool_step: np.ndarray
    pool_first_dp: np.ndarray
    step_compute: np.ndarray = None
    forward_seconds: np.ndarray = None
    forward_compute: np.ndarray = None
    phases: Dict[str, np.ndarray] = None


def _straggler(pools: List[PoolResult], pool_step: np.ndarray, num_steps: int, seconds_of: str,
               compute_of: str) -> Tuple[np.ndarray, np.ndarray]:
    """([GA] max over every step's workers of ``PoolResult.<seconds_of>``, [GA] that slowest worker's
    ``<compute_of>``; its exposed comm is the rest). Workers within 1e-9 (relative) of the step's maximum tie;
    the tie goes to the largest compute, so the exposed share is never overstated."""
    seconds = np.concatenate([getattr(p, seconds_of) for p in pools])
    compute = np.concatenate([getattr(p, compute_of) for p in pools])
    step = np.repeat(pool_step, [p.seconds.size for p in pools])
    top = np.zeros(num_steps)
    np.maximum.at(top, step, seconds)
    out = np.zeros(num_steps)
    tied = seconds >= top[step] * (1.0 - 1e-9)
    np.maximum.at(out, step[tied], compute[tied])
    return top, out


def _straggler_compute(pools: List[PoolResult], pool_step: np.ndarray, num_steps: int) -> np.ndarray:
    """[GA]: compute seconds of the slowest worker of every step, forward-only Pipeliner figures."""
    return _straggler(pools, pool_step, num_steps, "seconds", "compute_seconds")[1]


def _run_order(ev: PoolEvaluator, ids: np.ndarray, order: np.ndarray, pool_size: int,
               knobs: PoolKnobs, method, spec: SimSpec) -> _OrderRun:
    """Evaluate every pool of ``order`` (positions into the window ``ids``) and take per-step maxima."""
    num_pools = order.size // pool_size
    step, first_dp = _pool_positions(num_pools, pool_size, spec.data_parallel_size)
    cp = spec.context_parallel_size
    pools = [ev.evaluate(ids[order[k * pool_size:(k + 1) * pool_size]], knobs, method, int(first_dp[k]) * cp)
             for k in range(num_pools)]
    ga = spec.num_steps
    fwd_s, fwd_c = _straggler(pools, step, ga, "seconds", "compute_seconds")
    phases = {}
    for phase, prefix in (("forward", "fwd"), ("backward", "bwd")):
        phases[f"{phase}_seconds"], phases[f"{phase}_compute"] = _straggler(
            pools, step, ga, f"{prefix}_seconds", f"{prefix}_compute_seconds")
    return _OrderRun(phases["forward_seconds"] + phases["backward_seconds"], pools, step, first_dp,
                     phases["forward_compute"] + phases["backward_compute"], fwd_s, fwd_c, phases)


def _step_workers(run: _OrderRun, step: int) -> Tuple[np.ndarray, np.ndarray]:
    """(compute, exposed comm) per worker of one step, the whole layer (forward + backward), pools in DP-rank
    order."""
    chosen = sorted(np.flatnonzero(run.pool_step == step).tolist(), key=lambda k: run.pool_first_dp[k])
    compute = np.concatenate([run.pools[k].fwd_compute_seconds + run.pools[k].bwd_compute_seconds for k in chosen])
    total = np.concatenate([run.pools[k].fwd_seconds + run.pools[k].bwd_seconds for k in chosen])
    return compute, total - compute


@dataclass
class _Window:
    """Candidate-independent data of one window."""

    index: int
    ids: np.ndarray  # corpus sequence ids, sampler order
    flops: np.ndarray  # their Eq. 4 workloads
    ulysses_seq_seconds: np.ndarray  # (GBS,) whole layer (forward + backward)
    lower_bound_step: float  # whole layer: balanced forward + backward
    ulysses_forward_seconds: np.ndarray = None  # (GBS,) forward only (the forward_* figures)
    forward_lower_bound_step: float = 0.0  # balanced forward only


def _ulysses_heads(spec: SimSpec) -> Tuple[int, int, int]:
    return spec.dims.num_q_heads, spec.dims.num_kv_heads, spec.dims.elem_bytes


def ulysses_phases(pair_heads: np.ndarray, tokens: np.ndarray, spec: SimSpec) -> Tuple[np.ndarray, np.ndarray]:
    """Per sequence (= per CP rank of its group): Ulysses' (forward, backward) seconds under the whole-layer model,
    as the baseline prices them (``sim.baselines.ulysses_layer_seconds``)."""
    return ulysses_layer_seconds(pair_heads, tokens, spec.context_parallel_size, _ulysses_heads(spec), spec.cost)


def _ulysses_steps(pair_heads: np.ndarray, tokens: np.ndarray, spec: SimSpec) -> Tuple[np.ndarray, np.ndarray]:
    """Per sequence (= per CP rank of its group): (whole layer, forward-only) Ulysses seconds."""
    fwd, bwd = ulysses_phases(pair_heads, tokens, spec)
    cp = spec.context_parallel_size
    return fwd + bwd, ulysses_worker_seconds(pair_heads, tokens, cp, _ulysses_heads(spec), spec.cost)


def _window_data(corpus: _Corpus, w: int, spec: SimSpec) -> _Window:
    gbs = spec.global_batch_size
    ids = np.arange(w * gbs, (w + 1) * gbs, dtype=np.int64)
    layer, forward = _ulysses_steps(corpus.pair_heads[ids], np.full(gbs, spec.seq_len), spec)
    return _Window(w, ids, corpus.flops[ids], layer, _lower_bound_step(corpus, ids, spec), forward,
                   _lower_bound_step(corpus, ids, spec, forward_only=True))


def _lower_bound_step(corpus: "_Corpus", ids: np.ndarray, spec: SimSpec, forward_only: bool = False) -> float:
    """The window's attention work (forward + backward, or forward only) at peak rate spread perfectly over
    GA*DP*CP workers, no communication."""
    workers = spec.num_steps * spec.data_parallel_size * spec.context_parallel_size
    work = corpus.pair_heads[ids].sum()
    return spec.cost.balanced_seconds(work, workers) if forward_only else spec.cost.balanced_layer_seconds(work, workers)


def _wlb_steps(corpus: _Corpus, win: _Window, spec: SimSpec) -> Tuple[np.ndarray, np.ndarray]:
    """(whole layer, forward only) step seconds of the WLB-LLM variant."""
    bins = wlb_repack([corpus.segments[i] for i in win.ids], spec.global_batch_size, spec.wlb_cap_factor * spec.seq_len)
    tokens = np.array([b.sum() for b in bins], dtype=np.float64)
    layer, forward = _ulysses_steps(sequence_pair_heads(bins, spec.dims.num_q_heads), tokens, spec)
    shape = (spec.num_steps, spec.data_parallel_size)
    return layer.reshape(shape).max(axis=1), forward.reshape(shape).max(axis=1)


def _distca_steps(ev: PoolEvaluator, win: _Window, knobs: PoolKnobs, spec: SimSpec) -> _OrderRun:
    """The DistCA-scope variant's order run (one pool of P = DP per GA step, sampler order)."""
    order = np.arange(spec.global_batch_size, dtype=np.int64)
    return _run_order(ev, win.ids, order, spec.data_parallel_size, knobs, spec.tile_placement, spec)


def _extend_steps(steps, run: _OrderRun) -> None:
    steps.extend(run.step_seconds, run.step_compute, run.forward_seconds, run.forward_compute, run.phases)


def _inter_pool(cand_p: int, flops: np.ndarray, orders: Dict[str, np.ndarray]) -> Dict[str, float]:
    """Inter-pool R-1 of every order, of the counting lower bound, and Eq. 3 at the window CV."""
    out = {name: imbalance(pool_loads(flops, order, cand_p)) for name, order in orders.items()}
    mean_pool = float(flops.sum()) / (flops.size // cand_p)
    out["lower_bound"] = pool_lower_bound_counting(flops, cand_p) / mean_pool - 1.0 if mean_pool > 0 else 0.0
    cv = float(flops.std() / flops.mean()) if flops.mean() > 0 else 0.0
    out["eq3"] = clt_expected_imbalance(cv, cand_p, flops.size)
    return out


def sequence_stats(corpus: "_Corpus", ids: np.ndarray) -> SequenceStats:
    """What the priced-pool proxy reads of the packed sequences ``ids`` (``plan.sequences.pool_proxy``)."""
    return SequenceStats.of([corpus.segments[i] for i in np.asarray(ids).tolist()])


def window_pool_seconds(corpus: "_Corpus", ids: np.ndarray, pool_size: int, spec: SimSpec):
    """The ``pool_seconds`` the sync placement prices a window's candidate pools with: the proxy of
    ``spec.pool_proxy`` on the window's sequences where the priced placement runs (``priced_lanes_apply``), else
    None -- as the sampler builds it (``megatron.sampler.build_libra_data_loader``)."""
    if not priced_lanes_apply(spec.sync_layout(pool_size)):
        return None
    return spec.pool_proxy(pool_size).pricer(sequence_stats(corpus, ids))


def _orders(flops: np.ndarray, pool_size: int, spec: SimSpec, pool_seconds=None) -> Dict[str, np.ndarray]:
    return {
        "contiguous": place_sequences(flops, pool_size, SequencePlacement.CONTIGUOUS),
        "alg1": place_sequences(flops, pool_size, SequencePlacement.ALG1),
        "placed": place_sequences(flops, pool_size, spec.sequence_placement, spec.sync_layout(pool_size), pool_seconds),
    }


_VARIANT_PLAN = {  # variant -> (order name, tile method or None for --tile-placement)
    "tap": ("contiguous", TilePlacement.ALG2),
    "tap_vrsp": ("alg1", TilePlacement.ALG2),
    "libra": ("placed", None),
}


def _record_candidate(cand: Candidate, ev: PoolEvaluator, win: _Window,
                      orders: Dict[str, np.ndarray], spec: SimSpec) -> None:
    """Run the three Libra variants of one candidate on one window and accumulate."""
    for variant, (order_name, method) in _VARIANT_PLAN.items():
        method = method or spec.tile_placement
        run = _run_order(ev, win.ids, orders[order_name], cand.pool_size, cand.knobs, method, spec)
        _extend_steps(cand.steps[variant], run)
        if variant == "libra":
            _record_libra(cand, run, win, spec)
    cand.lower_bound.extend([win.lower_bound_step] * spec.num_steps)
    cand.forward_lower_bound.extend([win.forward_lower_bound_step] * spec.num_steps)
    _record_sync(cand, ev, win, orders, spec)


def sync_timings(cand: Candidate, ev: PoolEvaluator, win: _Window, orders: Dict[str, np.ndarray], spec: SimSpec):
    """(whole layer, forward-only) ``StepTiming`` of every order of ``orders`` (any names) and of the lower bound
    under the sync model (sim/sync.py), each order with the candidate's tile placement: the whole layer prices
    every pool's forward and backward; the forward-only figures take the Pipeliner forward and backward = the
    layout's ``backward_ratio`` x forward, as before."""
    layout = spec.sync_layout(cand.pool_size)
    runs = {name: _run_order(ev, win.ids, order, cand.pool_size, cand.knobs, spec.tile_placement, spec).pools
            for name, order in orders.items()}
    fwd_lb = win.forward_lower_bound_step
    timings = score_orders({n: [p.fwd_seconds for p in r] for n, r in runs.items()}, fwd_lb, layout,
                           {n: [p.bwd_seconds for p in r] for n, r in runs.items()}, win.lower_bound_step - fwd_lb)
    forward = score_orders({n: [p.seconds for p in r] for n, r in runs.items()}, fwd_lb, layout)
    return timings, forward


def _record_sync(cand: Candidate, ev: PoolEvaluator, win: _Window, orders: Dict[str, np.ndarray], spec: SimSpec) -> None:
    """Score every order under the sync model (``sync_timings``) into the candidate's accumulators."""
    timings, forward = sync_timings(cand, ev, win, orders, spec)
    cand.sync.record(win.index, timings, timings["lower_bound"], win.flops, orders, spec.sync_layout(cand.pool_size),
                     forward)


def _record_libra(cand: Candidate, run: _OrderRun, win: _Window, spec: SimSpec) -> None:
    cand.intra.extend(p.intra_imbalance for p in run.pools)
    cand.bytes_qkvo.extend(p.bytes_qkvo for p in run.pools)
    cand.num_tiles.extend(p.num_tiles for p in run.pools)
    cand.num_fallback += sum(p.num_fallback for p in run.pools)
    for p in run.pools:
        cand.save_modes[p.save_mode] += 1
    step = int(np.argmax(run.step_seconds))
    if cand.worst is None or run.step_seconds[step] > _worst_seconds(cand.worst):
        compute, exposed = _step_workers(run, step)
        dp = spec.data_parallel_size
        uly = np.repeat(win.ulysses_seq_seconds[step * dp:(step + 1) * dp], spec.context_parallel_size)
        cand.worst = WorstStep(win.index, step, compute, exposed, uly)


def _make_candidates(spec: SimSpec) -> List[Candidate]:
    return [Candidate(p, h, b, t, chunks_for_split(spec, h, m), tiling, fetch) for p in spec.pool_sizes
            for h in spec.head_splits
            for b in spec.block_sizes for t in spec.taus for m in spec.chunk_counts for tiling in spec.tilings
            for fetch in spec.kv_fetches]


def _simulate_window(corpus: _Corpus, w: int, spec: SimSpec, ev: PoolEvaluator, result: SimResult) -> None:
    win = _window_data(corpus, w, spec)
    dp = spec.data_parallel_size
    shape = (spec.num_steps, dp)
    result.ulysses.extend(win.ulysses_seq_seconds.reshape(shape).max(axis=1),
                          forward_seconds=win.ulysses_forward_seconds.reshape(shape).max(axis=1))
    wlb_layer, wlb_forward = _wlb_steps(corpus, win, spec)
    result.wlb.extend(wlb_layer, forward_seconds=wlb_forward)
    flops = corpus.flops[win.ids]
    result.window_cv.append(float(flops.std() / flops.mean()) if flops.mean() > 0 else 0.0)
    distca: Dict[PoolKnobs, _OrderRun] = {}
    for p in spec.pool_sizes:
        orders = _orders(flops, p, spec, window_pool_seconds(corpus, win.ids, p, spec))
        if spec.dump_orders:
            result.orders_dump.append(_order_record(corpus, win, p, orders["placed"], spec))
        inter = _inter_pool(p, flops, orders)
        for cand in (c for c in result.candidates if c.pool_size == p):
            for key, value in inter.items():
                cand.inter[key].append(value)
            _record_candidate(cand, ev, win, orders, spec)
            if spec.distca and cand.knobs not in distca:
                distca[cand.knobs] = _distca_steps(ev, win, cand.knobs, spec)
            if spec.distca:
                _extend_steps(cand.steps["distca"], distca[cand.knobs])
    ev.clear()


def _order_record(corpus: _Corpus, win: _Window, pool_size: int, order: np.ndarray, spec: SimSpec) -> Dict[str, object]:
    """One --dump-orders line: the window's packed sequences (document lengths, sampler order) and the order."""
    return {"window": win.index, "dp": spec.data_parallel_size, "pool_size": pool_size, "ga": spec.num_steps,
            "seq_docs": [corpus.segments[i].tolist() for i in win.ids.tolist()], "order": order.tolist()}


_WORKER: Dict[str, object] = {}  # per-process state of window workers (set before forking)


def _window_job(w: int) -> SimResult:
    """Simulate window ``w`` alone (in a worker process or inline) into a fresh partial result."""
    corpus, spec, ev = _WORKER["corpus"], _WORKER["spec"], _WORKER["evaluator"]
    part = SimResult(spec, _make_candidates(spec), _Steps(), _Steps(), 1, 0, 0)
    _simulate_window(corpus, w, spec, ev, part)
    return part


def _window_results(num_windows: int, jobs: int, job: Callable[[int], object] = _window_job):
    """Yield ``job(w)`` for every window in window order, ``jobs`` processes at a time (fork; ``job`` reads the
    corpus, spec and evaluator from ``_WORKER``)."""
    if jobs <= 1 or num_windows == 1:
        yield from (job(w) for w in range(num_windows))
        return
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(min(jobs, num_windows)) as pool:
        yield from pool.imap(job, range(num_windows))


def _megatron_hybrid_cp(baseline: HybridCpBaseline, corpus: "_Corpus", num_windows: int, spec: SimSpec) -> Dict:
    """Megatron-LM's hybrid-CP balancer on every window's documents, priced by ``sim.hybrid_cp``."""
    gbs = spec.global_batch_size
    ids = [np.arange(w * gbs, (w + 1) * gbs) for w in range(num_windows)]
    windows = [np.concatenate([corpus.segments[i] for i in win]).astype(int).tolist() for win in ids]
    lower = [_lower_bound_step(corpus, win, spec) * spec.num_steps for win in ids]
    forward_lower = [_lower_bound_step(corpus, win, spec, forward_only=True) * spec.num_steps for win in ids]
    dims = HybridCpDims(spec.dims.num_q_heads, spec.dims.num_kv_heads, spec.dims.elem_bytes)
    return baseline.evaluate(windows, lower, spec.num_steps, dims, spec.cost,
                             spec.data_parallel_size * spec.context_parallel_size, spec.seq_len,
                             spec.context_parallel_size, forward_lower_bounds=forward_lower)


def save_rule(spec: SimSpec, layout: TokenLayout) -> SaveRule:
    """The run's save mode as ``sim.pools`` applies it per pool (auto: the planner's rule over the layers alive at once)."""
    return SaveRule(spec.save_mode, spec.activation_budget_gb, spec.saved_layers, layout.local_len)


def prepare_corpus(doc_lens, spec: SimSpec, jobs: int) -> Tuple[_Corpus, int, PoolEvaluator]:
    """Validate ``spec`` and ``jobs``, refuse a too costly run (``check_run_cost``), pack the windows the run
    replays; returns (corpus, number of windows, the pool evaluator every window uses)."""
    spec.validate()
    check_jobs(jobs)
    doc_lens = np.asarray(doc_lens, dtype=np.int64)
    check_run_cost(doc_lens, spec)
    corpus = _pack_corpus(doc_lens, spec)
    layout = TokenLayout(spec.token_layout, spec.seq_len, spec.context_parallel_size)
    ev = PoolEvaluator(corpus.segments, layout, spec.dims.num_q_heads, spec.dims.num_kv_heads,
                       spec.dims.elem_bytes, spec.cost, save_rule(spec, layout))
    return corpus, _num_windows(corpus.num_sequences, spec), ev


def replay_windows(corpus: _Corpus, num_windows: int, ev: PoolEvaluator, spec: SimSpec, jobs: int,
                   job: Callable[[int], object] = _window_job):
    """Yield ``job(w)`` of every window in order, ``jobs`` forked processes at a time (``_WORKER`` holds the
    corpus, spec and evaluator while it runs)."""
    _WORKER.update(corpus=corpus, spec=spec, evaluator=ev)
    try:
        yield from _window_results(num_windows, jobs, job)
    finally:
        _WORKER.clear()


def run_simulation(doc_lens, spec: SimSpec, progress: Optional[Callable[[int, int], None]] = None,
                   jobs: int = 1, megatron_hybrid_cp: Optional[HybridCpBaseline] = None) -> SimResult:
    """Pack ``doc_lens`` (int, tokens), replay every GBS window for every (P, H, B, tau, M) and the baselines.

    ``jobs`` > 1 simulates windows in that many forked processes; results are identical to jobs=1.
    ``megatron_hybrid_cp`` adds Megatron-LM's hybrid-CP balancer on the same windows (``sim.hybrid_cp``).
    """
    start = time.perf_counter()
    corpus, num_windows, ev = prepare_corpus(doc_lens, spec, jobs)
    result = SimResult(spec, _make_candidates(spec), _Steps(), _Steps(), num_windows,
                       corpus.num_sequences, corpus.num_documents)
    for done, part in enumerate(replay_windows(corpus, num_windows, ev, spec, jobs), start=1):
        _merge_window(result, part)
        if progress is not None:
            progress(done, num_windows)
    if megatron_hybrid_cp is not None:
        result.megatron_hybrid_cp = _megatron_hybrid_cp(megatron_hybrid_cp, corpus, num_windows, spec)
    result.seconds = time.perf_counter() - start
    return result
