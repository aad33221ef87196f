"""Pre-collective safety check: every rank verifies its plan against its tensors, then all ranks agree.

Shape legend: t = local tokens, hq/hkv = query/kv heads, d = head dim; q (t, hq, d), k/v (t, hkv, d).

Never hang: every rank *always* joins exactly one small ``all_gather`` of int64 [1 + FP_WORDS] carrying
(local mismatch bitmask, plan fingerprint hash). Then every rank sees the same table and raises the same
``PlanError`` naming the offending ranks, or all proceed. A rank that skipped the gather would deadlock
the others, so the gather itself is never cached; only the fingerprint hash is (per plan object).
"""
from __future__ import annotations

import hashlib
import weakref
from typing import List

import torch
import torch.distributed as dist

from ..plan.errors import PlanError

__all__ = ["check_plan_consistency", "local_mismatches"]

FP_WORDS = 2  # 128-bit fingerprint hash as two int64
_MISMATCH = {
    1: "local token count != plan.local_tokens",
    2: "query heads / kv heads != plan.heads",
    4: "head dim != plan.heads.head_dim",
    8: "group size != plan.num_workers",
    16: "rank in group != plan.rank",
    32: "q/k/v dtypes or devices differ",
    64: "k and v shapes differ",
}
_FP_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _fingerprint_words(plan) -> List[int]:
    """Cached 128-bit hash of ``plan.fingerprint`` as FP_WORDS signed int64 values."""
    words = _FP_CACHE.get(plan)
    if words is None:
        digest = hashlib.blake2b(str(plan.fingerprint).encode(), digest_size=8 * FP_WORDS).digest()
        words = [int.from_bytes(digest[8 * i : 8 * i + 8], "little", signed=True) for i in range(FP_WORDS)]
        _FP_CACHE[plan] = words
    return words


def local_mismatches(q, k, v, plan, group) -> int:
    """Bitmask of ``_MISMATCH`` codes for this rank's tensors (thd views) against its RankPlan."""
    heads, code = plan.heads, 0
    if q.shape[0] != plan.local_tokens or k.shape[0] != plan.local_tokens:
        code |= 1
    if q.shape[1] != heads.num_q_heads or k.shape[1] != heads.num_kv_heads:
        code |= 2
    if q.shape[2] != heads.head_dim or k.shape[2] != heads.head_dim:
        code |= 4
    if dist.get_world_size(group) != plan.num_workers:
        code |= 8
    if dist.get_rank(group) != plan.rank:
        code |= 16
    if len({(x.dtype, x.device) for x in (q, k, v)}) != 1:
        code |= 32
    if k.shape != v.shape:
        code |= 64
    return code


def _describe(code: int) -> str:
    return "; ".join(msg for bit, msg in _MISMATCH.items() if code & bit)


def check_plan_consistency(q, k, v, plan, group) -> None:
    """Raise ``PlanError`` on every rank if any rank's plan does not fit its tensors or fingerprints differ.

    Cost: one all_gather of (1 + FP_WORDS) int64 per rank. The tensor lives on q's device (NCCL needs CUDA).
    """
    code = local_mismatches(q, k, v, plan, group)
    mine = torch.tensor([code] + _fingerprint_words(plan), dtype=torch.int64, device=q.device)
    table = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(table, mine, group=group)
    rows = [t.tolist() for t in table]
    problems = [f"rank {r}: {_describe(row[0])}" for r, row in enumerate(rows) if row[0]]
    fingerprints = {}
    for r, row in enumerate(rows):
        fingerprints.setdefault(tuple(row[1:]), []).append(r)
    if len(fingerprints) > 1:
        groups = sorted(fingerprints.values(), key=len, reverse=True)
        minority = [r for g in groups[1:] for r in g]
        names = ", ".join(f"rank {r}" for r in minority)
        problems.append(f"plan fingerprints differ: ranks {groups[0]} agree, {names} hold(s) a different (stale?) plan")
    if problems:
        raise PlanError(f"libra_attn_func: plan mismatch ({len(problems)} problem(s)): " + " | ".join(problems)
                        + f" (seen from rank {dist.get_rank(group)})")
