"""The K/V relay between nodes (issue 14; ``records`` module docstring, "Relay"), and every rank's Pipeliner lead.

``choose_relay`` prices the candidate relay sets of one plan on the Pipeliner timeline (``plan.model``) and keeps
the fastest; ``relay_runs`` cuts a KV run table into the hop-1 runs and the relay runs; ``leads`` picks every
rank's lead (``plan.model.best_lead``).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ..layout import HeadLayout
from ..model import best_lead, pipeline_seconds
from .records import frozen_int64
from .tables import UnitRuns, hosted_pair_heads, pair_units, peer_units
from .traffic import traffic_of_units

__all__ = ["RELAY_SENDER_CUTS", "relay_runs", "choose_relay", "leads"]

RELAY_SENDER_CUTS = (0.95, 0.99)  # relay candidates besides every home run (module docstring, "Relay")


def relay_runs(kv: UnitRuns, nodes: np.ndarray, senders: Optional[np.ndarray] = None):
    """(hop-1 KV runs, relay runs or None) (module docstring, "Relay"); ``senders`` (bool [W]): relay only the
    home runs of these workers (None: every worker's).

    KV runs of one home run (same src and src_start: same K/V class, same first row) fetched by several
    destinations on one node other than the source's keep only the longest (the relay R; lowest rank on ties)
    on the KV route; every other destination w gets a relay run R -> w of its own count, from R's arranged
    rows [tgt_R, +count_w) to its rows [tgt_w, +count_w). Relay runs come sorted by (dst, tgt)."""
    node = np.asarray(nodes, dtype=np.int64)
    cross = np.flatnonzero(node[kv.src] != node[kv.dst])
    if senders is not None:
        cross = cross[np.asarray(senders, dtype=bool)[kv.src[cross]]]
    if cross.size < 2:
        return kv, None
    src, start, dnode = kv.src[cross], kv.src_start[cross], node[kv.dst[cross]]
    order = cross[np.lexsort((kv.dst[cross], -kv.count[cross], dnode, start, src))]
    key = np.stack([kv.src[order], kv.src_start[order], node[kv.dst[order]]])
    first = np.ones(order.size, dtype=bool)
    first[1:] = (key[:, 1:] != key[:, :-1]).any(axis=0)
    if first.all():
        return kv, None
    lead = order[np.maximum.accumulate(np.where(first, np.arange(order.size), 0))]  # the relay's run
    moved = order[~first]
    relay_of = lead[~first]
    relay = UnitRuns(src=kv.dst[relay_of], dst=kv.dst[moved], src_start=kv.tgt_start[relay_of],
                      count=kv.count[moved], tgt_start=kv.tgt_start[moved])
    by_dst = np.lexsort((relay.tgt_start, relay.dst))
    keep = np.ones(kv.src.size, dtype=bool)
    keep[moved] = False
    return UnitRuns(*(x[keep] for x in kv.arrays())), UnitRuns(*(x[by_dst] for x in relay.arrays()))



def choose_relay(q_runs: UnitRuns, kv_runs: UnitRuns, q_len, kv_len, varlen, heads: HeadLayout, timing, peers,
                 hosted, relay_senders=None):
    """The plan's relay under ``timing`` (``timing.kv_relay``): (kv_runs, peers, hosted, lead, relay_units, relay
    runs), the direct plan's when no relay set prices the pool's slowest worker no slower. ``relay_senders``
    (bool [W], tests) relays exactly the home runs of these workers (no pricing)."""
    W = q_len.shape[0]
    lead, seconds = leads(peers, hosted, heads, timing)
    direct = (kv_runs, peers, hosted, lead, None, None)
    if not timing.kv_relay:
        return direct
    sets = [relay_senders] if relay_senders is not None else \
        [None] + _distinct([seconds >= cut * seconds.max() for cut in RELAY_SENDER_CUTS])
    best = None
    for senders in sets:
        hop1, runs = relay_runs(kv_runs, timing.nodes(W), senders)
        if runs is None:
            continue
        r_peers = frozen_int64(peer_units(q_runs, hop1, W))
        r_units = frozen_int64(pair_units(runs, W))
        r_hosted = hosted_pair_heads(q_runs, hop1, q_len, kv_len, varlen, heads, runs)
        r_lead, r_seconds = leads(r_peers, r_hosted, heads, timing, r_units)
        # relay unless the timeline prices the pool's slowest worker slower with it (ties relay: the
        # same step for fewer bytes between nodes); the fastest set wins, ties the earlier (more relayed)
        if relay_senders is None and (r_seconds.max() > seconds.max() * (1 + 1e-12) or
                                      (best is not None and r_seconds.max() >= best[0])):
            continue
        best = (r_seconds.max(), (hop1, r_peers, r_hosted, r_lead, r_units, runs))
    return direct if best is None else best[1]


def _distinct(masks: list) -> list:
    """``masks`` without the ones equal to an earlier one (the same relay set priced once)."""
    out = []
    for mask in masks:
        if not any(np.array_equal(mask, seen) for seen in out):
            out.append(mask)
    return out


def leads(peers, hosted, heads: HeadLayout, timing, relay_units=None):
    """(int64 [W] leads, float64 [W] every worker's seconds with them) under ``timing``: every rank's
    ``plan.model.best_lead`` from its local / remote loads and phase seconds; with a relay, also every relay
    sender at lead 0 (it issues its forwards before its local work, so its receivers start sooner), whichever
    prices the pool's slowest worker faster."""
    traffic = traffic_of_units(peers, heads, relay_units)
    nodes = timing.nodes(traffic.num_workers)
    dispatch, ret = traffic.phase_seconds(nodes, timing)
    local, remote = (timing.compute_seconds(x) for x in hosted)
    relay = traffic.relay_timing(nodes, timing)
    lead = best_lead(local, remote, dispatch, ret, relay)
    seconds = pipeline_seconds(local, remote, dispatch, ret, timing.local_first, lead, relay)[0]
    if relay is not None:
        early = np.where(np.asarray(relay_units).sum(axis=1) > 0, 0, lead)
        other = pipeline_seconds(local, remote, dispatch, ret, timing.local_first, early, relay)[0]
        if other.max() < seconds.max():
            lead, seconds = early, other
    return lead, seconds
