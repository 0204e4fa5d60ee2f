"""Simulated CPU devices for multi-device tests; must run before JAX initialises its backend."""

import os
import shutil
import sys
import tempfile

N_DEVICES = 8
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + f" --xla_force_host_platform_device_count={N_DEVICES}").strip()

# Compile time is most of the suite's time on a CPU, so two settings for the tests and the
# train.py / launch subprocesses they start (which inherit the environment):
# - one persistent compilation cache for the session: the suite compiles many identical programs
#   (the same tiny config in several tests, a run and its resume). A fresh folder per session,
#   removed at its end; a JAX_COMPILATION_CACHE_DIR the user set is used as it is (with its own
#   thresholds). The xdist workers and subprocesses share it without a lock (JAX's cache locks
#   only with a size limit): a half-written entry is read as a miss and recompiled, with a
#   warning.
# - JAX's `jax_disable_most_optimizations` (LLVM backend optimisation level 0): the same HLO
#   programs, so the same buffers, collectives and FLOP counts, compiled to slower machine code.
#   Unset it (JAX_DISABLE_MOST_OPTIMIZATIONS=0) to test the optimised code.
_OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_CACHE = tempfile.mkdtemp(prefix="sdp_jax_test_xla_cache_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", N_DEVICES)
jax.config.update("jax_platforms", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_sessionfinish(session, exitstatus):
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


def compact_opt_state(builder, state):
    """The optimizer state of a backward-masked ``state`` in the compact layout that its
    checkpoints stored before the sharded update (each worker's held components; every moment
    rebuilt from the shards), placed as the first migration's layout reads it (sdp_jax.train.migrations)."""
    import jax

    from sdp_jax.train import migrations
    (to_old, _), *_ = migrations.layouts(builder)
    old = to_old(builder.abstract_state())["opt_state"]
    keys = set(builder.param_shapes)

    def is_moment(x):
        return isinstance(x, dict) and set(x) == keys

    def compact(x, like):
        if not is_moment(x):
            return x
        stored = builder.layout.stored(builder.full_params(x, optimizer_layout=True))
        return jax.tree.map(lambda v, s: jax.device_put(v, s.sharding), stored, like)
    return jax.tree.map(compact, state["opt_state"], old, is_leaf=is_moment)


def resume_from_old_layout(ck, path, old_state, abstract, config, run_a, run_b):
    """Replace the checkpoint state at ``path`` (``CHECKPOINTS/STEP/state`` of run ``run_b``, a
    copy of ``run_a`` stopped early) by ``old_state`` in an earlier layout; the current layout
    alone must refuse it (from the checkpoint's metadata, before any array is read); then both
    runs finish and ``run_b``, resumed through its migration, ends with ``run_a``'s final
    validation loss."""
    import pytest

    from sdp_jax.train import checkpoint, loop
    shutil.rmtree(path)
    ck.save(path, old_state)
    ck.wait_until_finished()
    manager = checkpoint.CheckpointManager(os.path.dirname(os.path.dirname(path)))
    try:   # the current layout alone does not read it
        with pytest.raises(ValueError, match="holds another parameter layout"):
            manager.restore(int(os.path.basename(os.path.dirname(path))), abstract)
    finally:
        manager.close()
    config.stop_at_step = 0
    want = loop.train(config, str(run_a))["final_val_loss"]
    assert loop.train(config, str(run_b))["final_val_loss"] == pytest.approx(want, abs=1e-6)
