"""The column pool: source-rooted trees (MCCL's ``T_c``) and the paths they are made of.

A column is a tree ``T_c`` of tensor ``c`` (= source GPU ``s``): one path from
``s`` to every other GPU. Its coefficient ``beta_a`` on link ``a`` counts the
paths of the tree that cross ``a`` (MCCL Sec. 4.2). Paths are stored once
(deduplicated by a 64-bit hash of their arc sequence, kept sorted for
vectorized lookups and checked for equality on a hit); a column is the vector
of path ids of its ``N`` destinations (-1 at the source).
"""

from __future__ import annotations

import numpy as np

from jaxccl.errors import SynthesisError
from jaxccl.synth.alltoall.network import Network

_HASH_SEED = 0x6A636C_A2A


class ColumnPool:
    """Grows the path table and the tree columns of one topology.

    >>> from jaxccl.topology import ring
    >>> from jaxccl.synth.alltoall.network import build_network
    >>> from jaxccl.synth.alltoall.pricing import shortest_path_trees
    >>> net = build_network(ring(3))
    >>> pool = ColumnPool(net)
    >>> t = shortest_path_trees(net, np.ones(net.num_arcs))
    >>> new = pool.add(t.sources, t.paths)
    >>> new.size, pool.num_columns, pool.num_paths
    (3, 3, 6)
    >>> pool.add(t.sources, t.paths).size  # the same trees again: nothing new
    0
    """

    def __init__(self, net: Network):
        self.net = net
        n = net.num_gpus
        self._width = 1
        self._paths = np.full((0, 1), -1, dtype=np.int32)
        self._src = np.zeros(0, dtype=np.int64)
        self._dst = np.zeros(0, dtype=np.int64)
        self._keys = np.zeros(0, dtype=np.uint64)  # sorted path hashes
        self._key_ids = np.zeros(0, dtype=np.int64)  # path id of each
        self._tree_ids: dict[tuple[int, int], int] = {}
        self.col_src = np.zeros(0, dtype=np.int64)
        self.col_paths = np.zeros((0, n), dtype=np.int64)
        self.col_origin = np.zeros(0, dtype=np.int8)  # 0 generated, 1 reused (warm start)
        rng = np.random.default_rng(_HASH_SEED)
        self._mult = rng.integers(1, 2**63 - 1, size=64, dtype=np.int64).astype(np.uint64) | np.uint64(1)
        self._tree_mult = rng.integers(1, 2**63 - 1, size=n, dtype=np.int64).astype(np.uint64) | np.uint64(1)

    # ------------------------------------------------------------------ views
    @property
    def num_columns(self) -> int:
        return int(self.col_src.size)

    @property
    def num_paths(self) -> int:
        return int(self._src.size)

    @property
    def paths(self) -> np.ndarray:
        """``(P, L)`` arcs of every stored path, padded with -1."""
        return self._paths

    @property
    def path_src(self) -> np.ndarray:
        return self._src

    @property
    def path_dst(self) -> np.ndarray:
        return self._dst

    def path_arcs(self, pid: int) -> np.ndarray:
        row = self._paths[pid]
        return row[row >= 0]

    # ----------------------------------------------------------------- adding
    def _hash_rows(self, rows: np.ndarray) -> np.ndarray:
        width = rows.shape[1]
        if width > self._mult.size:
            rng = np.random.default_rng(_HASH_SEED + width)
            extra = rng.integers(1, 2**63 - 1, size=width, dtype=np.int64).astype(np.uint64) | np.uint64(1)
            self._mult = np.concatenate([self._mult, extra])
        with np.errstate(over="ignore"):
            vals = (rows.astype(np.int64) + 1).astype(np.uint64)
            return (vals * self._mult[:width]).sum(axis=1, dtype=np.uint64)

    def _intern_paths(self, rows: np.ndarray, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """Path ids of ``rows`` (``(M, L)`` padded arcs), adding the new ones."""
        width = rows.shape[1]
        if width > self._width:
            grown = np.full((self._paths.shape[0], width), -1, dtype=np.int32)
            grown[:, : self._width] = self._paths
            self._paths, self._width = grown, width
        elif width < self._width:
            padded = np.full((rows.shape[0], self._width), -1, dtype=np.int32)
            padded[:, :width] = rows
            rows = padded
        keys = self._hash_rows(rows)
        ids = np.full(keys.size, -1, dtype=np.int64)
        if self._keys.size:
            pos = np.minimum(np.searchsorted(self._keys, keys), self._keys.size - 1)
            hit = self._keys[pos] == keys
            ids[hit] = self._key_ids[pos[hit]]
        hit = ids >= 0
        if hit.any() and not np.array_equal(self._paths[ids[hit]], rows[hit]):
            raise SynthesisError("path hash collision in the column pool")  # pragma: no cover
        miss = np.flatnonzero(~hit)
        if miss.size:
            uniq, first, inverse = np.unique(keys[miss], return_index=True, return_inverse=True)
            new_ids = self.num_paths + np.arange(uniq.size)
            ids[miss] = new_ids[inverse.ravel()]
            sel = miss[first]
            self._paths = np.concatenate([self._paths, rows[sel]])
            self._src = np.concatenate([self._src, src[sel]])
            self._dst = np.concatenate([self._dst, dst[sel]])
            at = np.searchsorted(self._keys, uniq)
            self._keys = np.insert(self._keys, at, uniq)
            self._key_ids = np.insert(self._key_ids, at, new_ids)
        return ids

    def add_paths(self, src: np.ndarray, dst: np.ndarray, arcs: np.ndarray) -> np.ndarray:
        """Path ids of standalone paths (``(M, L)`` -1 padded arcs from ``src`` to ``dst``), adding new ones."""
        if arcs.shape[0] == 0:
            return np.zeros(0, dtype=np.int64)
        return self._intern_paths(
            np.asarray(arcs, dtype=np.int32), np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
        )

    def add(self, sources: np.ndarray, paths: np.ndarray, *, origin: int = 0) -> np.ndarray:
        """Adds trees; returns the indices of the columns that were new.

        Args:
            sources: ``(k,)`` source GPU of each tree.
            paths: ``(k, N, L)`` arcs of each tree's path to every GPU (-1 padded;
                the source's own row is ignored).
            origin: 0 for generated columns, 1 for columns reused from a previous schedule.
        """
        n = self.net.num_gpus
        sources = np.asarray(sources, dtype=np.int64)
        k = sources.size
        if k == 0:
            return np.zeros(0, dtype=np.int64)
        dst = np.tile(np.arange(n), k)
        src = np.repeat(sources, n)
        keep = dst != src
        rows = paths.reshape(k * n, -1)
        pid = np.full(k * n, -1, dtype=np.int64)
        pid[keep] = self._intern_paths(rows[keep], src[keep], dst[keep])
        pid = pid.reshape(k, n)
        with np.errstate(over="ignore"):
            tkeys = ((pid + 1).astype(np.uint64) * self._tree_mult).sum(axis=1, dtype=np.uint64).tolist()
        new = []
        for i, (s, key) in enumerate(zip(sources.tolist(), tkeys)):
            if (s, key) in self._tree_ids:
                continue
            self._tree_ids[(s, key)] = self.num_columns + len(new)
            new.append(i)
        if not new:
            return np.zeros(0, dtype=np.int64)
        new = np.asarray(new)
        first = self.num_columns
        self.col_src = np.concatenate([self.col_src, sources[new]])
        self.col_paths = np.concatenate([self.col_paths, pid[new]])
        self.col_origin = np.concatenate([self.col_origin, np.full(new.size, origin, dtype=np.int8)])
        return np.arange(first, self.num_columns)

    # ------------------------------------------------------------ coefficients
    def beta(self, cols: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Link coefficients of columns as CSC arrays ``(starts, arc index, count)``."""
        a_count = self.net.num_arcs
        cols = np.asarray(cols, dtype=np.int64)
        pid = self.col_paths[cols]
        valid = pid >= 0
        owner = np.repeat(np.arange(cols.size), valid.sum(axis=1))
        arcs = self._paths[pid[valid]]
        owner = np.repeat(owner, arcs.shape[1]).reshape(arcs.shape)
        ok = arcs >= 0
        keys = owner[ok] * a_count + arcs[ok].astype(np.int64)
        counts = np.bincount(keys, minlength=cols.size * a_count).reshape(cols.size, a_count)
        nz_col, nz_arc = np.nonzero(counts)
        starts = np.searchsorted(nz_col, np.arange(cols.size))
        return starts, nz_arc, counts[nz_col, nz_arc].astype(np.float64)

    def loads(self, cols: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """``(A,)`` link loads of columns with the given weights (``sum_T beta_aT x_T``)."""
        pid = self.col_paths[cols]
        w = np.broadcast_to(np.asarray(weights, dtype=np.float64)[:, None], pid.shape)
        valid = pid >= 0
        arcs = self._paths[pid[valid]]
        ww = np.repeat(w[valid], arcs.shape[1]).reshape(arcs.shape)
        ok = arcs >= 0
        return np.bincount(arcs[ok], weights=ww[ok], minlength=self.net.num_arcs)
