"""The op lists of one pool's attention layer, forward and backward, per rank: ``runtime.libra_attn`` call for call.

Pure numpy. ``rank_layer_ops(rank_plan, save_mode)`` walks the same steps as ``runtime.libra_attn._fwd`` and
``_bwd`` over the sizes of the rank's run tables (``rank_sizes``) and lists, in issue order, every ``all_to_all_single``
(bytes to and from each peer), every wait, every kernel call (entries, rows, causal pairs x heads), every
index copy and every dense kernel over whole tensors (``torch.cat``, a dtype cast, ``new_zeros``; not the
log-sum-exp arithmetic of split entries' merge) (``plan.model.ops``). ``plan.model.events`` prices the lists of all ranks together;
``tests/runtime/test_op_list.py`` records the runtime's real calls on gloo and asserts they are these lists.
A change to the runtime's schedule that is not made here too fails that test.

Byte sizes (one row of a chunk view / arranged buffer): Q, O, dO, dQ rows ``qp*d*e``; K|V rows ``2*kp*d*e``
(K and V each ``kp*d*e`` where they are gathered apart); lse ``4`` bytes per (head, row) (``8`` for fp64);
dK|dV sums in the accumulation dtype (``a`` = 4, 8 for fp64), e = ``HeadLayout.elem_bytes``. dK|dV go home at
``e`` when every chunk returns its own kv piece (``kv_return_chunks().all()``), else at ``a``.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np

from ..model import POOL, RELAY, Copy, Exchange, Kernel, Wait
from .runtime_tables import RankSizes, RouteSplits, rank_sizes

__all__ = ["rank_layer_ops", "rank_phase_ops", "entry_pairs", "check_modes", "SAVE_MODES", "PHASES"]

SAVE_MODES = ("arranged", "refetch")
PHASES = ("forward", "backward")
INVERSE_Q_TAGS = ("o", "dq")  # the returns along the inverse Q route: each fills its chunk's rows of the output


def entry_pairs(q_lens, k_lens, causal: bool = True) -> int:
    """Query-key pairs of varlen entries (bottom-right causal: query r of a q-row entry over e keys sees
    e - q + r + 1 of them)."""
    q = np.asarray(q_lens, dtype=np.int64)
    k = np.asarray(k_lens, dtype=np.int64)
    if not causal:
        return int((q * k).sum())
    return int((q * k - q * (q - 1) // 2).sum())


class _Sizes:
    """Row bytes of every buffer kind of one plan."""

    def __init__(self, heads):
        e = heads.elem_bytes
        self.acc = 8 if e == 8 else 4
        self.lse = 8 if e == 8 else 4
        self.e, self.qp, self.kp, self.d = e, heads.q_piece, heads.kv_piece, heads.head_dim
        self.q = self.qp * self.d * e  # Q / O / dO / dQ row
        self.k = self.kp * self.d * e  # K or V row
        self.kv = 2 * self.k  # K|V row
        self.dkv_acc = 2 * self.kp * self.d * self.acc  # dK|dV row in the accumulation dtype
        self.q_acc = self.qp * self.d * self.acc  # an O row in the accumulation dtype (split entries' merge)


class _Rank:
    """Builds one rank's op list (the runtime's ``_Ctx`` + ``PendingExchange`` bookkeeping, host side)."""

    def __init__(self, tables: RankSizes, heads, rank: int, num_workers: int, relay_comm: str,
                 byte_rows: Optional[dict] = None):
        self.t, self.heads, self.rank, self.W = tables, heads, rank, num_workers
        self.sz = _Sizes(heads)
        self.relay_comm = relay_comm
        self.ops: List[tuple] = []
        self.seq = {POOL: 0, RELAY: 0}
        self._calls = {}  # (id of the entry lengths, causal) -> the call's (entries, q rows, k rows, pairs x heads)
        self._nbytes = {} if byte_rows is None else byte_rows  # ``nbytes``' cache

    # ------------------------------------------------------------------ primitives
    def copy(self, op: str, rows: int, row_bytes: int, tag: str, m: int) -> None:
        self.ops.append(Copy(op, int(rows) * int(row_bytes), tag, m))

    def cast(self, rows: int, src_row_bytes: int, dst_row_bytes: int, tag: str, m: int) -> None:
        """``Tensor.to(dtype)`` of rows (a kernel only when the dtype changes): the mean of bytes read and written;
        "widen" to a larger element, else "elementwise"."""
        if src_row_bytes != dst_row_bytes:
            kind = "widen" if dst_row_bytes > src_row_bytes else "elementwise"
            self.ops.append(Copy(kind, int(rows) * (int(src_row_bytes) + int(dst_row_bytes)) // 2, tag, m))

    def copy_into(self, rows: int, src_row_bytes: int, dst_row_bytes: int, tag: str, m: int) -> None:
        """``Tensor.copy_`` of rows into a (strided) view: a dense copy of the destination's bytes, or, when the
        dtype changes, a cast (``cast``)."""
        if src_row_bytes == dst_row_bytes:
            self.ops.append(Copy("elementwise", int(rows) * int(dst_row_bytes), tag, m))
        else:
            self.cast(rows, src_row_bytes, dst_row_bytes, tag, m)

    def fill(self, rows: int, row_bytes: int, tag: str, m: int) -> None:
        """``new_zeros``: writes only, half the bytes of a copy of that size."""
        self.ops.append(Copy("elementwise", int(rows) * int(row_bytes) // 2, tag, m))

    def exchange(self, splits: RouteSplits, row_bytes: int, comm: str, tag: str, m: int) -> Optional[tuple]:
        """``start_exchange``: a pending (comm, seq, splits, tag, m), or None on a one-rank group (no collective)."""
        if len(splits.send) == 1:
            return None
        seq = self.seq[comm]
        self.seq[comm] += 1
        self.ops.append(Exchange(comm, seq, self.nbytes(splits.send, row_bytes), self.nbytes(splits.recv, row_bytes), tag, m))
        return (comm, seq, tag, m)

    def nbytes(self, rows: Tuple[int, ...], row_bytes: int) -> Tuple[int, ...]:
        """Bytes per peer of split sizes ``rows``: one tuple per (sizes tuple, row bytes), shared by the exchanges that
        repeat it and (``byte_rows``) the rank's two phases; keyed by the tuple's id, which the cache keeps alive."""
        key = (id(rows), row_bytes)
        hit = self._nbytes.get(key)
        if hit is None or hit[0] is not rows:
            hit = self._nbytes[key] = (rows, tuple(map(int(row_bytes).__mul__, rows)))  # rows: Python ints
        return hit[1]

    def wait(self, pending) -> None:
        if pending is not None:
            comm, seq, tag, m = pending
            self.ops.append(Wait(comm, seq, tag, m))

    def kernel(self, direction: str, q_lens, k_lens, tag: str, m: int, causal: bool = True) -> None:
        """One kernel call over entries of these lengths (an entry set's lengths are the same every chunk: the
        call's sizes are counted once per set)."""
        key = (id(q_lens), id(k_lens), causal)
        call = self._calls.get(key)
        if call is None:
            call = self._calls[key] = (len(q_lens), int(sum(q_lens)), int(sum(k_lens)),
                                       entry_pairs(q_lens, k_lens, causal) * self.sz.qp)
        self.ops.append(Kernel(direction, *call, self.sz.qp, causal, tag, m))

    # ------------------------------------------------------------------ routes of chunk m
    def dispatch_q(self, m: int, tag: str):
        sp = self.t.q_splits
        self.copy("gather", sp.send_total, self.sz.q, tag, m)
        return (self.exchange(sp, self.sz.q, POOL, tag, m), sp)

    def dispatch_kv(self, m: int, tag: str):
        sp = self.t.kv_splits
        self.copy("gather", sp.send_total, self.sz.k, tag, m)  # K rows, straight into the send buffer's K half
        self.copy("gather", sp.send_total, self.sz.k, tag, m)  # V rows, into its V half
        return (self.exchange(sp, self.sz.kv, POOL, tag, m), sp)

    def give_back(self, splits: RouteSplits, row_bytes: int, wire_bytes: int, tag: str, m: int, held: int = -1):
        """``_return``: gather the arranged rows (at their dtype), cast them to the wire dtype, send them; when the
        dtype changes and the rows sent are all ``held`` arranged rows, cast them first and gather at the wire's."""
        rows = splits.send_total
        if row_bytes != wire_bytes and rows == held:
            self.cast(rows, row_bytes, wire_bytes, tag, m)
            self.copy("gather", rows, wire_bytes, tag, m)
        else:
            self.copy("gather", rows, row_bytes, tag, m)
            self.cast(rows, row_bytes, wire_bytes, tag, m)
        return (self.exchange(splits, wire_bytes, POOL, tag, m), splits)

    def _fills(self, tag: str) -> bool:
        """The route's received rows fill its target, so the runtime places them by one gather through the
        inverse permutation (``runtime.routes.RouteIndex.recv_inverse``): the Q route always, the K|V route
        (tags ``kv*``) unless a relay route fills part of it."""
        return not tag.startswith("kv") or self.t.relay_splits is None

    def placed(self, pending, row_bytes: int, tag: str, m: int) -> None:
        """``PendingExchange.placed``: wait, place every received row (a gather when they fill the target)."""
        self.wait(pending[0])
        self.copy("gather" if self._fills(tag) else "place", pending[1].recv_total, row_bytes, tag, m)

    def self_placed(self, pending, row_bytes: int, tag: str, m: int) -> None:
        """``PendingExchange.self_placed``: a gather when the self segment is the whole target, else a place."""
        sp = pending[1]
        whole = self._fills(tag) and sp.self_rows == sp.recv_total
        self.copy("gather" if whole else "place", sp.self_rows, row_bytes, tag, m)

    def rest_placed(self, pending, row_bytes: int, tag: str, m: int) -> None:
        """Wait; when the received rows fill the target, one gather of them all (self segment included), else
        place the rows before and after the self segment (each part only when it has rows)."""
        self.wait(pending[0])
        sp = pending[1]
        lo, hi, total = sp.self_recv_offset, sp.self_recv_offset + sp.self_rows, sp.recv_total
        if self._fills(tag) and sp.self_rows < total:  # (all rows its own: ``self_placed`` gathered them all)
            self.copy("gather", total, row_bytes, tag, m)
            return
        for rows in (lo, total - hi):
            if rows:
                self.copy("place", rows, row_bytes, tag, m)

    def into(self, pending, row_bytes: int, accumulate: bool, tag: str, m: int, wire_bytes: Optional[int] = None) -> None:
        """``PendingExchange.into``: wait, cast the received rows from the wire dtype (``wire_bytes`` per row; None:
        the target's) to the target's, then add them, or copy them: the inverse Q route (O, dQ) fills chunk m's
        rows of the output, so one gather and one dense copy into that strided view; other routes place."""
        self.wait(pending[0])
        rows = pending[1].recv_total
        self.cast(rows, row_bytes if wire_bytes is None else wire_bytes, row_bytes, tag, m)
        if not accumulate and tag in INVERSE_Q_TAGS:
            self.copy("gather", rows, row_bytes, tag, m)
            self.copy("elementwise", rows, row_bytes, tag, m)
            return
        self.copy("add" if accumulate else "place", rows, row_bytes, tag, m)

    def relay(self, m: int, tag: str):
        """``runtime.relay.relay_forward``: gather the relayed rows of the arranged K|V, send them on the relay
        communicator."""
        sp = self.t.relay_splits
        if sp is None:
            return None
        self.copy("gather", sp.send_total, self.sz.kv, tag, m)
        return (self.exchange(sp, self.sz.kv, self.relay_comm, tag, m), sp)

    def relay_early(self, m: int):
        """``runtime.relay.relay_early``: a rank that sends no relayed row issues chunk m's relay exchange at once,
        with an empty send buffer (no gather), so a peer waiting for relayed rows never waits for this rank's other
        work; None without a relay, where this rank sends rows (it issues after they are placed) or where the relay
        shares the pool's communicator (an early issue would reorder that communicator's exchanges)."""
        sp = self.t.relay_splits
        if sp is None or sp.send_total or self.relay_comm != RELAY:
            return None
        return (self.exchange(sp, self.sz.kv, self.relay_comm, "relay", m), sp)

    # ------------------------------------------------------------------ kernels
    def packed_kv(self, k_rows: int, tag: str, m: int) -> None:
        self.copy("gather", k_rows, self.sz.kv, tag, m)

    def fwd_whole(self, m: int) -> None:
        """``runtime.entry_kernels.fwd_chunk``: packed K|V of every entry, one kernel call."""
        self.packed_kv(self.t.k_total, "kv", m)
        self.kernel("fwd", self.t.q_lens, self.t.k_lens, "all", m)

    def part_kernel(self, part, m: int, tag: str, causal: bool = True, arranged: bool = True) -> None:
        """``runtime.entry_kernels.part_kernel``: gather the part's keys, read its queries (a view of its slice of the
        arranged Q, ``q_span``; a gather where it has none or ``arranged`` is False: it reads a send buffer), one
        kernel call."""
        self.packed_kv(part.k_total, tag, m)
        if not (arranged and part.q_span is not None):
            self.copy("gather", part.q_total, self.sz.q, tag, m)
        self.kernel("fwd", part.q_lens, part.k_lens, tag, m, causal)

    def write_rows(self, part, out_row_bytes: int, tag: str, m: int) -> None:
        """``runtime.entry_kernels._write_rows``: out and lse rows into the part's slice (a dense copy each), else
        scattered."""
        n, kind = part.q_total, "elementwise" if part.q_span is not None else "place"
        for row_bytes in (out_row_bytes, self.sz.qp * self.sz.lse):
            self.copy(kind, n, row_bytes, tag, m)

    def fwd_part(self, part, m: int, tag: str, arranged: bool = True) -> None:
        """``runtime.entry_kernels.fwd_part``: the part's kernel, then its out and lse rows written into the chunk's
        buffers."""
        self.part_kernel(part, m, tag, arranged=arranged)
        self.write_rows(part, self.sz.q, tag, m)

    def merge_heads(self, m: int) -> None:
        """``runtime.entry_kernels.merge_heads``: read the tails' lse and out rows, write the merged rows back."""
        part, sz = self.t.heads, self.sz
        n = part.q_total
        if part.q_span is None:
            self.copy("gather", n, sz.qp * sz.lse, "merge", m)
            self.copy("gather", n, sz.q, "merge", m)
        self.cast(n, sz.q, sz.q_acc, "merge", m)  # the tail's out, then the head's, in the accumulation dtype
        self.cast(n, sz.q, sz.q_acc, "merge", m)
        self.cast(n, sz.q_acc, sz.q, "merge", m)  # the merged out back (the log-sum-exp arithmetic: not priced)
        self.write_rows(part, sz.q, "merge", m)


class _FwdChunk:
    """``runtime.libra_attn._Chunk``, host side: which of its steps have run."""

    def __init__(self, rk: _Rank, m: int, q_pend, kv_pend, split: bool):
        t = rk.t
        self.rk, self.m, self.q_pend, self.kv_pend, self.split = rk, m, q_pend, kv_pend, split
        self.relay_pend = rk.relay_early(m) if kv_pend is not None else None
        self.whole = split and len(t.remote.q_lens) == 0 and t.heads is None
        self.head = False
        self.tails_done = False
        self.has_out = False
        self.arrived = False  # the chunk's arranged Q is placed (the local set reads it, not the send buffer)
        # split: the local set reads the send buffers' self segments (``DeviceEntrySet.q_self`` / ``k_self``); the
        # self segment is placed first only for the whole-chunk call or a route that does not fill its target
        self.q_placed_first = split and self.whole
        self.kv_placed_first = split and kv_pend is not None and (self.whole or not rk._fills("kv"))
        if self.q_placed_first:
            rk.self_placed(q_pend, rk.sz.q, "q", m)
        if self.kv_placed_first:
            rk.self_placed(kv_pend, rk.sz.kv, "kv", m)

    def local(self) -> None:
        if not self.split:
            return
        if self.whole:
            self.rk.fwd_whole(self.m)
        else:
            self.rk.fwd_part(self.rk.t.local, self.m, "local", arranged=self.q_placed_first or self.arrived)
        self.has_out = True
        self.tails_done = True
        self._merge()

    def _merge(self) -> None:
        if self.head and self.tails_done:
            self.rk.merge_heads(self.m)
            self.head = False

    def arrive(self, sends_only: list) -> None:
        rk, m = self.rk, self.m
        (rk.rest_placed if self.q_placed_first else rk.placed)(self.q_pend, rk.sz.q, "q", m)
        self.arrived = True
        if self.kv_pend is not None:
            (rk.rest_placed if self.kv_placed_first else rk.placed)(self.kv_pend, rk.sz.kv, "kv", m)
        relayed = self.relay_pend
        if relayed is None and self.kv_pend is not None:
            relayed = rk.relay(m, "relay")
        if relayed is not None:
            if rk.t.relay_splits.recv_total > 0:
                rk.into(relayed, rk.sz.kv, False, "relay", m)
            else:
                sends_only.append(relayed)

    def remote(self) -> None:
        rk, t, m = self.rk, self.rk.t, self.m
        if not self.split:
            rk.fwd_whole(m)
            self.has_out = True
            return
        if len(t.remote.q_lens):
            rk.fwd_part(t.remote, m, "remote")
            self.has_out = True
        if t.heads is not None:
            rk.part_kernel(t.heads, m, "heads", causal=False)
            self.head = True
            self._merge()

    def write_self(self) -> None:
        sp = self.rk.t.q_back_splits
        self.rk.copy("gather", sp.self_rows, self.rk.sz.q, "o_self", self.m)
        self.rk.copy("place", sp.self_rows, self.rk.sz.q, "o_self", self.m)


def _lead(local_lead: int, t: RankSizes, M: int) -> int:
    """``runtime.libra_attn._lead``."""
    if t.local is None:
        return M + 1
    if 0 <= local_lead <= M + 1:
        return local_lead
    return M if len(t.remote.q_lens) == 0 and t.heads is None else M - 1


def _forward(rk: _Rank, local_lead: int) -> None:
    """``runtime.libra_attn._fwd``; ``local_lead`` = ``RankPlan.local_lead``."""
    t, M = rk.t, rk.heads.num_chunks
    sends = rk.heads.kv_send_chunks()
    lead = _lead(local_lead, t, M)
    split = t.local is not None and lead <= M
    chunks = []
    for m in range(M):
        q_pend = rk.dispatch_q(m, "q")
        kv_pend = rk.dispatch_kv(m, "kv") if sends[m] else None
        chunks.append(_FwdChunk(rk, m, q_pend, kv_pend, split))
    lead = lead if split else 0
    for m in range(lead):
        chunks[m].local()
    returns, relay_sends = [], []
    for m, chunk in enumerate(chunks):
        chunk.arrive(relay_sends)
        chunk.remote()
        row = rk.sz.q  # o_arr, or the arranged Q when no entry ran yet: the same row bytes
        returns.append(rk.give_back(t.q_back_splits, row, row, "o", m))
    for m in range(lead, M):
        chunks[m].local()
    for m, pending in enumerate(returns):
        rk.into(pending, rk.sz.q, False, "o", m)
    for pending in relay_sends:
        rk.wait(pending[0])
    if split:
        for m in range(lead, M):
            chunks[m].write_self()


def _bwd_inputs(rk: _Rank, m: int, refetch: bool) -> dict:
    """``runtime.libra_attn._bwd_inputs``."""
    pending = {"do": rk.dispatch_q(m, "do")}
    if refetch:
        pending["q"] = rk.dispatch_q(m, "q_bwd")
        if rk.heads.kv_send_chunks()[m]:
            pending["kv"] = rk.dispatch_kv(m, "kv_bwd")
        pending["o"] = rk.dispatch_q(m, "o_bwd")
    return pending


def _bwd_kernel(rk: _Rank, pending: dict, m: int) -> None:
    """``runtime.libra_attn._bwd_kernel``."""
    t, sz = rk.t, rk.sz
    if "q" in pending:
        rk.placed(pending["q"], sz.q, "q_bwd", m)
        rk.placed(pending["o"], sz.q, "o_bwd", m)
        if "kv" in pending:
            rk.placed(pending["kv"], sz.kv, "kv_bwd", m)
            relayed = rk.relay(m, "relay_bwd")
            if relayed is not None:
                rk.into(relayed, sz.kv, False, "relay_bwd", m)
    rk.placed(pending["do"], sz.q, "do", m)
    rk.packed_kv(t.k_total, "kv", m)
    rk.kernel("bwd", t.q_lens, t.k_lens, "all", m)


def _widened(rk: _Rank, rows: int, gathered: bool, m: int) -> None:
    """``runtime.libra_attn._widened``: per half (dK, dV), the packed rows (gathered at the kernel's dtype first)
    copied into the sums' dtype."""
    sz = rk.sz
    for _ in "KV":
        if gathered:
            rk.copy("gather", rows, sz.k, "dkv", m)
        rk.copy_into(rows, sz.k, sz.dkv_acc // 2, "dkv", m)


def _dkv_sums(rk: _Rank, m: int, fresh: bool) -> None:
    """``runtime.libra_attn._dkv_sums``; ``fresh``: the chunk starts its kv piece's sums."""
    t, sz = rk.t, rk.sz
    nk = t.k_total
    if fresh and t.kv_rows_read:  # the piece's first chunk: every arranged row's first packed row, the others added
        _widened(rk, t.kv_target_len, True, m)
        if nk > t.kv_target_len:
            _widened(rk, nk - t.kv_target_len, True, m)
            rk.copy("add", nk - t.kv_target_len, sz.dkv_acc, "dkv", m)
        return
    _widened(rk, nk, False, m)
    if fresh:  # some arranged row is no entry's key: the fp32 sums start at zero
        rk.fill(t.kv_target_len, sz.dkv_acc, "dkv", m)
    rk.copy("add", nk, sz.dkv_acc, "dkv", m)


def _backward(rk: _Rank, refetch: bool, local_rows: int) -> None:
    """``runtime.libra_attn._bwd``; ``local_rows`` = rows of the rank's dK|dV sums (local tokens x kv pieces)."""
    heads, t, sz = rk.heads, rk.t, rk.sz
    M = heads.num_chunks
    returns = heads.kv_return_chunks()
    dkv_wire = 2 * sz.kp * sz.d * (sz.e if returns.all() else sz.acc)

    def dkv_home(relayed, m):  # ``dkv_home``: wait the relay inverse and add it, then send dK|dV home
        if relayed is not None:
            rk.into(relayed, sz.dkv_acc, True, "relay_back", m)
        # received at the wire dtype, cast to the accumulation dtype, then added: the add reads ``a`` bytes
        return (rk.give_back(t.kv_back_splits, sz.dkv_acc, dkv_wire, "dkv", m, t.kv_target_len), sz.dkv_acc, True,
                "dkv", m, dkv_wire)

    def dq_home(m):  # ``dq_home``: the deferred relay inverse's dK|dV, then dQ
        returning = [dkv_home(*deferred)] if deferred is not None else []
        return returning + [(rk.give_back(t.q_back_splits, sz.q, sz.q, "dq", m), sz.q, False, "dq", m, sz.q)]

    rk.fill(local_rows, sz.dkv_acc, "dkv", -1)  # the home's fp32 sums
    incoming = _bwd_inputs(rk, 0, refetch)
    outgoing, deferred = [], None
    dq_first = t.relay_back_splits is None  # no relay inverse to put first on the link: dQ leaves at once
    for m in range(M):
        current = incoming
        if m + 1 < M:
            incoming = _bwd_inputs(rk, m + 1, refetch)
        _bwd_kernel(rk, current, m)
        if dq_first:
            returning, deferred = dq_home(m), None
        _dkv_sums(rk, m, fresh=m == 0 or bool(returns[m - 1]))
        relayed = None
        if returns[m] and t.relay_back_splits is not None:  # ``runtime.relay.relay_back``, ahead of the returns
            sp = t.relay_back_splits
            rk.copy("gather", sp.send_total, sz.dkv_acc, "relay_back", m)
            relayed = (rk.exchange(sp, sz.dkv_acc, rk.relay_comm, "relay_back", m), sp)
        if not dq_first:
            returning, deferred = dq_home(m), None
        if returns[m]:
            if relayed is not None and heads.relay_inverse_deferred()[m]:  # waited after the next kernel
                deferred = (relayed, m)
            else:
                returning.append(dkv_home(relayed, m))
        for pending, row, acc, tag, mm, wire in outgoing:
            rk.into(pending, row, acc, tag, mm, wire)
        outgoing = returning
    for pending, row, acc, tag, mm, wire in outgoing:
        rk.into(pending, row, acc, tag, mm, wire)
    for _ in "KV":  # the one cast of the sums, K and V apart (contiguous dk, dv: no copy in the reshape)
        rk.cast(local_rows, sz.dkv_acc // 2, sz.kv // 2, "dkv", -1)


def check_modes(save_mode: str, relay_comm: str) -> None:
    if save_mode not in SAVE_MODES:
        raise ValueError(f"save_mode must be one of {SAVE_MODES}, got {save_mode!r}")
    if relay_comm not in (POOL, RELAY):
        raise ValueError(f"relay_comm must be {POOL!r} or {RELAY!r}, got {relay_comm!r}")


def rank_phase_ops(inputs: tuple, phase: str, save_mode: str, relay_comm: str,
                   byte_rows: Optional[dict] = None) -> tuple:
    """The ops of one rank in one phase ("forward" | "backward") from everything they read (``op_lists.rank_ops_key``:
    sizes, heads, rank, pool size, local tokens, lead); ``byte_rows``: ``_Rank.nbytes``' cache, shared by the caller."""
    sizes, heads, rank, num_workers, local_tokens, local_lead = inputs
    rk = _Rank(sizes, heads, rank, num_workers, relay_comm, byte_rows)
    if phase == "forward":
        _forward(rk, local_lead)
    else:
        _backward(rk, save_mode == "refetch", local_tokens * heads.kv_pieces_per_token)
    return tuple(rk.ops)


def rank_layer_ops(plan, save_mode: str = "arranged", relay_comm: str = RELAY) -> Tuple[tuple, tuple]:
    """(forward ops, backward ops) of one ``RankPlan`` (module docstring). ``save_mode`` "arranged" | "refetch";
    ``relay_comm``: the communicator the relay runs on ("relay": its twin group, as the launcher sets it up;
    "pool": ``libra_attn_func(relay_group=None)``). Received rows are copied at the *target's* row bytes:
    ``PendingExchange.into`` casts the received rows to the target dtype, then copies (dK|dV that travel at the
    input dtype are added as fp32 rows)."""
    check_modes(save_mode, relay_comm)
    inputs = (rank_sizes(plan), plan.heads, plan.rank, plan.num_workers, plan.local_tokens, plan.local_lead)
    return tuple(rank_phase_ops(inputs, phase, save_mode, relay_comm) for phase in PHASES)
