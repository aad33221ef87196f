"""Python's cyclic garbage collector paused around the planner's allocation-heavy pricing (issue 25).

Pricing a pool's whole layer builds tens of thousands of short-lived op tuples while the candidates' op lists stay
alive; every automatic collection then rescans those survivors, ~20% of a dense placement's CPU time. Pricing
makes no reference cycles (op records are tuples of numbers and strings), so reference counting frees it all;
``paused_gc`` switches automatic collection off for the block and back on after.

The collector is one switch for the whole interpreter, so only the main thread flips it: the planner process
(the default, ``megatron.planner_process``) and the simulator plan there. A planner thread inside a training
process (``LIBRA_PLANNER_MODE=thread``) leaves the switch alone: it could otherwise turn collection back on
after Megatron's ``--manual-gc`` turned it off. A nested block, or one that finds collection off, changes
nothing."""
from __future__ import annotations

import gc
import threading
from contextlib import contextmanager

__all__ = ["paused_gc"]


@contextmanager
def paused_gc():
    if threading.current_thread() is not threading.main_thread() or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
