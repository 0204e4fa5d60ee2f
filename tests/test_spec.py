"""The model-agnostic SDP spec: rules -> masks, mask pytrees, tables; clear refusals; the
tree-level average and clip norm against the masked-psum reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from sdp_jax.models import llama
from sdp_jax.models.llama import LlamaConfig
from sdp_jax.spec import layout as layout_lib
from sdp_jax.spec import masks
from sdp_jax.spec import sdp_spec as sdp
from sdp_jax.sync import collectives as sync


class Block(nnx.Module):
    def __init__(self, d, f, rngs):
        self.up = nnx.Linear(d, f, rngs=rngs)
        self.down = nnx.Linear(f, d, rngs=rngs)

    def __call__(self, h):
        return h + self.down(jax.nn.relu(self.up(h)))


class ListNet(nnx.Module):
    """A list of blocks whose feature width d equals the number of blocks (4)."""

    def __init__(self, depth=4, d=4, f=6, rngs=None):
        rngs = rngs or nnx.Rngs(0)
        self.inp = nnx.Linear(3, d, rngs=rngs)
        self.blocks = nnx.List([Block(d, f, rngs) for _ in range(depth)])
        self.out = nnx.Linear(d, 2, rngs=rngs)


RULES = [sdp.Blocks("blocks"),
         sdp.Neurons("blocks/*/up/kernel", 1, "mlp"), sdp.Neurons("blocks/*/up/bias", 0, "mlp"),
         sdp.Neurons("blocks/*/down/kernel", 0, "mlp")]


def test_module_state_and_dict_give_the_same_spec():
    model = ListNet()
    a = sdp.build(model, RULES, "b-sdp", 4, 0.5)
    b = sdp.build(nnx.state(model, nnx.Param), RULES, "b-sdp", 4, 0.5)
    c = sdp.build(nnx.to_pure_dict(nnx.state(model, nnx.Param)), RULES, "b-sdp", 4, 0.5)
    assert a.record() == b.record() == c.record()
    np.testing.assert_array_equal(a.kinds["block"].masks[0], masks.build_mask("cyclic", 4, 4, 0.5))
    assert a.local_blocks == 2 and sdp.build(model, RULES, "nb-sdp", 4, 0.5).local_blocks == 4


def test_list_blocks_with_width_equal_to_block_count_mask_the_block_not_the_feature_axis():
    spec = sdp.build(ListNet(), RULES, "b-sdp", 4, 0.5)
    tree = spec.mask_tree()
    m = spec.kinds["block"].masks[0]
    assert tree["inp"]["bias"] is None and tree["out"]["kernel"] is None
    for j in range(4):
        bias = tree["blocks"][j]["up"]["bias"]                 # leaf shape [6]
        assert bias.shape == (4, 1)                            # one flag per worker, not [4, 4]
        np.testing.assert_array_equal(bias[:, 0], m[:, j])
    assert tree["blocks"][2]["down"]["kernel"].shape == (4, 1, 1)
    with pytest.raises(ValueError, match="keyed 0..3, a list of blocks"):
        sdp.build(ListNet(), [sdp.Blocks("blocks", stacked=True)], "b-sdp", 4, 0.5)


def test_neuron_masks_per_layer_on_the_declared_axis():
    spec = sdp.build(ListNet(), RULES, "n-sdp", 4, 0.5)
    t = spec.kinds["mlp"]
    assert t.masks.shape == (4, 4, 6) and t.k == 3
    tree = spec.mask_tree()
    up = tree["blocks"][1]["up"]["kernel"]                     # leaf [4, 6], axis 1
    assert up.shape == (4, 1, 6)
    np.testing.assert_array_equal(up[:, 0], t.masks[1])
    assert tree["blocks"][1]["down"]["kernel"].shape == (4, 6, 1)
    assert tree["blocks"][1]["down"]["bias"] is None           # not declared: always-kept
    assert spec.holders("mlp", 0, layer=1) == np.flatnonzero(t.masks[1][:, 0]).tolist()
    for w in range(4):   # what each worker holds, per layer
        assert spec.held_by(w)["mlp"] == [np.flatnonzero(m[w]).tolist() for m in t.masks]


@pytest.mark.parametrize("rules, variant, match", [
    ([sdp.Blocks("layers")], "b-sdp", r"matches no parameter; paths start with \['blocks'"),
    ([sdp.Neurons("blocks/*/up/kernel", 2, "mlp")], "n-sdp", "axis 2 is not a component axis"),
    ([sdp.Neurons("blocks/*/up/kernel", 1, "mlp"), sdp.Neurons("blocks/*/down/kernel", 1, "mlp")],
     "n-sdp", "has 4 mlp components on axis 1, but 'blocks/.*/up/kernel' of the same layer has 6"),
    ([sdp.Neurons("blocks/*/up/kernel", 1, "mlp"), sdp.Neurons("blocks/*/up/kernel", 1, "x")],
     "n-sdp", "matched by two rules"),
    ([sdp.Neurons("blocks/*/up/kernel", 1, "mlp")], "b-sdp", "declare no Blocks"),
    ([sdp.Blocks("blocks")], "nb-sdp", "declare no Neurons"),
    ([sdp.Blocks("blocks")], "x-sdp", "unknown variant"),
    ([sdp.Blocks("blocks")], "b-sdp", None),
])
def test_refusals_name_the_leaf_and_the_fix(rules, variant, match):
    if match is None:  # coverage not realizable: the masks module's message, with the kind
        with pytest.raises(ValueError, match="b-sdp masks 4 blocks: coverage C=0.3"):
            sdp.build(ListNet(), rules, variant, 4, 0.3)
        return
    with pytest.raises(ValueError, match=match):
        sdp.build(ListNet(), rules, variant, 4, 0.5)


def test_unequal_list_blocks_refused():
    class Uneven(nnx.Module):
        def __init__(self):
            self.blocks = nnx.List([nnx.Linear(4, 4, rngs=nnx.Rngs(0)),
                                    nnx.Linear(4, 5, rngs=nnx.Rngs(0))])
    for variant in ("b-sdp", "bb-sdp"):
        with pytest.raises(ValueError, match="block 1 differs from block 0"):
            sdp.build(Uneven(), [sdp.Blocks("blocks")], variant, 2, 0.5)


class Nested(nnx.Module):
    """Blocks under a list index: stages/0/blocks/{0..3}."""

    def __init__(self):
        rngs = nnx.Rngs(0)
        self.stages = nnx.List([nnx.Dict(blocks=nnx.List([Block(4, 6, rngs) for _ in range(4)]))])


def test_paths_through_list_indices_and_wildcard_leaf_names():
    spec = sdp.build(Nested(), [sdp.Blocks("stages/0/blocks")], "b-sdp", 4, 0.5)
    assert spec.kinds["block"].masks.shape == (1, 4, 4)
    with pytest.raises(ValueError, match="disconnected .* allow_disconnected=True"):
        sdp.build(Nested(), [sdp.Blocks("stages/0/blocks")], "b-sdp", 2, 0.5)
    # A '*' in the leaf position: kernel and bias of one layer share the layer's mask.
    spec = sdp.build(ListNet(), [sdp.Neurons("blocks/*/up/*", -1, "mlp")], "n-sdp", 4, 0.5)
    assert spec.kinds["mlp"].masks.shape == (4, 4, 6)
    assert spec.rule(("blocks", 2, "up", "bias")).layer == spec.rule(
        ("blocks", 2, "up", "kernel")).layer == 2


def test_more_refusals():
    model = ListNet()
    with pytest.raises(ValueError, match="names a parameter leaf, not the subtree"):
        sdp.build(model, [sdp.Blocks("inp/kernel")], "b-sdp", 4, 0.5)
    with pytest.raises(ValueError, match="matches no parameter"):   # unused by b-sdp, a typo
        sdp.build(model, [sdp.Blocks("blocks"), sdp.Neurons("nope", 1)], "b-sdp", 4, 0.5)
    with pytest.raises(ValueError, match="axis='1' must be an integer"):
        sdp.build(model, [sdp.Neurons("blocks/*/up/kernel", "1")], "n-sdp", 4, 0.5)
    with pytest.raises(ValueError, match="must be a list"):
        sdp.build(model, sdp.Blocks("blocks"), "b-sdp", 4, 0.5)
    with pytest.raises(ValueError, match="workers W=0 must be a positive integer"):
        sdp.build(model, RULES, "ddp", 0)

    class Stacked(nnx.Module):
        def __init__(self):
            self.blocks = nnx.Dict(w=nnx.Param(jnp.zeros((4, 8, 6))))
    with pytest.raises(ValueError, match="lies under the stacked blocks 'blocks'.*stacked=True"):
        sdp.build(Stacked(), [sdp.Blocks("blocks"), sdp.Neurons("blocks/w", 2, "mlp")],
                  "n-sdp", 2, 0.5)


# mask_sha256 that the plans before sdp_jax.spec wrote into checkpoints for these recipes (LLaMA
# d=32, L=8, H=4, K=2, F=48, W=8, seed 3): the spec must reproduce them, or old runs stop resuming.
OLD_RECORDS = [
    ("b-sdp", 0.5, "cyclic", "177382ab1cd735ffabc433078135efa3333dd59b9493fdb58ad49f5365bbac44"),
    ("n-sdp", 0.5, "random", "3534cd8805b348bce3498351365db7acf913ec3d8b49d4c07df00cbb293af51b"),
    ("bb-sdp", 0.75, "random", "4d0f5e5d24f2f93e37fcbb282b76c62671afb4391ec269c1e0b573e37b149ad9"),
    ("ddp", 1.0, "cyclic", "6b178d810e7dc2d0734d0df644546352d05a6e605a1675011102f405d1796cb5"),
]


@pytest.mark.parametrize("variant, coverage, scheme, sha", OLD_RECORDS)
def test_llama_masks_equal_those_of_earlier_checkpoints(variant, coverage, scheme, sha):
    cfg = LlamaConfig(d_model=32, n_layers=8, n_heads=4, n_kv_heads=2, d_ff=48)
    spec = llama.make_plan(variant, cfg, 8, coverage, scheme, 3)
    assert spec.record()["mask_sha256"] == sha


def test_llama_rules_give_the_recipe_masks():
    cfg = LlamaConfig(d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=48)
    b = llama.make_plan("b-sdp", cfg, 4, 0.5)
    np.testing.assert_array_equal(b.kinds["block"].masks[0], masks.build_mask("cyclic", 4, 4, 0.5))
    n = llama.make_plan("n-sdp", cfg, 4, 0.5, scheme="random", seed=3)
    recipe = masks.MaskRecipe("random", 4, 48, 0.5, 3)
    np.testing.assert_array_equal(n.kinds["mlp"].masks, sdp.layer_masks(recipe, 4))
    wq = n.rule(("blocks", "attn", "wq"))
    assert (wq.kind, wq.axis, wq.expand) == ("heads", 2, 2)
    assert n.rule(("blocks", "attn_norm", "scale")) is None and n.rule(("embed",)) is None
    assert n.compact_shape(("blocks", "attn", "wq"), (4, 32, 4, 8)) == (4, 32, 2, 8)


# ---------------------------------------------------------------- tree-level average and norm

def stacked_params(L=4, d=6, H=4, K=2, h=3, F=8):
    """A stacked-block model as a pure dict: GQA attention (H query heads, K key/value groups)
    and an MLP, every block leaf [L, ...]."""
    rng = np.random.default_rng(1)
    n = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    return {"embed": n(5, d), "blocks": {"norm": n(L, d), "wq": n(L, d, H, h),
                                         "wk": n(L, d, K, h), "wo": n(L, H, h, d),
                                         "up": n(L, d, F), "down": n(L, F, d)}}


STACKED_RULES = [sdp.Blocks("blocks"),
                 sdp.Neurons("blocks/wq", 2, "heads", 2, stacked=True),
                 sdp.Neurons("blocks/wk", 2, "heads", stacked=True),
                 sdp.Neurons("blocks/wo", 1, "heads", 2, stacked=True),
                 sdp.Neurons("blocks/up", 2, "mlp", stacked=True),
                 sdp.Neurons("blocks/down", 1, "mlp", stacked=True)]


def staged_params():
    """Two stages of list-form blocks keyed b0, b1, ... next to an always-kept projection;
    block 0 of stage s1 is narrower (4 inputs) than its other blocks (6): a padded slot."""
    rng = np.random.default_rng(2)
    n = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    return {"stem": n(3, 4),
            "s0": {f"b{j}": {"w": n(4, 4), "b": n(4)} for j in range(2)},
            "s1": {"proj": n(4, 6), "b0": {"w": n(4, 6), "b": n(6)},
                   **{f"b{j}": {"w": n(6, 6), "b": n(6)} for j in range(1, 4)}}}


STAGED_RULES = [sdp.Blocks("s0", key="b{}"), sdp.Blocks("s1", key="b{}", pad=True)]


def test_several_block_stacks_are_stage_balanced_and_padded():
    full = staged_params()
    spec = sdp.build(full, STAGED_RULES, "b-sdp", 4, 0.5)
    # C * L = 3 blocks: one of stage s0's 2 and two of stage s1's 4 (largest remainder).
    assert [spec.kinds[k].k for k in ("s0.blocks", "s1.blocks")] == [1, 2]
    assert spec.rule(("s1", "proj")) is None and spec.rule(("stem",)) is None
    assert spec.compact_shape(("s1", "b0", "w")) == (6, 6)   # the slot: padded to the union
    lay = layout_lib.of(spec)
    assert lay.stored_shapes[("s1", "slots", "w")] == (2, 6, 6)
    back = lay.unprune(lay.stored(full))   # first holders' copies, unpadded: the model again
    for p, x in layout_lib._flatten(full).items():
        np.testing.assert_array_equal(layout_lib._flatten(back)[p], x)
    mine = lay.prune(full, 0)                # worker 0's slots hold its blocks, padded
    for j, g in enumerate(spec.kinds["s1.blocks"].held[0]):
        want = np.zeros((6, 6), np.float32)
        want[:full["s1"][f"b{g}"]["w"].shape[0]] = full["s1"][f"b{g}"]["w"]
        np.testing.assert_array_equal(mine[("s1", f"b{j}", "w")], want)
    # Stage s1 is drawn with seed * 1009 + 1 and, cyclic, slid by one worker.
    recipe = masks.MaskRecipe("cyclic", 4, 4, 0.5, 1009 * 0 + 1)
    np.testing.assert_array_equal(spec.kinds["s1.blocks"].masks[0],
                                  np.roll(recipe.matrix(), 1, axis=0))
    over = sdp.build(full, STAGED_RULES, "b-sdp", 4, 0.5, stage_blocks=(2, 1))
    assert [over.kinds[k].k for k in ("s0.blocks", "s1.blocks")] == [2, 1]
    with pytest.raises(ValueError, match=r"stage_blocks=\(1, 1\).*adding up to C \* 6 = 3"):
        sdp.build(full, STAGED_RULES, "b-sdp", 4, 0.5, stage_blocks=(1, 1))
    with pytest.raises(ValueError, match="stage_blocks.*several Blocks rules"):
        sdp.build(full, STAGED_RULES[:1], "b-sdp", 4, 0.5, stage_blocks=(1,))
    with pytest.raises(ValueError, match=r"C=0\.25 is not realizable.*nearest valid"):
        sdp.build(full, STAGED_RULES, "b-sdp", 4, 0.25)
    # a coverage suggested to 6 decimals is accepted: 2/3 of 6 blocks, or of 384 neurons, as
    # 0.666667 (what the messages suggest)
    assert sdp.stage_balance(0.666667, [3, 3], 4) == sdp.stage_balance(2 / 3, [3, 3], 4)
    assert masks.components_per_worker(8, 384, 0.666667, allow_nonuniform=True) == 256
    with pytest.raises(ValueError, match=r"nearest valid coverages for W=8, G=384: "
                                         r"\[0\.664062, 0\.666667, 0\.669271\]"):
        masks.components_per_worker(8, 384, 0.6655, allow_nonuniform=True)
    with pytest.raises(ValueError, match="block 1 differs from block 0 in shape.*pad=True"):
        sdp.build(full, [sdp.Blocks("s0", key="b{}"), sdp.Blocks("s1", key="b{}")], "b-sdp",
                  4, 0.5)
    with pytest.raises(ValueError, match=r"key='b'\): key must be a format with one '\{\}'"):
        sdp.build(full, [sdp.Blocks("s0", key="b")], "b-sdp", 4, 0.5)
    with pytest.raises(ValueError, match="not keyed 0..L-1"):
        sdp.build(full, [sdp.Blocks("s0", stacked=False)], "b-sdp", 4, 0.5)
    with pytest.raises(ValueError, match="no child of 's0' is keyed c0"):
        sdp.build(full, [sdp.Blocks("s0", key="c{}")], "b-sdp", 4, 0.5)
    gap = {**full, "s0": {"b0": full["s0"]["b0"], "b2": full["s0"]["b1"]}}
    with pytest.raises(ValueError, match=r"without gaps, but the children are \['b0', 'b2'\]"):
        sdp.build(gap, [sdp.Blocks("s0", key="b{}")], "b-sdp", 2, 0.5)
    with pytest.raises(ValueError, match="stacked .* key= and pad= do not apply"):
        sdp.build(stacked_params(), [sdp.Blocks("blocks", pad=True)], "b-sdp", 4, 0.5)
    with pytest.raises(ValueError, match="kind 's1.blocks' is the name of a block stack"):
        sdp.build(full, STAGED_RULES + [sdp.Neurons("s1/*/b", 0, "s1.blocks")], "n-sdp", 4, 0.5)
    # Neuron variants do not stack blocks: unequal blocks under an (inactive) Blocks rule pass.
    n = sdp.build(full, [sdp.Blocks("s1", key="b{}"), sdp.Neurons("s1/*/b", 0, "units")],
                  "n-sdp", 4, 0.5)
    assert n.kinds["units"].masks.shape == (4, 4, 6)
    # One rule, stage-balanced on request (a one-stage model of a staged family).
    one = sdp.build(full, STAGED_RULES[1:], "b-sdp", 4, 0.5, stage_balanced=True)
    assert list(one.kinds) == ["s1.blocks"] and one.kinds["s1.blocks"].recipe["seed"] == 0
    assert one.describe().startswith("variant b-sdp") and "2/4 blocks of s1" in one.describe()


# Hand-made block mask: block 0 held by worker 0 alone, block 3 by worker 2 alone,
# block 1 by everyone, block 2 by workers 1 and 3. Equal row sums (2), not uniform.
HAND = np.array([[1, 1, 0, 0], [0, 1, 1, 0], [0, 1, 0, 1], [0, 1, 1, 0]], bool)


def _put(tree, mesh):
    return jax.device_put(tree, jax.sharding.NamedSharding(mesh, P("data")))


def _mesh(W):
    return jax.make_mesh((W,), ("data",), devices=jax.devices()[:W])


@pytest.mark.parametrize("form, variant, matrices", [
    ("list", "b-sdp", {"block": HAND}), ("list", "n-sdp", None),
    ("stacked", "b-sdp", {"block": HAND}), ("stacked", "nb-sdp", None),
    ("stages", "b-sdp", None), ("stages", "bb-sdp", None)])
def test_tree_average_equals_masked_psum_reference(form, variant, matrices):
    W = 4
    if form == "stages":
        full = staged_params()
        spec = sdp.build(full, STAGED_RULES, variant, W, 0.5)
    elif form == "list":
        full = nnx.to_pure_dict(nnx.state(ListNet(), nnx.Param))
        spec = sdp.build(full, RULES, variant, W, 0.5, matrices=matrices)
    else:
        full = stacked_params()
        spec = sdp.build(full, STACKED_RULES, variant, W, 0.5, matrices=matrices)
    lay = layout_lib.of(spec)
    # Every worker's own values: different per worker, in the compact layout.
    rng = np.random.default_rng(0)
    noisy = [jax.tree.map(lambda x: np.asarray(x) + rng.normal(size=x.shape).astype(np.float32),
                          full) for _ in range(W)]
    local = [lay.prune(n, w) for w, n in enumerate(noisy)]
    stacked = {lp: jnp.stack([jnp.asarray(loc[lp]) for loc in local]) for lp in lay.leaves}
    mesh = _mesh(W)

    def run(fn, tree, out_compact=True):
        specs = layout_lib.unflatten({lp: P("data") for lp in lay.leaves})
        out = layout_lib.unflatten({lp: P("data") if out_compact else P() for lp in lay.leaves})
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(specs,), out_specs=(out, P())))(
            _put(layout_lib.unflatten(tree), mesh))

    def local_fn(method):
        def fn(t):
            t = jax.tree.map(lambda x: x[0], t)
            avg = sync.average(t, spec, method=method)
            return jax.tree.map(lambda x: x[None], avg), sync.global_norm(avg, spec)
        return fn
    fast, n_fast = run(local_fn("alltoall"), stacked)
    ref, n_ref = run(local_fn("reference"), stacked)

    # Numpy: each component's mean over its holders.
    expect = {}
    for p in spec.shapes:
        m = spec.leaf_mask(p)
        xs = np.stack([layout_lib._flatten(n)[p] for n in noisy])
        if m is None:
            expect[p] = xs.mean(0)
        else:
            mb = np.broadcast_to(m, xs.shape)
            expect[p] = (xs * mb).sum(0) / mb.sum(0)
    want = {lp: np.stack([lay.prune(layout_lib.unflatten(expect), w)[lp] for w in range(W)])
            for lp in lay.leaves}
    for lp in lay.leaves:
        np.testing.assert_allclose(layout_lib._flatten(fast)[lp], want[lp], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(layout_lib._flatten(ref)[lp], want[lp], rtol=1e-5, atol=1e-5)
    norm = np.sqrt(sum(np.sum(v.astype(np.float64) ** 2) for v in expect.values()))
    assert float(n_fast) == pytest.approx(norm, rel=1e-5)
    assert float(n_ref) == pytest.approx(norm, rel=1e-5)
    if variant == "b-sdp" and form == "list":   # worker 0 alone holds block 0: kept as it is
        got = np.asarray(layout_lib._flatten(fast)[("blocks", 0, "up", "kernel")])[0]
        np.testing.assert_allclose(got, noisy[0]["blocks"][0]["up"]["kernel"], rtol=1e-6)
    if variant == "b-sdp" and form == "stacked":
        got = np.asarray(fast["blocks"]["up"])[0, 0]          # worker 0, slot 0 = block 0
        np.testing.assert_allclose(got, noisy[0]["blocks"]["up"][0], rtol=1e-6)
    if form == "stages":   # the stored form (slots stacked) averages and norms the same
        st_specs = layout_lib.unflatten({sp: P("data") for sp in lay.stored_shapes})
        st_tree = {sp: jnp.stack([lay.to_stored(loc)[sp] for loc in local])
                   for sp in lay.stored_shapes}

        def stored_fn(t):
            t = jax.tree.map(lambda x: x[0], t)
            avg = sync.average(t, spec)
            full_avg = sync.gather_full(avg, spec)
            return jax.tree.map(lambda x: x[None], avg), sync.global_norm(avg, spec), full_avg
        got, n_st, full_avg = jax.jit(jax.shard_map(
            stored_fn, mesh=mesh, in_specs=(st_specs,),
            out_specs=(st_specs, P(), layout_lib.unflatten({p: P() for p in spec.shapes}))))(
            _put(layout_lib.unflatten(st_tree), mesh))
        for w in range(W):
            want_w = lay.to_stored({lp: want[lp][w] for lp in lay.leaves})
            for sp, x in want_w.items():
                got_w = np.asarray(layout_lib._flatten(got)[sp])[w]
                np.testing.assert_allclose(got_w, x, rtol=1e-5, atol=1e-5)
        assert float(n_st) == pytest.approx(norm, rel=1e-5)
        for p in spec.shapes:
            np.testing.assert_allclose(layout_lib._flatten(full_avg)[p], expect[p], rtol=1e-5,
                                       atol=1e-5)

    # gather_full rebuilds the full averaged model on every worker from the compact means.
    def gather_fn(t):
        t = jax.tree.map(lambda x: x[0], t)
        return sync.gather_full(sync.average(t, spec), spec)
    specs = layout_lib.unflatten({lp: P("data") for lp in lay.leaves})
    rebuilt = jax.jit(jax.shard_map(
        gather_fn, mesh=mesh, in_specs=(specs,),
        out_specs=layout_lib.unflatten({p: P() for p in spec.shapes})))(
        _put(layout_lib.unflatten(stacked), mesh))
    for p in spec.shapes:
        np.testing.assert_allclose(layout_lib._flatten(rebuilt)[p], expect[p], rtol=1e-5,
                                   atol=1e-5, err_msg=str(p))

    # Full layout: the masked psum gives every worker the same averaged full tree.
    full_noisy = {p: jnp.stack([layout_lib._flatten(n)[p] for n in noisy]) for p in spec.shapes}

    def full_fn(t):
        t = jax.tree.map(lambda x: x[0], t)
        avg = sync.average(t, spec, compact=False)
        clipped, nrm = sync.clip_by_global_norm(avg, spec, 1.0, compact=False)
        return clipped, nrm
    specs = layout_lib.unflatten({p: P("data") for p in spec.shapes})
    clipped, nrm = jax.jit(jax.shard_map(
        full_fn, mesh=mesh, in_specs=(specs,),
        out_specs=(layout_lib.unflatten({p: P() for p in spec.shapes}), P())))(
        _put(layout_lib.unflatten(full_noisy), mesh))
    assert float(nrm) == pytest.approx(norm, rel=1e-5)
    for p in spec.shapes:
        np.testing.assert_allclose(layout_lib._flatten(clipped)[p], expect[p] / norm,
                                   rtol=1e-4, atol=1e-6)


def test_hand_made_matrices_are_checked():
    with pytest.raises(ValueError, match=r"matrices for \['blocks'\].*kinds: \['block'\]"):
        sdp.build(ListNet(), RULES, "b-sdp", 4, 0.5, matrices={"blocks": HAND})
    with pytest.raises(ValueError, match="each worker 2 of 4 components .* pass coverage=0.5"):
        sdp.build(ListNet(), RULES, "b-sdp", 4, 0.25, matrices={"block": HAND})
    with pytest.raises(ValueError, match="variant ddp holds every component"):
        sdp.build(ListNet(), RULES, "ddp", 4, matrices={"block": HAND})
    assert "hand-made masks" in sdp.build(ListNet(), RULES, "b-sdp", 4, 0.5,
                                          matrices={"block": HAND}).describe()
    bad = HAND.copy()
    bad[0, 0] = False       # row 0 holds one block, the others two
    with pytest.raises(ValueError, match=r"matrices\['block'\]: every worker must hold"):
        sdp.build(ListNet(), RULES, "b-sdp", 4, 0.5, matrices={"block": bad})
    with pytest.raises(ValueError, match=r"must be bool \[W, G\] = \[4, 4\]"):
        sdp.build(ListNet(), RULES, "b-sdp", 4, 0.5, matrices={"block": HAND[:, :3]})


def test_average_refuses_a_full_tree_in_the_compact_layout():
    spec = sdp.build(ListNet(), RULES, "b-sdp", 4, 0.5)
    full = nnx.to_pure_dict(nnx.state(ListNet(), nnx.Param))
    with pytest.raises(ValueError, match="not in the spec's compact layout.*compact=False"):
        sync.average(full, spec)
