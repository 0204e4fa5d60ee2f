"""The regime decided once (sdp_jax.step.regime.Regime): from the variant and the options, the
layout kinds, the parameter source, the update and the in-loop averaging of every combination; and a
step built for each combination uses exactly those pieces (and its source's earlier checkpoint
layouts)."""

import types

import jax
import pytest

from sdp_jax.models import llama
from sdp_jax.models.llama import LlamaConfig
from sdp_jax.options import StepOptions
from sdp_jax.step import sources, update
from sdp_jax.step.regime import Kind, Regime, Source, Update
from sdp_jax.train import families
from sdp_jax.train import optimizer as optim_lib

W = 4
CFG = LlamaConfig(vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=48,
                  max_seq_len=16)
FORWARD, BACKWARD = types.SimpleNamespace(backward=False), types.SimpleNamespace(backward=True)

# (spec, options, runner) -> (source, update, in-loop averaging)
CASES = [
    (FORWARD, {}, True, (Source.COMPACT, Update.AVERAGED, True)),
    (FORWARD, {}, False, (Source.COMPACT, Update.AVERAGED, False)),
    (FORWARD, {"method": "reference"}, True, (Source.COMPACT, Update.AVERAGED, False)),
    (FORWARD, {"grad_accum": 2}, True, (Source.COMPACT, Update.AVERAGED, False)),
    (FORWARD, {"average": "parameters", "sync_every": 2}, True,
     (Source.COMPACT, Update.PERIODIC, False)),
    (FORWARD, {"fsdp": True}, True, (Source.FSDP_BLOCKS, Update.SHARDED, False)),
    (FORWARD, {"fsdp": True}, False, (Source.FSDP_WHOLE, Update.SHARDED, False)),
    (BACKWARD, {}, True, (Source.BACKWARD_HELD, Update.SHARDED, True)),
    (BACKWARD, {"fsdp": True}, True, (Source.FSDP_BLOCKS, Update.SHARDED, False)),
]


@pytest.mark.parametrize("spec, options, runner, want", CASES)
def test_the_regime_of_every_combination(spec, options, runner, want):
    r = Regime.of(spec, StepOptions(**options), runner=runner, staged=False)
    assert (r.source, r.update, r.averages_in_loop) == want
    assert r.sharded_update == (r.update == Update.SHARDED)
    assert not Regime.of(spec, StepOptions(**options), runner, staged=True).averages_in_loop


def test_the_layout_kind_of_a_leaf():
    kind = Regime.of(FORWARD, StepOptions(), True, False).kind
    assert kind(optimizer=False, in_blocks_or_masked=True, stored_compact=True) == Kind.COMPACT
    assert kind(optimizer=True, in_blocks_or_masked=False, stored_compact=False) == \
        Kind.REPLICATED
    periodic = Regime.of(FORWARD, StepOptions(average="parameters"), True, False).kind
    assert periodic(optimizer=False, in_blocks_or_masked=False, stored_compact=False) == \
        Kind.PER_WORKER
    held = Regime.of(BACKWARD, StepOptions(), True, False).kind
    assert held(optimizer=False, in_blocks_or_masked=True, stored_compact=False) == \
        Kind.REPLICATED
    assert held(optimizer=True, in_blocks_or_masked=True, stored_compact=False) == Kind.SHARDED
    assert held(optimizer=True, in_blocks_or_masked=False, stored_compact=False) == \
        Kind.REPLICATED
    fsdp = Regime.of(BACKWARD, StepOptions(fsdp=True), True, False).kind
    assert fsdp(optimizer=False, in_blocks_or_masked=False, stored_compact=False) == Kind.SHARDED


PIECES = {Source.COMPACT: sources.Compact, Source.BACKWARD_HELD: sources.BackwardHeld,
          Source.FSDP_BLOCKS: sources.FsdpGather, Source.FSDP_WHOLE: sources.FsdpWhole}
UPDATES = {Update.AVERAGED: update.Averaged, Update.PERIODIC: update.Periodic,
           Update.SHARDED: update.Sharded}


@pytest.mark.parametrize("variant, options", [
    ("b-sdp", {}), ("n-sdp", {"average": "parameters", "sync_every": 2}), ("bb-sdp", {}),
    ("nb-sdp", {"fsdp": True}), ("ddp", {"grad_accum": 2})])
def test_a_step_is_assembled_from_its_regime(variant, options):
    """The step's source, update, in-loop tables and layout kinds are the regime's."""
    mesh = jax.make_mesh((W,), ("data",), devices=jax.devices()[:W])
    plan = llama.make_plan(variant, CFG, W, 1.0 if variant == "ddp" else 0.5, "cyclic", 0)
    step = families.language_model_step(CFG, plan, optim_lib.OptimConfig(), mesh,
                                        StepOptions(total_steps=10, **options))
    r = step.regime
    assert r == Regime.of(plan, step.options, runner=True, staged=False)
    assert type(step.source) is PIECES[r.source] and type(step.update) is UPDATES[r.update]
    # the checkpoint layouts earlier releases wrote: backward masking's compact optimizer
    assert len(step.earlier_layouts()) == (r.source == Source.BACKWARD_HELD)
    assert bool(step.in_loop_tables) == (r.averages_in_loop and variant != "bb-sdp")
    st = step.state_layout
    for p, k in st.param_layout.items():
        assert k == st._kind(p, optimizer=False)
    assert set(st.param_layout.values()) <= (
        {Kind.SHARDED} if r.fsdp else {Kind.REPLICATED} if r.backward else
        {Kind.COMPACT, Kind.PER_WORKER if r.periodic else Kind.REPLICATED})
