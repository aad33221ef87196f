"""The paper's Fig. 12 in the simulator (``--fig12``): per-microbatch forward time, Ulysses vs Libra.

Imports only ``libra_megatron.plan`` (through the simulator's own modules). The paper (§6.2 "PP Imbalance",
Fig. 12) runs DP=4 PP=2 with CP=8 GBS=128 (256K) and CP=16 GBS=32 (1M) and plots "the distribution of
per-microbatch forward time, aggregated over all ranks across 15 training iterations and normalized by Libra's
mean forward time in the same iteration (so Libra's mean sits at 1)". Here:

sample      one (window, DP replica, GA microbatch): the seconds of the microbatch's attention forward (one layer,
            whole-layer model) that every rank of the replica waits for on a pipeline stage. Under the simulator's
            even layer split every stage of a microbatch carries the same value, and all ranks of a replica see
            the same one, so "all ranks" (PP x DP x CP of them) weights every sample equally: the distribution
            (min, mean, max) is that of the samples, PP x CP copies of each. Forward times are neither summed
            nor maxed over DP replicas: each replica records its own (that is what a rank measures), and EP
            groups spanning replicas tie them as the sync model does (none in the shipped configs).
Ulysses     the sampler order without TAP: packed sequence g*DP + r of the window runs at GA step g on replica r
            (the simulator's Ulysses baseline), its CP group priced as that baseline prices it
            (``runner.ulysses_phases``: one kernel call of pair-heads/CP plus the four un-overlapped all-to-alls);
            the all-to-alls couple the group, so the group's time is every rank's.
Libra       the placement that ships: ``--sequence-placement`` (sync VRSP) and ``--tile-placement`` with the
            run's knobs (``--libra-config``), each pool priced by ``plan.exchange.plan_layer_timing`` (the
            simulator's pools, ``PoolResult.fwd_seconds``); the exchange couples the pool's P x CP workers, so
            the pool's forward (max over its workers, ``plan.sequences.step_timing``'s ``microbatch_seconds``)
            is every rank's of its P replicas.
normalise   both by Libra's mean sample of the same window (iteration).
reduction   the worst Ulysses sample over the worst Libra sample (both normalised). Libra's worst is >= its mean
            = 1, so the factor can never exceed Ulysses' normalised worst: a trace whose Ulysses spread is smaller
            than the paper's cannot show the paper's factor. Nor can it exceed about P when Ulysses and Libra
            run a unit of attention work at the same rate (the model's case): the sequence behind Ulysses'
            worst microbatch sits in one Libra pool of P sequences, whose P x CP workers carry at least its work
            (Ulysses: CP workers), so that pool's time is at least about 1/P of Ulysses' (a2a and exchange
            aside) in the same window.
trace       what the trace itself allows, per window, in Eq. 2 workloads F = sum l^2 of the packed sequences:
            ``sequence_spread`` = max F / mean F (Ulysses' compute spread) and ``libra_floor`` = the counting lower
            bound of the heaviest pool over the mean pool (``plan.model.pool_lower_bound_counting``: no placement
            of P sequences per pool does better; Libra's worst pool cannot fall below it in FLOPs).

Non-attention work (``--other-seconds``) is not part of the sample: it is the same for every packed sequence and
the paper's spread (0.02 - 23.1 at 1M) is attention's.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from ..plan.model import pool_lower_bound_counting
from ..plan.sequences import place_sequences, step_timing
from . import runner as R
from .spec import SimSpec
from .sync import describe_layout, worker_seconds

__all__ = ["PAPER_FIG12", "FIG12_PNG", "Fig12Result", "run_fig12", "window_forward", "paper_entry",
           "check_fig12_spec", "format_fig12", "plot_fig12"]

FIG12_PNG = "fig12_microbatch_forward.png"

PAPER_FIG12: Dict[str, Dict[str, object]] = {  # Fig. 12 (§6.2 "PP Imbalance"), per-microbatch forward / Libra mean
    "256K": {"layout": {"seq_len": 262144, "dp": 4, "pp": 2, "cp": 8, "gbs": 128},
             "ulysses": {"min": None, "mean": None, "max": 6.98}, "libra": {"min": None, "mean": 1.0, "max": 2.63},
             "worst_reduction": 2.6},
    "1M": {"layout": {"seq_len": 1048576, "dp": 4, "pp": 2, "cp": 16, "gbs": 32},
           "ulysses": {"min": 0.02, "mean": 4.14, "max": 23.1}, "libra": {"min": 0.52, "mean": 1.0, "max": 1.57},
           "worst_reduction": 14.7},
}
_CITATION = "Libra paper, Fig. 12 and §6.2 'PP Imbalance' (15 training iterations, all ranks)"
METHODS = ("ulysses", "libra")
TRACE_KEYS = ("sequence_spread", "libra_floor")


def _layout_of(spec: SimSpec) -> Dict[str, int]:
    return {"seq_len": spec.seq_len, "dp": spec.data_parallel_size, "pp": spec.pipeline_parallel_size,
            "cp": spec.context_parallel_size, "gbs": spec.global_batch_size}


def paper_entry(spec: SimSpec) -> Tuple[Optional[str], Optional[Dict[str, object]]]:
    """(name, ``PAPER_FIG12`` entry) of the paper's layout this run reproduces, or (None, None)."""
    layout = _layout_of(spec)
    for name, entry in PAPER_FIG12.items():
        if entry["layout"] == layout:
            return name, entry
    return None, None


def check_fig12_spec(spec: SimSpec) -> None:
    """``--fig12`` prices one Libra configuration: every grid flag has exactly one value (ValueError names it)."""
    grid = (("--pool-size", spec.pool_sizes), ("--head-split", spec.head_splits), ("--block-size", spec.block_sizes),
            ("--tau", spec.taus), ("--num-chunks", spec.chunk_counts),
            ("--tiling", tuple(t.value for t in spec.tilings)), ("--kv-fetch", tuple(f.value for f in spec.kv_fetches)))
    for flag, values in grid:
        if len(values) != 1:
            raise ValueError(f"--fig12 prices one Libra configuration (the one that ships), but {flag} has "
                             f"{len(values)} values ({' '.join(map(str, values))}); give one")


def window_forward(corpus, w: int, spec: SimSpec, ev) -> Dict[str, np.ndarray]:
    """One window's samples (module docstring): ``{"ulysses": [GA, DP], "libra": [GA, DP]}`` forward seconds per
    attention layer, replica r of GA step g at [g, r], and the window's ``sequence_spread`` and ``libra_floor``."""
    gbs, dp, cp, ga = spec.global_batch_size, spec.data_parallel_size, spec.context_parallel_size, spec.num_steps
    ids = np.arange(w * gbs, (w + 1) * gbs, dtype=np.int64)
    uly_fwd, uly_bwd = R.ulysses_phases(corpus.pair_heads[ids], np.full(gbs, spec.seq_len), spec)
    per_rank = lambda x: np.repeat(x.reshape(ga, dp), cp, axis=1)  # noqa: E731  [GA, DP*CP], sampler order
    ulysses = step_timing(per_rank(uly_fwd), spec.sync_layout(1), per_rank(uly_bwd)).microbatch_seconds
    p = spec.pool_sizes[0]
    layout = spec.sync_layout(p)
    order = place_sequences(corpus.flops[ids], p, spec.sequence_placement, layout,
                            R.window_pool_seconds(corpus, ids, p, spec))
    knobs = R._make_candidates(spec)[0].knobs
    pools = R._run_order(ev, ids, order, p, knobs, spec.tile_placement, spec).pools
    libra = step_timing(worker_seconds([q.fwd_seconds for q in pools], layout), layout,
                        worker_seconds([q.bwd_seconds for q in pools], layout)).microbatch_seconds
    ev.clear()
    flops = corpus.flops[ids]
    mean_pool = float(flops.sum()) * p / gbs
    return {"ulysses": ulysses, "libra": np.repeat(libra, p, axis=1),  # lane j = replicas j*P .. j*P+P-1
            "sequence_spread": float(flops.max() / flops.mean()) if flops.mean() > 0 else 1.0,
            "libra_floor": pool_lower_bound_counting(flops, p) / mean_pool if mean_pool > 0 else 1.0}


def _window_job(w: int) -> Dict[str, np.ndarray]:
    return window_forward(R._WORKER["corpus"], w, R._WORKER["spec"], R._WORKER["evaluator"])


def _stats(values: np.ndarray) -> Dict[str, float]:
    return {"min": float(values.min()), "mean": float(values.mean()), "max": float(values.max())}


@dataclass
class Fig12Result:
    """Every window's samples (seconds, ``window_forward``) and what they summarise to."""

    spec: SimSpec
    seconds: Dict[str, List[np.ndarray]] = field(default_factory=lambda: {m: [] for m in METHODS})
    trace: Dict[str, List[float]] = field(default_factory=lambda: {k: [] for k in TRACE_KEYS})
    num_sequences: int = 0
    num_documents: int = 0
    runtime_seconds: float = 0.0

    def normalised(self, method: str) -> np.ndarray:
        """[windows, GA, DP]: ``method``'s samples over Libra's mean sample of the same window."""
        means = np.array([x.mean() for x in self.seconds["libra"]])
        return np.stack(self.seconds[method]) / np.where(means > 0, means, 1.0)[:, None, None]

    def to_json(self) -> Dict[str, object]:
        spec = self.spec
        norm = {m: self.normalised(m) for m in METHODS}
        worst = {m: float(norm[m].max()) for m in METHODS}
        name, paper = paper_entry(spec)
        reduction = worst["ulysses"] / worst["libra"]
        return {
            "figure": "Fig. 12", "paper_layout": name, "layout": _layout_of(spec),
            "libra": _libra_knobs(spec), "num_windows": len(self.seconds["libra"]),
            "samples_per_window": spec.num_steps * spec.data_parallel_size,
            "ranks_per_sample": spec.pipeline_parallel_size * spec.context_parallel_size,
            "num_sequences": self.num_sequences, "num_documents": self.num_documents,
            "runtime_seconds": self.runtime_seconds,
            "normalised": {m: _stats(norm[m]) for m in METHODS},
            "worst_reduction": reduction,
            "ulysses_spread": worst["ulysses"] / float(norm["ulysses"].mean()),
            "trace": {f"{k}_max": float(np.max(v)) for k, v in self.trace.items()},
            "per_window": [{"window": w, "libra_mean_seconds": float(self.seconds["libra"][w].mean()),
                            **{f"{m}_max": float(norm[m][w].max()) for m in METHODS},
                            **{k: float(v[w]) for k, v in self.trace.items()}}
                           for w in range(norm["libra"].shape[0])],
            "samples": {m: norm[m].tolist() for m in METHODS},
            "paper": None if paper is None else {**paper, "citation": _CITATION},
            "verdict": _verdict(worst["ulysses"], reduction, paper, spec.pool_sizes[0]),
            "definition": __doc__.split("\n\n", 1)[1].strip(),
            "assumptions": {"cost": spec.cost.assumptions(), "sync": describe_layout(spec.sync_layout(spec.pool_sizes[0])),
                            "units": "seconds per attention layer, forward (samples: normalised, no unit)",
                            "libra_config": spec.libra_config, "packing": spec.packing.value, "seed": spec.seed,
                            "num_heads": spec.dims.num_q_heads, "num_kv_heads": spec.dims.num_kv_heads,
                            "head_dim": spec.dims.head_dim},
        }


def _libra_knobs(spec: SimSpec) -> Dict[str, object]:
    return {"pool_size": spec.pool_sizes[0], "head_split": spec.head_splits[0], "block_size": spec.block_sizes[0],
            "num_chunks": spec.chunk_counts[0], "tau": spec.taus[0], "tiling": spec.tilings[0].value,
            "kv_fetch": spec.kv_fetches[0].value, "sequence_placement": spec.sequence_placement.value,
            "tile_placement": spec.tile_placement.value, "token_layout": spec.token_layout.value,
            "save_mode": spec.save_mode.value, "kv_relay": bool(spec.cost.kv_relay)}


def _verdict(ulysses_worst: float, reduction: float, paper: Optional[Dict[str, object]], pool_size: int) -> str:
    """Does the reduction reach the paper's factor, and if not, is it because the trace's Ulysses spread is
    smaller (the factor cannot exceed Ulysses' normalised worst), or the factor above about P (module docstring)?"""
    if paper is None:
        return "no paper figure for this layout (PAPER_FIG12 has the 256K and 1M PP=2 layouts)"
    factor, paper_worst = paper["worst_reduction"], paper["ulysses"]["max"]
    if reduction >= factor:
        return f"meets the paper: worst microbatch reduced {reduction:.2f}x >= {factor}x"
    bound = (f"; at equal rates per unit of work the factor cannot exceed about P = {pool_size}, the paper's "
             f"{factor}x implies Ulysses microbatches slower per unit of work than Libra's" if factor > pool_size else "")
    if ulysses_worst < paper_worst:
        return (f"below the paper's {factor}x ({reduction:.2f}x), on a smaller Ulysses spread: Ulysses' worst "
                f"microbatch is {ulysses_worst:.2f}x Libra's mean here vs {paper_worst}x in the paper (the factor "
                f"cannot exceed it){bound}")
    return (f"below the paper's {factor}x ({reduction:.2f}x) at a Ulysses spread as large as the paper's "
            f"({ulysses_worst:.2f}x vs {paper_worst}x){bound}")


def run_fig12(doc_lens, spec: SimSpec, jobs: int = 1,
              progress: Optional[Callable[[int, int], None]] = None) -> Fig12Result:
    """Pack ``doc_lens`` and take every window's samples (``window_forward``); ``jobs`` forked processes."""
    start = time.perf_counter()
    check_fig12_spec(spec)
    corpus, num_windows, ev = R.prepare_corpus(doc_lens, spec, jobs)
    result = Fig12Result(spec, num_sequences=corpus.num_sequences, num_documents=corpus.num_documents)
    for done, part in enumerate(R.replay_windows(corpus, num_windows, ev, spec, jobs, _window_job), start=1):
        for m in METHODS:
            result.seconds[m].append(part[m])
        for k in TRACE_KEYS:
            result.trace[k].append(part[k])
        if progress is not None:
            progress(done, num_windows)
    result.runtime_seconds = time.perf_counter() - start
    return result


def _tokens(n: int) -> str:
    """262144 -> "256K", 1048576 -> "1M"."""
    return f"{n >> 20}M" if n % (1 << 20) == 0 else f"{n >> 10}K" if n % 1024 == 0 else str(n)


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_fig12(report: Dict[str, object]) -> str:
    """stdout: min / mean / max per method beside the paper's, the reduction factor and the verdict."""
    lay, knobs, paper = report["layout"], report["libra"], report["paper"]
    rows = [f"Fig. 12: per-microbatch attention forward / Libra's per-window mean; {_tokens(lay['seq_len'])} tokens, DP={lay['dp']} "
            f"PP={lay['pp']} CP={lay['cp']} GBS={lay['gbs']}; Libra P={knobs['pool_size']} H={knobs['head_split']} "
            f"B={knobs['block_size']} {knobs['sequence_placement']} + {knobs['tile_placement']}",
            f"{report['num_windows']} windows x {report['samples_per_window']} microbatch samples (each = "
            f"{report['ranks_per_sample']} ranks of a replica: PP stages x CP)",
            f"{'method':<9}{'min':>8}{'mean':>8}{'max':>8}   paper ({report['paper_layout'] or 'none'}):"
            f"{'min':>6}{'mean':>7}{'max':>7}"]
    for m, label in (("ulysses", "Ulysses"), ("libra", "Libra")):
        ours, theirs = report["normalised"][m], (paper or {}).get(m, {})
        rows.append(f"{label:<9}{ours['min']:>8.2f}{ours['mean']:>8.2f}{ours['max']:>8.2f}   {'':<16}"
                    f"{_fmt(theirs.get('min')):>6}{_fmt(theirs.get('mean')):>7}{_fmt(theirs.get('max')):>7}")
    paper_factor = f" (paper {paper['worst_reduction']}x)" if paper else ""
    rows += [f"worst microbatch reduced {report['worst_reduction']:.2f}x{paper_factor}; Ulysses' own spread "
             f"max/mean {report['ulysses_spread']:.2f}; runtime {report['runtime_seconds']:.1f}s",
             f"trace (Eq. 2 F per packed sequence, worst window): max F / mean F {report['trace']['sequence_spread_max']:.2f}; "
             f"heaviest-pool floor of any P={knobs['pool_size']} placement {report['trace']['libra_floor_max']:.2f} x the mean pool",
             report["verdict"]]
    return "\n".join(rows)


def plot_fig12(plt, report: Dict[str, object], out_dir: str) -> str:
    """``FIG12_PNG``: box + strip plot of both methods' normalised samples (log axis), dashed means, and the
    paper's min / mean / max as markers where it states them."""
    path = os.path.join(out_dir, FIG12_PNG)
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    data = [np.asarray(report["samples"][m]).reshape(-1) for m in METHODS]
    ax.boxplot(data, positions=[0, 1], widths=0.5, whis=(0, 100), showfliers=False)
    rng = np.random.default_rng(0)
    for x, (values, color) in enumerate(zip(data, ("tab:gray", "tab:blue"))):
        ax.scatter(x + rng.uniform(-0.18, 0.18, values.size), values, s=6, alpha=0.5, color=color)
        ax.hlines(values.mean(), x - 0.3, x + 0.3, colors=color, linestyles="--", lw=1.2,
                  label="mean (dashed; box: quartiles, median, min-max)" if x == 1 else None)
    paper = report["paper"]
    for x, m in enumerate(METHODS):
        marks = [v for v in ((paper or {}).get(m) or {}).values() if v is not None]
        if marks:
            ax.scatter([x + 0.38] * len(marks), marks, marker="x", color="tab:red", s=30,
                       label="paper (Fig. 12)" if x == 0 else None)
    lay = report["layout"]
    ax.set(yscale="log", xticks=[0, 1], xticklabels=["Ulysses (sampler order)", "Libra (sync VRSP + TAP)"],
           ylabel="microbatch forward / Libra's mean of its window",
           title=f"Fig. 12 reproduction: {_tokens(lay['seq_len'])}, DP={lay['dp']} PP={lay['pp']} CP={lay['cp']} "
                 f"GBS={lay['gbs']}; worst reduced {report['worst_reduction']:.2f}x", )
    ax.title.set_fontsize(9)
    ax.yaxis.set_major_formatter(plt.matplotlib.ticker.FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(plt.matplotlib.ticker.NullFormatter())
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
