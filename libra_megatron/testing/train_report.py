"""What the CPU training driver (``train_cpu``) reports: parity of a Libra run against its baseline, the closing
summary, and the printed tables."""
from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np

__all__ = ["PARITY_RTOL", "compare_runs", "summarize", "parity_ok", "print_run", "print_summary"]

PARITY_RTOL = 1e-4  # fp32: per-step loss and grad norm of Libra vs baseline, relative


def compare_runs(libra: List[List[dict]], base: List[List[dict]]) -> Dict[str, float]:
    """Max relative loss / grad-norm differences over steps, and whether every step's sample multiset matches."""
    a, b = libra[0], base[0]
    rel = lambda x, y: abs(x - y) / max(abs(y), 1e-30)  # noqa: E731

    def multiset(run, i):  # one entry per DP replica: its CP ranks share the sample
        return sorted(s for rank in run if rank[i]["cp_rank"] == 0 for s in rank[i]["samples"])

    same = all(multiset(libra, i) == multiset(base, i) for i in range(len(a)))
    return {"max_rel_loss": max(rel(x["loss"], y["loss"]) for x, y in zip(a, b)),
            "max_rel_grad_norm": max(rel(x["grad_norm"], y["grad_norm"]) for x, y in zip(a, b)),
            "same_step_multisets": float(same), "steps": float(len(a))}


def summarize(libra: List[List[dict]], parity: Optional[Dict[str, float]] = None) -> Dict[str, object]:
    """The closing summary of a Libra run (``libra[rank][step]``), plus parity against the baseline if given.

    Means are over steps; ``planner_ms_median`` is the median over every plan any rank computed.
    """
    steps = libra[0]
    mean = lambda key: float(np.mean([s[key] for s in steps]))  # noqa: E731
    latencies = [x for rank in libra for s in rank for x in s["plan_latencies_ms"]]
    out: Dict[str, object] = {
        "steps": len(steps),
        "inter_pool_r1_before_mean": mean("inter_pool_r1_before"),
        "inter_pool_r1_after_mean": mean("inter_pool_r1_after"),
        "lane_r1_before_mean": mean("lane_r1_before"),
        "lane_r1_after_mean": mean("lane_r1_after"),
        "intra_pool_max_mean_home": mean("intra_pool_max_over_mean_home"),
        "intra_pool_max_mean_placed": mean("intra_pool_max_over_mean_placed"),
        "bytes_per_step": mean("bytes_per_step"),
        "planner_ms_median": float(np.median(latencies)) if latencies else 0.0,
        "planner_ms_p90": float(np.percentile(latencies, 90)) if latencies else 0.0,
        "plans_computed": len(latencies),
        "pools_reused": int(sum(s["pools_reused"] for s in steps)),
        "loss_first": steps[0]["loss"], "loss_last": steps[-1]["loss"],
    }
    if parity is not None:
        out.update(parity_ok=parity_ok(parity), max_rel_loss=parity["max_rel_loss"],
                   max_rel_grad_norm=parity["max_rel_grad_norm"],
                   same_step_multisets=bool(parity["same_step_multisets"]), parity_rtol=PARITY_RTOL)
    return out


def parity_ok(parity: Dict[str, float]) -> bool:
    """Loss and grad norm within PARITY_RTOL (relative) on every step, and the same sample multisets."""
    return bool(max(parity["max_rel_loss"], parity["max_rel_grad_norm"]) < PARITY_RTOL
                and parity["same_step_multisets"])


def print_run(name: str, records: List[dict]) -> None:
    print(f"== {name}")
    print("step  loss        grad_norm   inter R-1 before -> after  intra max/mean home -> placed  "
          "KiB/step  plan_ms  reused  wait_ms  step_s")
    for i, r in enumerate(records):
        print(f"{i:4d}  {r['loss']:.8f}  {r['grad_norm']:.8f}  {r['inter_pool_r1_before']:8.4f} -> "
              f"{r['inter_pool_r1_after']:7.4f}      {r['intra_pool_max_over_mean_home']:8.4f} -> "
              f"{r['intra_pool_max_over_mean_placed']:7.4f}     {r['bytes_per_step'] / 1024:9.1f}  "
              f"{1e3 * r['planner_latency_s']:7.2f}  {r['pools_reused']:6d}  {1e3 * r['planner_wait_s']:7.2f}  "
              f"{r['step_s']:6.2f}")


def print_summary(summary: Dict[str, object]) -> None:
    print("== summary (Libra run; means over steps)")
    print(f"lane R-1 (max/mean - 1 over DP/P lanes of sum l^2 over the step's microbatches; what the sync "
          f"placement balances first, then the lanes' priced seconds) before -> after VRSP: {summary['lane_r1_before_mean']:.4f} -> "
          f"{summary['lane_r1_after_mean']:.4f}")
    print(f"per-instance R-1 (max/mean - 1 of pool sum l^2; what Alg. 1 balances) before -> after VRSP: "
          f"{summary['inter_pool_r1_before_mean']:.4f} -> {summary['inter_pool_r1_after_mean']:.4f}")
    print(f"intra-pool worker max/mean (Eq. 6 FLOPs) at home -> placed by TAP: "
          f"{summary['intra_pool_max_mean_home']:.4f} -> {summary['intra_pool_max_mean_placed']:.4f}")
    print(f"attention bytes exchanged per step (all ranks, fwd + bwd, all layers): "
          f"{summary['bytes_per_step'] / 2**20:.2f} MiB")
    print(f"planner latency: median {summary['planner_ms_median']:.2f} ms, p90 {summary['planner_ms_p90']:.2f} ms "
          f"over {summary['plans_computed']} plans ({summary['pools_reused']} pools reused a cached plan)")
    print(f"loss {summary['loss_first']:.4f} -> {summary['loss_last']:.4f} over {summary['steps']} steps")
    if "parity_ok" in summary:
        print(f"parity vs baseline: max rel loss {summary['max_rel_loss']:.3g}, max rel grad norm "
              f"{summary['max_rel_grad_norm']:.3g}, same step sample multisets: {summary['same_step_multisets']}"
              f" -> {'PARITY OK' if summary['parity_ok'] else f'PARITY FAILED (tolerance {PARITY_RTOL})'}")
