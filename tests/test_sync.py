"""Masked mean over holders against a numpy reference (docs/design.md invariant 2)."""

import jax
import numpy as np

import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sdp_jax.spec import sdp_spec as spec_lib
from sdp_jax.spec import layout as layout_lib
from sdp_jax.sync import collectives as sync

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


def test_masked_average_full_layout_matches_numpy(mesh):
    x = np.random.default_rng(0).normal(size=(W, 4, 3)).astype(np.float32)
    fn = jax.jit(jax.shard_map(
        lambda v: sync.masked_average({"a": v[0]}, {"a": HAND[:, :, None]})["a"][None],
        mesh=mesh, in_specs=P("data"), out_specs=P("data")))
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


def test_global_norm_counts_each_component_once(mesh):
    mask = np.array([[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1], [1, 0, 0, 1]], bool)
    tables, xc = _compact(mask, seed=3)
    spec = spec_lib.build({"blocks": {"a": np.zeros((4, 3), np.float32)}},
                          [spec_lib.Blocks("blocks", stacked=True)], "b-sdp", W, 0.5,
                          matrices={"block": mask})

    def fn(t):
        avg = sync.average({"blocks": {"a": t[0]}}, spec)
        return sync.global_norm(avg, spec)[None]
    out = np.asarray(jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("data"),
                                           out_specs=P("data")))(
        jax.device_put(xc, NamedSharding(mesh, P("data")))))
    full = np.zeros((W, 4, 3), np.float32)
    for w in range(W):
        full[w, tables.held[w]] = xc[w]
    ref = float(np.sqrt((numpy_masked_mean(full, mask) ** 2).sum()))
    np.testing.assert_allclose(out, ref, rtol=1e-5)  # identical on every worker


@pytest.mark.parametrize("step_bytes", [None, 1])  # all slots in one all_to_all; one per step
def test_holder_mean_moves_held_rows_and_matches_numpy(mesh, step_bytes):
    # components 1 and 3... : 1 held by worker 0 alone; the cyclic mask below by two each
    for hand in (np.array([[1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 0], [0, 0, 1, 1]], bool),
                 np.array([[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1], [1, 0, 0, 1]], bool)):
        _check_holder_mean(mesh, hand, step_bytes)


def _check_holder_mean(mesh, hand, step_bytes):
    tables, xc = _compact(hand, rows=5, seed=4)
    ht = layout_lib.HolderTables(tables.held[:, None, :], tables.counts[None, :], 0, False)

    def fn(t):  # two leaves with equal tables travel fused; the second is a multiple
        out = sync.holder_mean({"a": t[0], "b": 3 * t[0]}, {"a": ht, "b": ht},
                               step_bytes=step_bytes)
        return out["a"][None], out["b"][None]
    out, out3 = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("data"),
                                      out_specs=(P("data"), P("data"))))(
        jax.device_put(xc, NamedSharding(mesh, P("data"))))
    full = np.zeros((W, 4, 5), np.float32)
    for w in range(W):
        full[w, tables.held[w]] = xc[w]
    ref = numpy_masked_mean(full, hand)
    for w in range(W):
        np.testing.assert_allclose(np.asarray(out)[w], ref[tables.held[w]], rtol=1e-6)
        np.testing.assert_allclose(np.asarray(out3)[w], 3 * ref[tables.held[w]], rtol=1e-6,
                                   atol=1e-6)
    for g in np.flatnonzero(hand.sum(0) == 1):  # held by one worker: its own value, exactly
        w = int(np.flatnonzero(hand[:, g])[0])
        np.testing.assert_array_equal(np.asarray(out)[w, tables.slot[w, g]],
                                      xc[w, tables.slot[w, g]])


def test_holder_mean_neuron_leaves_match_layer_reference(mesh):
    L, F, rng = 3, 8, np.random.default_rng(5)
    perms = [rng.permutation(F) for _ in range(L)]  # every neuron held by exactly 2 workers
    idx = np.array([[np.sort(perms[layer][(2 * w + np.arange(4)) % F]) for layer in range(L)]
                    for w in range(W)])
    counts = np.full((L, F), 2, np.int32)
    # two leaves with the same components on different axes (like w_gate and w_down): they
    # travel fused, each with its own axis
    lt, lt1 = sync.LayerTables(idx, counts, 2), sync.LayerTables(idx, counts, 1)
    ht, ht1 = (layout_lib.HolderTables(t.indices, t.counts, t.axis, True) for t in (lt, lt1))
    x = rng.normal(size=(W, L, 6, 4)).astype(np.float32)   # [L, d=6, kc=4] per worker
    y = rng.normal(size=(W, L, 4, 5)).astype(np.float32)   # [L, kc=4, 5] per worker

    def fn(t, u):
        out = sync.holder_mean({"a": t[0], "b": u[0]}, {"a": ht, "b": ht1})
        return out["a"][None], out["b"][None]
    a, b = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("data"), P("data")),
                                 out_specs=(P("data"),) * 2))(
        jax.device_put(x, NamedSharding(mesh, P("data"))),
        jax.device_put(y, NamedSharding(mesh, P("data"))))
    for got, vals, axis in ((a, x, 2), (b, y, 1)):   # numpy: per layer, the mean over holders
        full = np.zeros((W, L) + tuple(F if i == axis else n
                                       for i, n in enumerate(vals.shape[1:]) if i > 0), np.float32)
        for w in range(W):
            for layer in range(L):
                np.moveaxis(full[w, layer], axis - 1, 0)[idx[w, layer]] = np.moveaxis(
                    vals[w, layer], axis - 1, 0)
        ref = full.sum(0) / 2
        for w in range(W):
            for layer in range(L):
                want = np.moveaxis(np.moveaxis(ref[layer], axis - 1, 0)[idx[w, layer]], 0,
                                   axis - 1)
                np.testing.assert_allclose(np.asarray(got)[w, layer], want, rtol=1e-6,
                                           atol=1e-7)
    assert not np.allclose(np.asarray(a), x)  # something was averaged


def test_fsdp_gather_gives_held_rows_and_masked_sum_gradient(mesh):
    mask = np.array([[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1], [1, 0, 0, 1]], bool)
    tables = sync.CompactTables(mask)
    rng = np.random.default_rng(6)
    G, r = 4, 7                     # r not a multiple of W: the last piece is padded
    rs = -(-r // W)
    full = rng.normal(size=(G, r)).astype(np.float32)
    wts = rng.normal(size=(W, tables.k, r)).astype(np.float32)

    def fn(sh, wl):
        idx = jax.numpy.asarray(tables.held)

        def loss(sh):
            return jax.numpy.sum(sync.fsdp_gather(sh, r, jax.numpy.float32, idx=idx) * wl[0])
        rows = sync.fsdp_gather(sh, r, jax.numpy.float32, idx=idx)
        return rows[None], jax.grad(loss)(sh)
    rows, grad = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(None, "data"), P("data")),
                                       out_specs=(P("data"), P(None, "data"))))(
        jax.device_put(np.pad(full, ((0, 0), (0, W * rs - r))),
                       NamedSharding(mesh, P(None, "data"))),
        jax.device_put(wts, NamedSharding(mesh, P("data"))))
    for w in range(W):
        np.testing.assert_array_equal(np.asarray(rows)[w], full[tables.held[w]])
    ref = np.zeros((G, r), np.float32)
    for w in range(W):
        for j in range(tables.k):
            ref[tables.held[w, j]] += wts[w, j]
    np.testing.assert_allclose(np.asarray(grad)[:, :r], ref, rtol=1e-6)
    assert np.all(np.asarray(grad)[:, r:] == 0)


def test_cotangent_orders_follow_the_weight_gradient_transposes():
    """The order in which JAX's backward pass makes each weight gradient (a matmul's product
    [output dims, input dims], then a transpose): through a bf16 cast and a nested jit; a leaf
    whose gradient needs no transpose is left out. to_order / from_order move a leaf (after a
    leading slot axis) into that order and back."""
    import jax.numpy as jnp

    def block(w, x):
        w = {k: v.astype(jnp.bfloat16) for k, v in w.items()}
        q = jnp.einsum("btd,dnh->btnh", x, w["wq"])
        o = jnp.einsum("btnh,nhd->btd", q, w["wo"])
        return jax.jit(lambda a, b: a @ b)(o, w["up"]) @ w["down"], w["g"] * 2
    w = {"wq": jnp.ones((8, 2, 4)), "wo": jnp.ones((2, 4, 8)), "up": jnp.ones((8, 16)),
         "down": jnp.ones((16, 8)), "g": jnp.ones((8,))}
    orders = sync.cotangent_orders(lambda w: block(w, jnp.ones((2, 3, 8), jnp.bfloat16)), w)
    assert orders == {"wq": (2, 0, 1), "wo": (1, 2, 0), "up": (1, 0), "down": (1, 0)}
    # the order is the product's: wq's gradient comes out [n, h, d] before its transpose
    assert sync.to_order(w["wq"], orders["wq"]).shape == (2, 4, 8)
    x = np.arange(5 * 8 * 2 * 4, dtype=np.float32).reshape(5, 8, 2, 4)
    z = sync.to_order(jnp.asarray(x), orders["wq"], lead=1)
    assert z.shape == (5, 2, 4, 8)
    np.testing.assert_array_equal(np.asarray(z[3]), np.transpose(x[3], (1, 2, 0)))
    np.testing.assert_array_equal(np.asarray(sync.from_order(z, orders["wq"], lead=1)), x)
    # the walk stops at a scan (its outputs are stacked: an order found inside would have one
    # axis too few) and keeps the leaf's own order; a nested tree is refused
    def scanned(w, x):
        return jax.lax.scan(lambda h, s: (h @ s.T, None), x, w["s"])[0] @ w["up"]
    w2 = {"s": jnp.ones((4, 8, 8)), "up": jnp.ones((8, 16))}
    assert sync.cotangent_orders(lambda w: scanned(w, jnp.ones((3, 8))), w2) == {"up": (1, 0)}
    with pytest.raises(ValueError, match="flat dict"):
        sync.cotangent_orders(lambda w: w["a"]["b"] * 2, {"a": {"b": jnp.ones(3)}})
