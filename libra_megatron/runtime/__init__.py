"""Torch runtime: the Libra attention operator, the Ulysses baseline and the kernel backends.

Imports torch (never megatron). Process groups and devices arrive as arguments.
"""
from .kernels import VarlenBatch, resolve_backend, varlen_attn_func, varlen_bwd, varlen_fwd
from .libra_attn import SaveMode, libra_attn_func
from .routes import ExchangeStats, set_table_cache_size
from .ulysses import ulysses_attn_func

__all__ = ["libra_attn_func", "ulysses_attn_func", "SaveMode", "ExchangeStats", "VarlenBatch", "varlen_fwd",
           "varlen_bwd", "varlen_attn_func", "resolve_backend", "set_table_cache_size"]
