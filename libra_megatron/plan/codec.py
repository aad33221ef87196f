"""Tensor-friendly encoding of plans: one 1-D int64 array, no pickle, so a plan can be broadcast as a tensor.

RankPlan buffer layout (int64 words):
    [0] MAGIC_RANK  [1] VERSION  [2] total words  [3] checksum (blake2b-64 of words [4:], as int64)
    [4:] scalars: rank, num_workers, local_tokens, HeadLayout (hq, hkv, d, H, M, elem_bytes),
         bytes_sent (q, kv, o), q_route (source_len, target_len, accumulate), kv_route (same),
         fingerprint length in bytes
    then 11 arrays, each as [length, values...]: q_route (send_index, send_splits, recv_splits, recv_index),
         kv_route (same four), cu_seqlens_q, seq_kv_offset, seq_k_len
    then the fingerprint's ASCII bytes, zero-padded to whole words.
ExchangePlan buffer: [MAGIC_PLAN, VERSION, total, checksum, W, bytes_q, bytes_kv, bytes_o, fp length,
    len(assignment), assignment..., fingerprint words, then W RankPlan buffers back to back].
``ExchangePlan.extra`` (debug tables) is not encoded. A truncated or corrupted buffer raises PlanError.
"""
from __future__ import annotations

import hashlib
from typing import List, Tuple

import numpy as np

from .errors import PlanError
from .exchange import ExchangePlan, RankPlan, Route
from .layout import HeadLayout

__all__ = ["encode_rank_plan", "decode_rank_plan", "encode_exchange_plan", "decode_exchange_plan"]

MAGIC_RANK = 0x4C4942524152504C  # "LIBRARPL"
MAGIC_PLAN = 0x4C49425241455850  # "LIBRAEXP"
VERSION = 1
_HEADER = 4
_ROUTE_ARRAYS = ("send_index", "send_splits", "recv_splits", "recv_index")


def _checksum(words: np.ndarray) -> int:
    digest = hashlib.blake2b(np.ascontiguousarray(words, dtype=np.int64).tobytes(), digest_size=8).digest()
    return int(np.frombuffer(digest, dtype=np.int64)[0])


def _text_words(text: str) -> Tuple[int, np.ndarray]:
    raw = text.encode("ascii")
    padded = raw + b"\0" * (-len(raw) % 8)
    return len(raw), np.frombuffer(padded, dtype=np.int64).copy()


def _seal(magic: int, body: List[np.ndarray]) -> np.ndarray:
    payload = np.concatenate([np.asarray(x, dtype=np.int64).reshape(-1) for x in body])
    head = np.array([magic, VERSION, _HEADER + payload.size, _checksum(payload)], dtype=np.int64)
    return np.concatenate([head, payload])


def _route_scalars(rt: Route) -> List[int]:
    return [rt.source_len, rt.target_len, int(rt.accumulate)]


def encode_rank_plan(plan: RankPlan) -> np.ndarray:
    """RankPlan -> 1-D int64 buffer (see module docstring); ``decode_rank_plan`` inverts it exactly."""
    hd = plan.heads
    n_fp, fp_words = _text_words(plan.fingerprint)
    scalars = [plan.rank, plan.num_workers, plan.local_tokens, hd.num_q_heads, hd.num_kv_heads, hd.head_dim,
               hd.head_split, hd.num_chunks, hd.elem_bytes, *plan.bytes_sent,
               *_route_scalars(plan.q_route), *_route_scalars(plan.kv_route), n_fp]
    arrays = [getattr(rt, a) for rt in (plan.q_route, plan.kv_route) for a in _ROUTE_ARRAYS]
    arrays += [plan.cu_seqlens_q, plan.seq_kv_offset, plan.seq_k_len]
    body = [np.array(scalars)]
    for a in arrays:
        body += [np.array([a.size]), a]
    return _seal(MAGIC_RANK, body + [fp_words])


class _Reader:
    """Sequential reader over a checked buffer; every read is bounds-checked (PlanError on truncation)."""

    def __init__(self, buf: np.ndarray, pos: int, end: int, what: str):
        self.buf, self.pos, self.end, self.what = buf, pos, end, what

    def take(self, n: int) -> np.ndarray:
        if n < 0 or self.pos + n > self.end:
            raise PlanError(f"{self.what}: buffer truncated or corrupt (need {n} words at {self.pos}, end {self.end})")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def scalars(self, n: int) -> List[int]:
        return [int(x) for x in self.take(n)]

    def array(self) -> np.ndarray:
        out = self.take(int(self.take(1)[0])).copy()
        out.setflags(write=False)
        return out

    def text(self, n_bytes: int) -> str:
        words = self.take((n_bytes + 7) // 8)
        try:
            return words.tobytes()[:n_bytes].decode("ascii")
        except UnicodeDecodeError as exc:
            raise PlanError(f"{self.what}: corrupt fingerprint bytes") from exc


def _open(buf, magic: int, what: str, start: int = 0) -> _Reader:
    buf = np.asarray(buf)
    if buf.ndim != 1 or buf.dtype != np.int64:
        raise PlanError(f"{what}: expected a 1-D int64 buffer, got shape {buf.shape} dtype {buf.dtype}")
    if buf.size - start < _HEADER:
        raise PlanError(f"{what}: buffer of {buf.size - start} words is shorter than the {_HEADER}-word header")
    m, version, total, checksum = (int(x) for x in buf[start : start + _HEADER])
    if m != magic or version != VERSION:
        raise PlanError(f"{what}: bad magic/version ({m:#x}, {version}), expected ({magic:#x}, {VERSION})")
    if total < _HEADER or start + total > buf.size:
        raise PlanError(f"{what}: header says {total} words, buffer holds {buf.size - start} (truncated)")
    if _checksum(buf[start + _HEADER : start + total]) != checksum:
        raise PlanError(f"{what}: checksum mismatch (corrupted buffer)")
    return _Reader(buf, start + _HEADER, start + total, what)


def _read_rank(rd: _Reader) -> RankPlan:
    (rank, W, local, hq, hkv, d, H, M, eb, bq, bkv, bo,
     q_src, q_tgt, q_acc, kv_src, kv_tgt, kv_acc, n_fp) = rd.scalars(19)
    routes = []
    for src_len, tgt_len, acc in ((q_src, q_tgt, q_acc), (kv_src, kv_tgt, kv_acc)):
        arrays = {a: rd.array() for a in _ROUTE_ARRAYS}
        routes.append(Route(**arrays, source_len=src_len, target_len=tgt_len, accumulate=bool(acc)))
    cu, off, klen = rd.array(), rd.array(), rd.array()
    fp = rd.text(n_fp)
    if rd.pos != rd.end:
        raise PlanError(f"{rd.what}: {rd.end - rd.pos} trailing words after the rank plan")
    return RankPlan(
        rank=rank, num_workers=W, local_tokens=local, heads=HeadLayout(hq, hkv, d, H, M, eb),
        q_route=routes[0], kv_route=routes[1], cu_seqlens_q=cu, seq_kv_offset=off, seq_k_len=klen,
        fingerprint=fp, bytes_sent=(bq, bkv, bo),
    )


def decode_rank_plan(buf: np.ndarray) -> RankPlan:
    """1-D int64 buffer from ``encode_rank_plan`` -> RankPlan. PlanError on a truncated/corrupt buffer."""
    return _read_rank(_open(buf, MAGIC_RANK, "rank plan buffer"))


def encode_exchange_plan(plan: ExchangePlan) -> np.ndarray:
    """Whole ExchangePlan (all ranks) -> 1-D int64 buffer."""
    n_fp, fp_words = _text_words(plan.fingerprint)
    head = [plan.num_workers, plan.bytes_q, plan.bytes_kv, plan.bytes_o, n_fp, plan.assignment.size]
    body = [np.array(head), plan.assignment, fp_words] + [encode_rank_plan(rp) for rp in plan.ranks]
    return _seal(MAGIC_PLAN, body)


def decode_exchange_plan(buf: np.ndarray) -> ExchangePlan:
    """Inverse of ``encode_exchange_plan`` (``extra`` comes back empty)."""
    rd = _open(buf, MAGIC_PLAN, "exchange plan buffer")
    W, bq, bkv, bo, n_fp, n_assign = rd.scalars(6)
    assignment = rd.take(n_assign).copy()
    assignment.setflags(write=False)
    fp = rd.text(n_fp)
    ranks = []
    for w in range(W):
        sub = _open(rd.buf, MAGIC_RANK, f"exchange plan buffer, rank {w}", start=rd.pos)
        ranks.append(_read_rank(sub))
        rd.take(sub.end - rd.pos)
    if rd.pos != rd.end:
        raise PlanError(f"exchange plan buffer: {rd.end - rd.pos} trailing words")
    return ExchangePlan(ranks=tuple(ranks), assignment=assignment, fingerprint=fp,
                        bytes_q=bq, bytes_kv=bkv, bytes_o=bo)
