"""SDP on a model defined here (not in sdp_jax), through the public spec and step."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from sdp_jax import costs
from sdp_jax import spec as sdp
from sdp_jax.options import ModelHooks, StepOptions
from sdp_jax.spec import layout as layout_lib
from sdp_jax.step import SDPStep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
W, DEPTH = 4, 4


class Block(nnx.Module):
    def __init__(self, d, f, rngs):
        self.up = nnx.Linear(d, f, rngs=rngs)
        self.down = nnx.Linear(f, d, rngs=rngs)

    def __call__(self, h):
        return h + self.down(jnp.tanh(self.up(h)))


class Net(nnx.Module):
    def __init__(self, depth=DEPTH, rngs=None, d=16, f=24):
        rngs = rngs or nnx.Rngs(0)
        self.inp = nnx.Linear(5, d, rngs=rngs)
        self.blocks = nnx.List([Block(d, f, rngs) for _ in range(depth)])
        self.out = nnx.Linear(d, 1, rngs=rngs)

    def __call__(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)[:, 0]


RULES = [sdp.Blocks("blocks"),
         sdp.Neurons("blocks/*/up/kernel", 1, "mlp"), sdp.Neurons("blocks/*/up/bias", 0, "mlp"),
         sdp.Neurons("blocks/*/down/kernel", 0, "mlp")]


def make(variant, coverage, optimizer=None, mesh=None, **kw):
    spec = sdp.build(Net(), RULES, variant, W, coverage)
    local = nnx.graphdef(nnx.eval_shape(lambda: Net(spec.local_blocks)))

    def loss_fn(params, batch):
        x, y = batch
        return jnp.mean((nnx.merge(local, params)(x) - y) ** 2)
    return SDPStep(spec, loss_fn, optimizer or optax.adam(1e-2), mesh, StepOptions(**kw)), loss_fn


def data(n=W * 8, seed=1):
    x = jax.random.normal(jax.random.key(seed), (n, 5))
    return x, jnp.sin(x.sum(1))


def full_loss(params, batch):
    x, y = batch
    return jnp.mean((nnx.merge(nnx.graphdef(Net()), params)(x) - y) ** 2)


def reference_steps(optimizer, batches):
    """Plain single-device training on each whole global batch."""
    params = nnx.to_pure_dict(nnx.state(Net(), nnx.Param))
    opt = optimizer.init(params)
    for b in batches:
        g = jax.grad(full_loss)(params, b)
        u, opt = optimizer.update(g, opt, params)
        params = optax.apply_updates(params, u)
    return params


def assert_trees_close(a, b, tol):
    fa, fb = layout_lib._flatten(a), layout_lib._flatten(b)
    assert fa.keys() == fb.keys()
    for p in fa:
        np.testing.assert_allclose(np.asarray(fa[p]), np.asarray(fb[p]), rtol=tol, atol=tol,
                                   err_msg=str(p))


@pytest.mark.parametrize("variant", ["ddp", "b-sdp", "bb-sdp", "nb-sdp"])
def test_coverage_one_equals_ddp_after_three_steps(variant):
    # Plain SGD: a gradient W times too large (the shard_map double count) would show.
    trainer, _ = make(variant, 1.0, optax.sgd(0.1))
    state = trainer.init(Net())
    batches = [data(seed=s) for s in range(3)]
    for b in batches:
        state, _ = trainer.train_step(state, trainer.put_batch(b))
    assert_trees_close(trainer.full_params(state), reference_steps(optax.sgd(0.1), batches),
                       2e-5)


@pytest.mark.parametrize("variant", ["n-sdp", "bb-sdp"])
def test_fsdp_without_a_block_runner_equals_the_unsharded_step(variant):
    """A user's model (list-form blocks, no block runner) with FSDP: the whole model is
    gathered per step and each entry's gradient divided by its holders; at C = 3/4 (3 holders)
    the parameters after 3 Adam steps equal the unsharded step's, stored 1/W per device."""
    batches = [data(seed=s) for s in range(3)]
    out = []
    for fsdp in (False, True):
        trainer, _ = make(variant, 0.75, fsdp=fsdp)
        state = trainer.init(Net())
        for b in batches:
            state, m = trainer.train_step(state, trainer.put_batch(b))
        out.append((trainer, trainer.full_params(state), float(m["grad_norm"])))
    assert_trees_close(out[1][1], out[0][1], 1e-5)
    assert abs(out[1][2] - out[0][2]) < 1e-5
    n_full = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(out[1][1]))
    assert out[1][0].per_device_param_count() <= n_full / W + W * len(jax.tree.leaves(out[1][1]))


def test_nb_sdp_is_unbiased_with_identical_data():
    # Invariant 3: the same batch on every worker -> one SGD step equals the full model's.
    trainer, _ = make("nb-sdp", 0.5, optax.sgd(0.1))
    state = trainer.init(Net())
    x, y = data(n=8)
    tiled = (jnp.tile(x, (W, 1)), jnp.tile(y, W))
    state, m = trainer.train_step(state, trainer.put_batch(tiled))
    assert_trees_close(trainer.full_params(state), reference_steps(optax.sgd(0.1), [(x, y)]),
                       1e-5)


def _block_bytes_per_device(compiled, state, part):
    """Bytes per device of the block leaves of ``state[part]``, from the compiled program's
    input shardings."""
    shardings = compiled.input_shardings[0][0][part]
    total = 0
    for (path, x), sh in zip(jax.tree_util.tree_flatten_with_path(state[part])[0],
                             jax.tree.leaves(shardings)):
        if any(str(getattr(k, "key", "")) == "blocks" for k in path):
            total += int(np.prod(sh.shard_shape(x.shape))) * x.dtype.itemsize
    return total


def test_b_sdp_compact_layout_stores_c_times_ddp_block_bytes():
    figures = {}
    for variant, c in (("ddp", 1.0), ("b-sdp", 0.5)):
        trainer, _ = make(variant, c)
        state = trainer.init(Net())
        compiled = trainer.compiled_train_step(data())
        figures[variant] = (_block_bytes_per_device(compiled, state, "params"),
                            _block_bytes_per_device(compiled, state, "opt_state"),
                            costs.memory_stats(compiled)["peak_bytes_per_device"])
    assert figures["b-sdp"][0] == pytest.approx(0.5 * figures["ddp"][0], rel=0.01)
    assert figures["b-sdp"][1] == pytest.approx(0.5 * figures["ddp"][1], rel=0.01)   # Adam
    assert figures["ddp"][1] == pytest.approx(2 * figures["ddp"][0], rel=0.01)        # m, v
    assert figures["b-sdp"][2] < figures["ddp"][2]


@pytest.mark.parametrize("variant", ["b-sdp", "n-sdp"])
def test_forward_variants_train_and_holders_agree(variant):
    trainer, _ = make(variant, 0.5, grad_clip=0.5)
    ref, _ = make(variant, 0.5, grad_clip=0.5, method="reference")
    state, rstate = trainer.init(Net()), ref.init(Net())
    losses = []
    for s in range(4):
        b = data(seed=s)
        state, m = trainer.train_step(state, trainer.put_batch(b))
        rstate, _ = ref.train_step(rstate, ref.put_batch(b))
        losses.append(float(m["train_loss"]))
    assert losses[-1] < losses[0]
    assert_trees_close(state["params"], rstate["params"], 1e-5)   # alltoall == masked psum
    if variant == "b-sdp":   # every holder of block g stores the same values
        t = trainer.spec.kinds["block"]
        stored = np.asarray(state["params"]["blocks"]["slots"]["up"]["kernel"])  # [W, k, ...]
        assert stored.shape[:2] == (W, t.k)
        kernels = {}
        for w in range(W):
            for j in range(t.k):
                kernels.setdefault(int(t.held[w, j]), []).append(stored[w, j])
        assert sorted(kernels) == list(range(DEPTH))
        for g, xs in kernels.items():
            assert len(xs) == 2
            np.testing.assert_array_equal(xs[1], xs[0])


def test_backward_step_keeps_the_callers_model_and_dtypes():
    model = Net()
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16),
                          nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    spec = sdp.build(params, RULES, "bb-sdp", W, 0.5)
    graph = nnx.graphdef(Net())

    def loss_fn(p, batch):
        x, y = batch
        return jnp.mean((nnx.merge(graph, p)(x.astype(jnp.bfloat16)) - y) ** 2).astype(
            jnp.float32)
    trainer = SDPStep(spec, loss_fn, optax.sgd(0.1))
    state = trainer.init(params)
    state, _ = trainer.train_step(state, trainer.put_batch(data()))
    assert {x.dtype for x in jax.tree.leaves(state["params"])} == {jnp.dtype(jnp.bfloat16)}
    for x in jax.tree.leaves(params):   # the caller's arrays were not donated
        np.asarray(x)


def test_bad_inputs_refused_before_compute():
    trainer, _ = make("b-sdp", 0.5)
    with pytest.raises(ValueError, match="differ from the ones the spec was built from"):
        trainer.init(Net(depth=DEPTH + 2))
    with pytest.raises(ValueError, match="does not split over W=4 workers"):
        trainer.put_batch(data(n=30))
    with pytest.raises(ValueError, match="grad_clip=nan must be a finite number"):
        make("b-sdp", 0.5, grad_clip=float("nan"))
    mesh = jax.make_mesh((W,), ("x",), devices=jax.devices()[:W])
    with pytest.raises(ValueError, match="none named 'data'"):
        make("b-sdp", 0.5, mesh=mesh)


def test_two_documented_mistakes_are_one_line_errors():
    """A graphdef of the full depth under b-sdp (flax: "Incorrect number of leaves, expected 53
    leaves, but got 29") and optax.clip_by_global_norm in the chain (a shard_map out_specs
    error) each end in one line naming the fix (docs/custom_models.md)."""
    spec = sdp.build(Net(), RULES, "b-sdp", W, 0.5)
    full = nnx.graphdef(Net())

    def loss_fn(params, batch):   # the mistake: the full model's graphdef
        x, y = batch
        return jnp.mean((nnx.merge(full, params)(x) - y) ** 2)
    trainer = SDPStep(spec, loss_fn, optax.adam(1e-2))
    state, batch = trainer.init(Net()), trainer.put_batch(data())
    with pytest.raises(ValueError) as e:
        trainer.train_step(state, batch)
    assert "\n" not in str(e.value) and "2 of 4 blocks per worker under b-sdp" in str(e.value)
    assert "spec.local_blocks" in str(e.value) and "Incorrect number of leaves" in str(e.value)
    clipped = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
    trainer, _ = make("b-sdp", 0.5, clipped)
    with pytest.raises(ValueError) as e:
        trainer.train_step(trainer.init(Net()), trainer.put_batch(data()))
    assert "\n" not in str(e.value) and "optax.clip_by_global_norm" in str(e.value)
    assert "grad_clip=" in str(e.value) and "the updated state ['opt_state']" in str(e.value)
    trainer, _ = make("b-sdp", 0.5, optax.adam(1e-2), grad_clip=1.0)   # the fix trains
    _, m = trainer.train_step(trainer.init(Net()), trainer.put_batch(data()))
    assert np.isfinite(float(m["train_loss"]))


def test_mesh_of_another_size_refused():
    spec = sdp.build(Net(), RULES, "b-sdp", W, 0.5)
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    with pytest.raises(ValueError, match="mesh axis 'data' has 2 devices but the spec has W=4"):
        SDPStep(spec, lambda p, b: 0.0, optax.sgd(0.1), mesh)


@pytest.mark.slow
def test_example_runs():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "custom_model.py")],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "b-sdp (forward masking), coverage C=0.5: each worker holds 4/8 blocks" in out.stdout
    assert "nb-sdp (backward masking)" in out.stdout


@pytest.mark.parametrize("variant", ["b-sdp", "n-sdp"])
def test_periodic_averaging_on_a_users_model(variant):
    """H = 1 with SGD is gradient averaging; H = 2 lets the workers' copies drift, then agree."""
    sgd = optax.sgd(0.05)
    grads, _ = make(variant, 0.5, sgd)
    every, _ = make(variant, 0.5, sgd, average="parameters", sync_every=1)
    two, _ = make(variant, 0.5, sgd, average="parameters", sync_every=2)
    sg, se, s2 = grads.init(Net()), every.init(Net()), two.init(Net())
    for s in range(2):
        b = data(seed=s)
        sg, _ = grads.train_step(sg, grads.put_batch(b))
        se, _ = every.train_step(se, every.put_batch(b))
        s2, _ = two.train_step(s2, two.put_batch(b))   # averages on even steps
        inp = np.asarray(s2["params"]["inp"]["kernel"])   # [W, ...]: per-worker copies
        assert inp.shape[0] == W
        spread = np.abs(inp - inp[0]).max()
        assert (spread > 0) if s == 0 else (spread == 0)
    assert_trees_close(grads.full_params(sg), every.full_params(se), 1e-5)


def test_bf16_compute_on_a_users_model_keeps_float32_state():
    trainer, _ = make("b-sdp", 0.5, dtype="bfloat16")
    state = trainer.init(Net())
    losses = []
    for _ in range(6):   # the same batch: the loss must fall
        state, m = trainer.train_step(state, trainer.put_batch(data()))
        losses.append(float(m["train_loss"]))
    assert losses[-1] < losses[0]
    assert {x.dtype for x in jax.tree.leaves(state["params"])} == {jnp.dtype(jnp.float32)}


def test_block_runner_options_refused_without_a_runner():
    spec = sdp.build(Net(), RULES, "b-sdp", W, 0.5)
    with pytest.raises(ValueError, match="remat works block by block"):
        SDPStep(spec, lambda p, b: 0.0, optax.sgd(0.1), options=StepOptions(remat="full"))
    with pytest.raises(ValueError, match="block_fn needs a stacked block subtree"):
        SDPStep(spec, ModelHooks(lambda p, b, run: 0.0, block_fn=lambda p, h: h), optax.sgd(0.1))


def _stateful(variant, coverage):
    """A user's model with non-gradient state (each block's running mean of its input, like a
    BatchNorm statistic), in the local list form (``stacked_slots=False``)."""
    params = nnx.to_pure_dict(nnx.state(Net(), nnx.Param))
    state = {"blocks": {j: {"mean": jnp.zeros((16,))} for j in range(DEPTH)}}
    spec = sdp.build(params, RULES, variant, W, coverage)
    sspec = sdp.build(state, [sdp.Blocks("blocks")], variant, W, coverage)
    local = nnx.graphdef(nnx.eval_shape(lambda: Net(spec.local_blocks)))

    def loss_fn(p, batch, st):
        x, y = batch
        model = nnx.merge(local, p)
        h, new = model.inp(x), {"blocks": {}}
        for j, blk in enumerate(model.blocks):
            new["blocks"][j] = {"mean": 0.9 * st["blocks"][j]["mean"] + 0.1 * h.mean(0)}
            h = blk(h - st["blocks"][j]["mean"])
        return jnp.mean((model.out(h)[:, 0] - y) ** 2), new
    step = SDPStep(spec, ModelHooks(loss_fn, state_spec=sspec), optax.sgd(0.1))
    return step, step.init((params, state))


def test_model_state_on_a_users_model():
    """Model state (state_spec) in the local list form: at C = 1 b-sdp equals DDP, state
    included; at C = 1/2 every holder of a block has the same state, which moved."""
    batches = [data(seed=s) for s in range(3)]
    out = {}
    for variant, c in (("ddp", 1.0), ("b-sdp", 1.0), ("b-sdp", 0.5)):
        step, st = _stateful(variant, c)
        for b in batches:
            st, m = step.train_step(st, step.put_batch(b))
        out[(variant, c)] = (step, st)
    (d_step, d), (b_step, b) = out[("ddp", 1.0)], out[("b-sdp", 1.0)]
    assert_trees_close(b_step.full_params(b), d_step.full_params(d), 2e-5)
    ms = np.asarray(b["stats"]["blocks"]["slots"]["mean"])      # [W, L, d]: slot j = block j
    np.testing.assert_allclose(ms, np.asarray(d["stats"]["blocks"]["slots"]["mean"]),
                               rtol=2e-5, atol=1e-6)
    assert np.abs(ms).max() > 0
    step, st = out[("b-sdp", 0.5)]
    ms = np.asarray(st["stats"]["blocks"]["slots"]["mean"])      # [W, k, d]
    held = step.spec.kinds["block"].held
    for g in range(DEPTH):
        copies = [ms[w, list(held[w]).index(g)] for w in range(W) if g in held[w]]
        assert len(copies) == 2 and np.array_equal(copies[0], copies[1])
        assert np.abs(copies[0]).max() > 0
    with pytest.raises(ValueError, match="initializes from a pair"):
        step.init(nnx.to_pure_dict(nnx.state(Net(), nnx.Param)))


def _cosine(a, b):
    a = np.concatenate([np.ravel(x) for x in jax.tree.leaves(a)])
    b = np.concatenate([np.ravel(x) for x in jax.tree.leaves(b)])
    return float(a @ b / np.sqrt((a @ a) * (b @ b)))


@pytest.mark.slow
def test_gradient_alignment_checked_by_hand():
    """SDPStep.alignment_fn against plain jax.grad on one device: B-SDP at C = 1/2 (each of
    the 4 workers runs 2 of the 4 blocks), worker by worker, and DDP (C = 1), where both
    cosines are 1."""
    batch = data()
    b = batch[0].shape[0] // W
    def any_depth(params, batch):   # the subnetwork's and the full model's loss
        x, y = batch
        gd = nnx.graphdef(nnx.eval_shape(lambda: Net(len(params["blocks"]))))
        return jnp.mean((nnx.merge(gd, params)(x) - y) ** 2)

    for variant, coverage in (("ddp", 1.0), ("b-sdp", 0.5), ("bb-sdp", 0.5)):
        trainer = SDPStep(sdp.build(Net(), RULES, variant, W, coverage), any_depth,
                          optax.adam(1e-2))
        state = trainer.init(Net())
        got = {k: float(v) for k, v in
               trainer.alignment_fn()(state, trainer.put_batch(batch)).items()}
        full = trainer.full_params(state)
        held = (np.asarray(trainer.spec.kinds[sdp.BLOCK].held) if variant != "ddp"
                else np.tile(np.arange(DEPTH), (W, 1)))
        cos, subs, fulls = [], [], []
        for w in range(W):
            mine = tuple(x[w * b:(w + 1) * b] for x in batch)
            g_full = jax.grad(full_loss)(full, mine)
            g_held = {**g_full, "blocks": {j: g_full["blocks"][int(i)]
                                           for j, i in enumerate(held[w])}}
            if variant == "bb-sdp":   # the full forward pass: the held part of g_full
                g_sub = g_held
            else:   # the worker's subnetwork alone, its blocks renumbered in depth order
                k = len(held[w])
                sub = {**full, "blocks": {j: full["blocks"][int(i)]
                                          for j, i in enumerate(held[w])}}
                assert len(sub["blocks"]) == k
                g_sub = jax.grad(any_depth)(sub, mine)
            cos.append(_cosine(g_sub, g_held))
            subs.append(g_sub)
            fulls.append(g_full)
        # the averaged update: each block's mean over its holders, the rest over all workers
        avg = {k: jax.tree.map(lambda *x: np.mean(x, 0), *[s[k] for s in subs])
               for k in full if k != "blocks"}
        avg["blocks"] = {}
        for i in range(DEPTH):
            mine = [s["blocks"][list(held[w]).index(i)] for w, s in enumerate(subs)
                    if i in held[w]]
            avg["blocks"][i] = jax.tree.map(lambda *x: np.mean(x, 0), *mine)
        ddp = jax.tree.map(lambda *x: np.mean(x, 0), *fulls)
        want = {"grad_alignment": float(np.mean(cos)), "update_alignment": _cosine(avg, ddp)}
        np.testing.assert_allclose([got["grad_alignment"], got["update_alignment"]],
                                   [want["grad_alignment"], want["update_alignment"]],
                                   rtol=0, atol=2e-5, err_msg=variant)
        if variant == "ddp":
            assert min(got.values()) > 1 - 1e-5
        elif variant == "b-sdp":   # another network runs: its gradients point elsewhere
            assert got["grad_alignment"] < 0.999 and got["update_alignment"] < 0.999
        else:   # held gradients are the full model's; the averaging over holders is not DDP's
            assert got["grad_alignment"] > 1 - 1e-5 and got["update_alignment"] < 0.999
