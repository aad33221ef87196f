"""Human-readable output of the simulator: the candidate table and a tiny stderr progress bar."""

from __future__ import annotations

import sys
import time
from typing import Dict, List, Optional, TextIO

__all__ = ["ProgressBar", "format_table"]


class ProgressBar:
    """``[#####.....] 5/10 windows 12.3s`` on one rewritten stderr line; silent when disabled."""

    def __init__(self, enabled: bool, stream: Optional[TextIO] = None, width: int = 30):
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.width = width
        self.start = time.perf_counter()

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        filled = self.width * done // max(total, 1)
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = time.perf_counter() - self.start
        self.stream.write(f"\r[{bar}] {done}/{total} windows {elapsed:.1f}s")
        if done >= total:
            self.stream.write("\n")
        self.stream.flush()


_COLUMNS = (  # header, width, getter
    ("P", 4, lambda c: f"{c['pool_size']}"),
    ("H", 3, lambda c: f"{c['head_split']}"),
    ("B", 6, lambda c: f"{c['block_size']}"),
    ("tiles", 7, lambda c: f"{c['num_tiles']}"),
    ("R-1 contig", 10, lambda c: f"{c['inter_pool_imbalance']['contiguous']:.4f}"),
    ("R-1 alg1", 9, lambda c: f"{c['inter_pool_imbalance']['alg1']:.4f}"),
    ("R-1 placed", 10, lambda c: f"{c['inter_pool_imbalance']['placed']:.4f}"),
    ("R-1 LB", 7, lambda c: f"{c['inter_pool_imbalance']['lower_bound']:.4f}"),
    ("intra", 7, lambda c: f"{c['intra_pool_imbalance']:.4f}"),
    ("intra max", 9, lambda c: f"{c['intra_pool_imbalance_max']:.4f}"),
    ("Q GB", 7, lambda c: f"{c['bytes_per_layer']['q'] / 1e9:.2f}"),
    ("KV GB", 7, lambda c: f"{c['bytes_per_layer']['kv'] / 1e9:.2f}"),
    ("O GB", 7, lambda c: f"{c['bytes_per_layer']['o'] / 1e9:.2f}"),
    ("step ms", 8, lambda c: f"{c['estimated_step_seconds'] * 1e3:.2f}"),
    ("comp ms", 8, lambda c: f"{c['compute_seconds'] * 1e3:.2f}"),
    ("exp ms", 7, lambda c: f"{c['exposed_comm_seconds'] * 1e3:.2f}"),
    ("vs Uly", 7, lambda c: f"{c['straggler_vs_ulysses']:.3f}"),
    ("max vs Uly", 10, lambda c: f"{c['straggler_max_vs_ulysses']:.3f}"),
    ("vs LB", 6, lambda c: f"{c['straggler_vs_lower_bound']:.3f}"),
    ("fwd vs LB", 9, lambda c: f"{c['forward_straggler_vs_lower_bound']:.3f}"),
    ("TAP x", 6, lambda c: _speedup(c, "tap")),
    ("T+V x", 6, lambda c: _speedup(c, "tap_vrsp")),
    ("DistCA x", 8, lambda c: _speedup(c, "distca")),
)


_SWEPT_COLUMNS = (  # (JSON key, column): shown after B only when the run swept more than one value
    ("tau", ("tau", 6, lambda c: f"{c['tau']:g}")),
    ("num_chunks", ("M", 3, lambda c: f"{c['num_chunks']}")),
    ("tiling", ("tiling", 8, lambda c: c["tiling"])),
    ("kv_fetch", ("fetch", 6, lambda c: c["kv_fetch"])),
)
_KNOBS = ("pool_size", "head_split", "block_size", "tau", "num_chunks", "tiling", "kv_fetch")


def _columns(candidates: List[Dict]) -> list:
    swept = [col for key, col in _SWEPT_COLUMNS if len({c[key] for c in candidates}) > 1]
    return list(_COLUMNS[:3]) + swept + list(_COLUMNS[3:])


def _speedup(cand: Dict, name: str) -> str:
    base = cand["baselines"].get(name)
    return "-" if base is None else f"{base['speedup_vs_ulysses']:.2f}"


def _megatron_line(report: Dict) -> List[str]:
    """One line for the Megatron-LM hybrid-CP baseline when the run had it."""
    meg = report["baselines"].get("megatron_hybrid_cp")
    if not meg:
        return []
    return [f"Megatron-LM hybrid CP (BalancedCPScheduler, max {meg['max_seqlen_per_rank']} tokens/rank): mean step "
            f"{meg['mean_step_seconds'] * 1e3:.2f} ms (compute {meg['compute_seconds'] * 1e3:.2f} + exposed comm "
            f"{meg['exposed_comm_seconds'] * 1e3:.2f}), vs LB {meg['straggler_vs_lower_bound']:.3f}"
            + (f" (forward only {meg['forward_straggler_vs_lower_bound']:.3f})"
               if "forward_straggler_vs_lower_bound" in meg else "")]


def _split_text(report: Dict) -> str:
    """`` (forward 1.23 ms = 1.00 compute + 0.23 exposed; backward ...)`` of the recommended candidate."""
    best = report["recommended"]
    cand = next((c for c in report["candidates"] if all(c[k] == best[k] for k in _KNOBS)), None)
    split = (cand or {}).get("straggler_split")
    if not split:
        return ""
    parts = [f"{phase} {v['seconds'] * 1e3:.2f} ms = {v['compute_seconds'] * 1e3:.2f} compute + "
             f"{v['exposed_comm_seconds'] * 1e3:.2f} exposed" for phase, v in split.items()]
    return f" ({'; '.join(parts)}; save mode {cand['save_mode_pools']}); forward only (Pipeliner) " \
           f"{cand['forward_estimated_step_seconds'] * 1e3:.2f} ms"


def _heads(assumptions: dict) -> str:
    """``q/kv x head_dim`` of one tensor-parallel rank (``--tp`` divides the model's), with TP when > 1."""
    tp = assumptions.get("sync", {}).get("tp", 1)
    text = f"{assumptions['num_heads']}/{assumptions['num_kv_heads']} x {assumptions['head_dim']}"
    return text + (f" (TP={tp})" if tp > 1 else "")


def format_table(report: Dict) -> str:
    """The stdout report of one run (``SimResult.to_json()`` as input)."""
    columns = _columns(report["candidates"])
    header = " ".join(h.rjust(w) for h, w, _ in columns)
    rows: List[str] = [header, "-" * len(header)]
    best = report["recommended"]
    for cand in report["candidates"]:
        mark = " <- recommended" if all(cand[k] == best[k] for k in _KNOBS) else ""
        rows.append(" ".join(get(cand).rjust(w) for _, w, get in columns) + mark)
    swept = "".join(f" {name}={best[key]:g}" if isinstance(best[key], (int, float)) else f" {name}={best[key]}"
                    for key, (name, _, _) in _SWEPT_COLUMNS if any(h == name for h, _, _ in columns))
    uly, wlb = report["baselines"]["ulysses"], report["baselines"]["wlb_llm"]
    rows += [
        "",
        f"windows {report['num_windows']}  sequences {report['num_sequences']}  documents {report['num_documents']}"
        f"  runtime {report['runtime_seconds']:.1f}s  heads per TP rank {_heads(report['assumptions'])}",
        f"Ulysses: mean step {uly['mean_step_seconds'] * 1e3:.2f} ms, max {uly['max_step_seconds'] * 1e3:.2f} ms;"
        f"  WLB-LLM (no deferral): mean {wlb['mean_step_seconds'] * 1e3:.2f} ms (x{wlb['speedup_vs_ulysses']:.2f}),"
        f" max {wlb['max_step_seconds'] * 1e3:.2f} ms (x{wlb['max_speedup_vs_ulysses']:.2f})",
        *_megatron_line(report),
        f"recommended P={best['pool_size']} H={best['head_split']} B={best['block_size']}{swept}: estimated step "
        f"{best['estimated_step_seconds'] * 1e3:.2f} ms per attention layer, forward + backward"
        + _split_text(report),
        "columns: R-1 = inter-pool max/mean-1 of sum l^2; intra (max) = worker max/mean-1 (Eq. 6), mean (worst) over"
        " pools; GB = remote bytes per pool"
        " per layer fwd; step/comp/exp ms = the straggler's forward + backward, its compute and exposed comm, mean per"
        " step; vs Uly/LB = straggler time ratio, forward + backward (lower is better); fwd vs LB = the forward-only"
        " Pipeliner figure; 'x' = speedup over Ulysses (higher is better)",
    ]
    return "\n".join(rows)
