"""Masked mean over holders against a numpy reference (DESIGN.md invariant 2)."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sdp_jax import sync

W = 4


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((W,), ("data",), devices=jax.devices()[:W])


# Hand-made: component 0 held by all, 1 by worker 2 alone, 2 by workers 0 and 3, 3 by 1 and 2.
HAND = np.array([[1, 0, 1, 0],
                 [1, 0, 0, 1],
                 [1, 1, 0, 1],
                 [1, 0, 1, 0]], bool)


def numpy_masked_mean(x, mask):
    """x [W, G, ...] per-worker values -> [G, ...] mean over holders."""
    m = mask.reshape(mask.shape + (1,) * (x.ndim - 2))
    return (x * m).sum(0) / mask.sum(0).reshape((-1,) + (1,) * (x.ndim - 2))


def test_masked_mean_full_layout_matches_numpy(mesh):
    x = np.random.default_rng(0).normal(size=(W, 4, 3)).astype(np.float32)
    fn = jax.jit(jax.shard_map(lambda v: sync.masked_mean(v[0], HAND)[None], mesh=mesh,
                               in_specs=P("data"), out_specs=P("data")))
    out = np.asarray(fn(jax.device_put(x, NamedSharding(mesh, P("data")))))
    ref = numpy_masked_mean(x, HAND)
    for w in range(W):
        np.testing.assert_allclose(out[w], ref, rtol=1e-6)
    # a component held by a single worker keeps that worker's value exactly
    np.testing.assert_array_equal(ref[1], x[2, 1])


def _compact(mask, rows=3, seed=0):
    """Per-worker compact values [W, 2, rows] for a mask with 2 components per worker."""
    rng = np.random.default_rng(seed)
    tables = sync.CompactTables(mask)
    return tables, rng.normal(size=(W, tables.k, rows)).astype(np.float32)


@pytest.mark.parametrize("method", ["blockwise", "reference"])
def test_compact_masked_mean_matches_numpy(mesh, method):
    mask = np.array([[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1], [1, 0, 0, 1]], bool)
    # components 1 and 3 are each held by a single worker (0 and 3); 0 and 2 by three workers
    hand = np.array([[1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 0], [0, 0, 1, 1]], bool)
    for m in (mask, hand):
        tables, xc = _compact(m)
        fn = jax.jit(jax.shard_map(
            lambda t: sync.compact_masked_mean({"a": t}, tables, method=method)["a"], mesh=mesh,
            in_specs=P("data"), out_specs=P("data")))
        out = np.asarray(fn(jax.device_put(xc, NamedSharding(mesh, P("data")))))
        full = np.zeros((W, 4, 3), np.float32)
        for w in range(W):
            full[w, tables.held[w]] = xc[w]
        ref = numpy_masked_mean(full, m)
        for w in range(W):
            np.testing.assert_allclose(out[w], ref[tables.held[w]], rtol=1e-6, atol=1e-7)
        single = np.flatnonzero(m.sum(0) == 1)
        for g in single:  # held by one worker: that worker's own value, untouched
            w = int(np.flatnonzero(m[:, g])[0])
            np.testing.assert_array_equal(out[w, tables.slot[w, g]], xc[w, tables.slot[w, g]])


def test_compact_sq_norm_counts_each_component_once(mesh):
    mask = np.array([[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1], [1, 0, 0, 1]], bool)
    tables, xc = _compact(mask, seed=3)
    fn = jax.jit(jax.shard_map(
        lambda t: sync.compact_sq_norm({"a": sync.compact_masked_mean({"a": t}, tables)["a"]},
                                       tables)[None],
        mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    out = np.asarray(fn(jax.device_put(xc, NamedSharding(mesh, P("data")))))
    full = np.zeros((W, 4, 3), np.float32)
    for w in range(W):
        full[w, tables.held[w]] = xc[w]
    ref = float((numpy_masked_mean(full, mask) ** 2).sum())
    np.testing.assert_allclose(out, ref, rtol=1e-5)  # identical on every worker
