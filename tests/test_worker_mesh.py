"""SDP as the third axis (issue 49): a worker that spans F x T devices of the mesh axes ``fsdp``
and ``tensor``, the step manual over ``data`` alone.

On 8 simulated devices, ``2 workers x 2 fsdp x 2 tensor`` (and ``2 x 4 x 1``, ``2 x 1 x 4``)
equal the same run with one device per worker (``2 x 1 x 1``) after 3 steps, for every variant
and with the step's options; the stored bytes per device fall as 1 / (F x T) for what is
sharded; a run config's worker layout is checked before compute.
"""

import jax
import numpy as np
import optax
import pytest

from sdp_jax import mesh as mesh_lib
from sdp_jax.costs import comm
from sdp_jax.models import llama
from sdp_jax.models import vision as vm
from sdp_jax.models.llama import LlamaConfig
from sdp_jax.options import MeshShape, StepOptions
from sdp_jax.spec import sdp_spec as spec_lib
from sdp_jax.step.inner import InnerLayout
from sdp_jax.sync.placement import manual_spec
from sdp_jax.train import families
from sdp_jax.train import optimizer as optim_lib
from sdp_jax.train.run import resolve

import test_custom_model as custom  # noqa: E402
from test_train_cli import tiny  # noqa: E402

W = 2
# 8 query and key/value heads, 64 MLP neurons: every held count at C = 1/2 splits over T = 4.
CFG = LlamaConfig(vocab_size=64, d_model=32, n_layers=4, n_heads=8, n_kv_heads=8, d_ff=64,
                  max_seq_len=16)
OPT = optim_lib.OptimConfig(name="adamw", lr=1e-2, warmup_steps=1, weight_decay=0.0)
# SGD, whose update is linear in the gradient, where bf16 rounds (Adam turns rounding-level
# differences of near-zero entries into full-size steps of either sign)
SGD = optim_lib.OptimConfig(name="sgd", lr=0.5, warmup_steps=1, weight_decay=0.0)
COVERAGE = {"ddp": 1.0, "b-sdp": 0.5, "n-sdp": 0.5, "bb-sdp": 0.5, "nb-sdp": 0.5}
SHAPES = [(2, 2, 2), (2, 4, 1), (2, 1, 4)]


def plan(variant, cfg=CFG):
    return llama.make_plan(variant, cfg, W, COVERAGE[variant], "cyclic", 0,
                           allow_disconnected=True)   # (W = 2 at C = 1/2: two groups)


def builder(variant, shape=(W, 1, 1), cfg=CFG, optim=OPT, **options):
    mesh = mesh_lib.make_mesh(shape[0], fsdp=shape[1], tensor=shape[2])
    return families.language_model_step(cfg, plan(variant, cfg), optim, mesh,
                                        StepOptions(total_steps=10, grad_clip=1.0, **options))


def batches(n=3):
    rng = np.random.default_rng(1)
    return [rng.integers(0, CFG.vocab_size, (4 * W, 13)).astype(np.int32) for _ in range(n)]


def run(b):
    state, losses = b.init_state(seed=0), []
    for x in batches():
        state, m = b.train_step_fn()(state, b.put_batch(x))
        losses.append(float(m["train_loss"]))
    # the declared layout over a worker's devices is kept through the steps
    kept = jax.tree.map(lambda x, sh: x.sharding.is_equivalent_to(sh, x.ndim), state,
                        b.shardings())
    assert all(jax.tree.leaves(kept))
    return state, losses


def max_difference(b1, s1, b2, s2) -> float:
    f1, f2 = b1.full_params(s1["params"]), b2.full_params(s2["params"])
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
               for x, y in zip(jax.tree.leaves(f1), jax.tree.leaves(f2), strict=True))


def stored_bytes(state) -> int:
    """Bytes the first device stores of a state."""
    first = jax.devices()[0]
    return sum(s.data.nbytes for x in jax.tree.leaves(state) for s in x.addressable_shards
               if s.device == first)


# ------------------------------------------------------------------ the mesh and the layout
def test_the_mesh_keeps_a_workers_devices_together():
    mesh = mesh_lib.make_mesh(2, fsdp=2, tensor=2)
    assert mesh.axis_names == ("data", "fsdp", "tensor")
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    assert sorted(ids[0].ravel()) == [0, 1, 2, 3] and sorted(ids[1].ravel()) == [4, 5, 6, 7]
    assert mesh_lib.inner_sizes(mesh) == (2, 2)
    assert mesh_lib.manual_axes(mesh) == {"data"}
    plain = mesh_lib.make_mesh(4)
    assert plain.axis_names == ("data",) and mesh_lib.inner_sizes(plain) == (1, 1)
    with pytest.raises(ValueError, match=r"workers \* mesh.fsdp \* mesh.tensor = 4 \* 2 \* 2 = "
                                         r"16: devices needed, 8"):
        mesh_lib.make_mesh(4, fsdp=2, tensor=2)
    with pytest.raises(ValueError, match="a pipeline .pipeline.stages=2. with workers of several"):
        mesh_lib.make_mesh(2, stages=2, fsdp=2)


class FakeDevice:
    """A device of a multi-slice TPU job as the mesh reads it (its platform kept as "cpu",
    which mesh_utils lays out in id order)."""
    platform = device_kind = "cpu"

    def __init__(self, id, process_index, slice_index):
        self.id, self.process_index, self.slice_index = id, process_index, slice_index

    def __repr__(self):
        return f"D{self.id}"


def test_a_workers_devices_are_one_slices_or_one_hosts():
    """2 slices x 2 hosts x 2 devices, device ids interleaving the slices (as ids need not
    follow them): a worker of 4 devices is one slice (W = 2), a worker of 2 one host (W = 4),
    a worker of 8 both slices; ``data`` is the axis between them."""
    devices = [FakeDevice(i, process_index=(i % 2) * 2 + (i // 4), slice_index=i % 2)
               for i in range(8)]   # slice 0: ids 0 2 4 6; slice 1: ids 1 3 5 7
    key = np.vectorize(lambda d: (d.slice_index, d.process_index), otypes=[object])
    grid = mesh_lib.worker_grid(devices[::-1], 2, 2, 2)   # (the given order does not matter)
    assert grid.shape == (2, 2, 2)
    assert [{s for s, _ in key(w).ravel()} for w in grid] == [{0}, {1}]
    assert [[d.id for d in w.ravel()] for w in grid] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    grid = mesh_lib.worker_grid(devices, 4, 2, 1)
    assert [set(key(w).ravel()) for w in grid] == [{(0, 0)}, {(0, 1)}, {(1, 2)}, {(1, 3)}]
    grid = mesh_lib.worker_grid(devices, 1, 4, 2)
    assert [d.id for d in grid.ravel()] == [0, 2, 4, 6, 1, 3, 5, 7]
    grid = mesh_lib.worker_grid(devices, 1, 2, 2)   # the first slice, whole
    assert [d.id for d in grid.ravel()] == [0, 2, 4, 6]
    with pytest.raises(ValueError, match="16 devices needed for 2 workers of 4 x 2, 8 present"):
        mesh_lib.worker_grid(devices, 2, 4, 2)


def test_a_workers_order_inside_comes_from_mesh_utils(monkeypatch):
    """Inside a host (or a worker of several hosts) the order is mesh_utils.create_device_mesh's
    (a TPU's torus); where it cannot lay the devices out, the id order; a worker that would
    straddle two hosts is refused in one line."""
    devices = [FakeDevice(i, process_index=i // 4, slice_index=0) for i in range(8)]
    calls = []

    def reversed_mesh(shape, devs):
        calls.append(len(devs))
        return np.asarray(devs[::-1], dtype=object).reshape(shape)
    monkeypatch.setattr(mesh_lib.mesh_utils, "create_device_mesh", reversed_mesh)
    grid = mesh_lib.worker_grid(devices, 2, 2, 2)
    assert calls == [4, 4] and [d.id for d in grid.ravel()] == [3, 2, 1, 0, 7, 6, 5, 4]

    def fails(shape, devs):
        raise ValueError("no such physical layout")
    monkeypatch.setattr(mesh_lib.mesh_utils, "create_device_mesh", fails)
    assert [d.id for d in mesh_lib.worker_grid(devices, 2, 2, 2).ravel()] == list(range(8))
    hosts = [FakeDevice(i, process_index=i // 6, slice_index=0) for i in range(12)]
    with pytest.raises(ValueError, match=r"mesh.fsdp x mesh.tensor = 2 x 2 = 4 devices would "
                                         r"straddle two of the hosts of 6 devices each"):
        mesh_lib.worker_grid(hosts, 3, 2, 2)


def test_manual_specs_keep_only_the_manual_axes():
    P = jax.sharding.PartitionSpec
    assert manual_spec(P("data", "fsdp", None, "tensor"), {"data"}) == P("data", None, None, None)
    assert manual_spec(P(("data", "fsdp")), {"data"}) == P("data")
    assert manual_spec(P(None, ("fsdp", "tensor")), {"data"}) == P(None, None)


def test_the_declared_layout_over_a_workers_devices():
    spec = plan("n-sdp")
    inner = InnerLayout(spec, fsdp=2, tensor=2)
    # q by heads (column-parallel) and o by its input heads (row-parallel) over tensor; the
    # block stack's axis whole; fsdp on the largest other axis
    assert inner.axes(("blocks", "attn", "wq"), (4, 32, 8, 4)) == [None, "fsdp", "tensor", None]
    assert inner.axes(("blocks", "attn", "wo"), (4, 8, 4, 32)) == [None, "tensor", None, "fsdp"]
    assert inner.axes(("blocks", "mlp", "w_down"), (4, 64, 32)) == [None, "tensor", "fsdp"]
    # an embedding's rows (a gather's table) stay whole; a norm splits over fsdp alone
    assert inner.axes(("embed",), (64, 32)) == [None, "fsdp"]
    assert inner.axes(("final_norm", "scale"), (32,)) == ["fsdp"]
    assert inner.axes(("final_norm", "scale"), (31,)) == [None]
    # the held heads of N-SDP: T must divide them (CFG at C = 1/2 holds 4 key/value groups)
    with pytest.raises(ValueError, match=r"mesh.tensor=8 does not divide the 4 components .* of "
                                         r"'blocks/attn/wk' along axis 2"):
        InnerLayout(spec, tensor=8).axes(("blocks", "attn", "wk"), (4, 32, 4, 4))
    assert InnerLayout(spec).axes(("embed",), (64, 32)) == [None, None]


def test_a_held_count_that_tensor_does_not_divide_is_refused_when_built():
    cfg = LlamaConfig(vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=48,
                      max_seq_len=16)   # one key/value group held per worker at C = 1/2
    with pytest.raises(ValueError, match="mesh.tensor=2 does not divide the 1 components"):
        builder("n-sdp", (2, 1, 2), cfg=cfg)


def test_a_model_without_neurons_rules_refuses_tensor():
    spec = spec_lib.build(custom.Net(), custom.RULES[:1], "b-sdp", 4, 0.5)
    with pytest.raises(ValueError, match="mesh.tensor=2 splits the axes of the model's Neurons "
                                         "rules over tensor, but this model declares none"):
        InnerLayout(spec, tensor=2).check()


def test_stored_bytes_fall_with_the_workers_devices():
    """Each device of a worker of F x T = 2 x 2 stores 1/4 of a leaf a Neurons rule splits
    (over both axes), 1/2 of the others that fsdp divides (``run`` checks that the layout is
    kept through the steps)."""
    one, inner = builder("n-sdp"), builder("n-sdp", (2, 2, 2))
    s1, s2 = one.init_state(seed=0), inner.init_state(seed=0)
    split = {("blocks", "attn", "wq"): 4, ("blocks", "attn", "wo"): 4,
             ("blocks", "mlp", "w_down"): 4, ("blocks", "mlp", "w_up"): 4, ("embed",): 2,
             ("lm_head",): 2, ("final_norm", "scale"): 2, ("blocks", "attn_norm", "scale"): 2}
    for path, n in split.items():
        a, b = (spec_lib.flatten(s["params"])[path] for s in (s1, s2))
        assert b.addressable_shards[0].data.size * n == a.addressable_shards[0].data.size, path
    assert stored_bytes(s2) < 0.3 * stored_bytes(s1)
    assert "2 workers of 4 devices each" in inner.describe_placement()
    assert one.describe_placement() == ""


@pytest.mark.parametrize("variant, options", [("nb-sdp", {}), ("b-sdp", {"fsdp": True})])
def test_the_rows_layout_is_split_over_the_workers_devices_too(variant, options):
    """The rows layout S (backward masking's ZeRO-2 optimizer state; every leaf under FSDP over
    ``data``) splits each worker's row shard over its F x T = 2 x 2 devices: under FSDP every
    device stores exactly 1/4 of the parameters a one-device worker stores, the global shapes
    the same (a checkpoint resumes across F x T)."""
    one, inner = builder(variant, **options), builder(variant, (2, 2, 2), **options)
    s1, s2 = one.init_state(seed=0), inner.init_state(seed=0)
    opt1, opt2 = (dict(jax.tree_util.tree_flatten_with_path(s["opt_state"])[0]) for s in (s1, s2))
    rows = [k for k, x in opt2.items() if "data" in str(x.sharding.spec)]
    assert len(rows) >= 9, opt2.keys()   # (every block leaf's moments at least)
    for k in rows:
        assert opt1[k].shape == opt2[k].shape, k
        assert opt2[k].addressable_shards[0].data.size * 4 == \
            opt1[k].addressable_shards[0].data.size, (k, opt2[k].sharding.spec)
    if options.get("fsdp"):   # (the optimizer's scalar counts aside)
        assert stored_bytes(s2["params"]) * 4 == stored_bytes(s1["params"])
    else:
        assert stored_bytes(s2) < 0.3 * stored_bytes(s1)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["bb-sdp", "nb-sdp"])
def test_backward_masking_does_not_gather_its_full_model(variant):
    """Backward masking prunes each device's own part of its stored full model (block stacks
    on their unsplit axis; N-SDP's neurons and heads by InnerLayout.take): the compiled
    step's peak per device with workers of F = 4 devices is under 3/4 of one-device
    workers' (measured 0.67 and 0.69 at b7e880b; gathering the full model on every device
    kept a model of width 512 at 0.95)."""
    from sdp_jax.costs import memory_stats
    cfg = LlamaConfig(vocab_size=64, d_model=128, n_layers=4, n_heads=8, n_kv_heads=8,
                      d_ff=256, max_seq_len=16)   # (the parameters outweigh the activations)
    peaks = [memory_stats(builder(variant, shape, cfg=cfg).compiled_train_step(
        jax.ShapeDtypeStruct((8, 9), np.int32)))["peak_bytes_per_device"]
        for shape in ((2, 1, 1), (2, 4, 1))]
    assert peaks[1] < 0.75 * peaks[0], peaks


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["ddp", "b-sdp", "bb-sdp"])
def test_the_evaluation_streams_a_workers_own_parts(variant):
    """The full model's evaluation reads each block from its holders one block at a time,
    from the parts each device stores (N-SDP's compact leaves alone are gathered whole over a
    worker's devices): its compiled peak per device with workers of F = 4 is under 0.6 of
    one-device workers'."""
    from sdp_jax.costs import memory_stats
    cfg = LlamaConfig(vocab_size=64, d_model=128, n_layers=4, n_heads=8, n_kv_heads=8,
                      d_ff=256, max_seq_len=16)
    peaks = []
    for shape in ((2, 1, 1), (2, 4, 1)):
        b = builder(variant, shape, cfg=cfg)
        batch = jax.ShapeDtypeStruct((8, 9), np.int32, sharding=b.batch_sharding())
        compiled = b.eval_step_fn().lower(b.abstract_state()["params"], batch).compile()
        peaks.append(memory_stats(compiled)["peak_bytes_per_device"])
    assert peaks[1] < 0.6 * peaks[0], peaks


def test_bad_batches_for_a_workers_devices_are_one_line():
    b = builder("ddp", (2, 4, 1), grad_accum=2)   # 4 rows per worker: microbatches of 2
    with pytest.raises(ValueError, match="config.mesh.fsdp=4 does not divide the 2 rows"):
        b.put_batch(np.zeros((8, 13), np.int32))


def test_mesh_sizes_are_declared_settings():
    assert MeshShape.from_config(tiny()) == MeshShape()
    assert MeshShape(fsdp=2, tensor=4).devices == 8
    with pytest.raises(ValueError, match="config.mesh.fsdp=0"):
        MeshShape(fsdp=0)


def test_run_config_refusals_before_compute():
    n = jax.device_count()
    run = resolve(tiny(workers=0, **{"mesh.fsdp": 2, "mesh.tensor": 2}), n)
    assert run.workers == 2 and run.worker_devices == 8 and run.mesh_shape.devices == 4
    with pytest.raises(ValueError, match=r"workers \* \(mesh.fsdp x mesh.tensor\) = 4 \* 4 needs "
                                         "16 devices"):
        resolve(tiny(workers=4, **{"mesh.fsdp": 2, "mesh.tensor": 2}), n)
    with pytest.raises(ValueError, match="a pipeline .pipeline.stages=2. with workers of several "
                                         "devices .mesh.fsdp x mesh.tensor = 2 x 1."):
        resolve(tiny(workers=2, **{"mesh.fsdp": 2, "pipeline.stages": 2,
                                   "pipeline.microbatches": 2}), n)
    with pytest.raises(ValueError, match="emulated workers run on one device, but mesh.fsdp x "
                                         "mesh.tensor = 1 x 2"):
        resolve(tiny(emulate_workers=True, workers=2, **{"mesh.tensor": 2}), n)
    # one worker of several devices is plain FSDP / tensor parallelism (C = 1)
    assert resolve(tiny(workers=1, **{"mesh.fsdp": 2, "mesh.tensor": 2, "sdp.variant": "ddp"}),
                   n).workers == 1
    with pytest.raises(ValueError, match="config.mesh.fsdp=4 does not divide the 2 rows"):
        resolve(tiny(workers=2, **{"mesh.fsdp": 4}), n)
    # llama_tiny's 2 key/value groups: a worker of N-SDP at C = 1/2 holds 1, which T = 2
    # does not divide (refused before any compile; coverage=auto skips such a coverage)
    with pytest.raises(ValueError, match="mesh.tensor=2 does not divide the 1 components"):
        resolve(tiny(workers=2, **{"mesh.tensor": 2, "sdp.variant": "n-sdp",
                                   "sdp.coverage": 0.5, "sdp.allow_disconnected": True}), n)
    assert resolve(tiny(workers=2, align_every=5, **{"mesh.fsdp": 2}), n).workers == 2
    with pytest.raises(ValueError, match="config.mesh.tensor=2: tensor parallelism is not built "
                                         "for vision models"):
        from sdp_jax.train.config import vision_config
        c = vision_config("resnet18", "digits")
        c.mesh.tensor = 2
        resolve(c, n)


# ------------------------------------------------------------------ equal to one device each
@pytest.mark.slow
@pytest.mark.parametrize("variant", spec_lib.VARIANTS)
def test_every_variant_on_workers_of_several_devices_equals_one_device_each(variant):
    """3 AdamW steps with clipping: losses, parameters and the full model's evaluation equal
    within float32 noise, for 2 x 2 x 2, 2 x 4 x 1 and 2 x 1 x 4."""
    ref = builder(variant)
    s1, l1 = run(ref)
    e1 = float(ref.eval_step_fn()(s1["params"], ref.put_batch(batches(1)[0])))
    for shape in SHAPES:
        b = builder(variant, shape)
        s2, l2 = run(b)
        np.testing.assert_allclose(l2, l1, rtol=1e-5, err_msg=str(shape))
        assert max_difference(ref, s1, b, s2) < 1e-5, shape
        e2 = float(b.eval_step_fn()(s2["params"], b.put_batch(batches(1)[0])))
        np.testing.assert_allclose(e2, e1, rtol=1e-5, err_msg=str(shape))


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["b-sdp", "n-sdp", "nb-sdp"])
def test_the_gradient_alignment_on_workers_of_several_devices(variant):
    """SDPStep.alignment_fn (each worker's subnetwork gradient against the full model's, and
    the holders' mean against DDP's) gives the one-device workers' figures on 2 x 2 x 2 and
    2 x 4 x 1, within float32 noise."""
    x = batches(1)[0]
    got = []
    for shape in ((2, 1, 1), (2, 2, 2), (2, 4, 1)):
        b = builder(variant, shape)
        out = b.alignment_fn()(b.init_state(seed=0), b.put_batch(x))
        got.append([float(out["grad_alignment"]), float(out["update_alignment"])])
    assert got[0][1] < 0.99   # (not trivially 1)
    np.testing.assert_allclose(got[1:], [got[0]] * 2, atol=1e-5)


@pytest.mark.slow
def test_one_worker_of_several_devices_equals_one_device():
    """W = 1 (plain FSDP and tensor parallelism: C = 1, every variant) over 1 x 2 x 2 and
    1 x 4 x 1 (sdp_jax.sync.placement.OneWorker) equals one device after 2 AdamW steps, with
    the full model's evaluation; each device stores under 0.3 of the state."""
    x = batches(1)[0][:4]
    for variant in spec_lib.VARIANTS:
        one = llama.make_plan(variant, CFG, 1, 1.0, "cyclic", 0)
        out = []
        for shape in ((1, 1, 1), (1, 2, 2), (1, 4, 1)):
            mesh = mesh_lib.make_mesh(1, fsdp=shape[1], tensor=shape[2])
            b = families.language_model_step(CFG, one, OPT, mesh,
                                              StepOptions(total_steps=10, grad_clip=1.0))
            s = b.init_state(seed=0)
            for _ in range(2):
                s, m = b.train_step_fn()(s, b.put_batch(x))
            e = float(b.eval_step_fn()(s["params"], b.put_batch(x)))
            out.append((b, s, float(m["train_loss"]), e, stored_bytes(s)))
        (b1, s1, l1, e1, n1) = out[0]
        for shape, (b2, s2, l2, e2, n2) in zip(((1, 2, 2), (1, 4, 1)), out[1:]):
            assert abs(l2 - l1) < 1e-5 and abs(e2 - e1) < 1e-5, (variant, shape)
            assert max_difference(b1, s1, b2, s2) < 1e-5, (variant, shape)
            assert n2 < 0.3 * n1, (variant, shape)
            assert b2.describe_placement().startswith("1 worker of 4 devices (mesh data x "
                                                      "fsdp x tensor = ")


@pytest.mark.slow
@pytest.mark.parametrize("variant, options", [
    ("b-sdp", {"fsdp": True}), ("nb-sdp", {"fsdp": True}),
    ("n-sdp", {"average": "parameters", "sync_every": 2}),
    ("bb-sdp", {"remat": "full"}), ("n-sdp", {"remat": "dots"}),
    ("b-sdp", {"dtype": "bfloat16"}),
    ("nb-sdp", {"grad_accum": 2}), ("b-sdp", {"method": "reference"}),
])
def test_the_steps_options_compose_with_workers_of_several_devices(variant, options):
    bf16 = options.get("dtype") == "bfloat16"
    optim = SGD if bf16 else OPT
    ref, b = builder(variant, optim=optim, **options), builder(variant, (2, 2, 2), optim=optim,
                                                               **options)
    (s1, l1), (s2, l2) = run(ref), run(b)
    np.testing.assert_allclose(l2, l1, rtol=1e-3 if bf16 else 1e-5)
    assert max_difference(ref, s1, b, s2) < (1e-3 if bf16 else 1e-5)   # (bf16: 8-bit mantissa)


@pytest.mark.slow
def test_holder_exchange_bytes_across_workers_fall_with_the_workers_devices():
    """B-SDP's holder exchange over ``data`` is split by columns over a worker's devices
    (sdp_jax/sync/collectives.py, _columns_per_device): with workers of F = 4 each device
    sends about 1/4 of what a worker of one device sends across the workers, and no
    collective spans both ``data`` and a worker's own axes (compiled only)."""
    shape = jax.ShapeDtypeStruct((4 * W, 13), np.int32)
    data = {}
    for f in (1, 4):
        b = builder("b-sdp", (W, f, 1))
        text = b.compiled_train_step(shape).as_text()
        by_axis = comm.comm_bytes_per_device(text, b.mesh.devices.size,
                                             dict(b.mesh.shape))["by_axis"]
        assert [k for k in by_axis if "data" in k and k != "data"] == [], by_axis
        data[f] = by_axis["data"]
    assert data[4] < 0.35 * data[1], data


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["ddp", "n-sdp", "nb-sdp"])
def test_a_users_model_on_workers_of_several_devices(variant):
    """The user's model of tests/test_custom_model.py (list-form blocks) with 4 workers of 2
    devices, over fsdp and over tensor, equals 4 workers of one device."""
    x = custom.data()
    ref, _ = custom.make(variant, 0.5, optimizer=optax.adam(1e-2))
    s1 = ref.init(custom.Net())
    for _ in range(3):
        s1, _ = ref.train_step_fn()(s1, ref.put_batch(x))
    for f, t in [(2, 1), (1, 2)]:
        b, _ = custom.make(variant, 0.5, optimizer=optax.adam(1e-2),
                           mesh=mesh_lib.make_mesh(4, fsdp=f, tensor=t))
        s2 = b.init(custom.Net())
        for _ in range(3):
            s2, _ = b.train_step_fn()(s2, b.put_batch(x))
        assert max_difference(ref, s1, b, s2) < 1e-5, (f, t)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [4, 1])
def test_a_vision_model_with_batchnorm_on_workers_of_two_fsdp_devices(workers):
    """A ResNet with BatchNorm (model state averaged over holders, the model's own slots):
    4 workers of 2 fsdp devices (B-SDP at C = 1/2) equal 4 workers of one device after 3
    steps, and the full model's evaluation (sdp_jax.train.families.VisionEval) too; and one
    worker of 2 devices (C = 1) equals one device."""
    cfg = vm.VisionConfig(name="resnet18", width=4, depths=(2, 2), image_size=16,
                          num_classes=5)
    plan = families.vision_spec(cfg, "b-sdp", workers, 0.5 if workers > 1 else 1.0)
    rng = np.random.default_rng(0)
    data = [(rng.normal(size=(8, 16, 16, 3)).astype(np.float32),
             rng.integers(0, 5, 8).astype(np.int32)) for _ in range(3)]
    out = []
    for f in (1, 2):
        step = families.vision_step(cfg, plan, OPT, mesh_lib.make_mesh(workers, fsdp=f),
                                    StepOptions(total_steps=10, grad_clip=1.0))
        state = step.init_state(0)
        for batch in data:
            state, m = step.train_step(state, step.put_batch(batch))
        ev = families.VisionEval(step)
        x, y = step.put_batch(data[0])
        scores = ev.eval_step_fn()(state["params"], state["stats"], x, y,
                                   step.put_batch(np.ones(8, bool)))
        out.append((jax.device_get(state), float(m["train_loss"]), [float(v) for v in scores]))
    (a, la, sa), (b, lb, sb) = out
    worst = max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
                for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)) if np.size(x))
    assert worst < 1e-5 and abs(la - lb) < 1e-5
    np.testing.assert_allclose(sb, sa, rtol=1e-5)
