"""``libra_attn_func``: attention of a sequence pool executed from an ExchangePlan (§4.3.3, §4.4).

Shape legend (one rank):
    t       local tokens (this rank's CP shard of its packed sequence, under the plan's token layout)
    hq/hkv  query / kv heads            d   head dim           H, M  head shards, Pipeliner chunks
    qp      q_piece = hq/(H*M)          kp  kv_piece           kvp   kv pieces per token = hkv/kp
    q (t, hq, d) | (t, 1, hq, d)        k, v (t, hkv, d) | (t, 1, hkv, d)        out like q
    chunk views: q/o/dq (t*H*M, qp, d); k/v/dk/dv (t*kvp, kp, d)
    arranged (destination side, chunk m): q/o/do/dq (nq, qp, d); kv = K|V stacked (nkv, 2*kp, d);
    packed K/V for the kernel (nk, kp, d) = arranged rows [seq_kv_offset, +seq_k_len) per varlen entry.

Forward, per chunk m: gather Q and K|V rows, all_to_all along ``q_route`` / ``kv_route``, place into the
arranged buffers, one varlen causal kernel call over all hosted tiles, return O along ``q_route.inverse()``.
Pipeliner (forward, issue 14): every chunk's dispatch is issued at once (they queue on the pool's
communicator in chunk order, so chunk 0 arrives first). Where some of a rank's varlen entries read only rows
it sends itself (``plan.exchange.local_entries``), those *local* entries run from the all_to_all's self segment,
placed straight from the send buffer: the local entries of chunks 0..k-1 while the dispatches travel, those
of chunks k..M-1 while the O returns travel, k = the plan's lead for this rank (``RankPlan.local_lead``,
chosen by ``plan.model.timing.best_lead``). In between, chunk by chunk: wait its dispatch, run its *remote* entries
(a second kernel call: queries gathered by ``q_rows``, outputs and lse scattered back), issue its O return. A
chunk whose local entries ran after its return left sent uninitialised self rows; its self segment is copied
into the output again once every return was placed. Receive buffers of all M dispatches can be alive at once
(each freed when placed): at most the arranged Q and K|V of one layer, which ARRANGED mode keeps anyway.
Relay (a pool whose plan relays K/V between nodes, ``plan.exchange``, ``runtime.relay``): when a K/V-sending
chunk's dispatch has arrived, every rank forwards the relayed rows it holds from its arranged K|V along the relay
route, on the relay group (a second communicator over the pool's ranks, so the relay does not queue behind the
other chunks' dispatches); a rank that sends no relayed row issues its relay with the dispatch (``relay_early``);
a rank that receives relayed rows places them before its remote entries, a rank that only sends waits for its
sends at the end of the forward. In backward the relayed rows' dK|dV go back to
the relay (added into its arranged dK|dV, in fp32) before the relay returns dK|dV home; where a kernel follows
the next one (m + 2 < M) that relay inverse travels during the next chunk's kernel and is waited after it (its
fp32 dK|dV alive one chunk longer: ``plan.model.memory.deferred_relay_bytes``), else at once (deferred, the home
return would queue behind the last kernel). In REFETCH mode the re-sent K|V is relayed again.
Backward mirrors it: dO travels the Q route, the kernel backward runs at the destination, dQ returns along
``q_route.inverse()`` and dK|dV along ``kv_route.inverse()`` (index_add: several destinations contribute to the
same local K/V rows). O and dQ rows have exactly one source over the chunks (a plan invariant), so their buffers
start uninitialised (``_uninitialized_like``) and are filled by copies (no memset, no atomics). K/V travel once
per step (``HeadLayout.kv_send_chunks``): a chunk reading the kv piece of the chunk before it reuses that chunk's
arranged K|V; dK|dV of a piece is summed at the destination over its chunks, returned once after the last.

Precision: every sum of dK|dV fragments runs in fp32 (fp64 for fp64 inputs): entries sharing key rows at a
destination and chunks sharing a kv piece add into an fp32 arranged buffer, which goes home cast once to the
input dtype -- in fp32 when it sums several chunks (one rounding of a larger partial sum would double the error;
no more bytes than the per-chunk returns it replaces) -- and the home adds every fragment into an fp32 local
buffer, cast once at the end. O and dQ rows have exactly one source, so they are never summed.

Per layer (a verified call key): the exchange's all_to_all_single calls (with a relay, one more per K/V-sending
chunk in forward and per dK/dV-returning chunk in backward, on the relay group) and nothing else -- no other
collective, no host read of a device value. The first call with a new key verifies it (``checks``).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import List, Optional

import torch

from ..config import KernelBackendName
from ..plan.exchange import RankPlan, rank_tables
from .checks import ensure_plan_verified
from .entry_kernels import fwd_chunk, fwd_part, merge_heads, packed_kv, part_kernel
from .kernels import resolve_backend
from .relay import relay_back, relay_early, relay_forward
from .routes import DeviceTables, ExchangeStats, device_tables, start_exchange

__all__ = ["libra_attn_func", "SaveMode", "ExchangeStats"]


class SaveMode(str, enum.Enum):
    """What the forward keeps for backward (``plan.model.memory`` predicts the bytes; docs/runtime.md)."""

    ARRANGED = "arranged"  # keep arranged Q, K|V, O and lse at the destination: no extra backward traffic
    REFETCH = "refetch"  # keep only lse (+ the local q, k, v, out); backward re-exchanges Q, K|V and O


def _save_mode(value) -> SaveMode:
    value = getattr(value, "value", value)
    if value == "auto":
        raise ValueError("save_mode 'auto' is resolved per pool plan by the planner (plan.model.memory.choose_save_mode); "
                         "libra_attn_func takes 'arranged' or 'refetch'")
    return SaveMode(value)


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Sums of dK/dV fragments run in fp32 for fp16/bf16 (fp64 stays fp64) and are cast once."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ============================================================================ operator state
@dataclass
class _Ctx:
    """Everything the chunk helpers share within one call (no tensors owned by autograd here)."""

    plan: RankPlan
    tables: DeviceTables
    group: object
    scale: float
    backend: object
    stats: Optional[ExchangeStats]
    acc_dtype: torch.dtype  # dK|dV sums (fp32 for fp16/bf16 inputs)
    deterministic: bool = False  # the kernels' deterministic backward (Megatron-LM's --deterministic-mode)
    relay_group: object = None  # the relay's communicator: a twin of ``group``, or ``group`` itself

    def kernel(self, fn, *args):
        if self.stats is None:
            return fn(*args)
        return self.stats.timed_kernel(fn, *args)


def _uninitialized_like(x: torch.Tensor) -> torch.Tensor:  # O / dQ: each row written once (tests fill it with NaN)
    return torch.empty_like(x)


def _views(q, k, v, heads):
    """Chunk views: q (t*H*M, qp, d); k, v (t*kvp, kp, d)."""
    t, d = q.shape[0], heads.head_dim
    qv = q.reshape(t * heads.head_split * heads.num_chunks, heads.q_piece, d)
    kv_shape = (t * heads.kv_pieces_per_token, heads.kv_piece, d)
    return qv, k.reshape(kv_shape), v.reshape(kv_shape)


def _chunk_rows(view, heads, m: int):
    """Chunk m's rows of a Q/O/dQ chunk view (t*H*M, qp, d): the strided (t*H, qp, d) view of local units."""
    return view.view(-1, heads.num_chunks, heads.q_piece, heads.head_dim)[:, m]


def _dispatch_q(cx: _Ctx, src_view, m: int, kind: str):
    idx = cx.tables.chunks[m].q_fwd
    return start_exchange(src_view.index_select(0, idx.send_rows), idx, cx.group, cx.stats, kind)


def _dispatch_kv(cx: _Ctx, k_view, v_view, m: int, kind: str):
    idx = cx.tables.chunks[m].kv_fwd
    kp = k_view.shape[1]
    send = k_view.new_empty((idx.send_rows.shape[0], 2 * kp, k_view.shape[2]))
    torch.index_select(k_view, 0, idx.send_rows, out=send[:, :kp])  # K and V gathered straight into the
    torch.index_select(v_view, 0, idx.send_rows, out=send[:, kp:])  # send buffer's halves: no cat pass
    return start_exchange(send, idx, cx.group, cx.stats, kind)


def _return(cx: _Ctx, arranged, m: int, which: str, kind: str, wire_dtype: torch.dtype):
    """Send arranged rows home along an inverse route, cast to ``wire_dtype`` once: before the gather when every
    arranged row goes home (the gather then moves the narrower rows), else after it."""
    idx = getattr(cx.tables.chunks[m], which)
    if arranged.dtype != wire_dtype and sum(idx.splits.send) == arranged.shape[0]:
        return start_exchange(arranged.to(wire_dtype).index_select(0, idx.send_rows), idx, cx.group, cx.stats, kind)
    return start_exchange(arranged.index_select(0, idx.send_rows).to(wire_dtype), idx, cx.group, cx.stats, kind)


# ============================================================================ forward
class _Chunk:
    """One chunk's destination side: its arranged buffers, O and lse, and -- under the local-first split
    (``plan.exchange.local_entries``) -- the local entries computed from the self segment before the dispatch is waited."""

    def __init__(self, cx: _Ctx, m: int, pending, split: bool, like: torch.Tensor):
        self.cx, self.m, (self.q_pend, self.kv_pend) = cx, m, pending
        self.split = split
        self.relay_pend = None if self.kv_pend is None else relay_early(cx, like)  # issued with the dispatch
        self.whole = self.split and cx.tables.remote.batch.num_entries == 0 and cx.tables.heads is None  # one call
        self.q_arr = self.o_arr = self.lse = self.kv_arr = None
        self.head = None  # (out, lse) over split entries' keys before their tails, until the tails are in
        self.tails_done = False
        self.q_src = self.kv_src = None  # send buffers whose self segment the local set reads before the wait
        if self.split:  # the rows this rank sends itself are in its send buffer already: the local set reads them
            # there (``q_self``, ``k_self``); placed first for the whole-chunk call, or where the K|V route does not
            # fill its target (a relay fills part of it: no ``k_self``)
            if self.whole:
                self.q_arr = self.q_pend.self_placed()
            else:
                self.q_src = self.q_pend.self_source()
            if self.kv_pend is not None and (self.whole or cx.tables.local.k_self is None):
                self.kv_arr = self.kv_pend.self_placed()
            elif self.kv_pend is not None:
                self.kv_src = self.kv_pend.self_source()

    def local(self, kv_chunk: "_Chunk") -> None:
        """Local entries (before any wait, or after all of them); with no split, nothing to do. ``kv_chunk``: the
        chunk whose K|V this one reads (``_kv_chunk``)."""
        if not self.split:
            return
        if self.whole:
            self.o_arr, self.lse = fwd_chunk(self.cx, self.q_arr, kv_chunk.kv_arr)
        else:
            part = self.cx.tables.local
            # the arranged Q once placed (its slice: ``DeviceEntrySet.q_span``), else the send buffer's self segment
            q, q_rows = (self.q_arr, None) if self.q_arr is not None else (self.q_src, part.q_self)
            kv, k_rows = (kv_chunk.kv_arr, part.k_gather) if kv_chunk.kv_arr is not None else (kv_chunk.kv_src, part.k_self)
            self.o_arr, self.lse = fwd_part(self.cx, q, kv, part, self.o_arr, self.lse, (q_rows, k_rows),
                                             self.q_pend.index.num_target_rows())
        self.tails_done = True
        self._merge()

    def _merge(self) -> None:
        if self.head is not None and self.tails_done:
            merge_heads(self.cx, self.o_arr, self.lse, self.cx.tables.heads, *self.head)
            self.head = None

    def arrive(self, sends_only: list) -> None:
        """Wait for the dispatch and place what other ranks sent; then the relay of the chunk's K|V (placed
        here when this rank receives relayed rows, else appended to ``sends_only`` to be waited at the end)."""
        # placed whole (one gather where the rows fill the target), or the rest after the placed self segment
        self.q_arr = self.q_pend.placed() if self.q_arr is None else self.q_pend.rest_placed(self.q_arr)
        if self.kv_pend is not None:
            self.kv_arr = self.kv_pend.placed() if self.kv_arr is None else self.kv_pend.rest_placed(self.kv_arr)
        relayed = self.relay_pend
        if relayed is None and self.kv_pend is not None:
            relayed = relay_forward(self.cx, self.kv_arr)
        if relayed is not None:
            if self.cx.tables.relay.receives:
                relayed.into(self.kv_arr)
            else:
                sends_only.append(relayed)

    def remote(self, kv_arr) -> None:
        """Entries that needed the dispatch (all of them without a split)."""
        if not self.split:
            self.o_arr, self.lse = fwd_chunk(self.cx, self.q_arr, kv_arr)
            return
        if self.cx.tables.remote.batch.num_entries:
            self.o_arr, self.lse = fwd_part(self.cx, self.q_arr, kv_arr, self.cx.tables.remote, self.o_arr, self.lse)
        if self.cx.tables.heads is not None:  # keys before the split entries' tails: no mask
            self.head = part_kernel(self.cx, self.q_arr, kv_arr, self.cx.tables.heads, causal=False)
            self._merge()

    def write_self(self, out_view) -> None:
        """Self segment of this chunk's O, from ``o_arr`` into ``out_view``: when its local entries ran after its
        return was issued, the return's self segment carried rows not yet computed (call after it was placed)."""
        idx = self.cx.tables.chunks[self.m].q_inv
        sp = idx.splits
        rows = idx.send_rows[sp.self_send_offset : sp.self_send_offset + sp.self_rows]
        home = idx.recv_rows[sp.self_recv_offset : sp.self_recv_offset + sp.self_rows]
        out_view.index_put_((home,), self.o_arr.index_select(0, rows).to(out_view.dtype))


def _fwd(cx: _Ctx, q, k, v, keep_arranged: bool):
    """Forward (module docstring, "Pipeliner"). Returns (out like q, per-chunk saved [(q_arr, kv_arr, o_arr, lse)]).

    1. every chunk's dispatch is issued at once (they queue on the pool's communicator in chunk order);
    2. the local entries of chunks 0..k-1 run while they travel (k = the plan's lead, ``_lead``);
    3. chunk by chunk: wait its dispatch, run its remote entries, issue its O return;
    4. the local entries of chunks k..M-1 run while the returns travel; every return is placed, then the self
       segments of those chunks are copied again (their returns left before their local rows were computed).
    """
    heads, M = cx.plan.heads, cx.plan.heads.num_chunks
    qv, kv_, vv = _views(q, k, v, heads)
    out_view = _uninitialized_like(qv)
    sends = heads.kv_send_chunks()  # K/V once per step: a chunk reading the previous chunk's kv piece reuses it
    lead = _lead(cx, M)
    split = cx.tables.local is not None and lead <= M
    chunks = [_Chunk(cx, m, (_dispatch_q(cx, qv, m, "q"), _dispatch_kv(cx, kv_, vv, m, "kv") if sends[m] else None),
                     split, kv_) for m in range(M)]
    lead = lead if split else 0
    for m in range(lead):
        chunks[m].local(_kv_chunk(chunks, m))
    returns, relay_sends = [], []
    for m, chunk in enumerate(chunks):
        chunk.arrive(relay_sends)
        chunk.remote(_kv_source(chunks, m))
        o_send = chunk.o_arr if chunk.o_arr is not None else chunk.q_arr  # no entry computed yet: self rows only
        returns.append(_return(cx, o_send, m, "q_inv", "o", q.dtype))
    for m in range(lead, M):
        chunks[m].local(_kv_chunk(chunks, m))
    for m, pending in enumerate(returns):
        pending.into(_chunk_rows(out_view, heads, m))
    for pending in relay_sends:
        pending.wait()
    if split:
        for m in range(lead, M):
            chunks[m].write_self(out_view)
    saved = [(c.q_arr, _kv_source(chunks, m), c.o_arr, c.lse) if keep_arranged else (c.lse,)
             for m, c in enumerate(chunks)]
    return out_view.view_as(q), saved


def _lead(cx: _Ctx, M: int) -> int:
    """Local chunks run before the first remote one: the plan's ``local_lead`` (``plan.model.timing.best_lead``; M + 1 =
    no local split), else M - 1 (the last chunk's local entries overlap the returns), M without remote entries."""
    if cx.tables.local is None:
        return M + 1
    if 0 <= cx.plan.local_lead <= M + 1:
        return cx.plan.local_lead
    return M if cx.tables.remote.batch.num_entries == 0 and cx.tables.heads is None else M - 1


def _kv_chunk(chunks: List[_Chunk], m: int) -> _Chunk:
    """The latest chunk <= m that sent K/V: the one whose K|V chunk m reads (kv pieces are sent once)."""
    while chunks[m].kv_pend is None:
        m -= 1
    return chunks[m]


def _kv_source(chunks: List[_Chunk], m: int):
    """Arranged K|V chunk m reads (``_kv_chunk``'s)."""
    return _kv_chunk(chunks, m).kv_arr


# ============================================================================ backward
def _bwd_inputs(cx: _Ctx, m: int, dout_view, saved, local):
    """Launch the exchanges chunk m's backward needs: dO (always), and Q, K|V, O in REFETCH mode."""
    pending = {"do": _dispatch_q(cx, dout_view, m, "do")}
    if local is not None:
        qv, kv_, vv, ov = local
        pending["q"] = _dispatch_q(cx, qv, m, "q_bwd")
        if cx.plan.heads.kv_send_chunks()[m]:
            pending["kv"] = _dispatch_kv(cx, kv_, vv, m, "kv_bwd")
        pending["o"] = _dispatch_q(cx, ov, m, "o_bwd")
    return pending


def _bwd_kernel(cx: _Ctx, pending, saved_m, kv_arr):
    """Kernel backward of one chunk at the destination: (dq_arr (nq, qp, d), kv_arr, dk_pk, dv_pk (nk, kp, d) at
    the kernel's dtype, one row per packed key row). ``kv_arr`` comes from the previous chunk when it read the same
    kv piece (None otherwise): the arranged K|V is reused."""
    if "q" in pending:
        q_arr, o_arr = pending["q"].placed(), pending["o"].placed()
        if "kv" in pending:
            kv_arr = pending["kv"].placed()
            relayed = relay_forward(cx, kv_arr, "kv_bwd")
            if relayed is not None:
                relayed.into(kv_arr)
        (lse,) = saved_m
    else:
        q_arr, kv_arr, o_arr, lse = saved_m
    do_arr = pending["do"].placed()
    k_pk, v_pk = packed_kv(cx, kv_arr)
    dq_arr, dk_pk, dv_pk = cx.kernel(cx.backend.bwd, do_arr, q_arr, k_pk, v_pk, o_arr, lse, cx.tables.batch, cx.scale,
                                     cx.deterministic)
    return dq_arr, kv_arr, dk_pk, dv_pk


def _widened(cx: _Ctx, dk_pk, dv_pk, rows=None):
    """(n, 2*kp, d) in ``cx.acc_dtype``: packed dK and dV rows widened into its K and V halves (no cat pass); with
    ``rows``, only those packed rows, gathered at the kernel's dtype before they are widened."""
    kp = dk_pk.shape[1]
    n = dk_pk.shape[0] if rows is None else rows.shape[0]
    out = dk_pk.new_empty((n, 2 * kp, dk_pk.shape[2]), dtype=cx.acc_dtype)
    for half, src in ((slice(None, kp), dk_pk), (slice(kp, None), dv_pk)):
        out[:, half].copy_(src if rows is None else src.index_select(0, rows))
    return out


def _dkv_sums(cx: _Ctx, dk_pk, dv_pk, kv_arr, dkv_arr):
    """The arranged dK|dV (nkv, 2*kp, d) in ``cx.acc_dtype`` with one chunk's packed dK, dV added: the entries sharing
    key rows are summed there in fp32. ``dkv_arr`` comes from the previous chunk when it read the same kv piece
    (None otherwise): its sums keep accumulating until the piece's last chunk."""
    if dkv_arr is None and cx.tables.k_first is not None:  # the piece's first chunk: first rows, the others added
        dkv_arr = _widened(cx, dk_pk, dv_pk, cx.tables.k_first)
        if cx.tables.k_repeat.shape[0]:
            dkv_arr.index_add_(0, cx.tables.k_repeat_rows, _widened(cx, dk_pk, dv_pk, cx.tables.k_repeat))
        return dkv_arr
    packed = _widened(cx, dk_pk, dv_pk)
    if dkv_arr is None:  # some arranged row is no entry's key: the sums start at zero
        dkv_arr = kv_arr.new_zeros(kv_arr.shape, dtype=cx.acc_dtype)
    dkv_arr.index_add_(0, cx.tables.k_gather, packed)
    return dkv_arr


def _bwd(cx: _Ctx, dout, saved, local, k_shape: torch.Size):
    """Pipelined backward -> (dq like dout, dk, dv of ``k_shape``).
    ``local`` = (q, k, v, out) chunk views in REFETCH mode, else None."""
    heads = cx.plan.heads
    dout_view = dout.reshape(-1, heads.q_piece, heads.head_dim)
    dq_view = _uninitialized_like(dout_view)
    kp = heads.kv_piece
    dkv_local = dout.new_zeros((k_shape[0] * heads.kv_pieces_per_token, 2 * kp, heads.head_dim), dtype=cx.acc_dtype)
    incoming = _bwd_inputs(cx, 0, dout_view, saved, local)
    outgoing, kv_arr, dkv_arr, deferred = [], None, None, None  # deferred: (relay inverse, its dK|dV, chunk)
    returns = heads.kv_return_chunks()  # dK|dV of a kv piece goes home after the last chunk reading it
    dkv_wire = dout.dtype if returns.all() else cx.acc_dtype  # sums over several chunks go home in fp32 (above)

    def dkv_home(relayed, dkv_arr, m):  # the relay's sums are read: wait its inverse, then send dK|dV home
        if relayed is not None:
            relayed.into(dkv_arr)
        return _return(cx, dkv_arr, m, "kv_inv", "dkv", dkv_wire), dkv_local

    def dq_home(dq_arr, m):  # the deferred relay inverse's dK|dV, then dQ
        returning = [dkv_home(*deferred)] if deferred is not None else []
        return returning + [(_return(cx, dq_arr, m, "q_inv", "dq", dout.dtype), _chunk_rows(dq_view, heads, m))]

    dq_first = cx.tables.relay is None  # without a relay inverse to put first on the link, dQ leaves at once
    for m in range(heads.num_chunks):
        current = incoming
        if m + 1 < heads.num_chunks:
            incoming = _bwd_inputs(cx, m + 1, dout_view, saved, local)
        dq_arr, kv_arr, dk_pk, dv_pk = _bwd_kernel(cx, current, saved[m], kv_arr)
        if dq_first:  # its rows go home while the chunk's dK|dV are summed
            returning, deferred = dq_home(dq_arr, m), None
        dkv_arr = _dkv_sums(cx, dk_pk, dv_pk, kv_arr, dkv_arr)
        relayed = relay_back(cx, dkv_arr) if returns[m] else None  # first: nothing queues ahead of it on the link
        if not dq_first:
            returning, deferred = dq_home(dq_arr, m), None
        if returns[m]:
            if relayed is not None and heads.relay_inverse_deferred()[m]:  # home after kernel m+1, beside m+2
                deferred = (relayed, dkv_arr, m)
                if cx.stats is not None:
                    cx.stats.kept_for_relay(dkv_arr)
            else:
                returning.append(dkv_home(relayed, dkv_arr, m))
            kv_arr = dkv_arr = None
        for pending, target in outgoing:
            pending.into(target)
        outgoing = returning
    for pending, target in outgoing:
        pending.into(target)
    sums = dkv_local.view(-1, 2, kp, heads.head_dim)  # one cast of the sums, K and V apart: contiguous dk, dv
    return dq_view.view_as(dout), sums[:, 0].to(dout.dtype).reshape(k_shape), sums[:, 1].to(dout.dtype).reshape(k_shape)


# ============================================================================ autograd
class _LibraAttnFunction(torch.autograd.Function):
    @staticmethod
    def forward(autograd_ctx, q, k, v, cx: _Ctx, save_mode: SaveMode):
        needs_grad = any(autograd_ctx.needs_input_grad[:3])
        keep_arranged = needs_grad and save_mode is SaveMode.ARRANGED
        out, saved = _fwd(cx, q, k, v, keep_arranged)
        autograd_ctx.cx, autograd_ctx.save_mode, autograd_ctx.k_shape = cx, save_mode, k.shape
        if not needs_grad:
            return out
        flat = [t for chunk in saved for t in chunk]
        first = {}  # chunks reusing a kv piece hold the same K|V tensor: save it once
        autograd_ctx.slots = [first.setdefault(id(t), len(first)) for t in flat]
        distinct = list({id(t): t for t in flat}.values())
        autograd_ctx.chunk_len, autograd_ctx.num_distinct = len(saved[0]), len(distinct)
        extra = [q, k, v, out] if save_mode is SaveMode.REFETCH else []
        autograd_ctx.save_for_backward(*distinct, *extra)
        if cx.stats is not None:
            cx.stats.saved_bytes = sum(t.numel() * t.element_size() for t in distinct + extra)
        return out

    @staticmethod
    def backward(autograd_ctx, dout):
        cx, n = autograd_ctx.cx, autograd_ctx.chunk_len
        tensors = autograd_ctx.saved_tensors
        M = cx.plan.heads.num_chunks
        flat = [tensors[i] for i in autograd_ctx.slots]
        saved = [tuple(flat[m * n : (m + 1) * n]) for m in range(M)]
        local = None
        if autograd_ctx.save_mode is SaveMode.REFETCH:
            q, k, v, out = tensors[autograd_ctx.num_distinct :]
            local = _views(q, k, v, cx.plan.heads) + (out.reshape(-1, cx.plan.heads.q_piece, cx.plan.heads.head_dim),)
        dq, dk, dv = _bwd(cx, dout.contiguous(), saved, local, autograd_ctx.k_shape)
        return dq, dk, dv, None, None


# ============================================================================ public API
def libra_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RankPlan, group, *,
                    softmax_scale: Optional[float] = None, backend=KernelBackendName.AUTO, qkv_format: str = "thd",
                    save_mode=SaveMode.ARRANGED, stats: Optional[ExchangeStats] = None, verify="auto",
                    check_group=None, deterministic: bool = False, relay_group=None) -> torch.Tensor:
    """Causal attention over the packed sequences of a sequence pool, executed from ``plan``.

    Arguments:
        q: (t, hq, d) for qkv_format="thd", or (t, 1, hq, d) for "sbhd" (s = t, b = 1). fp16/bf16/fp32/fp64.
           This rank's local tokens: its CP shard of its packed sequence under the plan's token layout.
        k, v: (t, hkv, d) or (t, 1, hkv, d), same dtype and device as q; hkv | hq (GQA).
        plan: this rank's ``RankPlan`` (``plan.rank`` == rank in ``group``); all ranks must hold RankPlans
            of the same ExchangePlan (checked: same call key, see ``runtime.checks``).
        group: the sequence pool's process group (P*CP ranks).
        softmax_scale: default 1/sqrt(d).
        backend: ``KernelBackendName`` (auto | flash | torch_flash | torch), see ``runtime.kernels``.
        save_mode: ``SaveMode.ARRANGED`` (keep destination tensors) or ``SaveMode.REFETCH``; every rank of
            the pool must pass the same (it is part of the call key).
        stats: optional ``ExchangeStats`` accumulating bytes sent per kind, kernel time, saved bytes.
        verify: True | False | "auto" -- when the one-collective plan verification runs (``runtime.checks``);
            "auto" = the first call with a new call key. Must be the same decision on every rank.
        check_group: group the verification gathers over (a gloo twin of ``group`` avoids a device read).
        deterministic: the kernels' deterministic backward (``KernelBackend.bwd``; Megatron-LM's
            --deterministic-mode).
        relay_group: a second process group over the pool's ranks for a relaying plan's relay exchanges (so
            they run beside the dispatches, as the simulator prices it); None: ``group`` (same results, the
            relay queues behind the dispatches).
    Returns:
        out: same shape, dtype and device as q -- attention output for exactly this rank's local tokens.
    Raises:
        PlanError on *every* rank (never a hang) if a verified call finds any rank's plan not fitting its
        tensors or group, or differing call keys. ValueError for a bad qkv_format / backend / save_mode.
    """
    if qkv_format not in ("thd", "sbhd"):
        raise ValueError(f"qkv_format must be 'thd' or 'sbhd', got {qkv_format!r}")
    if qkv_format == "sbhd":
        if q.dim() != 4 or q.shape[1] != 1:
            raise ValueError(f"qkv_format='sbhd' needs (t, 1, h, d) with b=1, got q of shape {tuple(q.shape)}")
        out = libra_attn_func(q.squeeze(1), k.squeeze(1), v.squeeze(1), plan, group, softmax_scale=softmax_scale,
                              backend=backend, save_mode=save_mode, stats=stats, verify=verify,
                              check_group=check_group, deterministic=deterministic, relay_group=relay_group)
        return out.unsqueeze(1)
    mode = _save_mode(save_mode)
    ensure_plan_verified(q, k, v, plan, group, save_mode=mode.value, verify=verify, check_group=check_group)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    cx = _Ctx(plan=plan, tables=device_tables(plan, rank_tables, q.device), group=group, scale=scale,
              backend=resolve_backend(backend, q.device, q.dtype, q.shape[-1]), stats=stats,
              acc_dtype=_accumulation_dtype(q.dtype), deterministic=bool(deterministic),
              relay_group=group if relay_group is None else relay_group)
    return _apply(q, k, v, cx, mode)


def _apply(q, k, v, cx: _Ctx, save_mode: SaveMode):
    return _LibraAttnFunction.apply(q.contiguous(), k.contiguous(), v.contiguous(), cx, save_mode)
