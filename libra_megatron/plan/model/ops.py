"""The operations one rank issues for one attention layer, in issue order: what the time model prices and
what the runtime is checked against (``tests/runtime/test_op_list.py``).

Pure data. ``plan.exchange.schedule`` lists them from an ExchangePlan, mirroring ``runtime.libra_attn._fwd`` /
``_bwd`` call for call; ``plan.model.events`` prices the lists of all ranks of a pool together (peers
coupled); the test records the runtime's real calls (``all_to_all_single``, ``Work.wait``, the kernel backend's
``fwd`` / ``bwd``, the index copies) on gloo and asserts the two lists are equal, op for op (``Op.key``).

    Exchange  an ``all_to_all_single`` on communicator ``comm`` ("pool": the pool group, "relay": the relay's
              twin group); ``seq`` = its issue number on that communicator (the same on every rank: NCCL order);
              ``send`` / ``recv`` = bytes to / from every pool rank (self included, tuples of length W)
    Wait      the wait of exchange (comm, seq): the host (gloo) or the compute stream (NCCL) blocks until it is in
    Kernel    one varlen attention call: ``direction`` "fwd" | "bwd", ``entries`` varlen entries, ``q_rows`` /
              ``k_rows`` packed query / key rows, ``pairs`` = query-key pairs x query heads it computes (causal:
              bottom-right aligned; ``causal=False``: every pair), ``heads`` = query heads per row
    Copy      a gather / scatter on the device: ``op`` "gather" (index_select), "place" (index_put_) or "add"
              (index_add_), ``nbytes`` = bytes of the rows it moves (what it reads, at the source dtype); or a
              dense kernel over whole tensors, ``nbytes`` = the mean of the bytes it reads and writes (a fill:
              half its bytes): "widen" (``Tensor.to`` a larger dtype, bf16 -> fp32) or "elementwise"
              (``torch.cat``, ``Tensor.to`` a smaller dtype, ``new_zeros``)

Records are named tuples (immutable, cheap to make: a pool's layer lists tens of thousands of them).
``tag`` and ``chunk`` say which tensor an op moves (q, kv, o, do, dq, dkv, q_bwd, kv_bwd, o_bwd) and for which
Pipeliner chunk; they are for reading a timeline, and ``key`` leaves them out (a recorder of real calls cannot
see them).
"""
from __future__ import annotations

from typing import NamedTuple, Tuple, Union

__all__ = ["Exchange", "Wait", "Kernel", "Copy", "Op", "POOL", "RELAY", "COPY_KINDS", "op_keys"]

POOL, RELAY = "pool", "relay"
COPY_KINDS = ("gather", "place", "add", "widen", "elementwise")  # index_select, index_put_, index_add_, .to, cat


class Exchange(NamedTuple):
    comm: str
    seq: int
    send: Tuple[int, ...]
    recv: Tuple[int, ...]
    tag: str = ""
    chunk: int = -1

    def key(self) -> tuple:
        return ("exchange", self.comm, self.seq, self.send, self.recv)


class Wait(NamedTuple):
    comm: str
    seq: int
    tag: str = ""
    chunk: int = -1

    def key(self) -> tuple:
        return ("wait", self.comm, self.seq)


class Kernel(NamedTuple):
    direction: str
    entries: int
    q_rows: int
    k_rows: int
    pairs: int
    heads: int
    causal: bool = True
    tag: str = ""
    chunk: int = -1

    def key(self) -> tuple:
        return ("kernel", self.direction, self.entries, self.q_rows, self.k_rows, self.pairs, self.heads, self.causal)


class Copy(NamedTuple):
    op: str
    nbytes: int
    tag: str = ""
    chunk: int = -1

    def key(self) -> tuple:
        return ("copy", self.op, self.nbytes)


Op = Union[Exchange, Wait, Kernel, Copy]


def op_keys(ops) -> list:
    """The comparable part of an op list (``Op.key`` of each, in order)."""
    return [op.key() for op in ops]
