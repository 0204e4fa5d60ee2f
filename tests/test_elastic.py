"""Elastic resume (sdp_jax.train.elastic): a checkpoint continued under another W, coverage,
scheme or variant, with the full model and its optimizer moments rebuilt exactly and the
data stream carried on in examples (docs/design.md invariant 10; docs/checkpoints.md)."""

import json
import os

import grain
import jax
import numpy as np
import pytest

from sdp_jax.step import state as state_lib
from sdp_jax.train import checkpoint as ckpt_lib
from sdp_jax.train.data import tokens as data_lib
from sdp_jax.train import elastic, loop
from sdp_jax.train import run as run_lib
from sdp_jax.train.config import vision_config
from tests.test_train_cli import tiny

# ---------------------------------------------------------------------------- the data stream
class _Identity(grain.MapDataset):
    """Stream index n -> n (so a batch shows which stream positions it read)."""

    def __init__(self):
        super().__init__([])

    def __len__(self):
        return 10**12

    def __getitem__(self, n):
        return np.int64(n)


def _read(origin, first_batch, n_batches, G, N, drop, rows=None):
    ds = data_lib.layout_free_batches(_Identity(), examples=N, global_batch=G,
                                      rows=rows or (0, G), drop_epoch_remainder=drop,
                                      origin=origin)
    return [ds[k] for k in range(first_batch, first_batch + n_batches)]


@pytest.mark.parametrize("drop", [True, False])
def test_stream_after_a_switch_reads_every_example_once(drop):
    """8 steps of G = 4, then the global batch becomes 6 at step 8 (as W 4 -> 6 would make
    it): the stream goes on at the first unread example; nothing is read twice, and nothing
    is skipped but (with ``drop``) an epoch's last < G examples, as without a switch."""
    N = 23
    before = _read(data_lib.Origin(), 0, 8, 4, N, drop)
    stream = data_lib.Stream(None, N, drop)
    new = data_lib.Origin(8, stream.position(data_lib.Origin(), 8, 4))
    after = _read(new, 8, 12, 6, N, drop)
    seen = np.concatenate(before + after)
    assert len(set(seen.tolist())) == len(seen)                     # each example once
    assert np.all(np.diff(seen) > 0)                                 # in stream order
    gaps = [(a, b) for a, b in zip(seen[:-1], seen[1:]) if b != a + 1]
    if not drop:
        assert not gaps and seen[0] == 0
    else:   # only an epoch's remainder is skipped; every batch within one epoch
        assert all(b % N == 0 and b - a - 1 < 6 for a, b in gaps)
        assert all(len({int(x) // N for x in batch}) == 1 for batch in before + after)
    # the same global batches on another process layout
    halves = [_read(new, 8, 12, 6, N, drop, rows=r) for r in ((0, 3), (3, 3))]
    np.testing.assert_array_equal(np.concatenate(after),
                                  np.concatenate([np.concatenate(p) for p in zip(*halves)]))
    with pytest.raises(ValueError, match="before the stream's origin"):
        _read(new, 7, 1, 6, N, drop)


def test_stream_from_the_start_is_grains_batching():
    """From Origin(0, 0) the batches are those of grain's own batching of the shuffled stream
    (epoch-aligned, the last partial batch of each epoch dropped), for any process rows."""
    N, G = 23, 4
    ds = grain.MapDataset.range(N).shuffle(seed=3)
    for rows in ((0, 4), (2, 2)):
        ours = data_lib.layout_free_batches(ds, examples=N, global_batch=G, rows=rows,
                                            drop_epoch_remainder=True)
        chunks = G // rows[1]
        ref = ds.batch(rows[1], drop_remainder=True)[: (N // G) * chunks]
        ref = ref[rows[0] // rows[1]::chunks].repeat()
        for k in range(17):
            np.testing.assert_array_equal(ours[k], ref[k])


# ---------------------------------------------------------------------------- the state
def _config(**kw):
    base = {"workers": 8, "sdp.variant": "b-sdp", "sdp.coverage": 0.5, "steps": 20,
            "optim.warmup_steps": 2}
    return tiny(**{**base, **kw})


def _full_stats(builder, state):
    """The full model state (BatchNorm statistics) of a state in ``builder``'s layout."""
    return builder.full_state(state)["stats"]


def _checkpoint(tmp_path, config, seed=1, spread=None):
    """A checkpoint at step 5 of ``config``'s run whose parameters, Adam moments (and model
    state) are random full arrays laid out under its masks (holders agree); ``spread(state)``:
    changes it (per-worker copies). Returns (directory, run, full params, full moments, full
    model state or None)."""
    run = run_lib.resolve(config, jax.device_count())
    builder = loop.make_step(run, loop.make_mesh(run))
    rng = np.random.default_rng(seed)
    random = lambda x: rng.standard_normal(x.shape).astype(x.dtype)  # noqa: E731
    init = builder.init_state(0)
    full = jax.tree.map(random, builder.full_params(init))
    moments = [jax.tree.map(lambda x: rng.random(x.shape).astype(x.dtype), full)
               for _ in range(2)]
    stats = None if "stats" not in init else jax.tree.map(random, _full_stats(builder, init))
    state = elastic.lay_out(builder, {"params": full, "opt_state": _with_moments(
        builder, moments), "stats": stats}, 5)
    if spread is not None:
        state = spread(state)
    d = str(tmp_path / "checkpoints")
    m = ckpt_lib.CheckpointManager(d)
    m.save(5, state, loop._meta(config, run))   # pylint: disable=protected-access
    m.close()
    return d, run, full, moments, stats


def _with_moments(builder, moments):
    """The optimizer state of ``builder`` (AdamW: count, mu, nu) with full ``moments`` in
    place of its parameter-shaped entries, count 5."""
    fresh = jax.eval_shape(lambda: builder.init_state(0)["opt_state"])
    it = iter(moments)
    return state_lib.map_moments(lambda _: next(it), fresh, builder.compact_shapes,
                                 other=lambda x: np.full(x.shape, 5, x.dtype))


def _resume(directory, config, meta=lambda saved: saved):
    run = run_lib.resolve(config, jax.device_count())
    builder = loop.make_step(run, loop.make_mesh(run))
    m = ckpt_lib.CheckpointManager(directory)
    saved = meta(m.read_meta(5))
    state = elastic.rebuild(m, 5, saved, run, builder, lambda line: None)
    m.close()
    return builder, state


def _moments(builder, state):
    entries, _, flags = state_lib.split_moments(state["opt_state"], builder.compact_shapes)
    return [builder.full_params(x, optimizer_layout=True) for x, m in zip(entries, flags) if m]


def _assert_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
@pytest.mark.parametrize("before,after", [
    ({"workers": 8}, {"workers": 6}),
    ({"workers": 4, "sdp.variant": "n-sdp"}, {"workers": 8, "sdp.variant": "n-sdp"}),
    ({"workers": 4}, {"workers": 4, "sdp.coverage": 0.75}),
    ({}, {"sdp.variant": "ddp", "sdp.coverage": 1.0}),
    ({"sdp.variant": "nb-sdp"}, {"sdp.variant": "b-sdp", "fsdp": True}),
    ({"sdp.variant": "ddp", "sdp.coverage": 1.0}, {"sdp.variant": "nb-sdp"}),
], ids=["8-to-6-workers", "4-to-8-workers-nsdp", "C-half-to-3-4", "bsdp-to-ddp",
        "nbsdp-to-bsdp-fsdp", "ddp-to-nbsdp"])
def test_rebuilt_state_equals_the_checkpoint_bit_for_bit(tmp_path, before, after):
    """Right after the switch, the full parameters and both Adam moments equal those at the
    checkpoint, bit for bit, and the step and Adam's count carry on."""
    d, _, full, moments, _ = _checkpoint(tmp_path, _config(**before))
    builder, state = _resume(d, _config(**after))
    _assert_equal(builder.full_params(state), full)
    _assert_equal(_moments(builder, state), moments)
    assert int(state["step"]) == 5
    counts = [x for x in jax.tree.leaves(state["opt_state"]) if x.shape == ()]
    assert counts and all(int(c) == 5 for c in counts)


@pytest.mark.slow
def test_batchnorm_statistics_are_rebuilt_with_the_model(tmp_path):
    """A ResNet with BatchNorm (model state stored like the parameters): N-SDP on 8 workers
    -> 4, the parameters, moments and running statistics equal bit for bit."""
    def resnet(workers):
        c = vision_config("resnet18", "digits")
        c.model.update(width=4, depths=(2, 2))
        c.update(workers=workers, batch_per_worker=8, steps=20)
        c.optim.warmup_steps = 2
        c.sdp.update(variant="n-sdp", coverage=0.5)
        return c
    d, _, full, moments, stats = _checkpoint(tmp_path, resnet(8))
    builder, state = _resume(d, resnet(4))
    _assert_equal(builder.full_params(state), full)
    _assert_equal(_moments(builder, state), moments)
    _assert_equal(_full_stats(builder, state), stats)


def test_a_checkpoint_that_records_no_worker_count_is_rebuilt(tmp_path):
    """Checkpoints from before the resolved W was recorded in their meta (their config's
    explicit ``workers`` is it) are rebuilt too."""
    d, _, full, _, _ = _checkpoint(tmp_path, _config(workers=4))
    old_meta = lambda saved: {k: v for k, v in saved.items() if k != "workers"}  # noqa: E731
    builder, state = _resume(d, _config(workers=8), meta=old_meta)
    _assert_equal(builder.full_params(state), full)
    assert elastic.saved_workers(old_meta({"config": {"workers": 4}})) == 4


def test_periodic_averaging_averages_the_holders_copies_first(tmp_path):
    """Under periodic parameter averaging the per-worker copies of an always-kept leaf, and
    the holders' copies of a block, differ between averaging steps: the rebuilt model (here
    also under periodic averaging, on 4 workers) holds their mean."""
    config = _config(**{"sdp.average": "parameters", "sdp.sync_every": 4})
    offsets = np.arange(8, dtype=np.float32) - 3.5   # mean 0, exact in float32

    def spread(state):
        emb, wq = state["params"]["embed"], state["params"]["blocks"]["attn"]["wq"]
        assert emb.shape[0] == 8 and wq.shape[:2] == (8, 2)   # [W, ...], [W, k blocks, ...]
        moved = np.asarray(emb) + offsets.reshape((8,) + (1,) * (emb.ndim - 1))
        state["params"]["embed"] = jax.device_put(moved, emb.sharding)
        wq_moved = np.asarray(wq).copy()
        wq_moved[0, 0] += 4.0    # worker 0's copy of its first block (held by 4 workers)
        state["params"]["blocks"]["attn"]["wq"] = jax.device_put(wq_moved, wq.sharding)
        return state

    d, run, full, _, _ = _checkpoint(tmp_path, config, spread=spread)
    builder, state = _resume(d, _config(**{"workers": 4, "sdp.average": "parameters",
                                           "sdp.sync_every": 4}))
    got = builder.full_params(state)
    np.testing.assert_allclose(got["embed"], full["embed"], atol=1e-6)
    (kind,) = run.plan.kinds.values()
    g = int(kind.held[0, 0])   # the block in worker 0's first slot: its 4 holders' mean
    want = full["blocks"]["attn"]["wq"].copy()
    want[g] += 1.0
    np.testing.assert_allclose(got["blocks"]["attn"]["wq"], want, atol=1e-6)
    _assert_equal(got["blocks"]["mlp"], full["blocks"]["mlp"])   # holders agree: their value


@pytest.mark.slow
def test_train_switches_from_8_to_4_workers_and_carries_the_data_on(tmp_path):
    """The loop: a run stopped at step 2 on 8 workers is refused on 4 without the flag (the
    error names it) and with it when another field changed; resumed on 4 with the flag, the
    switch is logged, recorded in the checkpoint (with the stream's new origin) and in the
    summary, and the run finishes."""
    wd = str(tmp_path / "run")
    common = {"steps": 4, "eval_every": 100, "checkpoint_every": 2, "eval_batches": 1}
    loop.train(_config(**common, stop_at_step=2), wd)
    with pytest.raises(ValueError, match=r"^[^\n]*W = 8 workers.*continue it under this run's "
                                         r"setting with --config\.elastic=True"):
        loop.train(_config(**common, workers=4), wd)    # refused without the flag, named
    with pytest.raises(ValueError) as e:   # another seed is another run, flag or not
        loop.train(_config(**common, workers=4, elastic=True, seed=3), wd)
    assert "seed: checkpoint has 0" in str(e.value)
    assert "--config.elastic=True" not in str(e.value)
    out = loop.train(_config(**common, workers=4, elastic=True), wd)
    assert out["completed"] and out["steps"] == 4
    (switch,) = out["elastic"]
    assert switch["step"] == 2 and switch["from"]["workers"] == 8
    assert switch["to"]["workers"] == 4 and switch["to"]["global_batch"] == 4 * 2
    m = ckpt_lib.CheckpointManager(os.path.join(wd, "checkpoints"))
    meta = m.read_meta(4)
    m.close()
    # 2 steps of 8 x 2 windows were read before the switch: the new stream starts there
    assert meta["data_origin"] == [2, 2 * 16] and meta["elastic"] == [switch]
    with open(os.path.join(wd, "summary.json")) as f:
        assert json.load(f)["elastic"] == [switch]


@pytest.mark.slow
def test_tools_read_a_checkpoint_under_the_setting_that_wrote_it(tmp_path, capsys):
    """An elastic switch 8 -> 6 workers stopped before its first save in the new layout (here
    by ``stop_at_step`` at the checkpoint's step: config.json is written, no checkpoint):
    config.json names W = 6 while the latest checkpoint is W = 8's. The tools read it under
    its own setting, with the same loss as before the switch and one line saying so; an
    override of the setting stays the caller's and is refused as before."""
    from sdp_jax.tools import evaluate, trained
    wd = str(tmp_path / "run")
    common = {"steps": 4, "eval_every": 100, "checkpoint_every": 2, "eval_batches": 1}
    loop.train(_config(**common, stop_at_step=2), wd)
    before = evaluate.main(["--workdir", wd])
    stopped = loop.train(_config(**common, workers=6, elastic=True, stop_at_step=2), wd)
    assert stopped["steps"] == 2 and trained.read_config(wd).workers == 6
    m = ckpt_lib.CheckpointManager(os.path.join(wd, "checkpoints"))
    assert m.all_steps() == [2] and m.read_meta(2)["workers"] == 8
    m.close()
    capsys.readouterr()
    after = evaluate.main(["--workdir", wd])
    assert after == before and after["step"] == 2
    err = capsys.readouterr().err
    assert "the checkpoint at step 2 was written under another setting than config.json" in err
    assert "workers 8, variant b-sdp, coverage 0.5" in err
    t = trained.load(wd)
    assert t.run.workers == 8 and t.config.workers == 8 and not t.config.emulate_workers
    with pytest.raises(SystemExit):
        evaluate.main(["--workdir", wd, "--config.workers=4"])
    assert "W = 8 workers, this run has W = 4" in capsys.readouterr().err


def test_a_checkpoint_of_more_workers_than_devices_is_read_emulated():
    """:func:`elastic.as_written`: the checkpoint's W beyond the devices present is emulated;
    a field the caller overrode stays the caller's; ``workers=0`` stays 0 where it resolves to
    the checkpoint's W; a config already the checkpoint's comes back as it is."""
    given = _config(workers=6, batch_per_worker=2)
    saved = {"config": run_lib.trajectory_config(_config(workers=8, **{"sdp.coverage": 0.25})),
             "workers": 8}
    got = elastic.as_written(given, saved, given, device_count=4)
    assert got.workers == 8 and got.emulate_workers and got.sdp.coverage == 0.25
    assert given.workers == 6 and not given.emulate_workers   # (a copy)
    mine = _config(workers=6, batch_per_worker=2, **{"sdp.coverage": 0.75})
    kept = elastic.as_written(mine, saved, given, device_count=8)
    assert kept.workers == 8 and not kept.emulate_workers and kept.sdp.coverage == 0.75
    every = _config(workers=0, **{"sdp.coverage": 0.25})
    assert elastic.as_written(every, saved, every, device_count=8) is every
    assert elastic.as_written(every, saved, every, device_count=6).workers == 8
