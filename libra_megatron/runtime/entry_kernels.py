"""Kernel calls of ``runtime.libra_attn`` on a chunk's buffers at the destination (forward), with the copies that
feed them: packed K/V gathered per varlen entry, an entry set's queries read as a slice of the arranged buffer
(``DeviceEntrySet.q_span``; a gather where the set is not one slice, or reads a send buffer), its outputs copied
back into that slice (else scattered), and the log-sum-exp merge of split entries. ``cx`` is ``libra_attn``'s
call context (its plan, tables, backend, scale).

Shape legend (one rank, chunk m):
    qp, kp  q_piece, kv_piece        d  head dim
    q_arr / o_arr (nq, qp, d) arranged Q / O; lse (qp, nq) fp32; kv_arr (nkv, 2*kp, d) arranged K|V (K and V stacked)
    packed K, V (nk, kp, d): arranged rows in varlen-entry order; an entry set's (n, qp, d) queries and outputs
    send buffers (a dispatch's): the local set reads its rows' self segment there (``rows`` = q_self, k_self)
"""
from __future__ import annotations

import torch

__all__ = ["packed_kv", "fwd_chunk", "part_kernel", "merge_heads", "fwd_part"]


def packed_kv(cx, kv_arr):
    """Arranged K|V (nkv, 2*kp, d) -> packed K, V (nk, kp, d) in varlen-entry order."""
    kp = cx.plan.heads.kv_piece
    packed = kv_arr.index_select(0, cx.tables.k_gather)
    return packed[:, :kp], packed[:, kp:]


def fwd_chunk(cx, q_arr, kv_arr):
    """Kernel forward of one chunk at the destination: (o_arr (nq, qp, d), lse (qp, nq))."""
    k_pk, v_pk = packed_kv(cx, kv_arr)
    return cx.kernel(cx.backend.fwd, q_arr, k_pk, v_pk, cx.tables.batch, cx.scale)


def _read_rows(arranged, part, rows=None):
    """The set's rows of an arranged buffer (n, ...): a view of its slice (``part.q_span``), else a gather of
    ``part.q_rows`` (or of ``rows``, in a send buffer)."""
    if rows is None and part.q_span is not None:
        return arranged.narrow(0, *part.q_span)
    return arranged.index_select(0, part.q_rows if rows is None else rows)


def _write_rows(o_arr, lse, part, out, part_lse) -> None:
    """out (n, qp, d) / part_lse (qp, n) into the set's rows of o_arr (nq, qp, d) / lse (qp, nq): one dense copy
    each into the slice (``part.q_span``), else a scatter."""
    if part.q_span is not None:
        o_arr.narrow(0, *part.q_span).copy_(out)
        lse.narrow(1, *part.q_span).copy_(part_lse)
        return
    o_arr.index_put_((part.q_rows,), out)
    lse.T.index_put_((part.q_rows,), part_lse.T)


def part_kernel(cx, q_arr, kv_arr, part, causal: bool = True, rows=None):
    """Kernel forward of the entries of ``part`` (a ``DeviceEntrySet``) on its queries (``_read_rows``) and
    gathered keys (rows ``part.k_gather``, or ``rows`` = (query, key) rows in send buffers): (out (n, qp, d),
    lse (qp, n))."""
    kp = cx.plan.heads.kv_piece
    packed = kv_arr.index_select(0, part.k_gather if rows is None else rows[1])
    q_part = _read_rows(q_arr, part, None if rows is None else rows[0])
    if causal:
        return cx.kernel(cx.backend.fwd, q_part, packed[:, :kp], packed[:, kp:], part.batch, cx.scale)
    return cx.kernel(cx.backend.fwd, q_part, packed[:, :kp], packed[:, kp:], part.batch, cx.scale, False)


def merge_heads(cx, o_arr, lse, part, head_out, head_lse) -> None:
    """Split entries: merge the key-tail result already in o_arr / lse rows ``part.q_rows`` with the result
    over the keys before the tail, by log-sum-exp, in fp32 (fp64 for fp64), written back in place."""
    acc = cx.acc_dtype
    tail_lse, tail_out = _read_rows(lse.T, part).to(acc), _read_rows(o_arr, part).to(acc)  # (n, qp)
    head_lse = head_lse.T.to(acc)
    merged = torch.logaddexp(tail_lse, head_lse)
    out = tail_out * torch.exp(tail_lse - merged)[..., None] + head_out.to(acc) * torch.exp(head_lse - merged)[..., None]
    _write_rows(o_arr, lse, part, out.to(o_arr.dtype), merged.T.to(lse.dtype))


def fwd_part(cx, q_arr, kv_arr, part, o_arr=None, lse=None, rows=None, nq=None):
    """Kernel forward of the entries of ``part`` (a ``DeviceEntrySet``): read their queries, gather their keys, write
    out (n, qp, d) and lse (qp, n) into the chunk's o_arr (nq, qp, d) / lse (qp, nq) rows (each row belongs to
    exactly one entry; ``_write_rows``); the buffers are made, in the kernel's output dtypes, when None. ``rows``,
    ``nq``: the (query, key) rows to gather and the arranged Q rows when q_arr / kv_arr are send buffers. Returns
    (o_arr, lse)."""
    out, part_lse = part_kernel(cx, q_arr, kv_arr, part, rows=rows)
    if o_arr is None:
        nq = q_arr.shape[0] if nq is None else nq
        o_arr = out.new_empty((nq,) + tuple(out.shape[1:]))
        lse = part_lse.new_empty((part_lse.shape[0], nq))
    _write_rows(o_arr, lse, part, out, part_lse)
    return o_arr, lse
