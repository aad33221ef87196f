"""Record the operations ``runtime.libra_attn`` really issues, as ``plan.model.ops`` records (issue 23).

``record_ops({group: "pool", relay_group: "relay"})`` is a context manager: while it is active, in this
process, it lists in issue order

    Exchange  every ``all_to_all_single`` that ``runtime.routes`` issues (the name that module calls is
              patched): ``comm`` = the name of its group object (by identity), ``seq`` = issue number on that
              comm, ``send`` / ``recv`` = split sizes x bytes of one row of the send tensor (its shape[1:], so a
              rank that sends no row still sizes what it receives)
    Wait      every ``wait()`` of the ``Work`` such an exchange returned (the Work is wrapped)
    Kernel    every ``fwd`` / ``bwd`` of the kernel backend ``runtime.libra_attn`` resolves (``resolve_backend``
              is wrapped): entries, packed q / k rows and causal (bottom-right) pairs x query heads, read off
              ``batch.bounds`` and ``q.shape[1]``
    Copy      every ``Tensor.index_select`` ("gather": bytes of the selected rows), ``index_put_`` ("place":
              bytes of the values) and ``index_add_`` ("add": bytes of the source) called from a module of
              ``libra_megatron.runtime``, outside kernel calls and the device-table upload; and the dense
              kernels there: ``torch.cat`` ("elementwise": bytes of the result), ``Tensor.to`` that changes the
              dtype ("widen" to a larger element, else "elementwise": mean of bytes read and written) and
              ``Tensor.new_zeros`` ("elementwise": half the bytes of the result), ``Tensor.copy_`` ("elementwise":
              bytes of the destination; one that changes the dtype as ``Tensor.to``); ``torch.index_select``
              (the function, e.g. with ``out=`` a view of a send buffer) as the method

and hands them back with ``take()`` (the ops since the last take; exchange numbers restart at 0). Nothing is patched outside the ``with``
block: the runtime's code path carries none of this. ``tests/runtime/test_op_list.py`` compares the lists with
``plan.exchange.schedule.rank_layer_ops``.
"""
from __future__ import annotations

import contextlib
import math
import sys
from typing import Dict, List, Mapping

import torch

from ..plan.model import Copy, Exchange, Kernel, Wait

__all__ = ["OpRecorder", "record_ops", "causal_pairs"]

_COPY_METHODS = (("index_select", "gather"), ("index_put_", "place"), ("index_add_", "add"))
_DENSE_METHODS = (("to", "cast"), ("new_zeros", "fill"), ("copy_", "copy"))
_RUNTIME = "libra_megatron.runtime"


def causal_pairs(bounds, causal: bool = True) -> int:
    """Query-key pairs of varlen entries ``bounds`` = ((q0, q1, k0, k1), ...): bottom-right causal, query r of
    an entry of q rows and e keys sees clip(e - q + r + 1, 0, e) keys; non-causal: every pair."""
    total = 0
    for q0, q1, k0, k1 in bounds:
        q, e = q1 - q0, k1 - k0
        if not causal:
            total += q * e
            continue
        for r in range(q):  # tiny test batches: the plain sum is the clearest statement
            total += min(e, max(0, e - q + r + 1))
    return total


def _nbytes(t: torch.Tensor) -> int:
    return int(t.numel() * t.element_size())


class _RecordedWork:
    """A ``Work`` whose ``wait()`` is recorded as ``Wait(comm, seq)``."""

    def __init__(self, work, recorder: "OpRecorder", comm: str, seq: int):
        self._work, self._recorder, self._comm, self._seq = work, recorder, comm, seq

    def wait(self, *args, **kwargs):
        self._recorder.ops.append(Wait(self._comm, self._seq))
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


class _DistProxy:
    """Stands for ``torch.distributed`` in ``runtime.routes``: ``all_to_all_single`` recorded, the rest as is."""

    def __init__(self, dist, recorder: "OpRecorder"):
        self._dist, self._recorder = dist, recorder

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        rec = self._recorder
        comm = rec.comm_name(group)
        seq = rec.seq.get(comm, 0)
        rec.seq[comm] = seq + 1
        row = math.prod(input.shape[1:]) * input.element_size()  # one row, also when this rank sends none
        rec.ops.append(Exchange(comm, seq, tuple(int(n) * row for n in input_split_sizes),
                                tuple(int(n) * row for n in output_split_sizes)))
        work = self._dist.all_to_all_single(output, input, output_split_sizes=output_split_sizes,
                                            input_split_sizes=input_split_sizes, group=group, async_op=async_op)
        return _RecordedWork(work, rec, comm, seq) if work is not None else None

    def __getattr__(self, name):
        return getattr(self._dist, name)


class _RecordedBackend:
    """A ``KernelBackend`` whose ``fwd`` / ``bwd`` are recorded (index copies inside them are not)."""

    def __init__(self, backend, recorder: "OpRecorder"):
        self._backend, self._recorder = backend, recorder

    def _kernel(self, direction: str, q, batch, causal: bool) -> None:
        bounds = batch.bounds
        heads = int(q.shape[1])
        self._recorder.ops.append(Kernel(direction, batch.num_entries, sum(b[1] - b[0] for b in bounds),
                                         sum(b[3] - b[2] for b in bounds), causal_pairs(bounds, causal) * heads,
                                         heads, causal))

    def fwd(self, q, k, v, batch, scale, causal: bool = True):
        self._kernel("fwd", q, batch, causal)
        with self._recorder.quiet():
            return self._backend.fwd(q, k, v, batch, scale, causal)

    def bwd(self, dout, q, k, v, out, lse, batch, scale, deterministic: bool = False):
        self._kernel("bwd", q, batch, True)
        with self._recorder.quiet():
            return self._backend.bwd(dout, q, k, v, out, lse, batch, scale, deterministic)

    def __getattr__(self, name):
        return getattr(self._backend, name)


class OpRecorder:
    """The ops recorded so far (``ops``) and the bookkeeping of ``record_ops``."""

    def __init__(self, comms: Mapping[object, str]):
        self._comms = list(comms.items())  # by identity: process groups need not hash or compare by value
        self.ops: List = []
        self.seq: Dict[str, int] = {}
        self._quiet = 0

    def comm_name(self, group) -> str:
        for known, name in self._comms:
            if known is group:
                return name
        raise AssertionError(f"op recorder: all_to_all_single on a group not in the mapping: {group!r}")

    def take(self) -> list:
        """The ops recorded since the last ``take`` (issue order), and a new numbering of the exchanges: each take
        closes one pass (a layer's forward, or its backward), which the model numbers from 0."""
        ops, self.ops, self.seq = self.ops, [], {}
        return ops

    @contextlib.contextmanager
    def quiet(self):
        self._quiet += 1
        try:
            yield
        finally:
            self._quiet -= 1

    def _runtime_call(self) -> bool:
        """Whether the patched method's caller (two frames up) is a module of the runtime, outside quiet work."""
        return not self._quiet and sys._getframe(2).f_globals.get("__name__", "").startswith(_RUNTIME)

    def dense(self, original, kind: str):
        """``torch.cat`` / ``Tensor.to`` / ``Tensor.new_zeros`` recorded as one dense kernel (module docstring)."""
        recorder = self

        def recorded(*args, **kwargs):
            if not recorder._runtime_call():
                return original(*args, **kwargs)
            with recorder.quiet():
                result = original(*args, **kwargs)
            if kind == "copy" and args[1].dtype != result.dtype:  # copy_(src) that casts: as ``Tensor.to``
                src, dst = args[1].element_size(), result.element_size()
                recorder.ops.append(Copy("widen" if dst > src else "elementwise", result.numel() * (src + dst) // 2))
            elif kind in ("cat", "copy"):
                recorder.ops.append(Copy("elementwise", _nbytes(result)))
            elif kind == "fill":
                recorder.ops.append(Copy("elementwise", _nbytes(result) // 2))
            elif isinstance(result, torch.Tensor) and result is not args[0] and result.dtype != args[0].dtype:
                src, dst = args[0].element_size(), result.element_size()
                recorder.ops.append(Copy("widen" if dst > src else "elementwise", result.numel() * (src + dst) // 2))
            return result

        return recorded

    def copy_method(self, original, op: str):
        recorder = self

        def recorded(tensor, *args, **kwargs):
            if not recorder._runtime_call():
                return original(tensor, *args, **kwargs)
            with recorder.quiet():
                result = original(tensor, *args, **kwargs)
            recorder.ops.append(Copy(op, _nbytes(_moved(op, result, args, kwargs))))
            return result

        return recorded


def _moved(op: str, result, args, kwargs) -> torch.Tensor:
    """The rows a copy moves: the gathered output, ``index_put_(indices, values)``'s values or
    ``index_add_(dim, index, source)``'s source."""
    if op == "gather":
        return result
    if op == "place":
        return args[1] if len(args) > 1 else kwargs["values"]
    return args[2] if len(args) > 2 else kwargs["source"]


@contextlib.contextmanager
def record_ops(comms: Mapping[object, str]):
    """Record the runtime's calls while active (module docstring); yields the ``OpRecorder``.
    ``comms`` maps each process group the runtime exchanges on to its name ("pool", "relay")."""
    from ..runtime import libra_attn, routes

    recorder = OpRecorder(comms)
    saved = [(routes, "dist", routes.dist), (libra_attn, "resolve_backend", libra_attn.resolve_backend),
             (libra_attn, "device_tables", libra_attn.device_tables), (torch, "cat", torch.cat),
             (torch, "index_select", torch.index_select)]
    saved += [(torch.Tensor, name, torch.Tensor.__dict__.get(name)) for name, _ in _COPY_METHODS + _DENSE_METHODS]
    original_resolve, original_tables = libra_attn.resolve_backend, libra_attn.device_tables
    routes.dist = _DistProxy(routes.dist, recorder)
    libra_attn.resolve_backend = lambda *a, **k: _RecordedBackend(original_resolve(*a, **k), recorder)

    def quiet_tables(*args, **kwargs):  # the tables' upload at a plan's first use is not the layer's work
        with recorder.quiet():
            return original_tables(*args, **kwargs)

    libra_attn.device_tables = quiet_tables
    torch.cat = recorder.dense(torch.cat, "cat")
    torch.index_select = recorder.copy_method(torch.index_select, "gather")
    for name, op in _COPY_METHODS:
        setattr(torch.Tensor, name, recorder.copy_method(getattr(torch.Tensor, name), op))
    for name, kind in _DENSE_METHODS:
        setattr(torch.Tensor, name, recorder.dense(getattr(torch.Tensor, name), kind))
    try:
        yield recorder
    finally:
        for owner, name, value in reversed(saved):
            if value is None:  # a method torch.Tensor inherits from its C base: drop the patch, inherit again
                delattr(owner, name)
            else:
                setattr(owner, name, value)
