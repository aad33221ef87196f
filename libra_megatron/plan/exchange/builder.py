"""``build_exchange_plan``: the routes, varlen entries and byte totals that execute a tile assignment.

The records it makes and their schema are in ``records``; the pool-wide run tables in ``tables``; the relay
choice and the ranks' leads in ``relay``.
"""
from __future__ import annotations

import numpy as np

from ..errors import PlanError
from .kv_refs import home_runs_in_prefix
from .records import ExchangePlan, expand_runs, frozen_int64
from .arranged_order import group_entries_by_kind
from .relay import choose_relay
from .tables import LazyRankPlans, PlanTables, RunIndex, UnitRuns, Varlen, bytes_sent, fingerprint, hosted_pair_heads, \
    peer_units, pool_kinds, segment_starts

__all__ = ["build_exchange_plan"]


def _hosted_order(tiles, assignment: np.ndarray) -> np.ndarray:
    """Tile ids sorted by (destination, head shard, block) -- the hosted order of every destination."""
    t = np.arange(tiles.num_tiles, dtype=np.int64)
    return np.lexsort((t // tiles.head_split, t % tiles.head_split, assignment)).astype(np.int64)


def _q_runs(tiles, assignment: np.ndarray, order: np.ndarray):
    """One Q run per tile, in hosted order; returns (runs, q_target_len per destination)."""
    H, W = tiles.head_split, tiles.num_workers
    block, head = order // H, order % H
    count = tiles.block_end[block] - tiles.block_start[block]
    dst = assignment[order]
    tgt = segment_starts(dst, count, W)
    runs = UnitRuns(
        src=tiles.block_home[block], dst=dst, src_start=tiles.block_local_start[block] * H + head,
        count=count, tgt_start=tgt,
    )
    return runs, np.bincount(dst, weights=count, minlength=W).astype(np.int64)


def _fragment_entries(tiles, order: np.ndarray):
    """Expand hosted tiles into (tile, doc fragment) entries, in hosted order.

    Returns int64 arrays: entry_tile (index into ``order``), head, doc, a, e (doc-local query rows
    [a, e)), row_in_block (first query row of the fragment inside its tile), kv_end (key rows it needs).
    """
    H = tiles.head_split
    block = order // H
    nfrag = tiles.frag_ptr[block + 1] - tiles.frag_ptr[block]
    frag = expand_runs(tiles.frag_ptr[block], nfrag, 1)
    entry_tile = np.repeat(np.arange(order.size, dtype=np.int64), nfrag)
    doc = tiles.frag_doc[frag]
    a, e = tiles.frag_q_start[frag], tiles.frag_q_end[frag]
    row_in_block = tiles.doc_start[doc] + a - tiles.block_start[block[entry_tile]]
    return dict(
        entry_tile=entry_tile, head=order[entry_tile] % H, doc=doc, a=a, e=e, row_in_block=row_in_block,
        kv_end=tiles.frag_kv_end[frag],
    )


def _home_local_starts(tiles) -> np.ndarray:
    """Per doc-home run: the local token index of its first row at its worker."""
    layout = tiles.layout
    bounds = layout.boundaries()
    chunk_local = np.array([c.local_start for c in layout.cp_chunks()], dtype=np.int64)
    owner = np.repeat(np.arange(tiles.num_docs, dtype=np.int64), np.diff(tiles.doc_home_ptr))
    gstart = tiles.doc_start[owner] + tiles.doc_home_offset
    chunk = np.searchsorted(bounds, gstart, side="right") - 1
    return chunk_local[chunk] + gstart - bounds[chunk]


def _kv_and_varlen(tiles, assignment: np.ndarray, order: np.ndarray, q_tgt: np.ndarray):
    """KV runs (deduplicated per (group, destination), rows [0, largest kv_end of the destination's tiles)),
    KV target lengths per destination, merged varlen entries, and the referenced pairs as int64
    [5, n_pairs] rows (dst, KV class, doc, arranged KV offset, prefix length), sorted by (dst, class, doc)."""
    H, G, W, S = tiles.head_split, tiles.num_kv_classes, tiles.num_workers, tiles.num_docs
    ent = _fragment_entries(tiles, order)
    it = ent["entry_tile"]
    dst = assignment[order][it]
    doc, head = ent["doc"], ent["head"]
    klass = tiles.heads.kv_class_of_shard()[head]
    group_key = (dst * G + klass) * S + doc  # shards of one KV class share the group (H > hkv)
    perm = np.argsort(group_key, kind="stable")
    sorted_key = group_key[perm]
    new_pair = np.ones(sorted_key.size, dtype=bool)
    new_pair[1:] = sorted_key[1:] != sorted_key[:-1]
    first = perm[new_pair]
    pair_dst, pair_class, pair_doc = dst[first], klass[first], doc[first]
    pair_len = np.maximum.reduceat(ent["kv_end"][perm], np.flatnonzero(new_pair)) if perm.size else perm
    pair_off = segment_starts(pair_dst, pair_len, W)
    entry_pair = np.empty(perm.size, dtype=np.int64)
    entry_pair[perm] = np.cumsum(new_pair) - 1
    key = (dst * H + head) * S + doc  # non-decreasing in hosted order
    varlen = _merge_entries(dst, key, ent["a"], ent["e"], q_tgt[it] + ent["row_in_block"], pair_off[entry_pair], W)
    kv = _kv_runs(tiles, pair_dst, pair_class, pair_doc, pair_off, pair_len)
    kv_len = np.bincount(pair_dst, weights=pair_len, minlength=W).astype(np.int64)
    pairs = np.stack([pair_dst, pair_class, pair_doc, pair_off, pair_len])
    return kv, kv_len, varlen, pairs


def _merge_entries(dst, key, a, e, q_start, kv_off, num_workers: int) -> Varlen:
    """Merge consecutive entries of one (destination, head, doc) whose query rows continue (e == next a)."""
    start = np.ones(key.size, dtype=bool)
    start[1:] = (key[1:] != key[:-1]) | (e[:-1] != a[1:])
    idx = np.flatnonzero(start)
    last = np.concatenate([idx[1:], [key.size]]) - 1
    m_dst = dst[idx]
    q_len = (q_start[last] + (e[last] - a[last])) - q_start[idx]
    dst_ptr = np.searchsorted(m_dst, np.arange(num_workers + 1), side="left").astype(np.int64)
    return Varlen(dst_ptr=dst_ptr, q_start=q_start[idx], q_len=q_len, kv_offset=kv_off[idx], k_len=e[last])


def _kv_runs(tiles, pair_dst, pair_class, pair_doc, pair_off, pair_len) -> UnitRuns:
    """Expand every referenced (group, destination) pair into the doc's home runs clipped to its prefix
    (KV units: local token * G + class, so a KV run's stride is G)."""
    G = tiles.num_kv_classes
    pair, home, count = home_runs_in_prefix(tiles, pair_doc, pair_len)
    return UnitRuns(
        src=tiles.doc_home_worker[home], dst=pair_dst[pair],
        src_start=_home_local_starts(tiles)[home] * G + pair_class[pair],
        count=count, tgt_start=pair_off[pair] + tiles.doc_home_offset[home],
    )


def _check_assignment(tiles, assignment) -> np.ndarray:
    assignment = np.asarray(assignment).reshape(-1)
    if assignment.shape[0] != tiles.num_tiles:
        raise PlanError(f"assignment has {assignment.shape[0]} entries, expected one per tile ({tiles.num_tiles})")
    if not np.issubdtype(assignment.dtype, np.integer):
        raise PlanError(f"assignment must be integer worker ids, got dtype {assignment.dtype}")
    bad = np.flatnonzero((assignment < 0) | (assignment >= tiles.num_workers))
    if bad.size:
        t = int(bad[0])
        raise PlanError(
            f"tile {t}: destination {int(assignment[t])} is outside the pool of {tiles.num_workers} workers"
        )
    return frozen_int64(assignment)


def build_exchange_plan(tiles, assignment: np.ndarray, timing=None, relay_stripe=None) -> ExchangePlan:
    """Turn a tile assignment (``assignment[t]`` = destination worker of tile t) into an ExchangePlan.

    Per destination, hosted tiles are ordered by (h, sequence, block start); the arranged Q buffer is
    their query units in that order, then regrouped by entry kind: remote, split, local entries, each group in
    that order (``arranged_order``: every entry set of the local-first split is one slice). Every referenced KV
    group g=(doc, h) (Eq. 7) is fetched once per destination, rows [0, p) in doc-position order with p the largest
    ``tiles.frag_kv_end`` of its tiles there (the whole doc under KvFetch.GROUP, the causal prefix under PREFIX),
    groups ordered by (h, doc).
    Varlen entries are (tile, doc fragment) pairs, consecutive entries of one group with continuing rows
    merged; an entry's keys are the first e rows of its group (bottom-right causal alignment).
    Byte totals follow Eq. 8: remote KV units * V_g/token + migrated tile tokens * (V_Q + V_O)/token.
    ``timing`` (a ``plan.model.StepTimeModel``): every rank's Pipeliner lead is chosen under it
    (``plan.model.best_lead``; it orders local and remote kernel calls, never a collective); with
    ``timing.kv_relay`` the K/V of other nodes is relayed over ``timing.nodes`` (module docstring, "Relay"), in the
    striped layout with stripes of at least ``relay_stripe`` KV units when it is given (``relay.relay_runs``).
    Cost: O(tiles + fragments + referenced groups * homes) here; O(the rank's runs) per RankPlan on access.
    """
    return _build_exchange_plan(tiles, assignment, timing, relay_stripe=relay_stripe)


def _build_exchange_plan(tiles, assignment: np.ndarray, timing=None, relay_senders=None,
                         relay_stripe=None, group_by_kind: bool = True) -> ExchangePlan:
    """``build_exchange_plan``; ``relay_senders`` (bool [W], tests) relays exactly the home runs of these
    workers whenever ``timing.kv_relay`` (no pricing); ``group_by_kind=False`` (tests) keeps the hosted order, so
    entry sets interleave (the runtime's gather / scatter path for sets that are not one slice)."""
    assignment = _check_assignment(tiles, assignment)
    W, heads = tiles.num_workers, tiles.heads
    order = _hosted_order(tiles, assignment)
    q_runs, q_len = _q_runs(tiles, assignment, order)
    kv_runs, kv_len, varlen, pairs = _kv_and_varlen(tiles, assignment, order, q_runs.tgt_start)
    peers = frozen_int64(peer_units(q_runs, kv_runs, W))
    hosted = hosted_pair_heads(q_runs, kv_runs, q_len, kv_len, varlen, heads)
    relay = relay_units = lead = None
    if timing is not None:
        kv_runs, peers, hosted, lead, relay_units, relay = choose_relay(q_runs, kv_runs, q_len, kv_len, varlen, heads,
                                                                        timing, peers, hosted, relay_senders,
                                                                        relay_stripe)
        lead = frozen_int64(lead)
    if group_by_kind:
        kinds, _ = pool_kinds(q_runs, kv_runs, q_len, kv_len, varlen, relay)
        q_runs, varlen = group_entries_by_kind(q_runs, varlen, kinds, q_len, heads.head_split)
    sent = bytes_sent(q_runs, kv_runs, heads, W, relay)
    fp = fingerprint(tiles, assignment, q_runs, pairs, varlen, relay)
    tables = PlanTables(
        heads=heads, local_tokens=tiles.layout.local_len, q=RunIndex(q_runs, W), kv=RunIndex(kv_runs, W),
        q_len=q_len, kv_len=kv_len, varlen=varlen, bytes_sent=sent, fingerprint=fp, local_lead=lead,
        relay=None if relay is None else RunIndex(relay, W),
    )
    totals = sent.sum(axis=0)
    return ExchangePlan(
        ranks=LazyRankPlans(tables), assignment=assignment, fingerprint=fp,
        bytes_q=int(totals[0]), bytes_kv=int(totals[1]), bytes_o=int(totals[2]),
        arranged_q_units=frozen_int64(q_len), arranged_kv_units=frozen_int64(kv_len),
        peer_units=peers, hosted_pair_heads=hosted, local_lead=lead, relay_units=relay_units,
    )
