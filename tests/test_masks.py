import numpy as np
import pytest

from sdp_jax.spec import masks


@pytest.mark.parametrize("scheme", ["cyclic", "random"])
@pytest.mark.parametrize("W,L,C", [(8, 16, 0.5), (4, 8, 0.75), (8, 4, 0.5), (6, 12, 1 / 3),
                                   (4, 6, 0.5), (3, 9, 2 / 3), (8, 16, 0.25)])
def test_uniform_representation(scheme, W, L, C):
    m = masks.build_mask(scheme, W, L, C, seed=1)
    assert m.shape == (W, L) and m.dtype == bool
    assert (m.sum(1) == round(C * L)).all()          # every worker holds C*L blocks
    assert (m.sum(0) == round(W * C)).all()          # every block held by W*C workers
    np.testing.assert_array_equal(m, masks.build_mask(scheme, W, L, C, seed=1))  # reproducible


def test_random_scheme_depends_on_seed_and_cyclic_is_windows():
    a = masks.build_mask("random", 8, 16, 0.5, seed=0)
    b = masks.build_mask("random", 8, 16, 0.5, seed=1)
    assert not np.array_equal(a, b)
    c = masks.build_mask("cyclic", 4, 8, 0.5)
    for row in c:  # one contiguous cyclic window per worker
        idx = np.flatnonzero(row)
        assert len(np.flatnonzero(np.diff(np.r_[row, row[0]].astype(int)) != 0)) <= 2, idx


@pytest.mark.parametrize("W,L,C,fragment", [
    (8, 16, 0.0, "must lie in (0, 1]"),
    (8, 16, 1.5, "must lie in (0, 1]"),
    (8, 16, 0.3, "not a whole number"),
    (8, 16, 0.6875, "W*C=5.5"),
])
def test_bad_requests_name_value_and_nearest(W, L, C, fragment):
    with pytest.raises(ValueError) as e:
        masks.build_mask("cyclic", W, L, C)
    msg = str(e.value)
    assert fragment in msg and "nearest valid coverages" in msg
    assert str(C) in msg or f"{C:g}" in msg


def test_nearest_valid_listed_for_paper_1b_setting():
    with pytest.raises(ValueError, match=r"\[0\.5, 0\.625, 0\.75\]"):
        masks.components_per_worker(8, 16, 0.6875)


def test_too_many_workers_and_unknown_scheme():
    with pytest.raises(ValueError, match="larger than the 4 devices"):
        masks.components_per_worker(8, 16, 0.5, max_workers=4)
    with pytest.raises(ValueError, match="unknown mask scheme"):
        masks.build_mask("striped", 4, 8, 0.5)


def test_near_uniform_when_allowed():
    m = masks.build_mask("cyclic", 8, 16, 0.6875, allow_nonuniform=True)
    assert (m.sum(1) == 11).all()
    assert set(m.sum(0).tolist()) <= {5, 6}
    assert masks.spectral_gap(m) > 0


def test_spectral_gap_disjoint_groups_zero_cyclic_positive():
    disjoint = np.zeros((4, 4), bool)
    disjoint[0, [0, 1]] = disjoint[1, [0, 1]] = True
    disjoint[2, [2, 3]] = disjoint[3, [2, 3]] = True
    assert masks.spectral_gap(disjoint) == pytest.approx(0.0, abs=1e-9)
    assert masks.spectral_gap(masks.build_mask("cyclic", 8, 16, 0.5)) > 0.1
    g = masks.mask_graph(disjoint)
    assert g[0, 1] == 2 and g[0, 2] == 0 and (np.diag(g) == 0).all()


def test_tables():
    m = masks.build_mask("cyclic", 4, 8, 0.5)
    held, slot = masks.held_table(m), masks.slot_table(m)
    assert held.shape == (4, 4)
    for w in range(4):
        assert (np.diff(held[w]) > 0).all()  # depth order
        assert (slot[w, held[w]] == np.arange(4)).all()
        assert (slot[w, ~m[w]] == -1).all()


def test_validate_mask_rejects_unequal_rows_and_orphans():
    with pytest.raises(ValueError, match="same number"):
        masks.validate_mask(np.array([[1, 1, 0], [1, 0, 0]], bool))
    with pytest.raises(ValueError, match="held by no worker"):
        masks.validate_mask(np.array([[1, 0, 0], [1, 0, 0]], bool))
