"""Activation memory of the Libra operator, predicted from a pool's ExchangePlan (numpy only, no torch).

What ``runtime.libra_attn_func`` keeps alive for backward, per rank and per transformer layer (one call):

    arranged  every chunk m < M keeps the destination-side buffers it computed on: Q and O (nq rows of qp
              heads) and lse (qp x nq, fp32); K|V (nkv rows of 2*kp heads) once per kv piece, i.e. per
              K/V-sending chunk (F = ``heads.kv_send_chunks().sum()``; the chunks reading one piece share it)
                  bytes = M * (2*nq*qp*d*e + nq*qp*l) + F * nkv*2*kp*d*e
    refetch   only lse per chunk, plus references to the local q, k, v, out (t tokens)
                  bytes = M * nq*qp*l + t*(2*hq + 2*hkv)*d*e

Backward keeps one buffer longer when the plan relays K/V (``relay_units`` set): a chunk's fp32 arranged dK|dV
returned by chunk m < M - 2 waits for its relay inverse across the next chunk's kernel (``runtime.libra_attn._bwd``),
so at most one more
arranged dK|dV in the accumulation dtype is alive during backward, transient (one layer at a time):
                  bytes = nkv*2*kp*d*a       (``deferred_relay_bytes``; a = 4, 8 for fp64; 0 without a relay)
``choose_save_mode`` counts it once on top of the saved layers' bytes.

nq / nkv = Q / KV units the rank hosts (arranged rows per chunk), t = local tokens, e = element bytes of
q/k/v, l = lse bytes (4; 8 for fp64 inputs). ``runtime`` reports the same quantity as
``ExchangeStats.saved_bytes``; tests assert equality. ``choose_save_mode`` is the ``save_mode=auto`` rule:
it decides from pool-wide numbers only, so every rank of the pool decides the same. It keeps the arranged
tensors whenever they fit: arranged's backward moves a subset of refetch's bytes (refetch re-sends Q, K|V and
O) and is never slower under the whole-step model (``tests/plan/test_save_mode_auto.py`` prices both on real
pools), so the budget is the only reason to refetch. ``saved_layers`` is how many layers' tensors are alive at
once: the stage's layers, or under Megatron-LM's full recompute only the ones being recomputed.
"""
from __future__ import annotations

from typing import Dict

import numpy as np

from ...config import SaveModeName

__all__ = ["hosted_units", "saved_bytes_per_rank", "predicted_saved_bytes", "deferred_relay_bytes", "choose_save_mode",
           "saved_layers"]

GIB = float(1 << 30)


def hosted_units(exchange) -> tuple:
    """(nq, nkv): int64 [W] Q units and KV units every worker hosts (rows of its arranged buffers per chunk)."""
    return exchange.arranged_q_units, exchange.arranged_kv_units


def _lse_bytes(elem_bytes: int) -> int:
    return 8 if elem_bytes == 8 else 4


def saved_bytes_per_rank(exchange, heads, local_tokens: int, mode) -> np.ndarray:
    """int64 [W]: bytes rank w keeps for backward in one layer under ``mode`` (arranged | refetch)."""
    mode = SaveModeName(mode)
    nq, nkv = hosted_units(exchange)
    M, d, e = heads.num_chunks, heads.head_dim, heads.elem_bytes
    qp, kp, lse = heads.q_piece, heads.kv_piece, _lse_bytes(heads.elem_bytes)
    lse_bytes = M * nq * qp * lse
    if mode is SaveModeName.ARRANGED:
        kv_buffers = int(heads.kv_send_chunks().sum())
        return M * 2 * nq * qp * d * e + kv_buffers * nkv * 2 * kp * d * e + lse_bytes
    if mode is SaveModeName.REFETCH:
        local = local_tokens * (2 * heads.num_q_heads + 2 * heads.num_kv_heads) * d * e
        return lse_bytes + local
    raise ValueError(f"saved_bytes_per_rank: mode must be arranged or refetch, got {mode.value}")


def deferred_relay_bytes(exchange, heads) -> np.ndarray:
    """int64 [W]: the arranged dK|dV (accumulation dtype) each rank keeps alive one chunk longer in backward while
    its relay inverse travels (module docstring); zeros when the plan does not relay or no chunk m < M - 2 returns
    dK|dV (the runtime waits every relay inverse at once then)."""
    _, nkv = hosted_units(exchange)
    if getattr(exchange, "relay_units", None) is None or not heads.relay_inverse_deferred().any():
        return np.zeros_like(np.asarray(nkv, dtype=np.int64))
    acc = 8 if heads.elem_bytes == 8 else 4
    return np.asarray(nkv, dtype=np.int64) * 2 * heads.kv_piece * heads.head_dim * acc


def predicted_saved_bytes(exchange, heads, local_tokens: int) -> Dict[str, np.ndarray]:
    """{"arranged": int64 [W], "refetch": int64 [W]} bytes per rank per layer."""
    return {m.value: saved_bytes_per_rank(exchange, heads, local_tokens, m)
            for m in (SaveModeName.ARRANGED, SaveModeName.REFETCH)}


def choose_save_mode(mode, arranged_bytes_per_rank: np.ndarray, budget_gb: float, num_layers: int,
                     transient_bytes_per_rank=None) -> SaveModeName:
    """Resolve ``save_mode``: ``auto`` keeps arranged tensors iff the pool's worst rank fits the budget.

    arranged_bytes_per_rank: int64 [W] per layer (``saved_bytes_per_rank(..., "arranged")``);
    budget_gb: GiB for one microbatch over ``num_layers`` layers; transient_bytes_per_rank: int64 [W] one layer's
    backward keeps besides (``deferred_relay_bytes``), counted once. Pool-wide inputs: same answer on every rank.
    """
    mode = SaveModeName(mode)
    if mode is not SaveModeName.AUTO:
        return mode
    total = np.asarray(arranged_bytes_per_rank, dtype=np.int64) * max(1, int(num_layers))
    if transient_bytes_per_rank is not None:
        total = total + np.asarray(transient_bytes_per_rank, dtype=np.int64)
    fits = int(np.max(total, initial=0)) <= budget_gb * GIB
    return SaveModeName.ARRANGED if fits else SaveModeName.REFETCH


def saved_layers(stage_layers: int, recompute_granularity=None, recompute_method=None,
                 recompute_num_layers=None) -> int:
    """Layers of one microbatch whose Libra saved tensors are alive at once on a pipeline stage of
    ``stage_layers`` layers, under Megatron-LM's recompute flags (``--recompute-granularity``, ``-method``,
    ``-num-layers``): what ``save_mode=auto``'s budget is summed over.

    None / "selective": every layer's (selective recompute does not drop the Libra operator's tensors);
    "full", "uniform": the forward keeps no tensors and the backward recomputes ``recompute_num_layers`` layers
    at a time, so that many (at most ``stage_layers``); "full", "block": the first ``recompute_num_layers`` layers
    are recomputed one at a time, the others keep theirs: stage_layers - n + 1 (n >= 1)."""
    stage = int(stage_layers)
    if stage < 1:
        raise ValueError(f"layers per pipeline stage must be >= 1, got {stage_layers}")
    if recompute_granularity in (None, "selective"):
        return stage
    if recompute_granularity != "full":
        raise ValueError(f"--recompute-granularity {recompute_granularity!r}: expected full or selective")
    n = 1 if recompute_num_layers is None else int(recompute_num_layers)
    if n < 1:
        raise ValueError(f"--recompute-num-layers {recompute_num_layers} must be >= 1 with --recompute-granularity full")
    method = recompute_method or "uniform"
    if method == "uniform":
        return min(n, stage)
    if method == "block":
        return stage - min(n, stage) + 1
    raise ValueError(f"--recompute-method {recompute_method!r}: expected uniform or block")
