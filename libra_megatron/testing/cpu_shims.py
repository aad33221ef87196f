"""CPU shims for running megatron-core 0.16 models without CUDA (tests and the CPU end-to-end run only).

Never applied on the GPU path: every shim is a no-op when ``torch.cuda.is_available()``.
"""
from __future__ import annotations

import torch

__all__ = ["apply_megatron_cpu_shims"]

_APPLIED = {"current_device": False, "cp_pos_emb": False, "moe_gemm": False}

_ROPE_MODULES = (
    "megatron.core.models.common.embeddings.rope_utils",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
)


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def apply_megatron_cpu_shims() -> bool:
    """Shims for megatron-core 0.16.1 on CPU-only torch; idempotent; True when active (no CUDA).

    1. ``torch.cuda.current_device()`` returns the CPU device (called unconditionally by RoPE ``inv_freq``,
       ``GPTModel`` position ids, TP layers' device placement).
    2. ``get_pos_emb_on_this_cp_rank`` (CP RoPE slicing) without ``pin_memory``/``.cuda()``.
    3. ``moe_utils.te_general_gemm = None`` when Transformer Engine is absent (MoE router).
    """
    if torch.cuda.is_available():
        return False
    if not _APPLIED["current_device"]:
        torch.cuda.current_device = _cpu_current_device
        _APPLIED["current_device"] = True
    if not _APPLIED["cp_pos_emb"]:
        _patch_cp_pos_emb()
        _APPLIED["cp_pos_emb"] = True
    if not _APPLIED["moe_gemm"]:
        _define_missing_te_gemm()
        _APPLIED["moe_gemm"] = True
    return True


def _define_missing_te_gemm() -> None:
    """megatron-core 0.16's MoE router tests ``te_general_gemm is not None`` but only defines the name when
    Transformer Engine imports; bind it to None so the router takes its torch matmul path."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _cpu_pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    """megatron-core's ``get_pos_emb_on_this_cp_rank`` (zigzag: chunks c and 2*CP-1-c of 2*CP) without
    its ``pin_memory=True`` / ``.cuda()`` index tensor; same result on the positional table's device."""
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    cp_idx = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1:])
    pos_emb = pos_emb.index_select(seq_dim, cp_idx)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2:])


def _patch_cp_pos_emb() -> None:
    """Replace the CP RoPE slicer in every megatron-core module that imported it by name."""
    import importlib

    for name in _ROPE_MODULES:
        module = importlib.import_module(name)
        if hasattr(module, "get_pos_emb_on_this_cp_rank"):
            module.get_pos_emb_on_this_cp_rank = _cpu_pos_emb_on_this_cp_rank
