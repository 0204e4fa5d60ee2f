"""Optimization on the Stiefel manifold St(d, r) = {A in R^{d x r}: A^T A = I} for MAPL projectors.

MAPL (Janson, Oyallon, Belilovsky, arXiv 2606.05484) compresses the residual stream crossing a
pipeline-stage boundary through a learned orthogonal projector ``A`` in St(d, r) and trains it by
spectral steepest descent on the manifold (docs/design.md, "MAPL-style projectors"):

    m  <- beta * m + g                      (momentum of the Euclidean gradient g)
    xi <- m - A sym(A^T m)                  (projection onto the tangent space at A)
    A  <- msign(A - lr * msign(xi))         (spectral step, then retraction by the polar factor)

``msign(X) = U V^T`` for the thin SVD ``X = U S V^T`` (the polar factor, the matrix sign of a
rectangular matrix) is computed by the Polar Express iteration (Amsel, Persson, Musco, Gower 2025,
"The Polar Express: Optimal Matrix Sign Methods and Their Application to the Muon Algorithm",
arXiv 2505.16932, Algorithm 1): odd quintic polynomials ``p(x) = a x + b x^3 + c x^5`` applied to
the singular values, with one optimal (a, b, c) per step, always in float32 here.

What this module provides: :func:`polar_express`, :func:`tangent_projection`, :func:`retract`,
:func:`orthogonality_error`, the optax transform :func:`stiefel_sgd` (``update`` needs
``params`` and returns ``A_new - A``), and :func:`label_projectors`, labels for ``optax.partition``
that send projector parameters to it and everything else to another optimizer (AdamW). The
compressed pipeline boundaries that use the projectors are in :mod:`sdp_jax.pipeline`
(``pipeline.method="mapl"``).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

# Amsel et al. 2025, Algorithm 1 (degree 5, designed for singular values in [1e-3, 1] after the
# normalization below); every polynomial but the last is divided by a safety factor 1.01
# (1.01, 1.01^3, 1.01^5 on a, b, c) as in that algorithm. Steps past the list repeat the last.
_PE_COEFFS = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
_SAFETY = 1.01
POLAR_EXPRESS_COEFFS = tuple(
    (a / _SAFETY, b / _SAFETY ** 3, c / _SAFETY ** 5) for a, b, c in _PE_COEFFS[:-1]
) + (_PE_COEFFS[-1],)
PROJECTOR = "stiefel"  # label of projector leaves for optax.partition
OTHER = "other"


def _check_matrix(x, what: str):
    if x.ndim < 2:
        raise ValueError(f"{what} must be a matrix [..., d, r], got shape {tuple(x.shape)}.")


def polar_express(x: jax.Array, steps: int = 10, eps: float = 1e-7) -> jax.Array:
    """The polar factor ``msign(x) = U V^T`` of ``x = U S V^T`` by the Polar Express iteration.

    Args:
      x: [..., d, r] float array (any float dtype; computed in float32). Batched over the leading
        axes. Works for d >= r and d < r (the smaller Gram matrix is used).
      steps: iterations (the first 8 use Amsel et al.'s per-step coefficients, later ones the
        last, quadratically convergent, polynomial). With 10 steps singular values down to about
        1e-3 of the largest are mapped to 1 within float32 accuracy; smaller ones need more
        (each extra step multiplies a tiny singular value by 1.875).
      eps: added to the Frobenius norm of the normalization ``y / (1.01 ||y||_F + eps)``, where
        ``y = x / max|x|`` (so the result does not depend on the scale of ``x``: inputs from
        1e-20 to 1e6 in scale give the same factor; ``||y||_F >= 1`` unless ``x`` is 0).

    Returns:
      float32 [..., d, r] with orthonormal columns (rows if d < r) where ``x`` has full rank;
      zeros where ``x`` is zero.

    Raises:
      ValueError: ``x`` has fewer than 2 dimensions or ``steps`` < 1.

    Source: Amsel, Persson, Musco, Gower 2025, arXiv 2505.16932, Algorithm 1.
    """
    _check_matrix(x, "polar_express input")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r} must be a positive integer.")
    x = x.astype(jnp.float32)
    tall = x.shape[-2] >= x.shape[-1]
    if not tall:
        x = jnp.swapaxes(x, -1, -2)
    top = jnp.max(jnp.abs(x), axis=(-2, -1), keepdims=True)   # scale first: no under/overflow
    x = x / jnp.where(top > 0, top, 1.0)
    x = x / (jnp.linalg.norm(x, axis=(-2, -1), keepdims=True) * _SAFETY + eps)
    for i in range(steps):
        a, b, c = POLAR_EXPRESS_COEFFS[min(i, len(POLAR_EXPRESS_COEFFS) - 1)]
        g = jnp.swapaxes(x, -1, -2) @ x                          # [..., r, r]
        x = a * x + x @ (b * g + c * (g @ g))
    return x if tall else jnp.swapaxes(x, -1, -2)


def sym(m: jax.Array) -> jax.Array:
    """Symmetric part ``(m + m^T) / 2`` of square matrices [..., r, r]."""
    return 0.5 * (m + jnp.swapaxes(m, -1, -2))


def tangent_projection(a: jax.Array, m: jax.Array) -> jax.Array:
    """Projection of ``m`` [..., d, r] onto the tangent space of St(d, r) at ``a``:
    ``m - a sym(a^T m)`` (Absil, Mahony, Sepulchre 2008, "Optimization Algorithms on Matrix
    Manifolds", Eq. 3.35, with the embedded metric)."""
    return m - a @ sym(jnp.swapaxes(a, -1, -2) @ m)


def retract(y: jax.Array, steps: int = 10) -> jax.Array:
    """Polar retraction onto St(d, r): the nearest matrix with orthonormal columns, ``msign(y)``."""
    return polar_express(y, steps)


def orthogonality_error(a: jax.Array) -> jax.Array:
    """``max |a^T a - I|`` (float32 scalar over all leading axes): how far ``a`` [..., d, r] is
    from St(d, r)."""
    _check_matrix(a, "a projector")
    a = a.astype(jnp.float32)
    g = jnp.swapaxes(a, -1, -2) @ a
    return jnp.max(jnp.abs(g - jnp.eye(a.shape[-1], dtype=jnp.float32)))


class StiefelState(NamedTuple):
    """State of :func:`stiefel_sgd`: ``count`` int32 scalar (steps taken) and ``momentum``
    (float32 buffers shaped like the params)."""

    count: jax.Array
    momentum: Any


def stiefel_sgd(learning_rate: float | Callable[[jax.Array], jax.Array], momentum: float = 0.9,
                steps: int = 10) -> optax.GradientTransformation:
    """Spectral steepest descent on the Stiefel manifold, as an optax transform.

    Per leaf ``A`` [..., d, r] (d >= r) with gradient ``g`` (MAPL; docs/design.md):
    ``m <- momentum * m + g``; ``xi = m - A sym(A^T m)``; ``A_new = msign(A - lr * msign(xi))``.
    ``update`` returns ``A_new - A`` (so ``optax.apply_updates`` lands on ``A_new``), computed in
    float32 and cast to the parameter's dtype (store projectors in float32: a bfloat16 ``A`` is
    only orthogonal to about 1e-2); the learning rate (a float or an optax schedule of the step count) is
    applied inside, so do not chain a scaling after it.

    Args:
      learning_rate: step length along the spectral direction (the spectral norm of
        ``msign(xi)`` is 1), or a schedule ``count -> lr``.
      momentum: ``beta`` in [0, 1).
      steps: Polar Express iterations for both ``msign`` calls.

    Raises:
      ValueError: bad ``momentum`` / ``steps`` (at construction); ``update`` called without
        ``params``, or on a leaf that is not a matrix or is wider than tall.
    """
    if isinstance(momentum, bool) or not 0.0 <= float(momentum) < 1.0:
        raise ValueError(f"momentum={momentum!r} must be in [0, 1).")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r} must be a positive integer.")

    def init(params):
        return StiefelState(jnp.zeros((), jnp.int32),
                            jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))

    def update(grads, state, params=None):
        if params is None:
            raise ValueError("stiefel_sgd.update needs params (the current projectors A): call "
                             "optimizer.update(grads, state, params).")
        lr = learning_rate(state.count) if callable(learning_rate) else learning_rate

        def one(g, m, a):
            _check_matrix(a, "a Stiefel parameter")
            if a.shape[-2] < a.shape[-1]:
                raise ValueError(f"a Stiefel parameter must be [..., d, r] with d >= r, got "
                                 f"{tuple(a.shape)}; store the projector tall.")
            a32 = a.astype(jnp.float32)
            m = momentum * m + g.astype(jnp.float32)
            xi = tangent_projection(a32, m)
            new = polar_express(a32 - lr * polar_express(xi, steps), steps)
            return (new - a32).astype(a.dtype), m

        out = jax.tree.map(one, grads, state.momentum, params)
        treedef = jax.tree.structure(grads)
        flat = treedef.flatten_up_to(out)
        updates = treedef.unflatten([u for u, _ in flat])
        moms = treedef.unflatten([m for _, m in flat])
        return updates, StiefelState(state.count + 1, moms)

    return optax.GradientTransformation(init, update)


def label_projectors(params: Any, is_projector: Callable[[tuple, Any], bool] | None = None):
    """Labels for ``optax.partition``: :data:`PROJECTOR` for projector leaves, :data:`OTHER` for
    the rest. By default a leaf is a projector when a key on its path contains ``"stiefel"``
    (for example ``{"boundary_0": {"stiefel_A": ...}}``); pass ``is_projector(path_keys, leaf)``
    to decide otherwise."""
    def default(keys, _):
        return any("stiefel" in k for k in keys)
    pred = is_projector or default
    return jax.tree_util.tree_map_with_path(
        lambda path, x: PROJECTOR if pred(tuple(str(getattr(k, "key", k)) for k in path), x)
        else OTHER, params)
