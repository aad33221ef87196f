"""Baselines without cross-group exchange: Ulysses and a WLB-LLM-style re-packing (§6.1).

Imports only ``libra_megatron.plan``. Units as in ``cost``: pair-heads (causal query-key pairs x query
heads, Eq. 6 summed over a sequence) and seconds per attention layer.

Ulysses. Each CP group runs one packed sequence; the head all-to-all gives every CP rank all L tokens
and hq/CP heads, so it balances perfectly inside the group: per-rank load = sequence pair-heads / CP.
Forward: all-to-alls bring Q, K, V into the head layout and take O back: a rank holds t = L/CP tokens and
keeps 1/CP of them, so it sends (and receives) (CP-1)/CP x t x (hq + 2 hkv) x d x e bytes in and
(CP-1)/CP x t x hq x d x e out. Backward (as Transformer Engine's a2a CP and DeepSpeed-Ulysses run it): dO comes
in the same way as Q (hq heads), the kernel's dQ, dK, dV go out as Q, K, V came in (hq + 2 hkv heads; at the
activation dtype e): the same bytes as the forward, (CP-1)/CP x t x (2 hq + 2 hkv) x d x e per rank and phase.
Q, K, V, O in the head layout are kept from the forward (FlashAttention saves them), so nothing else travels.
Nothing overlaps the all-to-alls. ``ulysses_layer_seconds`` prices both phases under the whole-layer model:
compute = one kernel call of pair-heads / CP (the backward by ``StepTimeModel.bwd_call_seconds``: 2.5 x the forward
FLOPs, FlashAttention's 5 matmuls with the recomputed QK^T vs 2, or a kernel fit's own) plus its launch
(``StepTimeModel.launch_seconds``: none under a kernel fit, whose call includes it); four all-to-all calls per
phase (Q, K, V / O forward; dO / dQ, dK, dV backward, one tensor each), each paying ``collective_us`` plus, per
link class, bytes / bandwidth + peers x the message latency. ``ulysses_worker_seconds`` is the earlier
forward-only figure (no latencies), kept for the ``forward_*`` keys.

WLB-LLM, as the Libra paper reproduced it (no outlier deferral): the documents (segments) of one GBS
window are re-packed into DP*GA = GBS variable-token sequences, heaviest first, each into the sequence
with the least sum l^2 that still has room under a token cap (``cap_factor * L``; when no sequence has
room, the one with the fewest tokens). Outliers stay indivisible. Ulysses runs inside each CP group.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import numpy as np

from ..plan.model import GB, US, StepTimeModel

__all__ = ["sequence_pair_heads", "ulysses_worker_seconds", "ulysses_layer_seconds", "ulysses_comm_bytes",
           "ulysses_call_seconds", "wlb_repack"]


def sequence_pair_heads(segments: Sequence[np.ndarray], num_q_heads: int) -> np.ndarray:
    """Eq. 6 over whole sequences: hq * sum_j l_j (l_j + 1) / 2 per sequence. float64 (n,)."""
    out = np.empty(len(segments), dtype=np.float64)
    for i, seg in enumerate(segments):
        seg = np.asarray(seg, dtype=np.float64)
        out[i] = float(np.dot(seg, seg + 1.0)) / 2.0 * num_q_heads
    return out


def ulysses_comm_bytes(tokens, cp: int, hq: int, hkv: int, head_dim: int, elem_bytes: int,
                       gpus_per_node: int) -> Tuple[np.ndarray, np.ndarray]:
    """Per-rank (intra, inter) bytes of Ulysses' all-to-alls for sequences of ``tokens`` tokens.

    A rank holds tokens/CP tokens and sends (CP-1)/CP of their Q, K, V and of the O it computed:
    (2*hq + 2*hkv) * d * elem bytes per token. Sent == received. Of its CP-1 peers, min(CP, gpn)-1
    share its node (CP groups are node-aligned when CP <= gpus_per_node).
    """
    tokens = np.asarray(tokens, dtype=np.float64)
    if cp == 1:
        zero = np.zeros_like(tokens)
        return zero, zero
    per_token = (2 * hq + 2 * hkv) * head_dim * elem_bytes
    total = tokens / cp * per_token * (cp - 1) / cp
    intra_share = (min(cp, gpus_per_node) - 1) / (cp - 1)
    return total * intra_share, total * (1.0 - intra_share)


def ulysses_worker_seconds(pair_heads, tokens, cp: int, heads: Tuple[int, int, int], cost: StepTimeModel):
    """Per-sequence (= per CP rank of its group) seconds: compute of load/CP plus the un-overlapped all-to-all.

    ``heads`` = (hq, hkv, elem_bytes). Returns float64 (n,).
    """
    hq, hkv, elem_bytes = heads
    compute = cost.call_seconds(np.asarray(pair_heads, dtype=np.float64) / cp, tokens, max(hq // cp, 1))
    intra, inter = ulysses_comm_bytes(tokens, cp, hq, hkv, cost.head_dim, elem_bytes, cost.gpus_per_node)
    return compute + cost.comm_seconds(intra, inter)


def ulysses_call_seconds(tokens, cp: int, heads_moved: int, elem_bytes: int, cost: StepTimeModel) -> np.ndarray:
    """Seconds of one all-to-all moving ``heads_moved`` heads of every token of a rank's L/CP (CP-1)/CP share:
    ``collective_us`` + max over link classes of (bytes / bandwidth + peers of the class x message latency)."""
    tokens = np.asarray(tokens, dtype=np.float64)
    if cp == 1:
        return np.zeros_like(tokens)
    total = tokens / cp * heads_moved * cost.head_dim * elem_bytes * (cp - 1) / cp
    intra_peers = min(cp, cost.gpus_per_node) - 1
    inter_peers = cp - 1 - intra_peers
    share = intra_peers / (cp - 1)
    intra = total * share / (cost.intra_node_gbps * GB) + intra_peers * cost.intra_message_us * US
    inter = np.where(inter_peers > 0, total * (1.0 - share) / (cost.inter_node_gbps * GB)
                     + inter_peers * cost.inter_message_us * US, 0.0)
    return cost.collective_us * US + np.maximum(intra, inter)


def ulysses_layer_seconds(pair_heads, tokens, cp: int, heads: Tuple[int, int, int],
                          cost: StepTimeModel) -> Tuple[np.ndarray, np.ndarray]:
    """Per-sequence (= per CP rank of its group) (forward, backward) seconds under the whole-layer model (module
    docstring): compute of load/CP plus the un-overlapped all-to-alls. ``heads`` = (hq, hkv, elem_bytes)."""
    hq, hkv, elem_bytes = heads
    compute = cost.call_seconds(np.asarray(pair_heads, dtype=np.float64) / cp, tokens, max(hq // cp, 1))
    busy = np.asarray(pair_heads) > 0  # a launch per call on top (none under a kernel fit: its call includes it)
    launch, launch_b = (np.where(busy, cost.launch_seconds(d), 0.0) for d in ("fwd", "bwd"))
    calls = [ulysses_call_seconds(tokens, cp, h, elem_bytes, cost) for h in (hq, hkv, hkv, hq)]  # Q K V | O
    comm = np.sum(calls, axis=0)  # backward: dO | dQ dK dV, the same four sizes
    backward = cost.bwd_call_seconds(np.asarray(pair_heads, dtype=np.float64) / cp, tokens, max(hq // cp, 1))
    return compute + launch + comm, backward + launch_b + comm


def wlb_repack(segments: Sequence[np.ndarray], num_sequences: int, cap_tokens: float) -> List[np.ndarray]:
    """Re-pack all segments into ``num_sequences`` variable-token sequences (module docstring).

    Returns per-sequence segment arrays; the multiset of segments is preserved exactly.
    """
    items = np.sort(np.concatenate([np.asarray(s, dtype=np.int64) for s in segments]))[::-1]
    load = np.zeros(num_sequences, dtype=np.float64)
    tokens = np.zeros(num_sequences, dtype=np.int64)
    members: List[List[int]] = [[] for _ in range(num_sequences)]
    for length in items.tolist():
        room = tokens + length <= cap_tokens
        if room.any():
            k = int(np.argmin(np.where(room, load, np.inf)))
        else:
            k = int(np.argmin(tokens))
        members[k].append(length)
        load[k] += float(length) * length
        tokens[k] += length
    return [np.asarray(m, dtype=np.int64) for m in members]
