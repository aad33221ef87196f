"""Seconds of one phase (forward or backward) of a pool's attention layer: the op lists of all its ranks
(``plan.model.ops``, issued as ``runtime.libra_attn`` issues them, listed by ``plan.exchange.schedule``)
played on an event timeline with the peers coupled.

Pure numpy. Per rank, two kinds of resource:
    compute stream   kernels and index copies run one after another, in list order; a ``Wait`` holds the
                     stream until that exchange has ended *on this rank*
    links            two per rank, one per link class: intra-node (NVLink) and inter-node (the NIC), each shared
                     by both communicators (the pool group and the relay's twin); an exchange occupies each class
                     from its start in that class for its own transfer time in it
Exchanges on one communicator run in issue order (NCCL's FIFO per communicator): exchange c of a rank begins at
    a = max(issued, the rank's previous exchange on the communicator ended)
(its kernel runs; ``issued`` is the compute stream's time when it was issued, its send buffer gathered by then),
and its transfers in class k start at b_k = max(a, the rank's class-k link free). A transfer from s to d occupies
s's egress and d's ingress, and it starts only when both have reached the exchange (max(b_k,s, b_k,d)). Inside
one exchange the transfers share each rank's links max-min fairly (NCCL interleaves its peers' chunks): the
message s -> d of ``n`` bytes, in link class k (intra-node or inter-node), is done after
    max( sum over s's messages p in class k of min(bytes s -> p, n),
         sum over d's incoming messages q in class k of min(bytes q -> d, n) ) / bandwidth_k  +  alpha_msg_k
so a receive cannot finish before its sender has sent (a sender busy with larger messages delays it), and a
small message is not held up by a large one. Exchange c ends on rank r at
    end_r = alpha_call + max( a_r + self copy,  every message r sends or receives done )
The self segment is copied at the copy rate (read + write). Class k's link stays busy for
x_k,r = max(bytes sent, bytes received in class k) / bandwidth_k (an exchange of the other communicator waits for
it in that class only: the relay's intra-node hop runs beside a dispatch's inter-node transfers, on the relay's
own NCCL communicator and stream). Exchanges are played in the order they begin (the smallest max over ranks of
``a``; ties by communicator name), so an exchange that begins late, queued behind its communicator's earlier
ones, does not hold a link before one of the other communicator that begins sooner. Costs of the
compute stream: a kernel call is a launch plus its FLOPs (4 d x pairs x heads forward, times
``BACKWARD_FLOPS_FACTOR`` backward) at ``StepTimeModel.call_seconds``' rate, plus ``kernel_entry_us`` per varlen
entry (0 on a GPU; the CPU fit's per-entry loop); a copy is a launch plus
2 x its bytes (read + write) at its kind's rate (gather, index_put_ "place", index_add_ "add", a widening cast
"widen", cat / fill / narrowing cast "elementwise": measured apart, ``plan.model.rates``); calls with nothing to do
cost nothing.

What is not modelled: transfers of two exchanges in flight at once in one link class sharing its bandwidth (the
second waits for the first's link time in that class instead), NVLink / InfiniBand contention between pools and
with other parallelisms' traffic (NCCL's PXN routing of inter-node bytes over NVLink included), host-side launch
gaps (the host is assumed ahead of the device), and stream priorities.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import numpy as np

from .kernel_fit import KernelFit
from .ops import COPY_KINDS, Copy, Exchange, Kernel, Wait
from .rates import BACKWARD_FLOPS_FACTOR, GB, US

__all__ = ["PhaseTiming", "price_ops", "OpCosts", "message_done_seconds", "exchange_class_seconds",
           "kernel_floor_per_pair"]


@dataclass(frozen=True, eq=False)
class PhaseTiming:
    """One phase of one pool layer, per worker (float64 [W]): ``seconds`` when its last op ends, ``compute``
    the busy time of its compute stream (kernels + copies), ``exposed`` = seconds - compute (time the stream
    waited for exchanges), ``link`` the busy time of its link."""

    seconds: np.ndarray
    compute: np.ndarray
    link: np.ndarray

    @property
    def exposed(self) -> np.ndarray:
        return self.seconds - self.compute


class OpCosts:
    """Seconds of a rank's kernel and copy ops under one model (module docstring), with the model's constants
    read once (a pool's layer has tens of thousands of ops). The backward kernel runs its
    ``BACKWARD_FLOPS_FACTOR`` x FLOPs at ``attn_bwd_tflops`` (default: the forward's rate)."""

    def __init__(self, model):
        self.model = model
        self.per_pair = None if model.calibration is not None else float(model.compute_seconds(1.0))
        self.fit = model.calibration if isinstance(model.calibration, KernelFit) else None
        self.bwd_scale = BACKWARD_FLOPS_FACTOR * (1.0 if model.attn_bwd_tflops is None
                                                  else model.attn_tflops / model.attn_bwd_tflops)
        self.launch, self.entry = model.launch_seconds("fwd"), model.kernel_entry_us * US
        self.bwd_launch = model.launch_seconds("bwd")  # both unused under a kernel fit (its call includes them)
        self.bwd_entry = self.entry if model.bwd_kernel_entry_us is None else model.bwd_kernel_entry_us * US
        self.copy_launch = model.copy_launch_us * US
        self.copy_per_byte = {kind: 2.0 / (getattr(model, kind + "_gbps") * GB) for kind in COPY_KINDS}

    def kernel(self, op: Kernel) -> float:
        if op.entries == 0 or op.pairs == 0:
            return 0.0
        if self.fit is not None:  # a fit on measured calls: the whole call, launch and backward its own
            return float(self.fit.call_seconds(op.pairs, op.q_rows, op.heads, op.direction))
        if self.per_pair is not None:
            seconds = op.pairs * self.per_pair
        else:
            seconds = float(self.model.call_seconds(op.pairs, op.q_rows, op.heads))
        if op.direction == "bwd":
            return seconds * self.bwd_scale + self.bwd_launch + op.entries * self.bwd_entry
        return seconds + self.launch + op.entries * self.entry

    def copy(self, op: Copy) -> float:
        per_byte = self.copy_per_byte.get(op.op)
        if per_byte is None:
            raise ValueError(f"Copy op {op.op!r} is not one of {COPY_KINDS} (plan.model.ops)")
        return 0.0 if op.nbytes == 0 else self.copy_launch + op.nbytes * per_byte


def kernel_floor_per_pair(model) -> Optional[Tuple[float, float]]:
    """(forward, backward) seconds per pair-head that a rank's kernel calls take at least under ``model``
    (``OpCosts.kernel`` without its launches and per-entry costs); None under a calibration (its calls are priced
    per shape). A rank's calls compute exactly the pair-heads it hosts (every entry's pairs; a split entry's parts
    together), and a phase's seconds on a rank are never below its kernels' sum, so hosted pair-heads x this bounds
    the phase from below (``plan.tiles.placement`` cuts candidates with it)."""
    costs = OpCosts(model)
    if costs.per_pair is None:
        return None
    return costs.per_pair, costs.per_pair * costs.bwd_scale


def _fair_sums(S: np.ndarray) -> np.ndarray:
    """E[q, r] = sum over p of min(S[q, p], S[q, r]): what q's other messages delay its message to r under
    max-min fair sharing. Row by row in ascending order, the message at place k is delayed by the k smaller ones
    and by itself, and by its own size for each of the W - 1 - k larger ones (tied messages get the same sums in
    either order). Byte counts are whole numbers far below 2**53, so every sum here is exact in float64 in any
    order: the rows' running sums come from one running sum over the whole array."""
    n, W = S.shape
    flat = (np.argsort(S, axis=1) + (np.arange(n) * W)[:, None]).ravel()  # each row ascending, as flat indices
    ascending = S.ravel()[flat].reshape(n, W)
    running = np.cumsum(ascending).reshape(n, W)
    before = np.concatenate([[0.0], running[:-1, -1]])  # the running sum at the end of the previous row
    out = np.empty(n * W)
    out[flat] = (running - before[:, None] + ascending * (W - 1 - np.arange(W))).ravel()
    return out.reshape(n, W)


def _link_classes(nodes: np.ndarray, model):
    """The two link classes of a pool, in the order of ``exchange_class_seconds``' rows: (pair mask [W, W],
    GB/s, per-message alpha in us) for intra-node (off the diagonal) and inter-node pairs."""
    same = nodes[:, None] == nodes[None, :]
    return ((same & ~np.eye(nodes.shape[0], dtype=bool), model.intra_node_gbps, model.intra_message_us),
            (~same, model.inter_node_gbps, model.inter_message_us))


def message_done_seconds(send: np.ndarray, nodes: np.ndarray, model) -> np.ndarray:
    """float64 [W, W]: seconds after both ends started until message s -> d of one exchange is done (module
    docstring: max-min fair share of s's egress and d's ingress in its link class, plus its alpha); 0 where
    nothing moves (and on the diagonal). Both classes' egress and ingress sums in one ``_fair_sums`` call."""
    W = send.shape[0]
    classes = _link_classes(nodes, model)
    S = np.stack([np.where(mask, send, 0.0) for mask, _, _ in classes])  # [class, s, d]
    sums = _fair_sums(np.concatenate([S, S.transpose(0, 2, 1)]).reshape(4 * W, W)).reshape(4, W, W)
    out = np.zeros(send.shape)
    for k, (mask, gbps, alpha) in enumerate(classes):
        share = np.maximum(sums[k], sums[2 + k].T)
        out = np.where(mask & (S[k] > 0), share / (gbps * GB) + alpha * US, out)
    return out


def exchange_class_seconds(send: np.ndarray, nodes: np.ndarray, model) -> np.ndarray:
    """float64 [2, W]: how long each rank's intra-node (row 0) and inter-node (row 1) link is busy with one
    exchange: max(bytes sent, bytes received) in that class at the class bandwidth."""
    out = np.zeros((2, send.shape[0]))
    for k, (mask, gbps, _) in enumerate(_link_classes(nodes, model)):
        S = np.where(mask, send, 0.0)
        out[k] = np.maximum(S.sum(axis=1), S.sum(axis=0)) / (gbps * GB)
    return out


class _Collective:
    """Issue times and byte rows of one exchange (comm, seq) as its ranks issue it; the matrices are built once, when
    every rank has issued it (``matrices``)."""

    def __init__(self, W: int, rows: dict):
        self.rows = rows  # the timeline's byte tuple -> float64 row conversions (one tuple object, one conversion)
        self.issued = [None] * W
        self.send_rows = [None] * W
        self.recv_rows = [None] * W
        self.count = 0
        self._matrices = None

    def add(self, rank: int, when: float, op: Exchange) -> None:
        W = len(self.issued)
        if self.issued[rank] is not None:
            raise ValueError(f"exchange ({op.comm}, {op.seq}) issued twice by rank {rank}")
        if len(op.send) != W or len(op.recv) != W:
            raise ValueError(f"exchange ({op.comm}, {op.seq}) of rank {rank} names {len(op.send)} ranks, the pool "
                             f"has {W}")
        self.issued[rank], self.count = when, self.count + 1
        self.send_rows[rank], self.recv_rows[rank] = self.row(op.send), self.row(op.recv)

    def row(self, sizes: tuple) -> np.ndarray:
        """float64 [W] of a byte tuple, converted once per distinct value and found by the tuple's id after that (the
        op lists share one tuple among the exchanges that repeat a route's sizes; the cache holds the tuple, so its
        id names no other while cached)."""
        hit = self.rows.get(id(sizes))
        if hit is None or hit[0] is not sizes:
            row = self.rows.get(sizes)
            if row is None:
                row = self.rows[sizes] = np.asarray(sizes, dtype=np.float64)
            hit = self.rows[id(sizes)] = (sizes, row)
        return hit[1]

    def matrices(self) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(issued float64 [W], send float64 [W, W], recv float64 [W, W]) of a fully issued exchange, built once."""
        if self._matrices is None:
            self._matrices = (np.array(self.issued, dtype=np.float64), np.stack(self.send_rows),
                              np.stack(self.recv_rows))
        return self._matrices

    @staticmethod
    def check(key, send: np.ndarray, recv: np.ndarray) -> None:
        """Every rank's receive sizes are what its peers send it (what ``all_to_all_single`` requires)."""
        if not np.array_equal(send, recv.T):
            bad = np.argwhere(send != recv.T)[0]
            raise ValueError(f"exchange {key}: rank {bad[0]} sends {send[bad[0], bad[1]]:.0f} bytes to rank "
                             f"{bad[1]}, which expects {recv[bad[1], bad[0]]:.0f}")


class _Timeline:
    """The event timeline of one phase (module docstring). Ranks run their ops as far as they can (``advance``); then
    the exchange that begins earliest of those every rank has issued ends (``resolve_one``), and only the ranks
    waiting for it run on: no other rank can, its next op waits for an exchange that has not ended."""

    def __init__(self, ops_per_rank: Sequence[Sequence[object]], model, nodes: np.ndarray):
        self.ops = [list(o) for o in ops_per_rank]
        self.W, self.model, self.nodes = len(self.ops), model, nodes
        self.costs = OpCosts(model)
        self.ptr = [0] * self.W
        self.t = [0.0] * self.W
        self.busy = [0.0] * self.W
        self.link_busy = np.zeros(self.W)
        self.link_free = np.zeros((2, self.W))  # per link class: intra-node (NVLink), inter-node (the NIC)
        self.same_node = nodes[:, None] == nodes[None, :]
        self.pending: Dict[Tuple[str, int], _Collective] = {}
        self.ends: Dict[Tuple[str, int], list] = {}  # an ended exchange's end per rank (Python floats)
        self.waiting: Dict[Tuple[str, int], list] = {}  # ranks stopped at a wait for an exchange not yet ended
        self.comm_free: Dict[str, np.ndarray] = {}
        self.next_seq: Dict[str, int] = {}
        self.rows: dict = {}  # ``_Collective.row``: by tuple id and by value
        self.links: Dict[bytes, tuple] = {}  # send matrix bytes -> (message done seconds, link seconds)

    def advance(self, r: int) -> None:
        """Run rank r's ops until a wait whose exchange has not ended (the rank then waits for it in ``waiting``)."""
        ops, i = self.ops[r], self.ptr[r]
        t, busy, costs = self.t[r], self.busy[r], self.costs
        while i < len(ops):
            op = ops[i]
            kind = type(op)
            if kind is Copy:
                cost = costs.copy(op)
                t, busy = t + cost, busy + cost
            elif kind is Kernel:
                cost = costs.kernel(op)
                t, busy = t + cost, busy + cost
            elif kind is Wait:
                key = (op.comm, op.seq)
                end = self.ends.get(key)
                if end is None:
                    self.waiting.setdefault(key, []).append(r)
                    break
                t = max(t, end[r])
            elif kind is Exchange:
                coll = self.pending.get((op.comm, op.seq))
                if coll is None:
                    coll = self.pending[(op.comm, op.seq)] = _Collective(self.W, self.rows)
                    self.next_seq.setdefault(op.comm, 0)
                coll.add(r, t, op)
            else:
                raise ValueError(f"rank {r}: op {i} is not an op record of plan.model.ops: {op!r}")
            i += 1
        self.ptr[r], self.t[r], self.busy[r] = i, t, busy

    def resolve_one(self) -> Optional[Tuple[str, int]]:
        """End, of the communicators' next exchanges that every rank has issued, the one that begins earliest (the
        max over ranks of max(issued, the communicator's previous exchange ended); module docstring); its key, or
        None when no exchange can end."""
        candidates = []
        for comm, seq in self.next_seq.items():
            coll = self.pending.get((comm, seq))
            if coll is not None and coll.count == self.W:
                issued = coll.matrices()[0]
                free = self.comm_free.get(comm)
                begins = issued if free is None else np.maximum(issued, free)
                candidates.append((float(np.max(begins)), comm, seq))
        if not candidates:
            return None
        _, comm, seq = min(candidates)
        coll = self.pending.pop((comm, seq))
        issued, send, recv = coll.matrices()
        coll.check((comm, seq), send, recv)
        free = self.comm_free.setdefault(comm, np.zeros(self.W))
        ready = np.maximum(issued, free)  # its kernel runs: issued, and the communicator's previous one ended
        start = np.maximum(ready[None, :], self.link_free)  # [class, rank]: that link is free too
        done, x = self.link_seconds(send)
        moves = done > 0
        pair_start = np.where(self.same_node, np.maximum(start[0][:, None], start[0][None, :]),
                              np.maximum(start[1][:, None], start[1][None, :]))
        both = np.where(moves, pair_start + done, -np.inf)  # [s, d]: message s -> d done
        last = np.maximum(both.max(axis=1, initial=-np.inf), both.max(axis=0, initial=-np.inf))
        own = ready + 2.0 * np.diagonal(send) / (self.model.copy_gbps * GB)  # the self segment
        end = self.model.collective_us * US + np.maximum(own, last)
        self.ends[(comm, seq)] = end.tolist()
        self.comm_free[comm] = end
        self.link_free = np.where(x > 0, start + x, self.link_free)  # a class an exchange does not use stays free
        self.link_busy += x.max(axis=0)
        self.next_seq[comm] = seq + 1
        return comm, seq

    def link_seconds(self, send: np.ndarray) -> tuple:
        """(``message_done_seconds``, ``exchange_class_seconds``) of one send matrix, computed once per distinct
        matrix: a layer's exchanges repeat a few routes' sizes (Q, dO, O and dQ share one)."""
        key = send.tobytes()
        out = self.links.get(key)
        if out is None:
            out = self.links[key] = (message_done_seconds(send, self.nodes, self.model),
                                     exchange_class_seconds(send, self.nodes, self.model))
        return out

    def run(self) -> PhaseTiming:
        runnable = range(self.W)
        while True:
            for r in runnable:
                self.advance(r)
            ended = self.resolve_one()
            if ended is None:
                break
            runnable = self.waiting.pop(ended, ())
        if not all(p == len(o) for p, o in zip(self.ptr, self.ops)):
            stuck = [(r, self.ops[r][self.ptr[r]]) for r in range(self.W) if self.ptr[r] < len(self.ops[r])]
            raise ValueError(f"the op lists cannot run to the end (ranks disagree on their exchanges): "
                             f"first stuck {stuck[:2]}")
        if self.pending:
            raise ValueError(f"exchanges issued but never ended: {sorted(self.pending)[:4]}")
        return PhaseTiming(seconds=np.asarray(self.t), compute=np.asarray(self.busy), link=self.link_busy.copy())


def price_ops(ops_per_rank: Sequence[Sequence[object]], model, nodes=None) -> PhaseTiming:
    """``PhaseTiming`` of the ops of every rank of a pool (index = pool worker) under ``model``
    (``StepTimeModel``: rates, latencies, nodes; ``nodes`` overrides ``model.nodes(W)``). Raises ValueError
    when the lists cannot all run (ranks disagree on an exchange), never hangs."""
    W = len(ops_per_rank)
    node = model.nodes(W) if nodes is None else np.asarray(nodes, dtype=np.int64)
    return _Timeline(ops_per_rank, model, node).run()

