"""runtime.routes: run tables expanded by torch give exactly the unit-based row tables, without a host read."""
import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from libra_megatron.plan.exchange import RowRuns, build_exchange_plan, build_rank_tables
from libra_megatron.runtime import routes
from libra_megatron.testing.unit_tables import unit_tables

from plan.test_exchange import SETTINGS, pools  # tests/ is the rootdir: its packages import by name
from plan.test_rank_tables import HEADS, _plan, assert_tables_equal_unit_tables
from .cases import CallCounter


def _device_arrays(dev):
    """The device tables in the shape of ``RankTables``: per-chunk send rows, arranged rows, k_gather, cu."""
    first = dev.chunks[0]
    return dict(q_send=[c.q_fwd.send_rows for c in dev.chunks], kv_send=[c.kv_fwd.send_rows for c in dev.chunks],
                q_arranged=first.q_fwd.recv_rows, kv_arranged=first.kv_fwd.recv_rows, k_gather=dev.k_gather,
                cu_q=dev.batch.cu_q, cu_k=dev.batch.cu_k)


def assert_device_tables_equal_unit_tables(rp):
    tables = build_rank_tables(rp)
    dev = routes.upload_tables(tables, "cpu")
    got, ref = _device_arrays(dev), unit_tables(rp)
    for name in ("q_send", "kv_send"):
        for m, (g, want) in enumerate(zip(got[name], getattr(ref, name))):
            assert g.dtype == torch.int32, (name, m, g.dtype)
            np.testing.assert_array_equal(g.numpy(), want, err_msg=f"{name}[{m}] rank {rp.rank}")
    for name in ("q_arranged", "kv_arranged", "k_gather", "cu_q", "cu_k"):
        assert got[name].dtype == torch.int32, name
        np.testing.assert_array_equal(got[name].numpy(), getattr(ref, name), err_msg=f"{name} rank {rp.rank}")
    for c in dev.chunks:  # inverse routes read the forward tables swapped
        assert c.q_inv.send_rows is c.q_fwd.recv_rows and c.q_inv.recv_rows is c.q_fwd.send_rows
        assert c.kv_inv.send_rows is c.kv_fwd.recv_rows and c.kv_inv.recv_rows is c.kv_fwd.send_rows
    kv_ids = {id(c.kv_fwd.send_rows) for c in dev.chunks}
    assert len(kv_ids) == len({id(r) for r in tables.kv_send})  # chunks sharing a kv piece share the tensor
    assert dev.nbytes == tables.nbytes() == sum(t.numel() * 4 for t in _distinct(dev))
    for c in dev.chunks:  # forward routes that fill their target place by a gather through the inverse
        for route, arranged in ((c.q_fwd, "q_arranged"), (c.kv_fwd, "kv_arranged")):
            if route.recv_inverse is not None:
                rows = getattr(ref, arranged)
                np.testing.assert_array_equal(route.recv_inverse.numpy()[rows], np.arange(len(rows)))
    assert (dev.chunks[0].kv_fwd.recv_inverse is None) == (dev.relay is not None)
    M = len(dev.chunks)
    for m, c in enumerate(dev.chunks):  # O / dQ returns: received rows gathered into local unit order
        units = getattr(ref, "q_send")[m][c.q_inv.recv_inverse.numpy()]
        np.testing.assert_array_equal(units // M, np.arange(units.size))
        assert (units % M == m).all()
    _assert_first_and_repeats(dev, ref.k_gather, tables)
    if dev.local is not None:  # the local set's rows, read in the send buffers' self segments
        for name, rows, arranged, splits, self_rows in (
                ("q", tables.local.q_rows, ref.q_arranged, tables.q_splits, dev.local.q_self),
                ("kv", tables.local.k_gather, ref.kv_arranged, tables.kv_splits, dev.local.k_self)):
            if self_rows is None:
                assert name == "kv" and dev.relay is not None  # a relay fills part of the arranged K|V
                continue
            received = self_rows.numpy() - splits.self_send_offset + splits.self_recv_offset
            assert ((received >= splits.self_recv_offset) & (received < splits.self_recv_offset + splits.self_rows)).all()
            np.testing.assert_array_equal(arranged[received], rows.expand(), err_msg=f"{name} rank {rp.rank}")
    assert (dev.local is None) == (dev.remote is None) == (tables.local is None)
    assert (dev.heads is None) == (tables.heads is None)
    for part, host in ((dev.local, tables.local), (dev.remote, tables.remote), (dev.heads, tables.heads)):
        if part is not None:  # the local-first entry sets went up unchanged
            for name in ("q_rows", "k_gather"):
                np.testing.assert_array_equal(getattr(part, name).numpy(), getattr(host, name).expand())
            np.testing.assert_array_equal(part.batch.cu_q.numpy(), host.cu_q)
            np.testing.assert_array_equal(part.batch.cu_k.numpy(), host.cu_k)


def _assert_first_and_repeats(dev, k_gather: np.ndarray, tables) -> None:
    """Every arranged KV row's first packed row, then the others in order (None when a row is no entry's key)."""
    covered = np.array_equal(np.unique(k_gather), np.arange(tables.kv_target_len))
    assert tables.kv_rows_read == covered
    if not covered:
        assert dev.k_first is None and dev.k_repeat is None and dev.k_repeat_rows is None
        return
    first = np.array([np.flatnonzero(k_gather == r)[0] for r in range(tables.kv_target_len)], dtype=np.int64)
    np.testing.assert_array_equal(dev.k_first.numpy(), first)
    np.testing.assert_array_equal(dev.k_repeat.numpy(), np.setdiff1d(np.arange(k_gather.size), first))
    np.testing.assert_array_equal(dev.k_repeat_rows.numpy(), k_gather[dev.k_repeat.numpy()])


def _distinct(dev):
    arrays = [t for c in dev.chunks for t in (c.q_fwd.send_rows, c.kv_fwd.send_rows, c.q_fwd.recv_rows,
                                              c.kv_fwd.recv_rows)] + [dev.k_gather, dev.batch.cu_q, dev.batch.cu_k]
    arrays += [t for c in dev.chunks for t in (c.q_fwd.recv_inverse, c.kv_fwd.recv_inverse, c.q_inv.recv_inverse)
               if t is not None]
    arrays += [t for t in (dev.k_first, dev.k_repeat, dev.k_repeat_rows) if t is not None]
    arrays += [t for t in ((dev.local.q_self, dev.local.k_self) if dev.local is not None else ()) if t is not None]
    arrays += [t for part in (dev.local, dev.remote, dev.heads) if part is not None
               for t in (part.q_rows, part.k_gather, part.batch.cu_q, part.batch.cu_k)]
    return list({id(t): t for t in arrays}.values())


@given(pools())
@settings(**dict(SETTINGS, max_examples=80))
def test_device_tables_equal_unit_tables_across_layouts_tilings_fetch_modes_and_heads(pool):
    """contiguous/zigzag, CP/P/H/M in {1,2,4}, GQA 1/4/8 incl. H > hkv, uniform/adaptive, group/prefix fetch,
    random and home assignments, blocks crossing documents and CP chunks."""
    _, _, _, tiles, assign, _ = pool
    plan = build_exchange_plan(tiles, assign)
    for rp in plan.ranks:
        assert_device_tables_equal_unit_tables(rp)


def test_device_tables_equal_unit_tables_for_non_affine_kv_columns_and_h_above_hkv():
    for hq, hkv, H, M in HEADS:
        for kv_fetch in ("group", "prefix"):
            _, plan = _plan(hq, hkv, H, M, kv_fetch, tiling="uniform")
            for rp in plan.ranks:
                assert_device_tables_equal_unit_tables(rp)


def test_host_and_device_expansion_agree_with_the_numpy_reference():
    _, plan = _plan(128, 4, 4, 4)
    for rp in plan.ranks:
        assert_tables_equal_unit_tables(rp, build_rank_tables(rp), RowRuns.expand)


@given(st.lists(st.tuples(st.integers(0, 1000), st.integers(1, 7)), max_size=12), st.integers(0, 9),
       st.sampled_from([torch.int32, torch.int64]))
@settings(deadline=None, max_examples=100)
def test_expand_runs_equals_concatenated_ranges(runs, stride, dtype):
    want = [s + stride * i for s, c in runs for i in range(c)]
    start = torch.tensor([s for s, _ in runs], dtype=torch.int64)
    count = torch.tensor([c for _, c in runs], dtype=torch.int64)
    out = routes.expand_runs(start, count, stride, len(want), dtype)
    assert out.dtype == dtype and out.tolist() == want


def test_expand_runs_keeps_rows_above_int32_in_int64():
    start, count = torch.tensor([2**31 + 3, 7]), torch.tensor([3, 2])
    out = routes.expand_runs(start, count, 5, 5, torch.int64)
    assert out.tolist() == [2**31 + 3, 2**31 + 8, 2**31 + 13, 7, 12]


def test_upload_reads_nothing_back_and_uses_only_ops_of_host_known_size(monkeypatch):
    """The expansion must run under ``set_sync_debug_mode("error")`` on a GPU: no host read of a device
    value, no op whose output size depends on device values (nonzero, repeat_interleave without size)."""
    banned = []
    for name in ("nonzero", "repeat_interleave", "unique", "masked_select"):
        original = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _n=name, _o=original, **k: banned.append(_n) or _o(*a, **k))
    _, plan = _plan(32, 8, 4, 4)
    tables = [build_rank_tables(rp) for rp in plan.ranks]
    counter = CallCounter()
    try:
        counts = [counter.measure(lambda t=t: routes.upload_tables(t, "cpu")) for t in tables]
    finally:
        counter.restore()
    assert all(c == {} for c in counts) and banned == [], (counts, banned)


class _FinishedWork:
    def wait(self):
        return None


def _route(rows, accumulate):
    splits = type("Splits", (), {"send": (len(rows),), "recv": (len(rows),), "remote_send_rows": 0})()
    return routes.RouteIndex(torch.tensor(rows, dtype=torch.int32), torch.tensor(rows, dtype=torch.int32), splits,
                             accumulate)


def test_an_exchange_releases_its_receive_buffer_once_placed_or_copied():
    """The receive buffer of chunk m must be freed before chunk m computes (the Pipeliner keeps the exchange
    object alive until the next chunk): placed() / into() hand it over and keep no reference."""
    import gc
    import weakref

    for accumulate in (False, True):
        received = torch.arange(6.0).reshape(3, 2)
        alive = weakref.ref(received)
        pending = routes.PendingExchange(_FinishedWork(), received, _route([2, 0, 1], accumulate))
        del received
        target = torch.zeros(3, 2)
        pending.into(target)
        gc.collect()
        assert alive() is None and pending.received is None, accumulate
        assert target[2].tolist() == [0.0, 1.0] and target[0].tolist() == [2.0, 3.0]
    received = torch.arange(6.0).reshape(3, 2)
    alive = weakref.ref(received)
    pending = routes.PendingExchange(_FinishedWork(), received, _route([2, 0, 1], False))
    del received
    arranged = pending.placed()
    gc.collect()
    assert alive() is None and arranged[2].tolist() == [0.0, 1.0]


def test_the_inverse_q_route_copies_and_the_inverse_kv_route_adds():
    """O/dQ rows have one source (copied into an uninitialised buffer); dK|dV rows add over destinations."""
    copy = routes.PendingExchange(_FinishedWork(), torch.ones(2, 1), _route([1, 0], False))
    add = routes.PendingExchange(_FinishedWork(), torch.ones(2, 1), _route([1, 0], True))
    assert copy.into(torch.full((2, 1), 5.0)).tolist() == [[1.0], [1.0]]
    assert add.into(torch.full((2, 1), 5.0)).tolist() == [[6.0], [6.0]]
