"""The step's options declared once (sdp_jax.options.StepOptions): every setting carries its
run-config field, default and doc; a run config's fields are built from the declarations and
read back into one object; every refusal is one line naming the command-line field."""

import dataclasses

import numpy as np
import pytest

from sdp_jax import fields
from sdp_jax.options import ModelHooks, StepOptions
from sdp_jax.spec import sdp_spec as spec_lib
from sdp_jax.train import config as config_lib
from sdp_jax.train import optimizer as optim_lib
from sdp_jax.train import run as run_lib

CONFIGS = {"language model": config_lib.base_config(),
           "vision": config_lib.vision_config("resnet18", "digits"),
           "task": config_lib.task_config({"name": "mine"})}


def _at(config, path):
    for part in path.split("."):
        config = config[part]
    return config


def test_every_option_is_declared_with_a_doc_and_a_rule():
    declared = fields.settings(StepOptions)
    assert {f.name for f in declared} == {f.name for f in dataclasses.fields(StepOptions)}
    for f in declared:
        m = f.metadata
        assert m["doc"] and "\n" not in m["doc"], f.name
        assert m["kind"] in (bool, int, float, str), f.name
        assert m["kind"] is not str or m["choices"], f.name   # a string has its choices
        # the field's name is the config's name (no translation between them)
        path = fields.config_path(StepOptions, f)
        assert path is None or path.split(".")[-1] == f.name, f.name


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_run_configs_are_built_from_the_declarations(family):
    config = CONFIGS[family]
    for f in fields.settings(StepOptions):
        path = fields.config_path(StepOptions, f)
        if path:
            assert _at(config, path) == f.metadata["run_default"], path
    options = StepOptions.from_config(config, total_steps=7)
    # a run clips at 1 and computes in float32; a library caller's defaults do neither
    assert options == StepOptions(grad_clip=1.0, dtype="float32", total_steps=7)
    assert StepOptions().grad_clip == 0 and StepOptions().compute_dtype is None
    assert "grad_clip" not in {f.name for f in dataclasses.fields(optim_lib.OptimConfig)}
    assert optim_lib.OptimConfig.from_config(config.optim) == optim_lib.OptimConfig(
        **{k: v for k, v in config.optim.items() if k != "grad_clip"})


def test_a_config_is_read_at_each_declared_path():
    config = config_lib.base_config()
    config.sdp.update(average="parameters", sync_every=3, method="reference")
    config.update(remat="full", dtype="bf16", grad_accum=2, emulate_workers=True)
    config.optim.grad_clip = 0.25
    got = StepOptions.from_config(config)
    assert (got.average, got.sync_every, got.method, got.remat, got.dtype, got.grad_accum,
            got.emulate_workers, got.grad_clip) == ("parameters", 3, "reference", "full",
                                                    "bfloat16", 2, True, 0.25)
    assert got.periodic and got.reference and str(got.compute_dtype) == "bfloat16"


@pytest.mark.parametrize("change, match", [
    ({"grad_accum": 0}, r"^config\.grad_accum=0 must be a positive integer \(microbatches"),
    ({"grad_accum": 2.0}, r"^config\.grad_accum=2\.0 must be a positive integer"),
    ({"grad_accum": True}, r"^config\.grad_accum=True must be a positive integer"),
    ({"sync_every": 0, "average": "parameters"}, r"^config\.sdp\.sync_every=0 must be a "),
    ({"fsdp": "yes"}, r"^config\.fsdp='yes' must be True or False \(shard parameters"),
    ({"emulate_workers": 1}, r"^config\.emulate_workers=1 must be True or False"),
    ({"average": "both"}, r"^config\.sdp\.average='both'; use gradients or parameters \("),
    ({"method": "psum"}, r"^config\.sdp\.method='psum'; use one of auto, alltoall, reference \("),
    ({"remat": "some"}, r"^config\.remat='some'; use one of none, full, dots \("),
    ({"dtype": "float16"}, r"^config\.dtype='float16'; use float32 or bfloat16 \("),
    ({"grad_clip": float("nan")}, r"^config\.optim\.grad_clip=nan must be a finite number >= 0"),
    ({"grad_clip": -1.0}, r"^config\.optim\.grad_clip=-1\.0 must be a finite number >= 0"),
    ({"total_steps": -1}, r"^total_steps=-1 must be an integer >= 0"),
    ({"unroll": None}, r"^unroll=None must be True or False"),
    ({"average": "parameters", "fsdp": True}, r"FSDP stores one sharded copy \(config\.fsdp"),
    ({"sync_every": 2}, r"^config\.sdp\.sync_every=2 only applies with "
                        r"--config\.sdp\.average=parameters"),
])
def test_a_bad_option_is_one_line_naming_the_config_field(change, match):
    with pytest.raises(ValueError, match=match) as e:
        StepOptions(**change)
    assert "\n" not in str(e.value)


def test_numpy_scalars_are_taken_as_python_values():
    got = StepOptions(grad_clip=np.float32(0.5), grad_accum=np.int64(2), fsdp=np.bool_(True))
    assert (got.grad_clip, got.grad_accum, got.fsdp) == (0.5, 2, True)
    assert type(got.grad_accum) is int and type(got.fsdp) is bool
    with pytest.raises(ValueError, match=r"config\.grad_accum=.*must be a positive integer"):
        StepOptions(grad_accum=np.float32(2))


def test_the_fields_a_resumed_run_may_change():
    """The fields declared control=True, which a resumed run may change (its checkpoint still
    resumes): pinned, since checkpoint compatibility depends on them."""
    assert set(run_lib.CONTROL) == {
        "sdp.memory_budget_gib", "remat", "emulate_workers", "grad_accum", "num_cpu_devices",
        "eval_every", "log_every", "checkpoint_every", "keep_checkpoints", "stop_at_step",
        "elastic", "peak_flops", "align_every", "profile_start", "profile_stop",
        "eval_batches", "init_from", "eval_limit", "eval_bn_batches", "model.attention",
        "model.attention_chunk", "data.worker_count", "mesh.fsdp", "mesh.tensor"}
    d = run_lib.trajectory_config(config_lib.base_config())
    assert "grad_accum" not in d and "worker_count" not in d["data"] and "seq_len" in d
    assert "attention" not in d["model"] and d["sdp"]["average"] == "gradients"


def test_the_options_a_model_or_a_regime_refuses():
    blocks = {str(i): {"w": np.zeros((4, 4), np.float32)} for i in range(4)}
    spec = spec_lib.build({"blocks": blocks}, [spec_lib.Blocks("blocks")], "bb-sdp", 4, 0.5)
    with pytest.raises(ValueError, match=r"^config\.sdp\.average=parameters is not available "
                                         r"for bb-sdp \(backward masking"):
        StepOptions(average="parameters").check_for(spec)
    with pytest.raises(ValueError, match=r"^config\.remat='dots'; use one of none, full"):
        StepOptions(remat="dots").check_for(spec, ("none", "full"))
    StepOptions(remat="full").check_for(spec, ("none", "full"))   # accepted


def test_model_hooks_need_a_callable_loss():
    with pytest.raises(ValueError, match=r"loss_fn=3 is not callable"):
        ModelHooks(3)
    assert ModelHooks(len).block_fn is None
