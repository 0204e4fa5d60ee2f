"""Stiefel-manifold pieces of MAPL: Polar Express, tangent projection, the optax transform."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sdp_jax.pipeline import stiefel as st


def _svd_polar(x):
    u, _, vt = np.linalg.svd(np.asarray(x, np.float64), full_matrices=False)
    return u @ vt


def test_polar_express_matches_svd_polar_factor():
    rng = np.random.default_rng(0)
    for shape in ((64, 16), (8, 40), (3, 32, 8)):  # tall, wide, batched
        x = rng.normal(size=shape).astype(np.float32)
        got = np.asarray(st.polar_express(jnp.asarray(x)))
        want = np.stack([_svd_polar(m) for m in x]) if x.ndim == 3 else _svd_polar(x)
        np.testing.assert_allclose(got, want, atol=1e-5)
    u, _ = np.linalg.qr(rng.normal(size=(64, 16)))
    v, _ = np.linalg.qr(rng.normal(size=(16, 16)))
    x = (u * np.logspace(0, -3, 16)) @ v.T  # ill-conditioned: condition number 1000
    np.testing.assert_allclose(np.asarray(st.polar_express(jnp.asarray(x, jnp.float32))),
                               u @ v.T, atol=1e-5)
    assert st.polar_express(jnp.ones((4, 2), jnp.bfloat16)).dtype == jnp.float32
    with pytest.raises(ValueError, match="must be a matrix"):
        st.polar_express(jnp.ones((4,)))
    with pytest.raises(ValueError, match="steps=0"):
        st.polar_express(jnp.ones((4, 2)), steps=0)


@pytest.mark.parametrize("scale", [1e-20, 1e-12, 1e-6, 1.0, 1e3, 1e6])
def test_polar_express_does_not_depend_on_the_input_scale(scale):
    """An orthonormal 64 x 16 input scaled by 1e-12 came back with Frobenius norm 0.88
    instead of 4 (the normalization's eps dominated)."""
    rng = np.random.default_rng(1)
    q, _ = np.linalg.qr(rng.normal(size=(64, 16)))
    got = np.asarray(st.polar_express(jnp.asarray(q * scale, jnp.float32)))
    np.testing.assert_allclose(got, q, atol=1e-5)
    x = rng.normal(size=(3, 32, 8))
    got = np.asarray(st.polar_express(jnp.asarray(x * scale, jnp.float32)))
    np.testing.assert_allclose(got, np.stack([_svd_polar(m) for m in x]), atol=1e-5)


def test_polar_express_of_zero_is_zero():
    out = np.asarray(st.polar_express(jnp.zeros((2, 16, 4))))
    assert np.isfinite(out).all() and not out.any()


def test_tangent_projection_is_tangent():
    rng = np.random.default_rng(1)
    a = jnp.asarray(_svd_polar(rng.normal(size=(12, 4))), jnp.float32)
    xi = st.tangent_projection(a, jnp.asarray(rng.normal(size=(12, 4)), jnp.float32))
    # Tangent vectors at A satisfy A^T xi + xi^T A = 0.
    np.testing.assert_allclose(np.asarray(a.T @ xi + xi.T @ a), 0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(st.tangent_projection(a, xi)), np.asarray(xi),
                               atol=1e-5)  # a projection


def test_stiefel_sgd_stays_on_manifold_and_improves_objective():
    """100 steps on a PCA objective: maximize tr(A^T C A) over St(16, 4)."""
    rng = np.random.default_rng(2)
    basis, _ = np.linalg.qr(rng.normal(size=(16, 16)))
    cov = jnp.asarray((basis * np.linspace(5.0, 0.1, 16)) @ basis.T, jnp.float32)
    a = jnp.asarray(_svd_polar(rng.normal(size=(16, 4))), jnp.float32)
    params = {"boundary": {"stiefel_A": a}}

    def loss(p):
        A = p["boundary"]["stiefel_A"]
        return -jnp.trace(A.T @ cov @ A)

    tx = st.stiefel_sgd(optax.cosine_decay_schedule(0.3, 100, alpha=0.01), momentum=0.5)
    state = tx.init(params)
    step = jax.jit(lambda p, s: tx.update(jax.grad(loss)(p), s, p))
    start = float(loss(params))
    for _ in range(100):
        updates, state = step(params, state)
        params = optax.apply_updates(params, updates)
    assert float(st.orthogonality_error(params["boundary"]["stiefel_A"])) < 1e-5
    best = -float(np.sort(np.linalg.eigvalsh(np.asarray(cov)))[-4:].sum())
    assert float(loss(params)) < start - 1.0
    assert float(loss(params)) < best + 0.05  # close to the top-4 eigen-subspace
    assert int(state.count) == 100
    with pytest.raises(ValueError, match="needs params"):
        tx.update(jax.grad(loss)(params), state)
    with pytest.raises(ValueError, match="d >= r"):
        tx.update({"w": jnp.ones((2, 8))}, tx.init({"w": jnp.ones((2, 8))}),
                  {"w": jnp.ones((2, 8))})
    with pytest.raises(ValueError, match="momentum"):
        st.stiefel_sgd(0.1, momentum=1.0)


def test_partition_routes_projectors_to_the_manifold_and_the_rest_to_adamw():
    rng = np.random.default_rng(3)
    params = {"w": jnp.asarray(rng.normal(size=(8, 8)), jnp.float32),
              "boundary_0": {"stiefel_A": jnp.asarray(_svd_polar(rng.normal(size=(8, 2))),
                                                      jnp.float32)}}
    labels = st.label_projectors(params)
    assert labels == {"w": st.OTHER, "boundary_0": {"stiefel_A": st.PROJECTOR}}
    tx = optax.partition({st.PROJECTOR: st.stiefel_sgd(0.1), st.OTHER: optax.adamw(1e-2)}, labels)
    state = tx.init(params)
    grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), params)
    updates, state = tx.update(grads, state, params)
    new = optax.apply_updates(params, updates)
    assert float(st.orthogonality_error(new["boundary_0"]["stiefel_A"])) < 1e-5
    assert not np.allclose(new["boundary_0"]["stiefel_A"], params["boundary_0"]["stiefel_A"])
    # AdamW's first step moves every entry by about lr.
    np.testing.assert_allclose(np.abs(np.asarray(new["w"] - params["w"])), 1e-2, rtol=0.05,
                               atol=2e-3)
