"""One process of an elastic re-layout checked bit for bit (run by tests/test_multiprocess.py
under ``python -m sdp_jax.train.launch``, each process with its own simulated CPU devices).

    python tests/elastic_probe.py WORKDIR --config configs/llama_tiny.py --config.FIELD=VALUE ...

Every process resolves the run of the config flags (``train.py``'s, read by the same loader,
:mod:`sdp_jax.train.cli`; ``--config.elastic=True`` is implied) on
the launched processes, reads WORKDIR's latest checkpoint (written under another W, coverage or
process layout) and lays it out on the mesh as ``train.py`` does
(:func:`sdp_jax.train.elastic.rebuild`: each process places only its own devices' shares),
gathers the laid-out state from every process and joins it again under the new masks: the
result must equal the checkpoint's full model and optimizer state
(:func:`sdp_jax.train.elastic.read_full`, read again) bit for bit in every process. Process 0
prints one JSON line: ``{"leaves", "step", "workers", "processes", "change"}``; a mismatch is an
AssertionError naming the leaf (status 1).
"""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sdp_jax.train.launch import launcher as launch  # noqa: E402

launch.initialize("auto", 120)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from sdp_jax import mesh as mesh_lib  # noqa: E402
from sdp_jax.train import checkpoint as ckpt_lib  # noqa: E402
from sdp_jax.train import cli  # noqa: E402
from sdp_jax.train import elastic, loop  # noqa: E402
from sdp_jax.train import run as run_lib  # noqa: E402


def main(workdir: str, config) -> None:
    mesh_lib.simulate_cpu_devices(config.num_cpu_devices)
    with config.unlocked():
        config.elastic = True
    run = run_lib.resolve(config, jax.device_count())
    builder = loop.make_step(run, loop.make_mesh(run))
    manager = ckpt_lib.CheckpointManager(os.path.join(workdir, "checkpoints"))
    step = manager.latest_step()
    changes = manager.check_compatible(step, loop._meta(config, run),  # noqa: SLF001
                                       **loop._compatibility(run))      # noqa: SLF001
    assert changes, "the probe's run is the checkpoint's: no elastic switch to check"
    saved = manager.read_meta(step)
    saved["config"] = ckpt_lib.with_defaults(saved["config"], run.family.added_fields())
    state = elastic.rebuild(manager, step, saved, run, builder,   # what train.py runs
                            lambda line: print(line, file=sys.stderr))
    full, _ = elastic.read_full(manager, step, saved, run)          # the reference, again
    manager.close()
    gathered = multihost_utils.process_allgather(state, tiled=True)
    again = builder.full_state(gathered, average=False)
    assert int(gathered["step"]) == step
    want = jax.tree_util.tree_flatten_with_path(full)[0]
    got = jax.tree.leaves(again)
    assert len(want) == len(got), (len(want), len(got))
    for (path, a), b in zip(want, got):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape, (jax.tree_util.keystr(path), a, b)
        assert np.array_equal(a, b), f"{jax.tree_util.keystr(path)} differs after the re-layout"
    if jax.process_index() == 0:
        print(json.dumps({"leaves": len(got), "step": step, "workers": run.workers,
                          "processes": jax.process_count(),
                          "change": elastic.change_line(saved, run)}), flush=True)


if __name__ == "__main__":
    prog, argv = "tests/elastic_probe.py", [sys.argv[0], *sys.argv[2:]]
    fv = cli.flag_values(cli.config_file("llama_tiny.py"), argv, prog)
    cli.parse(fv, argv, prog, __doc__)
    main(sys.argv[1], fv.config)
