"""Host-side mask matrices for Subnetwork Data Parallelism (numpy only, no tracing).

A *mask matrix* is a static numpy ``bool`` array ``[W, G]``: row ``w`` says which of the ``G``
maskable components (blocks for B-SDP) worker ``w`` holds. Every row holds exactly ``k = C * G``
components, so that every device of an SPMD program runs the same shapes (docs/design.md, invariant 4).
*Uniform representation* (Singh et al., arXiv 2507.09029, Sec. 3) additionally asks that every
component be held by the same number ``m = W * C`` of workers.

When ``W * C`` is not a whole number (the paper's 1B setting: 8 workers, 11 of 16 blocks, so
``W * C = 5.5``) uniform representation is impossible. By default that request is refused; with
``allow_nonuniform=True`` a *near-uniform* matrix is built instead, in which every component is held
by ``floor(W*C)`` or ``ceil(W*C)`` workers. Averaging stays an exact mean over the holders of each
component (the count is per component), so only the balance of the representation differs.

It is numpy alone (host-side, no tracing): ``from sdp_jax.spec import masks``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

SCHEMES = ("cyclic", "random", "grouped")


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------

def valid_coverages(workers: int, components: int, *, allow_nonuniform: bool = False) -> list[float]:
    """All coverages ``C = k / G`` realizable for ``W`` workers and ``G`` components.

    Args:
      workers: ``W``, number of data-parallel workers (>= 1).
      components: ``G``, number of maskable components (>= 1).
      allow_nonuniform: if False (default), only coverages with ``W * C`` whole are listed.

    Returns:
      Sorted list of floats in (0, 1].
    """
    _check_counts(workers, components)
    out = []
    for k in range(1, components + 1):
        if workers * k < components:  # some component would be held by no worker
            continue
        if allow_nonuniform or (workers * k) % components == 0:
            out.append(k / components)
    return out


def _check_counts(workers, components) -> None:
    for name, v in (("workers W", workers), ("components G", components)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive integer.")


def nearest_coverages(values: list[float], target: float, n: int = 3) -> list[float]:
    """The ``n`` coverages of ``values`` nearest ``target``, ascending, to 6 decimals (as error
    messages suggest them; :func:`whole_count` accepts them)."""
    return sorted(round(v, 6) for v in sorted(values, key=lambda v: (abs(v - target), v))[:n])


def whole_count(coverage: float, total: int) -> bool:
    """Whether ``coverage * total`` is a whole number of components, up to the 6 decimals the
    error messages give coverages in (2/3 of 384 as 0.666667: 256.000128 is whole)."""
    return abs(round(coverage * total) - coverage * total) <= 1e-6 * max(total, 1)


def components_per_worker(workers: int, components: int, coverage: float, *,
                          allow_nonuniform: bool = False, max_workers: int | None = None) -> int:
    """Validate a request and return ``k = C * G``, the components each worker holds.

    Args:
      workers: ``W`` (>= 1).
      components: ``G`` (>= 1).
      coverage: ``C`` in (0, 1].
      allow_nonuniform: accept ``W * C`` that is not whole (near-uniform masks).
      max_workers: if given, the number of devices available; ``W`` may not exceed it.

    Returns:
      ``k`` as an int.

    Raises:
      ValueError: naming the bad value and the nearest valid coverages, if ``C`` is outside
        (0, 1], ``C * G`` is not whole, ``W * C`` is not whole (unless ``allow_nonuniform``), or
        ``W`` exceeds ``max_workers``.
    """
    _check_counts(workers, components)
    if max_workers is not None and workers > max_workers:
        raise ValueError(
            f"workers W={workers} is larger than the {max_workers} devices available; use "
            f"W <= {max_workers} (on a CPU, simulate more devices with "
            f"--config.num_cpu_devices={workers}).")
    valid = valid_coverages(workers, components, allow_nonuniform=allow_nonuniform)
    is_number = isinstance(coverage, (int, float, np.integer, np.floating)) and not isinstance(
        coverage, bool)
    target = float(coverage) if is_number and math.isfinite(coverage) else 0.5
    hint = (f"nearest valid coverages for W={workers}, G={components}: "
            f"{nearest_coverages(valid, target)}")
    if not is_number:
        raise ValueError(f"coverage C={coverage!r} must be a number; {hint}.")
    c = float(coverage)
    if not (0.0 < c <= 1.0) or math.isnan(c):
        raise ValueError(f"coverage C={coverage!r} must lie in (0, 1]; {hint}.")
    k = round(c * components)
    if k < 1 or not whole_count(c, components):
        raise ValueError(
            f"coverage C={c} gives C*G={c * components:g} components per worker for G={components}, "
            f"which is not a whole number; {hint}.")
    if workers * k < components:
        raise ValueError(
            f"coverage C={c} with W={workers} workers gives W*C={workers * k / components:g} < 1: "
            f"some components would be held by no worker; use C >= 1/W; {hint}.")
    if not allow_nonuniform and (workers * k) % components != 0:
        raise ValueError(
            f"coverage C={c} gives W*C={workers * k / components:g} holders per component for "
            f"W={workers}, which is not a whole number, so uniform representation is impossible; "
            f"{hint}; or set allow_nonuniform=True (--config.sdp.allow_nonuniform=True) for "
            f"near-uniform masks where each component is held by "
            f"{(workers * k) // components} or {-(-workers * k // components)} workers.")
    return int(k)


# --------------------------------------------------------------------------------------------
# Schemes
# --------------------------------------------------------------------------------------------

def cyclic_mask(workers: int, components: int, k: int) -> np.ndarray:
    """Cyclic sliding-window mask: worker ``w`` holds ``k`` consecutive components (mod ``G``).

    Windows start at evenly spread offsets ``floor(w * G / W)`` so neighbouring workers overlap
    and the mask graph is connected; when the evenly spread windows do not give uniform
    multiplicities, the starts ``w * k mod G`` (which always do) are used instead.

    Returns:
      bool array ``[W, G]`` with row sums ``k``.
    """
    def build(starts):
        m = np.zeros((workers, components), dtype=bool)
        for w, s in enumerate(starts):
            m[w, (s + np.arange(k)) % components] = True
        return m

    spread = build([(w * components) // workers for w in range(workers)])
    counts = spread.sum(0)
    if counts.max() - counts.min() <= 1:
        return spread
    return build([(w * k) % components for w in range(workers)])


def random_mask(workers: int, components: int, k: int, seed: int) -> np.ndarray:
    """Balanced random mask: row sums ``k``, column sums within one of ``W*k/G``, seeded.

    Starts from the cyclic mask with stride ``k`` (exact balanced margins), permutes components,
    then applies ``20 * W * G`` random margin-preserving 2x2 swaps (a checkerboard Markov chain),
    so the result is a seeded random draw with the same row and column sums.

    Returns:
      bool array ``[W, G]``.
    """
    rng = np.random.default_rng(seed)
    m = np.zeros((workers, components), dtype=bool)
    for w in range(workers):
        m[w, (w * k + np.arange(k)) % components] = True
    m = m[:, rng.permutation(components)]
    for _ in range(20 * workers * components):
        r1, r2 = rng.integers(0, workers, size=2)
        c1, c2 = rng.integers(0, components, size=2)
        if m[r1, c1] and m[r2, c2] and not m[r1, c2] and not m[r2, c1]:
            m[r1, c1] = m[r2, c2] = False
            m[r1, c2] = m[r2, c1] = True
    return m


def grouped_mask(workers: int, components: int, k: int) -> np.ndarray:
    """Grouped mask, the poorly connected extreme: the components split into ``n = G / k``
    disjoint sets and the workers into ``n`` equal groups; group ``i`` holds set ``i``. Uniform
    (every component held by ``W / n`` workers) but the mask graph falls apart into ``n``
    groups that share nothing: spectral gap 0 (Singh et al., arXiv 2507.09029, Sec. 4), so a
    run needs ``allow_disconnected``. With ``k = G`` it is the full mask.

    Returns:
      bool array ``[W, G]`` with row sums ``k``.
    Raises:
      ValueError: ``k`` does not divide ``G`` or ``G / k`` does not divide ``W``.
    """
    if components % k or workers % (components // k):
        raise ValueError(f"the grouped scheme needs C*G={k} to divide G={components} and "
                         f"G/(C*G) to divide W={workers}; use scheme cyclic or random, or a "
                         "coverage such as 1/2 with an even W.")
    n = components // k
    m = np.zeros((workers, components), dtype=bool)
    for w in range(workers):
        i = w * n // workers
        m[w, i * k:(i + 1) * k] = True
    return m


@dataclasses.dataclass(frozen=True)
class MaskRecipe:
    """Everything that determines a mask matrix: (scheme, W, G, C, seed) (docs/design.md, invariant 7).

    Attributes:
      scheme: ``"cyclic"``, ``"random"`` or ``"grouped"`` (:func:`grouped_mask`).
      workers: ``W``.
      components: ``G`` (blocks for B-SDP).
      coverage: ``C`` in (0, 1].
      seed: seed of the ``random`` scheme (ignored by ``cyclic``).
      allow_nonuniform: accept ``W*C`` not whole (near-uniform multiplicities).
    """

    scheme: str
    workers: int
    components: int
    coverage: float
    seed: int = 0
    allow_nonuniform: bool = False

    def __post_init__(self):
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) \
                or self.seed < 0:
            raise ValueError(f"mask seed={self.seed!r} must be a non-negative integer "
                             "(--config.sdp.mask_seed).")
        if self.scheme not in SCHEMES:
            raise ValueError(f"unknown mask scheme {self.scheme!r}; choose one of {SCHEMES}.")
        components_per_worker(self.workers, self.components, self.coverage,
                              allow_nonuniform=self.allow_nonuniform)

    @property
    def k(self) -> int:
        """Components held per worker, ``C * G``."""
        return round(self.coverage * self.components)

    def matrix(self) -> np.ndarray:
        """The mask matrix, bool ``[W, G]``; the same on every host and after a restart."""
        k = self.k
        if k == self.components:
            return np.ones((self.workers, self.components), dtype=bool)
        if self.scheme == "cyclic":
            return cyclic_mask(self.workers, self.components, k)
        if self.scheme == "grouped":
            return grouped_mask(self.workers, self.components, k)
        # A balanced random draw can, rarely, disconnect the workers; redraw deterministically.
        for attempt in range(64):
            m = random_mask(self.workers, self.components, k, seed=self.seed * 1000 + attempt)
            if self.workers == 1 or spectral_gap(m) > 1e-9:
                return m
        return m

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def build_mask(scheme: str, workers: int, components: int, coverage: float, seed: int = 0, *,
               allow_nonuniform: bool = False) -> np.ndarray:
    """Validated mask matrix, bool ``[W, G]``, each row holding exactly ``C * G`` components.

    Raises:
      ValueError: see :func:`components_per_worker`; or an unknown scheme.
    """
    return MaskRecipe(scheme, workers, components, coverage, seed, allow_nonuniform).matrix()


def validate_mask(mask: np.ndarray, *, require_uniform: bool = True) -> None:
    """Check a hand-made or loaded mask matrix.

    Raises:
      ValueError: if it is not 2-D bool, a row holds a different number of components than the
        others (SPMD needs equal shapes), a component is held by no worker, or (with
        ``require_uniform``) multiplicities differ.
    """
    mask = np.asarray(mask)
    if mask.ndim != 2 or mask.dtype != bool:
        raise ValueError(f"mask must be a 2-D bool array [W, G], got {mask.dtype} {mask.shape}.")
    rows = mask.sum(1)
    if rows.min() != rows.max():
        raise ValueError(f"every worker must hold the same number of components; row sums are "
                         f"{rows.tolist()}.")
    cols = mask.sum(0)
    if cols.min() == 0:
        raise ValueError(f"components {np.flatnonzero(cols == 0).tolist()} are held by no worker.")
    if require_uniform and cols.min() != cols.max():
        raise ValueError(f"multiplicities differ (uniform representation broken): {cols.tolist()}.")


# --------------------------------------------------------------------------------------------
# Tables for the compact layout
# --------------------------------------------------------------------------------------------

def held_table(mask: np.ndarray) -> np.ndarray:
    """Global indices of the components each worker holds, in ascending (depth) order.

    Returns:
      int32 ``[W, k]``; row ``w`` lists worker ``w``'s components. Slot ``j`` of a worker's
      compact stack holds global component ``held[w, j]``.
    """
    validate_mask(mask, require_uniform=False)
    return np.stack([np.flatnonzero(r) for r in mask]).astype(np.int32)


def slot_table(mask: np.ndarray) -> np.ndarray:
    """Inverse of :func:`held_table`: ``slot[w, g]`` = position of component ``g`` in worker
    ``w``'s compact stack, or -1 where ``w`` does not hold ``g``. int32 ``[W, G]``."""
    held = held_table(mask)
    slot = -np.ones(mask.shape, dtype=np.int32)
    for w, row in enumerate(held):
        slot[w, row] = np.arange(len(row), dtype=np.int32)
    return slot


def multiplicities(mask: np.ndarray) -> np.ndarray:
    """``m_g``: number of workers holding each component. int32 ``[G]``."""
    return np.asarray(mask).sum(0).astype(np.int32)


# --------------------------------------------------------------------------------------------
# Mask graph (Singh et al., Sec. 4: convergence depends on its spectral gap)
# --------------------------------------------------------------------------------------------

def mask_graph(mask: np.ndarray) -> np.ndarray:
    """Worker graph: ``A[u, v]`` = number of components workers ``u`` and ``v`` share (u != v).

    Returns:
      int64 ``[W, W]`` symmetric, zero diagonal.
    """
    m = np.asarray(mask).astype(np.int64)
    a = m @ m.T
    np.fill_diagonal(a, 0)
    return a


def spectral_gap(mask: np.ndarray) -> float:
    """Second-smallest eigenvalue of the normalized Laplacian ``I - D^-1/2 A D^-1/2`` of the
    mask graph; 0 when the workers split into groups that share no component. For ``W = 1``
    returns 1.0 by convention. An isolated worker (shares nothing) gives 0."""
    mask = np.asarray(mask)
    if mask.ndim != 2 or mask.size == 0:
        raise ValueError(f"mask must be a non-empty 2-D array [W, G], got shape {mask.shape}.")
    a = mask_graph(mask).astype(np.float64)
    w = a.shape[0]
    if w == 1:
        return 1.0
    deg = a.sum(1)
    if (deg == 0).any():
        return 0.0
    dinv = 1.0 / np.sqrt(deg)
    lap = np.eye(w) - dinv[:, None] * a * dinv[None, :]
    ev = np.sort(np.linalg.eigvalsh(lap))
    return float(max(ev[1], 0.0))


def summarize(mask: np.ndarray) -> dict[str, Any]:
    """Plain-JSON summary: W, G, k, multiplicity range and spectral gap."""
    validate_mask(mask, require_uniform=False)
    mult = multiplicities(mask)
    return {
        "workers": int(mask.shape[0]),
        "components": int(mask.shape[1]),
        "per_worker": int(mask[0].sum()),
        "multiplicity_min": int(mult.min()),
        "multiplicity_max": int(mult.max()),
        "spectral_gap": round(spectral_gap(mask), 6),
    }
