"""Communication counting from optimized HLO (sdp_jax.costs.comm) on 8 simulated CPU devices.

Real programs are compiled with ``jax.shard_map`` and the byte counts checked exactly; a few
hand-written HLO modules cover what XLA:CPU never emits (async ``*-start``/``*-done`` pairs,
iota replica groups, names without ``%``). Bus-byte convention: nccl-tests PERFORMANCE.md.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sdp_jax.costs.comm import (COLLECTIVE_OPS, _iota_group, collective_ops, comm_bytes_per_device,
                                group_axes, shape_bytes)
from sdp_jax.sync.collectives import to_varying

N = 8


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((N,), ("data",))


def hlo(fn, x, mesh, spec=None, out_spec=None):
    """Optimized HLO text of ``jit(shard_map(fn))`` applied to ``x`` sharded by ``spec``."""
    spec = P("data") if spec is None else spec
    out_spec = spec if out_spec is None else out_spec
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=out_spec))
    x = jax.device_put(x, NamedSharding(mesh, spec))
    return f.lower(x).compile().as_text()


def only(ops, op):
    sel = [o for o in ops if o["op"] == op]
    assert len(sel) == 1, ops
    return sel[0]


def f32(n_local):
    """A global f32 vector whose per-device shard has ``n_local`` elements."""
    return jnp.arange(N * n_local, dtype=jnp.float32)


# ---------------------------------------------------------------------------------------------
# One collective each
# ---------------------------------------------------------------------------------------------


def test_psum_all_reduce(mesh):
    text = hlo(lambda a: lax.psum(a, "data"), f32(1024), mesh)
    ops = collective_ops(text)
    o = only(ops, "all-reduce")
    assert len(ops) == 1
    assert (o["bytes"], o["group_size"], o["count"]) == (4096, 8, 1)
    assert o["bus_bytes"] == pytest.approx(2 * 7 / 8 * 4096)
    r = comm_bytes_per_device(text, N)
    assert r["total"] == pytest.approx(7168.0)
    assert r["by_op"]["all-reduce"] == pytest.approx(7168.0)
    assert set(r["by_op"]) == set(COLLECTIVE_OPS)
    assert (r["ops"], r["unknown_trip_counts"]) == (1, 0)


def test_all_gather_counts_input_shard(mesh):
    text = hlo(lambda a: lax.all_gather(a, "data", tiled=True), f32(128), mesh)
    o = only(collective_ops(text), "all-gather")
    # Result is f32[1024] (4096 B); S is the 512-byte shard each device contributes.
    assert (o["bytes"], o["group_size"]) == (512, 8)
    assert o["bus_bytes"] == pytest.approx(7 * 512)


def test_reduce_scatter_counts_full_input(mesh):
    text = hlo(lambda a: lax.psum_scatter(a, "data", tiled=True), f32(1024), mesh)
    o = only(collective_ops(text), "reduce-scatter")
    # Result is f32[128] (512 B); S is the full 4096-byte input.
    assert (o["bytes"], o["group_size"]) == (4096, 8)
    assert o["bus_bytes"] == pytest.approx(7 / 8 * 4096)


def test_all_to_all_tuple_result(mesh):
    x = jnp.ones((N * 8, 16), jnp.float32)  # local [8, 16] f32 = 512 B
    text = hlo(lambda a: lax.all_to_all(a, "data", 0, 0), x, mesh)
    # XLA:CPU splits it into a variadic all-to-all of 8 f32[1,16] pieces (tuple result).
    assert re.search(r"= \(f32\[1,16\].*\) all-to-all\(", text)
    o = only(collective_ops(text), "all-to-all")
    assert (o["bytes"], o["group_size"]) == (512, 8)
    assert o["bus_bytes"] == pytest.approx(7 / 8 * 512)


def test_ppermute_collective_permute(mesh):
    perm = [(i, (i + 1) % N) for i in range(N)]
    text = hlo(lambda a: lax.ppermute(a, "data", perm), f32(1024), mesh)
    o = only(collective_ops(text), "collective-permute")
    assert (o["bytes"], o["bus_bytes"], o["group_size"]) == (4096, 4096.0, 8)


def test_combined_psums_total(mesh):
    # Two psums of f32[1024]; XLA may combine them into one tuple all-reduce, so only the
    # total is asserted.
    def fn(a):
        return lax.psum(a, "data") + lax.psum(a * 2, "data").sum()

    r = comm_bytes_per_device(hlo(fn, f32(1024), mesh), N)
    assert r["total"] == pytest.approx(2 * (2 * 7 / 8 * 4096))
    assert r["by_op"]["all-reduce"] == r["total"]


# ---------------------------------------------------------------------------------------------
# Loops and conditionals
# ---------------------------------------------------------------------------------------------


def step(c):
    # Keep the carry "varying" over 'data' (c + invariant) and the psum result used.
    return c + 0.5 * lax.psum(c, "data")


def test_fori_loop_counted_five_times(mesh):
    text = hlo(lambda a: lax.fori_loop(0, 5, lambda i, c: step(c), a), f32(1024), mesh)
    assert '"known_trip_count":{"n":"5"}' in text
    o = only(collective_ops(text), "all-reduce")
    assert (o["count"], o["bytes"]) == (5, 4096)
    assert o["bus_bytes"] == pytest.approx(5 * 7168.0)
    assert comm_bytes_per_device(text, N)["total"] == pytest.approx(5 * 7168.0)


def test_scan_counted_five_times(mesh):
    def fn(a):
        c, ys = lax.scan(lambda c, _: (step(c), c.sum()), a, None, length=5)
        return c + ys.sum()

    o = only(collective_ops(hlo(fn, f32(1024), mesh)), "all-reduce")
    assert (o["count"], o["exact"]) == (5, True)
    assert o["bus_bytes"] == pytest.approx(5 * 7168.0)


def nested(a):
    def outer(c, _):
        c, _ = lax.scan(lambda d, _: (step(d), None), c, None, length=4)
        return c, None

    return lax.scan(outer, a, None, length=3)[0]


def test_nested_scans_multiply(mesh):
    text = hlo(nested, f32(1024), mesh)
    o = only(collective_ops(text), "all-reduce")
    assert o["count"] == 12
    assert comm_bytes_per_device(text, N)["total"] == pytest.approx(12 * 7168.0)


def test_trip_count_inferred_from_condition(mesh):
    # Without backend_config the count comes from compare(gte(param, 0), constant(5)) in the
    # condition (a fusion on CPU) and the init value in the while's tuple operand.
    text = hlo(lambda a: lax.fori_loop(0, 5, lambda i, c: step(c), a), f32(1024), mesh)
    stripped = re.sub(r", backend_config=\{.*\}", "", text)
    assert "known_trip_count" not in stripped
    r = comm_bytes_per_device(stripped, N)
    assert (r["total"], r["unknown_trip_counts"]) == (pytest.approx(5 * 7168.0), 0)
    # Nested loops too.
    stripped = re.sub(r", backend_config=\{.*\}", "", hlo(nested, f32(1024), mesh))
    assert only(collective_ops(stripped), "all-reduce")["count"] == 12


def test_unknown_trip_count_counted_once(mesh):
    def body(c):
        return c[0] + 1, c[1] + lax.psum(c[1], "data")

    def fn(a):
        return lax.while_loop(lambda c: c[1].sum() < 100.0, body, (0, a))[1]

    text = hlo(fn, f32(1024), mesh)
    r = comm_bytes_per_device(text, N)
    assert r["unknown_trip_counts"] == 1 and r["warnings"]
    o = only(collective_ops(text), "all-reduce")
    assert (o["count"], o["exact"]) == (1, False)
    assert r["total"] == pytest.approx(7168.0)


def test_cond_counts_every_branch(mesh):
    def fn(a):
        return lax.cond(a.sum() > 0, lambda b: b + lax.psum(b, "data"),
                        lambda b: b + lax.pmax(b, "data"), a)

    text = hlo(fn, f32(1024), mesh)
    ops = collective_ops(text)
    assert [o["op"] for o in ops] == ["all-reduce", "all-reduce"]
    assert all(o["count"] == 1 and not o["exact"] for o in ops)
    assert comm_bytes_per_device(text, N)["total"] == pytest.approx(2 * 7168.0)  # upper bound


# ---------------------------------------------------------------------------------------------
# dtypes, meshes, text variants
# ---------------------------------------------------------------------------------------------


def test_f16_halves_bytes(mesh):
    x = jnp.ones((N * 1024,), jnp.float16)
    o = only(collective_ops(hlo(lambda a: lax.psum(a, "data"), x, mesh)), "all-reduce")
    assert o["bytes"] == 2048
    assert o["bus_bytes"] == pytest.approx(7168.0 / 2)


def test_bf16_counts_what_is_sent(mesh):
    # XLA:CPU promotes bf16 collectives to f32 (convert -> f32 all-reduce -> convert), so on CPU
    # a bf16 psum sends 4 bytes per element; count what the HLO says rather than the input dtype.
    x = jnp.ones((N * 1024,), jnp.bfloat16)
    text = hlo(lambda a: lax.psum(a, "data"), x, mesh)
    dtype = re.search(r"= (\w+)\[1024\]\{0\} all-reduce\(", text).group(1)
    o = only(collective_ops(text), "all-reduce")
    assert o["bytes"] == 1024 * {"bf16": 2, "f32": 4}[dtype]
    # The hand-written module below checks bf16 proper.
    assert only(collective_ops(ASYNC_HLO), "all-reduce")["bytes"] == 512  # bf16[256]


def test_mesh_2x4_groups():
    mesh2 = jax.make_mesh((2, 4), ("a", "b"))
    x = jnp.ones((2 * 16, 4 * 16), jnp.float32)  # local [16, 16] f32 = 1024 B
    spec = P("a", "b")
    o = only(collective_ops(hlo(lambda v: lax.psum(v, "b"), x, mesh2, spec)), "all-reduce")
    assert (o["group_size"], o["bytes"]) == (4, 1024)
    assert o["bus_bytes"] == pytest.approx(2 * 3 / 4 * 1024)
    o = only(collective_ops(hlo(lambda v: lax.psum(v, "a"), x, mesh2, spec)), "all-reduce")
    assert (o["group_size"], o["bus_bytes"]) == (2, pytest.approx(1024.0))



def test_bytes_by_the_mesh_axes_each_collective_spans():
    """On a ``data x fsdp x tensor`` mesh of 2 x 2 x 2 (issue 49, item 5): each collective's bytes
    go to the axes its groups span, and the axes' bytes add up to the total. Local f32[4]
    (16 B): a psum over 2 devices sends 2 (1/2) 16 = 16 B, over 4 devices 2 (3/4) 16 = 24 B, an
    all-gather over 2 devices (2 - 1) 16 = 16 B."""
    mesh3 = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"))
    spec = P(("data", "fsdp", "tensor"))

    def fn(v):
        both = lax.psum(v, ("fsdp", "tensor")) + lax.psum(v, "data") + lax.psum(v, "fsdp")
        # pairs inside each worker (devices 0..3, 4..7): fsdp alone, though the pairs of the
        # two workers together hold devices of both
        swapped = lax.ppermute(v, "fsdp", [(0, 1), (1, 0)])
        return both + swapped, lax.all_gather(v, "tensor", tiled=True)

    text = hlo(fn, jnp.ones((8 * 4,)), mesh3, spec, (spec, spec))
    traffic = comm_bytes_per_device(text, N, dict(mesh3.shape))
    assert traffic["by_axis"] == {"data": 16.0, "fsdp": 32.0, "tensor": 16.0,
                                  "fsdp+tensor": 24.0}
    assert sum(traffic["by_axis"].values()) == traffic["total"]
    assert "by_axis" not in comm_bytes_per_device(text, N)
    with pytest.raises(ValueError, match=r"mesh_axes=\{'data': 2\} has 2 devices, num_devices=8"):
        comm_bytes_per_device(text, N, {"data": 2})


def test_group_axes_reads_device_ids_in_mesh_order():
    axes = {"data": 2, "fsdp": 2, "tensor": 2}
    assert group_axes([0, 4], axes) == ("data",)
    assert group_axes([0, 2], axes) == ("fsdp",)
    assert group_axes([4, 5, 6, 7], axes) == ("fsdp", "tensor")
    assert group_axes(list(range(8)), axes) == ("data", "fsdp", "tensor")
    assert group_axes([3], axes) == ()
    assert group_axes(None, axes) is None and group_axes([0, 8], axes) is None


@pytest.mark.parametrize("text, dims, perm", [
    ("[4,2]<=[8]", (8,), (0,)), ("[2,4]<=[2,4]T(1,0)", (2, 4), (1, 0)),
    ("[2,4]<=[4,2]T(1,0)", (4, 2), (1, 0)), ("[4,2]<=[2,2,2]T(0,2,1)", (2, 2, 2), (0, 2, 1))])
def test_iota_replica_groups_first_group(text, dims, perm):
    """The iota form's first group is numpy's arange(prod(dims)).reshape(dims).transpose(perm)
    cut into rows of the group size."""
    n = int(text[1:text.index("]")].split(",")[1])
    want = np.arange(int(np.prod(dims))).reshape(dims).transpose(perm).reshape(-1, n)[0]
    assert _iota_group(text) == want.tolist()

def test_gspmd_mesh_axes_replica_groups():
    # Automatic partitioning (no shard_map): XLA prints replica groups in the mesh-axes form,
    # e.g. replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,2,2]T(0,2,1)) {'axis_0'}.
    mesh3 = jax.make_mesh((2, 2, 2), ("x", "y", "z"))
    a = jax.device_put(jnp.ones((8, 8)), NamedSharding(mesh3, P(("x", "z"), "y")))
    f = jax.jit(lambda v: v.sum(0), out_shardings=NamedSharding(mesh3, P()))
    text = f.lower(a).compile().as_text()
    ops = collective_ops(text)
    if "replica_groups=mesh[" in text:
        # Local block is [2, 4]: its column sums (f32[4], 16 B) are all-reduced over x*z (4
        # devices), then the 2 halves over y are all-gathered (16 B shard, 2 devices).
        ar, ag = only(ops, "all-reduce"), only(ops, "all-gather")
        assert (ar["bytes"], ar["group_size"], ag["bytes"], ag["group_size"]) == (16, 4, 16, 2)
    assert jnp.allclose(f(a), 8.0)
    total = comm_bytes_per_device(text, N)["total"]
    assert total == pytest.approx(sum(o["bus_bytes"] for o in ops)) and total > 0


def test_names_without_percent(mesh):
    text = hlo(nested, f32(1024), mesh)
    bare = text.replace("%", "")
    assert comm_bytes_per_device(bare, N) == comm_bytes_per_device(text, N)


def test_no_entry_raises():
    with pytest.raises(ValueError, match="ENTRY"):
        collective_ops("HloModule m\n\nfoo {\n  ROOT p = f32[] parameter(0)\n}\n")


@pytest.mark.parametrize("shape, nbytes", [
    ("pred[3]", 3), ("s8[5]", 5), ("u8[5]", 5), ("s16[3]", 6), ("u16[3]", 6), ("bf16[3]", 6),
    ("f16[3]", 6), ("s32[3]", 12), ("u32[3]", 12), ("f32[2,3]{1,0}", 24), ("s64[3]", 24),
    ("u64[3]", 24), ("f64[3]", 24), ("c64[3]", 24), ("c128[3]", 48), ("f32[]", 4),
    ("s4[3]", 2), ("f8e4m3fn[4]", 4), ("f32[<=10]", 40), ("token[]", 0),
    ("(f32[2]{0}, /*index=1*/(bf16[4]{0}, s8[1]))", 17),
])
def test_shape_bytes(shape, nbytes):
    assert shape_bytes(shape) == nbytes


# ---------------------------------------------------------------------------------------------
# Hand-written modules (accepted by XLA's HLO parser; not what XLA:CPU emits). Long
# lines are broken with a backslash-newline, which Python drops inside the literal.
# ---------------------------------------------------------------------------------------------

# GPU-style async collectives, names without '%', iota / explicit / empty replica groups.
ASYNC_HLO = """HloModule syn, num_partitions=8

add {
  x = bf16[] parameter(0)
  y = bf16[] parameter(1)
  ROOT s = bf16[] add(x, y)
}

add32 {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT c = f32[] add(a, b)
}

ENTRY main (p: bf16[256], q: s8[32,2], r: f32[64], z: c64[4]) -> (bf16[256], s8[64,2]) {
  p = bf16[256]{0} parameter(0)
  q = s8[32,2]{1,0} parameter(1)
  r = f32[64]{0} parameter(2)
  z = c64[4]{0} parameter(3)
  ars = bf16[256]{0} all-reduce-start(p), channel_id=1, replica_groups=[1,8]<=[8], to_apply=add
  ard = bf16[256]{0} all-reduce-done(ars)
  ags = (s8[32,2]{1,0}, s8[64,2]{1,0}) all-gather-start(q), channel_id=2, \
    replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}
  agd = s8[64,2]{1,0} all-gather-done(ags)
  cps = (bf16[256]{0}, bf16[256]{0}, u32[], u32[]) collective-permute-start(ard), channel_id=3, \
    source_target_pairs={{0,1},{1,0}}
  cpd = bf16[256]{0} collective-permute-done(cps)
  rss = ((f32[64]{0}), f32[16]{0}) reduce-scatter-start(r), channel_id=5, \
    replica_groups=[2,4]<=[8], dimensions={0}, to_apply=add32
  rsd = f32[16]{0} reduce-scatter-done(rss)
  a2a = (c64[4]{0}, c64[4]{0}) all-to-all(z, z), channel_id=6, replica_groups={}
  ROOT t = (bf16[256]{0}, s8[64,2]{1,0}) tuple(cpd, agd)
}
"""


def test_async_pairs_counted_once():
    ops = {o["op"]: o for o in collective_ops(ASYNC_HLO, num_devices=8)}
    assert len(ops) == 5
    expect = {  # op: (S, n, bus)
        "all-reduce": (512, 8, 2 * 7 / 8 * 512),
        "all-gather": (64, 2, 64.0),  # s8[32,2] shard, groups of 2
        "collective-permute": (512, 2, 512.0),
        "reduce-scatter": (256, 4, 3 / 4 * 256),  # iota [2,4]<=[8]: groups of 4
        "all-to-all": (64, 8, 7 / 8 * 64),  # empty groups -> num_devices; c64 = 8 B
    }
    for op, (s, n, bus) in expect.items():
        assert (ops[op]["bytes"], ops[op]["group_size"]) == (s, n), op
        assert ops[op]["bus_bytes"] == pytest.approx(bus), op
    assert comm_bytes_per_device(ASYNC_HLO, 8)["total"] == pytest.approx(
        sum(b for _, _, b in expect.values()))


# Generic async wrapper (async-start calls=...), a call inside a while with a trip count of 3,
# collective-broadcast, and a collective-permute with no pairs (costs nothing).
LOOP_HLO = """HloModule syn2, num_partitions=8

add32 {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT c = f32[] add(a, b)
}

wrapped_rs {
  p0 = f32[64]{0} parameter(0)
  ROOT rs = f32[16]{0} reduce-scatter(p0), channel_id=5, replica_groups=[2,4]<=[8], \
    dimensions={0}, to_apply=add32
}

step {
  x = u16[100]{0} parameter(0)
  ROOT cb = u16[100]{0} collective-broadcast(x), channel_id=7, replica_groups={{0,1,2,3},{4,5,6,7}}
}

body {
  bp = (s32[], u16[100]{0}) parameter(0)
  i = s32[] get-tuple-element(bp), index=0
  v = u16[100]{0} get-tuple-element(bp), index=1
  one = s32[] constant(1)
  i1 = s32[] add(i, one)
  v1 = u16[100]{0} call(v), to_apply=step
  v2 = u16[100]{0} collective-permute(v1), channel_id=8, source_target_pairs={}
  ROOT bt = (s32[], u16[100]{0}) tuple(i1, v2)
}

cond {
  cp = (s32[], u16[100]{0}) parameter(0)
  ci = s32[] get-tuple-element(cp), index=0
  lim = s32[] constant(3)
  ROOT lt = pred[] compare(ci, lim), direction=LT
}

ENTRY main {
  r = f32[64]{0} parameter(0)
  u = u16[100]{0} parameter(1)
  as = ((f32[64]{0}), f32[16]{0}) async-start(r), calls=wrapped_rs
  ad = f32[16]{0} async-done(as), calls=wrapped_rs
  zero = s32[] constant(0)
  init = (s32[], u16[100]{0}) tuple(zero, u)
  w = (s32[], u16[100]{0}) while(init), condition=cond, body=body, \
    backend_config={"known_trip_count":{"n":"3"}}
  wu = u16[100]{0} get-tuple-element(w), index=1
  ROOT t = (f32[16]{0}, u16[100]{0}) tuple(ad, wu)
}
"""


@pytest.mark.parametrize("text", [LOOP_HLO, LOOP_HLO.replace(
    ', backend_config={"known_trip_count":{"n":"3"}}', "")], ids=["known", "inferred"])
def test_async_wrapper_call_in_loop(text):
    ops = {o["op"]: o for o in collective_ops(text)}
    assert set(ops) == {"reduce-scatter", "collective-broadcast", "collective-permute"}
    assert (ops["reduce-scatter"]["count"], ops["reduce-scatter"]["bytes"]) == (1, 256)
    cb = ops["collective-broadcast"]
    assert (cb["count"], cb["bytes"], cb["group_size"]) == (3, 200, 4)
    assert cb["bus_bytes"] == pytest.approx(3 * 3 / 4 * 200)
    assert (ops["collective-permute"]["count"], ops["collective-permute"]["bus_bytes"]) == (3, 0)
    r = comm_bytes_per_device(text, 8)
    assert r["unknown_trip_counts"] == 0
    assert r["total"] == pytest.approx(3 / 4 * 256 + 450.0)


def test_values_still_correct(mesh):
    # Sanity: the programs analysed above compute what they claim (catches a wrong mesh setup).
    f = jax.jit(jax.shard_map(lambda a: lax.fori_loop(0, 5, lambda i, c: step(c), a), mesh=mesh,
                              in_specs=P("data"), out_specs=P("data")))
    x = jax.device_put(jnp.ones((N * 4,), jnp.float32), NamedSharding(mesh, P("data")))
    np.testing.assert_allclose(np.asarray(f(x)), (1 + 0.5 * N) ** 5)


def _loop_module(cond_body: str) -> str:
    """A while (init 2, step 1, no backend_config) around an f32[10] all-reduce over 8 devices."""
    return f"""HloModule loop, num_partitions=8

add {{
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT c = f32[] add(a, b)
}}

body {{
  bp = (s32[], f32[10]{{0}}) parameter(0)
  i = s32[] get-tuple-element(bp), index=0
  v = f32[10]{{0}} get-tuple-element(bp), index=1
  one = s32[] constant(1)
  i1 = s32[] add(i, one)
  ar = f32[10]{{0}} all-reduce(v), channel_id=1, replica_groups=[1,8]<=[8], to_apply=add
  ROOT bt = (s32[], f32[10]{{0}}) tuple(i1, ar)
}}
{cond_body}
ENTRY main {{
  x = f32[10]{{0}} parameter(0)
  two = s32[] constant(2)
  start = s32[] copy(two)
  init = (s32[], f32[10]{{0}}) tuple(start, x)
  w = (s32[], f32[10]{{0}}) while(init), condition=cond, body=body
  ROOT out = f32[10]{{0}} get-tuple-element(w), index=1
}}
"""


# XLA:GPU-style: the bound constant fused into the compare fusion, operands swapped (GT).
FUSED_COND = """
fused_cmp {
  p0 = s32[] parameter(0)
  lim = s32[] constant(7)
  ROOT gt = pred[] compare(lim, p0), direction=GT
}

cond {
  cp = (s32[], f32[10]{0}) parameter(0)
  ci = s32[] get-tuple-element(cp), index=0
  ROOT f = pred[] fusion(ci), kind=kLoop, calls=fused_cmp
}
"""

PLAIN_COND = """
cond {
  cp = (s32[], f32[10]{0}) parameter(0)
  ci = s32[] get-tuple-element(cp), index=0
  lim = s32[] constant(7)
  ROOT lt = pred[] compare(ci, lim), direction=LT
}
"""

# Bound computed from the loop state: not a constant, so the trip count is unknown.
DYNAMIC_COND = """
cond {
  cp = (s32[], f32[10]{0}) parameter(0)
  ci = s32[] get-tuple-element(cp), index=0
  lim = s32[] multiply(ci, ci)
  ROOT lt = pred[] compare(ci, lim), direction=LT
}
"""


@pytest.mark.parametrize("cond, count, unknown", [
    (PLAIN_COND, 5, 0), (FUSED_COND, 5, 0), (DYNAMIC_COND, 1, 1),
], ids=["plain", "fused-swapped", "dynamic"])
def test_trip_count_inference_variants(cond, count, unknown):
    text = _loop_module(cond)
    o = only(collective_ops(text), "all-reduce")
    assert (o["count"], o["bytes"], o["exact"]) == (count, 40, unknown == 0)
    r = comm_bytes_per_device(text, 8)
    assert r["unknown_trip_counts"] == unknown
    assert r["total"] == pytest.approx(count * 2 * 7 / 8 * 40)


def test_collectives_inside_the_backward_loop(mesh):
    """A gradient averaged per block inside the backward scan (a psum in a custom_vjp's
    backward rule) is counted in ``in_backward_loop``; the same average after the scan is not."""
    @jax.custom_vjp
    def averaged(w):
        return w

    averaged.defvjp(lambda w: (w, None), lambda _, g: (to_varying(lax.pmean(g, "data")),))

    def loss(ws, x, inside):
        def body(h, w):
            return jnp.tanh(h @ (averaged(w) if inside else w)), None
        h, _ = lax.scan(body, x, ws)
        return jnp.sum(h)

    def step(x, inside):
        ws = jnp.ones((3, 16, 16), jnp.float32) * 0.1
        g = jax.grad(loss)(to_varying(ws), x, inside)
        return g if inside else lax.pmean(g, "data")

    for inside in (True, False):
        text = hlo(lambda x: step(x.reshape(1, 16), inside)[None], f32(16), mesh,
                   out_spec=P("data"))
        traffic = comm_bytes_per_device(text, N)
        assert traffic["total"] >= 2 * 7 / 8 * 3 * 16 * 16 * 4, traffic
        loop = traffic["in_backward_loop"]
        assert (loop == traffic["total"]) if inside else loop == 0, (inside, traffic)
