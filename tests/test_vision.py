"""Vision SDP: ResNet / Swin variants against DDP, BatchNorm, dropped downsampling blocks, plans."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import compact_opt_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sdp_jax.options import StepOptions
from sdp_jax.costs import program as costs
from sdp_jax.spec import sdp_spec as sdp
from sdp_jax.models import vision as vm
from sdp_jax.train import families
from sdp_jax.train import migrations
from sdp_jax.train import optimizer as optim_lib

W = 4
RESNET = vm.VisionConfig(name="resnet18", width=4, depths=(2, 2), image_size=16, num_classes=5)
SWIN = vm.VisionConfig(name="swin_t", embed_dim=8, depths=(2, 2), num_heads=(2, 2),
                       image_size=16, num_classes=5)
OPT = optim_lib.OptimConfig(lr=1e-2, warmup_steps=1)


def options(clip=1.0, **settings) -> StepOptions:
    """The step options of these tests: 10 steps, clipping at ``clip`` (a run's default, 1)."""
    return StepOptions(total_steps=10, grad_clip=clip, **settings)


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((W,), ("data",), devices=jax.devices()[:W])


def _batches(mesh, cfg, n=3, same=False, seed=0):
    rng = np.random.default_rng(seed)
    sh = NamedSharding(mesh, P("data"))
    out = []
    for _ in range(n):
        per = 2
        x = rng.normal(size=(per if same else per * W, cfg.image_size, cfg.image_size, 3))
        y = rng.integers(0, cfg.num_classes, per if same else per * W)
        if same:  # identical data on every worker
            x, y = np.tile(x, (W, 1, 1, 1)), np.tile(y, W)
        out.append((jax.device_put(jnp.asarray(x, jnp.float32), sh),
                    jax.device_put(jnp.asarray(y, jnp.int32), sh)))
    return out


def _run(mesh, cfg, variant, coverage, batches, optim=OPT, remat="none", step_kw=None, clip=1.0,
         **kw):
    step_kw = step_kw or {}
    plan = families.vision_spec(cfg, variant, W, coverage, **kw)
    b = families.vision_step(cfg, plan, optim, mesh, options(clip, remat=remat, **step_kw))
    state = b.init_state(seed=0)
    fn = b.train_step_fn()
    for x, y in batches:
        state, m = fn(state, (x, y))
        float(m["train_loss"])  # one step in flight
    return b, state, {k: float(v) for k, v in m.items()}


def _close(a, b, tol=2e-5):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=tol, rtol=tol)


@pytest.mark.slow
@pytest.mark.parametrize("cfg,variants", [
    (RESNET, ("b-sdp", "n-sdp", "bb-sdp", "nb-sdp")),
    (SWIN, ("b-sdp", "n-sdp"))], ids=["resnet", "swin"])  # backward masking: model-agnostic
def test_every_variant_at_c1_matches_ddp(mesh, cfg, variants):
    """Invariant 1 for vision, BatchNorm running statistics included: block slots (with the
    padded downsampling block), narrowed channels / neurons / heads and backward masking at
    C = 1 give DDP's parameters after 3 steps."""
    batches = _batches(mesh, cfg)
    ref_b, ref_state, ref_m = _run(mesh, cfg, "ddp", 1.0, batches)
    ref = jax.device_get(families.VisionEval(ref_b).full_model(ref_state))
    for variant in variants:
        b, state, m = _run(mesh, cfg, variant, 1.0, batches)
        _close(ref, jax.device_get(families.VisionEval(b).full_model(state)))
        assert abs(m["train_loss"] - ref_m["train_loss"]) < 1e-5, variant
        assert abs(m["grad_norm"] - ref_m["grad_norm"]) < 1e-4, variant


@pytest.mark.slow
def test_bsdp_prunes_and_holders_agree(mesh):
    """B-SDP C = 1/2 on a ResNet: each worker stores one block per stage (a compact slot stack),
    every holder of a block has the same copy after training (invariant 2), activation
    checkpointing gives the same parameters, and the full model evaluates with every block."""
    batches = _batches(mesh, RESNET, n=2)
    b, state, m = _run(mesh, RESNET, "b-sdp", 0.5, batches)
    ddp = families.vision_step(RESNET, families.vision_spec(RESNET, "ddp", W, 1.0), OPT, mesh,
                               options())
    assert b.per_device_param_count() < 0.7 * ddp.per_device_param_count()
    slots = np.asarray(state["params"]["s1"]["slots"]["conv2"]["kernel"])  # [W, 1, ...]
    assert slots.shape[:2] == (W, 1)
    held = b.spec.kinds["s1.blocks"].held[:, 0]
    assert set(held) == {0, 1}  # the downsampling block is dropped by some workers
    for g in (0, 1):
        copies = slots[held == g, 0]
        assert len(copies) == 2 and np.array_equal(copies[0], copies[1])
    stats = np.asarray(state["stats"]["s1"]["slots"]["bn2"]["mean"])
    for g in (0, 1):
        assert np.array_equal(*stats[held == g, 0])
    _, state_ac, _ = _run(mesh, RESNET, "b-sdp", 0.5, batches, remat="full")
    _close(state["params"], state_ac["params"], tol=1e-5)  # checkpointing changes no result
    x, y = batches[0]
    valid = jax.device_put(jnp.ones(y.shape, bool), NamedSharding(mesh, P("data")))
    loss, right, count = families.VisionEval(b).eval_step_fn()(state["params"], state["stats"], x,
                                                            y, valid)
    assert int(count) == y.shape[0] and np.isfinite(float(loss))


@pytest.mark.slow
@pytest.mark.parametrize("cfg,variant", [(RESNET, "ddp"), (RESNET, "b-sdp"), (SWIN, "b-sdp")],
                         ids=["resnet", "resnet-slots", "swin-slots"])
def test_activation_checkpointing_changes_no_result_and_lowers_the_peak(mesh, cfg, variant):
    """Checkpointed blocks of equal shapes run under a scan (the only form XLA:CPU keeps the
    recomputation in; models.vision._run_blocks): ResNet stage 0's two blocks, the B-SDP
    slots at C = 1 (Swin's with the shift traced). The same parameters after 3 steps; a lower
    compiled peak (the training program: 2 images per worker)."""
    batches = _batches(mesh, cfg)
    b0, s0, m0 = _run(mesh, cfg, variant, 1.0, batches)
    b1, s1, m1 = _run(mesh, cfg, variant, 1.0, batches, remat="full")
    _close(s0["params"], s1["params"], tol=1e-5)
    _close(s0["stats"], s1["stats"], tol=1e-5)
    assert abs(m0["train_loss"] - m1["train_loss"]) < 1e-5
    if variant == "ddp":
        shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batches[0])
        peak = [costs.memory_stats(b.compiled_train_step(shapes))["peak_bytes_per_device"]
                for b in (b0, b1)]
        assert peak[1] < 0.85 * peak[0], peak


@pytest.mark.slow
def test_backward_masking_is_unbiased(mesh):
    """Invariant 3: with the same data on every worker, Nb-SDP and Bb-SDP (C = 1/2) take the
    step DDP takes (plain SGD, no clipping)."""
    sgd = optim_lib.OptimConfig(name="sgd", lr=0.1, warmup_steps=0, weight_decay=0.0)
    batches = _batches(mesh, RESNET, n=1, same=True)
    ref_b, ref_state, _ = _run(mesh, RESNET, "ddp", 1.0, batches, optim=sgd, clip=0.0)
    ref = jax.device_get(families.VisionEval(ref_b).full_model(ref_state))
    for variant in ("nb-sdp", "bb-sdp"):
        b, state, _ = _run(mesh, RESNET, variant, 0.5, batches, optim=sgd, clip=0.0)
        _close(ref, jax.device_get(families.VisionEval(b).full_model(state)), tol=1e-5)


def _tiny_params(cfg):
    m = vm.build(cfg, 0)
    return m.params(), m.batch_stats()


def _as_slots(tree, stage, ids):
    """Full tree -> slot form of ``stage`` holding blocks ``ids`` (padded to the union)."""
    out = dict(tree)
    st = dict(tree[stage])
    blocks = [st.pop(f"b{j}") for j in range(2)]
    union = jax.tree.map(lambda a, b: tuple(max(i, j) for i, j in zip(a.shape, b.shape)),
                         blocks[0], blocks[1])
    st["slots"] = jax.tree.map(
        lambda *xs: jnp.stack([jnp.pad(xs[j], [(0, n - m) for m, n in zip(xs[j].shape, xs[-1])])
                               for j in ids]),
        *blocks, union, is_leaf=lambda x: isinstance(x, tuple) and all(
            isinstance(i, int) for i in x))
    out[stage] = st
    return out


def test_dropped_downsampling_block_is_its_projection():
    """Invariant 5: a ResNet subnetwork without the downsampling block of stage 1 runs its 1x1
    projection shortcut (always-kept) and still produces the right shapes; with both blocks
    held the slot form equals the full model."""
    cfg = RESNET
    p, s = _tiny_params(cfg)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 16, 16, 3)), jnp.float32)
    full, _ = vm.forward(cfg, p, s, x, False)
    both, _ = vm.forward(cfg, _as_slots(p, "s1", [0, 1]), _as_slots(s, "s1", [0, 1]), x, False,
                         {"s1": jnp.asarray([0, 1])})
    np.testing.assert_allclose(both, full, atol=1e-5)
    for kind in ("mixed", "regular"):
        logits, new = vm.forward(cfg, _as_slots(p, "s1", [1]), _as_slots(s, "s1", [1]), x, True,
                                 {"s1": jnp.asarray([1])}, {"s1": kind})
        assert logits.shape == (2, cfg.num_classes)
        assert new["s1"]["slots"]["bn1"]["mean"].shape == (1, cfg.stage_width(1))
        # By hand: stem -> stage 0 -> relu(projection) -> block 1 (x2: one of 2 blocks held).
        h, _ = vm._resnet_stem(p, s, x, True)
        for j in range(2):
            h, _, _ = vm.resnet_block(cfg, p["s0"][f"b{j}"], s["s0"][f"b{j}"], h, True, 0, j == 0)
        short, _ = vm.resnet_projection(p["s1"]["proj"], s["s1"]["proj"], h, True)
        h = jax.nn.relu(short)
        r, _ = vm.resnet_branch(cfg, p["s1"]["b1"], s["s1"]["b1"], h, 1, True,
                                cfg.stage_width(1), scale=2.0)
        h = jax.nn.relu(h + r)
        np.testing.assert_allclose(logits, vm._head(p, jnp.mean(h, axis=(1, 2))), atol=1e-5)
        assert h.shape == (2, 8, 8, cfg.stage_width(1))


@pytest.mark.slow
def test_bn_recalibration_matches_full_model_statistics(mesh):
    """The full model's BatchNorm statistics (B-SDP evaluation) are its batch statistics."""
    batches = _batches(mesh, RESNET, n=1)
    b, state, _ = _run(mesh, RESNET, "b-sdp", 0.5, batches)
    ev = families.VisionEval(b)
    assert ev.recalibrate
    x, _ = batches[0]
    got = ev.bn_stats_fn()(state["params"], state["stats"], x)
    p, s = ev.full_model(state)
    xs = np.asarray(x).reshape(W, -1, *x.shape[1:])
    want = None
    for w in range(W):  # per-worker batch statistics, averaged
        zeros = jax.tree.map(jnp.zeros_like, s)
        _, new = vm.forward(RESNET, p, zeros, jnp.asarray(xs[w]), True)
        new = jax.tree.map(lambda a: a / (1 - vm.BN_MOMENTUM) / W, new)
        want = new if want is None else jax.tree.map(jnp.add, want, new)
    _close(want, got, tol=1e-4)
    ddp = families.vision_step(RESNET, families.vision_spec(RESNET, "ddp", W, 1.0), OPT, mesh,
                               options())
    assert not families.VisionEval(ddp).recalibrate


def test_plans_and_bad_coverages():
    """Stage-balanced block masks, realizable coverages and their errors, named before any
    compute."""
    r18 = vm.VisionConfig(name="resnet18")
    swin = vm.VisionConfig(name="swin_t")
    assert sdp.stage_balance(2 / 3, swin.depths, 8) == [2, 1, 4, 1]
    assert sdp.stage_balance(0.5, r18.depths, 8) == [1, 1, 1, 1]
    plan = families.vision_spec(swin, "b-sdp", 8, 2 / 3, allow_nonuniform=True)
    assert [plan.kinds[f"s{i}.blocks"].k for i in range(4)] == [2, 1, 4, 1]
    plan = families.vision_spec(r18, "b-sdp", 8, 0.5)
    assert plan.summary()["spectral_gap"] > 0  # stage windows slide: workers mix
    one = vm.VisionConfig(name="resnet18", width=4, depths=(4,), image_size=16)
    plan = families.vision_spec(one, "b-sdp", 4, 0.5, scheme="random", seed=2)
    assert list(plan.kinds) == ["s0.blocks"]   # a one-stage model: still a stage's stack
    assert plan.kinds["s0.blocks"].recipe["seed"] == 2 * 1009
    assert list(families.vision_record(plan)["recipes"]) == ["s0.blocks"]
    with pytest.raises(ValueError, match=r"resnet18: b-sdp: coverage C=0\.3 is not realizable"
                                         r".*nearest valid"):
        families.vision_spec(r18, "b-sdp", 8, 0.3)
    with pytest.raises(ValueError, match=r"C=0\.25 is not realizable.*from 4 .* to 8"):
        families.vision_spec(r18, "b-sdp", 8, 0.25)  # 2 blocks, but every stage keeps one
    with pytest.raises(ValueError, match="3 heads per block"):
        families.vision_spec(swin, "n-sdp", 8, 0.5)
    with pytest.raises(ValueError, match="allow_nonuniform"):
        families.vision_spec(swin, "b-sdp", 8, 2 / 3)
    with pytest.raises(ValueError, match="unknown variant"):
        families.vision_spec(r18, "x-sdp", 8, 0.5)
    with pytest.raises(ValueError, match="model.name='resnet50'"):
        vm.VisionConfig(name="resnet50")
    with pytest.raises(ValueError, match="not divisible"):
        vm.VisionConfig(name="swin_t", embed_dim=10)
    counts = {"resnet18": 11_173_962, "wrn18": 44_662_922}
    for name, n in counts.items():
        assert vm.param_count(vm.VisionConfig(name=name, widen=2 if name == "wrn18" else 1)) == n


# Mask records of vision checkpoints written before the spec existed (VisionPlan.record at
# commit a265ab2): the spec's masks must let those runs resume (docs/design.md invariant 7).
OLD_VISION_RECORDS = [
    ("resnet18", "b-sdp", 0.5, "cyclic", 0,
     "54fc3eee8e9f4c19768c47c8b339d7607e378793d9029fb779a4a8a472ad2b0e"),
    ("resnet18", "n-sdp", 0.5, "random", 3,
     "87876b70df7eb2e3db2cb3f32d5601429c64fdaa6c144f88f31b93473022e09e"),
    ("resnet18", "bb-sdp", 0.75, "random", 1,
     "d8dc778cc081f539e5d1f8c203d9299cc159e97e2f5132368cc123356a54cc2a"),
    ("swin_t", "b-sdp", 2 / 3, "cyclic", 0,
     "da9135144ca62feb3dbf863afd61f54720396c7db820bb7c252658090be8ff33"),
    ("swin_t", "nb-sdp", 2 / 3, "cyclic", 0,
     "ba0921a8237c8121e79d19934e258d68f059413bcc42b40fbfcf56be0f8e0eb9"),
]


@pytest.mark.parametrize("name, variant, coverage, scheme, seed, sha", OLD_VISION_RECORDS)
def test_vision_masks_equal_those_of_earlier_checkpoints(name, variant, coverage, scheme, seed,
                                                         sha):
    cfg = vm.VisionConfig(name=name, widen=2 if name == "wrn18" else 1)
    spec = families.vision_spec(cfg, variant, 8, coverage, scheme, seed,
                             allow_nonuniform=name == "swin_t")
    assert families.vision_record(spec)["mask_sha256"] == sha


def test_stage_blocks_override():
    swin = vm.VisionConfig(name="swin_t")
    plan = families.vision_spec(swin, "b-sdp", 8, 2 / 3, allow_nonuniform=True,
                             stage_blocks=(1, 2, 4, 1))
    assert [plan.kinds[f"s{i}.blocks"].k for i in range(4)] == [1, 2, 4, 1]
    with pytest.raises(ValueError, match=r"adding up to C \* 12 = 8.*default apportionment"):
        families.vision_spec(swin, "b-sdp", 8, 2 / 3, allow_nonuniform=True,
                          stage_blocks=(1, 1, 1, 1))


@pytest.mark.slow
def test_bench_vision_rows(tmp_path):
    """The benchmark compiles vision steps: N-SDP stores and peaks below DDP, with FSDP about
    1/W of the parameters; options built for language models only are refused before
    compiling."""
    from sdp_jax.bench import measure as bench
    cfg = tmp_path / "tiny_vision.py"
    cfg.write_text(
        "from sdp_jax.train.config import vision_config\n\n\ndef get_config():\n"
        "    c = vision_config('resnet18', 'digits')\n"
        "    c.model.update(width=4, image_size=16)\n    c.model.depths = (2, 2)\n"
        "    c.workers = 4\n    c.batch_per_worker = 4\n    return c\n")
    rows = bench.main(["--config", str(cfg), "--variants", "ddp,n-sdp",
                       "--config.sdp.coverage=0.5", "--noflops"])
    ddp, nsdp = rows
    assert nsdp["params_per_device"] < 0.7 * ddp["params_per_device"]
    assert nsdp["peak_bytes_per_device"] < ddp["peak_bytes_per_device"]
    assert nsdp["held_per_worker"].startswith("channels 2/4 4/8")
    fsdp = bench.main(["--config", str(cfg), "--variants", "n-sdp", "--config.sdp.coverage=0.5",
                       "--config.fsdp=True", "--noflops"])[0]
    assert fsdp["setting"] == "n-sdp+fsdp"
    assert fsdp["params_per_device"] < 0.3 * ddp["params_per_device"]   # ~1/W, padding
    with pytest.raises(SystemExit):
        bench.main(["--config", str(cfg), "--variants", "b-sdp", "--config.sdp.coverage=0.3"])
    with pytest.raises(SystemExit):
        bench.main(["--config", str(cfg), "--measure_time"])


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["ddp", "b-sdp"])
def test_periodic_parameter_averaging(mesh, variant):
    """Vision + periodic parameter averaging (the one SDPStep): with SGD and H = 1 it takes the
    gradient-averaging step, BatchNorm statistics included; with H = 2 the workers' copies of
    the always-kept stem drift apart on the local step and agree after the averaging step."""
    sgd = optim_lib.OptimConfig(name="sgd", lr=0.1, warmup_steps=0, weight_decay=0.0)
    batches = _batches(mesh, RESNET, n=2)
    ref_b, ref, m_ref = _run(mesh, RESNET, variant, 0.5, batches, optim=sgd, clip=0.0)
    b, got, m = _run(mesh, RESNET, variant, 0.5, batches, optim=sgd, clip=0.0,
                     step_kw=dict(average="parameters", sync_every=1))
    _close(jax.device_get(families.VisionEval(b).full_model(got)),
           jax.device_get(families.VisionEval(ref_b).full_model(ref)), tol=1e-5)
    assert abs(m["train_loss"] - m_ref["train_loss"]) < 1e-5
    b = families.vision_step(RESNET, families.vision_spec(RESNET, variant, W, 0.5), OPT, mesh,
                             options(average="parameters", sync_every=2))
    state = b.init_state(seed=0)
    for i, (x, y) in enumerate(batches + batches[:1]):
        state, _ = b.train_step(state, (x, y))
        stem = np.asarray(state["params"]["stem"]["conv"]["kernel"])
        assert stem.shape[0] == W   # per-worker copies of always-kept parameters
        spread = np.abs(stem - stem[0]).max()
        # step 1: lr 0 (warm-up); 2 and 4 average; 3 is a local step: the copies drift apart
        assert (spread > 0) if i == 2 else (spread == 0), (i, spread)


@pytest.mark.slow
@pytest.mark.parametrize("variant,coverage,ref_variant", [
    ("n-sdp", 1.0, "ddp"), ("b-sdp", 0.5, "b-sdp"), ("nb-sdp", 0.75, "nb-sdp")])
def test_fsdp_equals_unsharded_step(mesh, variant, coverage, ref_variant):
    """Vision + FSDP (ZeRO-3, the one SDPStep without a block runner): after 3 steps the
    parameters and BatchNorm statistics equal those of the same run without FSDP (of DDP at
    C = 1; 3 holders per channel at C = 3/4: gradients divided by a count that is not a power
    of two), each device stores about 1/W of the parameters, and the full-model evaluation
    with re-estimated BatchNorm statistics gives the same loss."""
    batches = _batches(mesh, RESNET)
    ref_b, ref, m_ref = _run(mesh, RESNET, ref_variant, 1.0 if ref_variant == "ddp" else coverage,
                             batches)
    b, got, m = _run(mesh, RESNET, variant, coverage, batches, step_kw=dict(fsdp=True))
    _close(jax.device_get(families.VisionEval(b).full_model(got)),
           jax.device_get(families.VisionEval(ref_b).full_model(ref)), tol=1e-5)
    assert abs(m["train_loss"] - m_ref["train_loss"]) < 1e-5
    assert abs(m["grad_norm"] - m_ref["grad_norm"]) < 1e-5
    n_full = sum(int(np.prod(s)) for s in b.spec.shapes.values())
    assert b.per_device_param_count() < n_full / W + 64 * len(b.spec.shapes)
    x, y = batches[0]
    valid = jax.device_put(jnp.ones(y.shape, bool), NamedSharding(mesh, P("data")))
    outs = []
    for builder, state in ((b, got), (ref_b, ref)):
        ev = families.VisionEval(builder)
        extra = (ev.bn_stats_fn()(state["params"], state["stats"], x),) if ev.recalibrate else ()
        outs.append(ev.eval_step_fn(bool(extra))(state["params"], state["stats"], x, y, valid,
                                                 *extra))
    assert abs(float(outs[0][0]) - float(outs[1][0])) < 1e-4 and outs[0][1] == outs[1][1]


@pytest.mark.slow
def test_reference_averaging_equals_alltoall(mesh):
    """``--config.sdp.method=reference`` for vision (one config schema): the full-size masked
    psum gives the parameters and BatchNorm statistics the holder all_to_all gives (N-SDP
    C = 1/2: channels and their statistics held by 2 of 4 workers)."""
    batches = _batches(mesh, RESNET, n=2)
    fast, s_fast, _ = _run(mesh, RESNET, "n-sdp", 0.5, batches)
    ref, s_ref, _ = _run(mesh, RESNET, "n-sdp", 0.5, batches, step_kw=dict(method="reference"))
    assert (fast.update.method, ref.update.method) == ("alltoall", "reference")
    _close(jax.device_get(families.VisionEval(fast).full_model(s_fast)),
           jax.device_get(families.VisionEval(ref).full_model(s_ref)), tol=1e-6)


# The train state layout of vision checkpoints written before the one step (the deleted
# VisionStepBuilder at commit a265ab2): SHA-256 over (path, shape, dtype, sharded over data)
# of every leaf of the abstract state, W = 4, C = 1/2.
OLD_STATE_LAYOUTS = [
    (RESNET, "b-sdp", 75, "d6e6a9270a58754d3c9742a5f32f5d41bedda129d32dd87e3549ee24e9f0f066"),
    (RESNET, "nb-sdp", 119, "56d7fd71a518d1fc38adfa8663e817685d724c5e6bf3afa46c3b4bad9de2e471"),
    (SWIN, "n-sdp", 192, "52fece9f65f0a6a2bb6daa5a819dbb81252f8df02c754fc64a0ff665e84f3908"),
    (SWIN, "ddp", 192, "ffa8f1b4f4ed2603a732ce54e255179263d035bc2d3493d3433888bcb457d537"),
]


@pytest.mark.parametrize("cfg, variant, n, sha", OLD_STATE_LAYOUTS,
                         ids=[f"{c.name}-{v}" for c, v, _, _ in OLD_STATE_LAYOUTS])
def test_state_layout_equals_that_of_earlier_checkpoints(mesh, cfg, variant, n, sha):
    """Vision checkpoints written by the earlier builder restore into the one step: same
    leaves, shapes, dtypes and shardings (and a ``stats`` entry, empty for Swin)."""
    import hashlib
    b = families.vision_step(cfg, families.vision_spec(cfg, variant, W, 0.5),
                             optim_lib.OptimConfig(), mesh, options())
    a = b.abstract_state()
    assert set(a) == {"params", "stats", "opt_state", "step"}
    if variant == "nb-sdp":   # since the sharded update (ZeRO-2) a legacy layout, converted
        (to_old, _), = migrations.layouts(b)
        a = to_old(a)
    rows = [(jax.tree_util.keystr(p), tuple(int(d) for d in x.shape), str(x.dtype),
             "data" in str(x.sharding.spec)) for p, x in jax.tree_util.tree_flatten_with_path(a)[0]]
    assert len(rows) == n
    assert hashlib.sha256(repr(rows).encode()).hexdigest() == sha


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["bb-sdp", "nb-sdp"])
def test_compact_optimizer_state_of_earlier_checkpoints_converts(mesh, variant):
    """Backward-masked vision checkpoints from before the sharded update stored each worker's
    compact optimizer state (list-form block slots, full-size leaves: no block runner); the
    step's migration (sdp_jax.train.migrations) gives back the moments of the sharded layout exactly."""
    b, state, _ = _run(mesh, RESNET, variant, 0.5, _batches(mesh, RESNET, n=1))
    (_, from_old), = migrations.layouts(b)
    back = from_old({**state, "opt_state": compact_opt_state(b, state)})["opt_state"]
    for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(state["opt_state"]), strict=True):
        assert x.sharding == y.sharding
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
