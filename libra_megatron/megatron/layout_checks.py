"""Which Megatron-LM runs Libra supports: one rule per unsupported option (each returns the reason, None when
fine), ``check_supported_layout`` over all of them, ``validate_run`` (the rules plus the Libra config against
the model), and the carrier format megatron-core's RoPE needs (``carrier_format``; ``hooks`` has the carrier)."""
from __future__ import annotations

import argparse
from typing import Optional

from ..config import LibraConfig, TokenLayoutKind

__all__ = ["check_supported_layout", "validate_run", "carrier_format"]


def _attention_dropout(args: argparse.Namespace) -> Optional[str]:
    p = float(getattr(args, "attention_dropout", 0.0) or 0.0)
    if p > 0:
        return (f"--attention-dropout {p:g}: Libra's attention runs without dropout (Megatron-LM's default "
                f"is 0.1 when the flag is not given); pass --attention-dropout 0")
    return None


def _dataloader(args: argparse.Namespace) -> Optional[str]:
    loader = getattr(args, "dataloader_type", None) or "single"  # validate_args' default
    if loader not in ("single", "cyclic"):
        return (f"--dataloader-type {loader}: Libra replaces Megatron's 'single'/'cyclic' samplers with its "
                f"VRSP global-batch sampler; an '{loader}' loader bypasses it")
    return None


def _hybrid_cp(args: argparse.Namespace) -> Optional[str]:
    """Megatron's own CP re-balancing (core_v0.16/0.19: --hybrid-context-parallel; renamed
    --dynamic-context-parallel on the development line) regroups sequences over DP x CP ranks itself."""
    for dest in ("hybrid_context_parallel", "dynamic_context_parallel"):
        if getattr(args, dest, False):
            return (f"--{dest.replace('_', '-')} cannot be combined with Libra sequence pools (VRSP and TAP "
                    f"balance the DP x CP ranks themselves)")
    return None


def _inter_document_masking(args: argparse.Namespace) -> Optional[str]:
    """core_v0.19's GPTDataset emits its own cu_seqlens (and pads documents for its CP split) with this flag;
    Libra's sampler and get_batch already give per-document attention from the packed segments."""
    if getattr(args, "dataloader_inter_document_masking", False):
        return ("--dataloader-inter-document-masking: Libra computes per-document attention itself (cu_seqlens "
                "from its sampler's segments); drop the flag")
    return None


def _local_attention_backend(args: argparse.Namespace) -> Optional[str]:
    """core_v0.19's GPT model builder replaces the layer spec's core attention with megatron-core's
    DotProductAttention when --attention-backend is local, which would silently drop LibraCoreAttention."""
    backend = getattr(args, "attention_backend", None)
    if backend is not None and getattr(backend, "name", str(backend)).split(".")[-1] == "local":
        return ("--attention-backend local: Megatron-LM core_v0.19 then replaces the spec's core attention "
                "(LibraCoreAttention) with its own DotProductAttention; leave --attention-backend at auto")
    return None


def _mla(args: argparse.Namespace) -> Optional[str]:
    if getattr(args, "multi_latent_attention", False):
        return ("--multi-latent-attention: Libra's core attention implements multi-head/grouped-query "
                "attention (one head dim for q, k and v), not MLA")
    return None


def _overlap_moe_ep_comm(args: argparse.Namespace) -> Optional[str]:
    if getattr(args, "overlap_moe_expert_parallel_comm", False):
        return ("--overlap-moe-expert-parallel-comm: Megatron-LM's forward_step for it (build_schedule_plan) "
                "passes no packed_seq_params, so Libra's document boundaries and plan cannot reach attention; "
                "drop the flag")
    return None


def _reset_position_ids_with_cp(args: argparse.Namespace) -> Optional[str]:
    """--reset-position-ids selects the THD carrier, whose RoPE megatron-core 0.16 splits per document
    under its own CP layout, not Libra's token layout: exact only at CP = 1 (see _check_rope_layout)."""
    cp = int(getattr(args, "context_parallel_size", 1) or 1)
    if cp > 1 and getattr(args, "reset_position_ids", False):
        return (f"--reset-position-ids with --context-parallel-size {cp}: megatron-core 0.16 applies "
                f"per-document (THD) RoPE under its own per-document CP split, not Libra's token layout; drop "
                f"--reset-position-ids (positions then run over the packed sequence) or use CP=1")
    return None


def _libra_spec(args: argparse.Namespace) -> Optional[str]:
    if getattr(args, "spec", None) is None:
        return ("--spec is not given: Megatron-LM's default layer spec has no Libra attention; pass "
                "--spec libra_megatron.megatron.spec libra_gpt_spec (each layer built from the run's flags; or "
                "libra_te_spec, libra_local_spec, libra_local_qk_spec, libra_local_moe_spec)")
    return None


_LAYOUT_RULES = (_attention_dropout, _dataloader, _hybrid_cp, _inter_document_masking,
                 _local_attention_backend, _mla, _overlap_moe_ep_comm, _reset_position_ids_with_cp, _libra_spec)
"""Megatron settings the Libra path cannot run with; each returns the error (naming the flag) or None."""


def check_supported_layout(args: argparse.Namespace, config: Optional[LibraConfig] = None) -> None:
    """Reject Megatron settings the Libra path does not implement, naming the flag (ValueError).

    Works on Megatron's parsed args before or after ``validate_args`` (the launcher calls it before
    distributed init, ``on_model_parallel_ready`` again on the validated args). Micro-batch size and the
    --libra-* arithmetic are ``LibraConfig.validate``'s (see ``validate_run``).
    """
    for rule in _LAYOUT_RULES:
        problem = rule(args)
        if problem:
            raise ValueError(problem)
    if config is not None:
        _check_rope_layout(args, config)


def validate_run(args: argparse.Namespace) -> LibraConfig:
    """Every start-up check of a Libra run on Megatron's args: layout rules, the effective LibraConfig
    (YAML < flags < ablations, validated against heads/DP/CP/L/mbs/GBS), and the RoPE/token layout."""
    from .args import libra_config_from_args

    check_supported_layout(args)
    config = libra_config_from_args(args)
    check_supported_layout(args, config)
    return config


def _check_rope_layout(args: argparse.Namespace, config: LibraConfig) -> None:
    """RoPE is applied by megatron-core before core attention; only two position schemes match Libra's layout.

    --reset-position-ids (positions restart in every document) needs the THD carrier: CP = 1 only (a layout
    rule above). Without it (Megatron's default: positions run over the whole packed sequence) the sbhd
    carrier is used and megatron-core slices the positions zigzag (2*CP chunks), which is Libra's layout
    only when zigzag.
    """
    cp = int(getattr(args, "context_parallel_size", 1) or 1)
    if cp > 1 and config.token_layout is not TokenLayoutKind.ZIGZAG:
        raise ValueError(
            f"--libra-token-layout {config.token_layout.value} with --context-parallel-size {cp}: megatron-core "
            f"slices RoPE positions zigzag (2*CP chunks); use --libra-token-layout zigzag"
        )


def carrier_format(args: argparse.Namespace) -> str:
    """qkv_format of the batch's LibraPackedSeqParams: 'thd' iff --reset-position-ids (see _check_rope_layout)."""
    return "thd" if getattr(args, "reset_position_ids", False) else "sbhd"
