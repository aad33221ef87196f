"""Calibrated per-tile kernel cost (review objection 2): seconds instead of the Eq. 6 FLOPs proxy.

Pure numpy. Algorithm 2 balances ``f_t`` = Eq. 6 pair-heads; a varlen kernel also pays per call, per
varlen entry, per query row and per key row. ``TileCostModel`` prices one SH-Tile as

    seconds(t) = per_pair_head * pairs(t) + per_row_head * rows(t) + per_entry * entries(t)
                 + per_key_row_head * key_rows(t)

with, for tile t = (block b, head shard h), hs = hq / H query heads and M = heads.num_chunks:
    pairs(t)    = hs * sum_j sum_{q=a_j}^{e_j - 1} (q + 1)    Eq. 6 causal query-key pairs x heads (tile_flops)
    rows(t)     = hs * (tokens of block b)                     query rows x heads
    entries(t)  = M * (fragments of block b)                   varlen entries: one per document fragment per chunk call
    key_rows(t) = hs * sum_j e_j                               key-prefix rows read per fragment x heads
where fragment j covers doc-local query rows [a_j, e_j) and attends the key prefix [0, e_j).
The sum over a worker's tiles is its predicted kernel time (fwd + bwd when calibrated on fwd + bwd).
It is additive over tiles: the exchange plan merges fragments of one document that continue across
consecutive blocks on the same worker and head into one entry, so per_entry is slightly overcharged there.
``per_call`` (seconds per kernel call) is fitted so it does not bias the other terms, but it is the same
for every worker that hosts any tile (M calls), so it is not part of a tile's cost.
With per_row_head = per_entry = per_key_row_head = 0 the model is the FLOPs proxy up to a scale.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np

from .workload import causal_pairs

__all__ = ["TileCostModel", "FEATURES", "tile_features", "entry_features", "fit_tile_cost_model", "nnls"]

FEATURES = ("pairs", "rows", "entries", "key_rows")  # column order of every feature matrix here


@dataclass(frozen=True)
class TileCostModel:
    """Seconds per unit of each tile feature (see the module docstring); all coefficients >= 0.

    per_pair_head     s per causal query-key pair and query head (Eq. 6 unit)
    per_row_head      s per query row and query head
    per_entry         s per varlen entry (one document fragment in one kernel call)
    per_key_row_head  s per key-prefix row and query head
    per_call          s per kernel call (not charged to tiles; same on every busy worker)
    """

    per_pair_head: float
    per_row_head: float
    per_entry: float
    per_key_row_head: float = 0.0
    per_call: float = 0.0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not (np.isfinite(value) and value >= 0):
                raise ValueError(f"TileCostModel.{name} must be a finite number >= 0, got {value!r}")

    @property
    def coefficients(self) -> np.ndarray:
        """float64 [4] in ``FEATURES`` order."""
        return np.array([self.per_pair_head, self.per_row_head, self.per_entry, self.per_key_row_head])

    def predict(self, features: np.ndarray, num_calls=0) -> np.ndarray:
        """features float [n, 4] (``FEATURES`` order) -> seconds [n]; adds ``per_call * num_calls``."""
        return np.asarray(features, dtype=np.float64) @ self.coefficients + self.per_call * np.asarray(num_calls)

    def tile_costs(self, tiles) -> np.ndarray:
        """float64 [num_tiles]: predicted seconds of every SH-Tile (``place_tiles(tile_cost=...)`` input)."""
        return self.predict(tile_features(tiles))

    @staticmethod
    def flops_only(seconds_per_pair_head: float = 1.0) -> "TileCostModel":
        """The Eq. 6 proxy as a cost model: only the pair term."""
        return TileCostModel(float(seconds_per_pair_head), 0.0, 0.0, 0.0)

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(data: Mapping[str, float]) -> "TileCostModel":
        return TileCostModel(**{k: float(v) for k, v in data.items()})

    @staticmethod
    def from_json(path) -> "TileCostModel":
        """Load ``{"model": {...}, ...}`` as written by ``benchmarks/calibrate_cpu.py``."""
        from ...paths import read_json

        data = read_json(path, str(path))
        if not isinstance(data, dict) or "model" not in data:
            raise ValueError(f"{path}: no 'model' key (expected the output of benchmarks/calibrate_cpu.py)")
        return TileCostModel.from_dict(data["model"])


def tile_features(tiles) -> np.ndarray:
    """float64 [num_tiles, 4]: (pairs, rows, entries, key_rows) of every tile, as in the module docstring."""
    heads = float(tiles.heads.q_heads_per_shard)
    nfrag = np.diff(tiles.frag_ptr)
    nonempty = tiles.frag_ptr[:-1][nfrag > 0]
    key_rows = np.zeros(tiles.num_blocks)
    if nonempty.size:
        key_rows[nfrag > 0] = np.add.reduceat(tiles.frag_q_end.astype(np.float64), nonempty)
    per_block = np.stack([
        tiles.block_pairs * heads,
        (tiles.block_end - tiles.block_start) * heads,
        nfrag * float(tiles.heads.num_chunks),
        key_rows * heads,
    ], axis=1).astype(np.float64)
    return np.repeat(per_block, tiles.head_split, axis=0)


def entry_features(q_lens, k_lens, num_heads: int) -> np.ndarray:
    """float64 [4]: features of ONE varlen kernel call with bottom-right causal entries (q_len <= k_len).

    pairs = heads * sum q*(k-q) + q(q+1)/2; rows = heads * sum q; entries = n; key_rows = heads * sum k.
    """
    q = np.asarray(q_lens, dtype=np.int64)
    k = np.asarray(k_lens, dtype=np.int64)
    if (q > k).any():
        raise ValueError("entry_features: every entry needs q_len <= k_len (bottom-right causal)")
    pairs = causal_pairs(k - q, k).sum()
    return np.array([pairs * num_heads, q.sum() * num_heads, q.size, k.sum() * num_heads], dtype=np.float64)


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int = 200) -> np.ndarray:
    """Non-negative least squares min ||a x - b||, x >= 0 (Lawson-Hanson active set), numpy only."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    n = a.shape[1]
    x, passive = np.zeros(n), np.zeros(n, dtype=bool)
    tol = 1e-12 * max(1.0, float(np.abs(a.T @ b).max(initial=0.0)))
    for _ in range(max_iter):
        grad = a.T @ (b - a @ x)
        if passive.all() or grad[~passive].max(initial=-np.inf) <= tol:
            break
        passive[np.flatnonzero(~passive)[np.argmax(grad[~passive])]] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
    return x


def _sample_rows(samples: Iterable[Mapping[str, float]]):
    """(features float64 [n, 5] = FEATURES + calls, seconds float64 [n])."""
    rows = [(*(float(s[f]) for f in FEATURES), float(s.get("calls", 1)), float(s["seconds"])) for s in samples]
    data = np.asarray(rows, dtype=np.float64).reshape(-1, len(FEATURES) + 2)
    return data[:, :-1], data[:, -1]


def fit_tile_cost_model(samples: Iterable[Mapping[str, float]], relative: bool = True,
                        features: Sequence[str] = FEATURES + ("calls",)) -> TileCostModel:
    """NNLS fit of ``TileCostModel`` to measured samples.

    samples   dicts with keys pairs, rows, entries, key_rows (``FEATURES``), calls (default 1), seconds
    relative  True: minimise relative error (each row divided by its seconds), so small calls dominated by
              per-entry costs weigh as much as large ones; False: absolute seconds.
    features  the terms to fit (others are 0); ``("pairs",)`` gives the FLOPs proxy in seconds.
    Columns are scaled to unit norm before the solve so the coefficients' very different magnitudes
    (~1e-8 s/pair vs ~1e-4 s/entry) do not hurt the conditioning.
    """
    names = FEATURES + ("calls",)
    unknown = set(features) - set(names)
    if unknown:
        raise ValueError(f"fit_tile_cost_model: unknown features {sorted(unknown)}; choose from {names}")
    x, y = _sample_rows(samples)
    cols = [names.index(f) for f in features]
    if y.size < len(cols):
        raise ValueError(f"fit_tile_cost_model needs at least {len(cols)} samples for {len(cols)} terms, got {y.size}")
    weight = 1.0 / np.maximum(y, 1e-12) if relative else np.ones_like(y)
    a, b = x[:, cols] * weight[:, None], y * weight
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    coef = np.zeros(len(names))
    coef[cols] = nnls(a / scale, b) / scale
    return TileCostModel(*(float(c) for c in coef[:4]), per_call=float(coef[4]))
