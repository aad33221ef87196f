"""Pure-numpy reference executor of an ExchangePlan: the semantics the torch runtime must reproduce.

Shape legend (per rank r): t = local tokens, hq/hkv = query/kv heads, d = head dim.
    q_local[r]   (t, hq, d)    k_local[r], v_local[r]  (t, hkv, d)
    units        Q: local_token*H + h, KV: local_token*G + KV class (``exchange`` module docstring); rows of
                 chunk views via ``q_rows`` (Q/O/dQ) and ``kv_rows`` (K/V/dK/dV).
Every collective is simulated by slicing each source's send buffer with its ``send_splits`` -- the same
(send_index, send_splits, recv_splits, recv_index) contract an ``all_to_all_single`` would execute.
Backward-direction moves use ``Route.inverse()`` (accumulating), exactly as the runtime does. A relaying plan's
relay route runs after the KV route on the arranged K/V (``relay_numpy``), and its inverse adds the relayed
rows' gradients into the relay's arranged ones before the KV route's inverse (``return_kv_grads_numpy``).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np

from ..plan.exchange import ExchangePlan, Route, kv_rows, q_rows

__all__ = [
    "exchange_numpy", "relay_numpy", "run_routes_numpy", "return_outputs_numpy", "return_kv_grads_numpy", "attention_numpy",
    "scatter_to_workers", "gather_from_workers",
]


def exchange_numpy(routes: Sequence[Route], sources: Sequence[np.ndarray]) -> List[np.ndarray]:
    """Execute one all_to_all over W ranks. ``sources[r]`` has ``routes[r].source_len`` rows.

    Returns the W target buffers (``target_len`` rows, trailing dims of the sources). Placement routes
    assign (every target row written once); accumulating routes sum with ``np.add.at``.
    """
    W = len(routes)
    sends = [np.asarray(src)[rt.send_index] for rt, src in zip(routes, sources)]
    offsets = [np.concatenate([[0], np.cumsum(rt.send_splits)]) for rt in routes]
    out = []
    for d, rt in enumerate(routes):
        parts = [sends[s][offsets[s][d] : offsets[s][d + 1]] for s in range(W)]
        received = np.concatenate(parts, axis=0)
        assert received.shape[0] == rt.recv_index.shape[0], f"rank {d}: received {received.shape[0]} units"
        target = np.zeros((rt.target_len,) + received.shape[1:], dtype=received.dtype)
        if rt.accumulate:
            np.add.at(target, rt.recv_index, received)
        else:
            target[rt.recv_index] = received
        out.append(target)
    return out


def run_routes_numpy(plan: ExchangePlan, local_q_units: list, local_kv_units: list):
    """Forward Q dispatch and KV fetch on unit buffers (``local_q_units[r]`` has local_tokens*H rows,
    ``local_kv_units[r]`` local_tokens*G).

    Returns (arranged_q, arranged_kv): per-rank arrays of ``q_route.target_len`` / ``kv_route.target_len`` rows.
    """
    ranks = list(plan.ranks)
    arranged_q = exchange_numpy([rp.q_route for rp in ranks], local_q_units)
    arranged_kv = relay_numpy(plan, exchange_numpy([rp.kv_route for rp in ranks], local_kv_units))
    return arranged_q, arranged_kv


def relay_numpy(plan: ExchangePlan, arranged_kv: list) -> list:
    """The relay hop on arranged K/V buffers (unchanged without a relay): relayed rows are placed from the
    relay's arranged buffer into the rows the KV route left for them."""
    ranks = list(plan.ranks)
    if ranks[0].relay_route is None:
        return arranged_kv
    relayed = exchange_numpy([rp.relay_route for rp in ranks], arranged_kv)
    out = []
    for rp, a, got in zip(ranks, arranged_kv, relayed):
        a = np.array(a)
        a[rp.relay_route.recv_index] = got[rp.relay_route.recv_index]
        out.append(a)
    return out


def return_outputs_numpy(plan: ExchangePlan, arranged_o: list) -> list:
    """O (or dQ) return: arranged rows -> local units, via ``q_route.inverse()`` on every rank."""
    return exchange_numpy([rp.q_route.inverse() for rp in plan.ranks], arranged_o)


def return_kv_grads_numpy(plan: ExchangePlan, arranged_dkv: list) -> list:
    """dK/dV return: arranged KV rows -> local units, summed over destinations (``kv_route.inverse()``); with a
    relay, the relayed rows' gradients are first added into the relay's arranged rows (``relay_route.inverse()``)."""
    ranks = list(plan.ranks)
    if ranks[0].relay_route is not None:
        back = exchange_numpy([rp.relay_route.inverse() for rp in ranks], arranged_dkv)
        arranged_dkv = [np.asarray(a) + b for a, b in zip(arranged_dkv, back)]
    return exchange_numpy([rp.kv_route.inverse() for rp in ranks], arranged_dkv)


def _varlen_attention(rp, q_arr: np.ndarray, k_arr: np.ndarray, v_arr: np.ndarray, scale: float):
    """Bottom-right causal varlen attention over the arranged buffers of one rank and one chunk.

    q_arr (nq, q_piece, d), k_arr/v_arr (nkv, kv_piece, d) -> out (nq, q_piece, d) float64.
    """
    heads = rp.heads
    out = np.zeros(q_arr.shape, dtype=np.float64)
    kv_of_q = _kv_head_of_q_piece(heads)
    for i in range(rp.num_seqs):
        q0, q1 = int(rp.cu_seqlens_q[i]), int(rp.cu_seqlens_q[i + 1])
        off, e = int(rp.seq_kv_offset[i]), int(rp.seq_k_len[i])
        q = q_arr[q0:q1]  # (nq_i, q_piece, d)
        k = k_arr[off : off + e][:, kv_of_q]  # (e, q_piece, d)
        v = v_arr[off : off + e][:, kv_of_q]
        s = np.einsum("qhd,khd->hqk", q, k) * scale
        qpos = e - (q1 - q0) + np.arange(q1 - q0)
        s = np.where(np.arange(e)[None, None, :] <= qpos[None, :, None], s, -np.inf)
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        out[q0:q1] = np.einsum("hqk,khd->qhd", p, v)
    return out


def _kv_head_of_q_piece(heads) -> np.ndarray:
    """int64 [q_piece]: kv head (index inside the fetched kv piece) read by each query head of a piece.

    Pieces are aligned to GQA groups (HeadLayout invariant), so this is the same for every shard and chunk:
    j // group when a piece spans whole groups, else 0 (the piece lies inside one kv head).
    """
    j = np.arange(heads.q_piece, dtype=np.int64)
    return j // heads.group if heads.kv_piece > 1 else np.zeros_like(j)


def attention_numpy(plan: ExchangePlan, q_local: list, k_local: list, v_local: list,
                    softmax_scale: Optional[float] = None) -> list:
    """Full forward executing the plan, float64: per chunk m, gather rows, exchange, varlen attention, return.

    q_local[r] (t, hq, d); k_local[r], v_local[r] (t, hkv, d). Returns o_local[r] (t, hq, d) float64.
    """
    ranks = list(plan.ranks)
    heads = ranks[0].heads
    H, M, d = heads.head_split, heads.num_chunks, heads.head_dim
    scale = d ** -0.5 if softmax_scale is None else float(softmax_scale)
    t = ranks[0].local_tokens
    q_view = [np.asarray(q, np.float64).reshape(t * H * M, heads.q_piece, d) for q in q_local]
    k_view = [np.asarray(k, np.float64).reshape(t * heads.kv_pieces_per_token, heads.kv_piece, d) for k in k_local]
    v_view = [np.asarray(v, np.float64).reshape(t * heads.kv_pieces_per_token, heads.kv_piece, d) for v in v_local]
    o_view = [np.zeros_like(q) for q in q_view]
    units, kv_units = np.arange(t * H, dtype=np.int64), np.arange(t * heads.num_kv_classes, dtype=np.int64)
    sends = heads.kv_send_chunks()
    for m in range(M):
        qr, kr = q_rows(units, heads, m), kv_rows(kv_units, heads, m)
        aq = exchange_numpy([rp.q_route for rp in ranks], [q[qr] for q in q_view])
        if sends[m]:  # K/V once per step: later chunks reading the same kv piece reuse these rows
            ak = relay_numpy(plan, exchange_numpy([rp.kv_route for rp in ranks], [k[kr] for k in k_view]))
            av = relay_numpy(plan, exchange_numpy([rp.kv_route for rp in ranks], [v[kr] for v in v_view]))
        ao = [_varlen_attention(rp, aq[r], ak[r], av[r], scale) for r, rp in enumerate(ranks)]
        back = return_outputs_numpy(plan, ao)
        for r in range(len(ranks)):
            o_view[r][qr] = back[r]
    return [o.reshape(t, heads.num_q_heads, d) for o in o_view]


def scatter_to_workers(layout, per_sequence: Sequence[np.ndarray]) -> list:
    """Split P packed sequences (each (L, ...)) into the P*CP local buffers, worker w = p*CP + c."""
    return [np.asarray(x)[layout.local_to_global(c)] for x in per_sequence for c in range(layout.cp)]


def gather_from_workers(layout, local: Sequence[np.ndarray]) -> list:
    """Inverse of ``scatter_to_workers``: P*CP local buffers -> P packed sequences in global order."""
    out = []
    for p in range(len(local) // layout.cp):
        first = np.asarray(local[p * layout.cp])
        seq = np.zeros((layout.seq_len,) + first.shape[1:], dtype=first.dtype)
        for c in range(layout.cp):
            seq[layout.local_to_global(c)] = local[p * layout.cp + c]
        out.append(seq)
    return out
