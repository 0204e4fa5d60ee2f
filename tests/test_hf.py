"""Hugging Face LLaMA checkpoints (sdp_jax.models.hf_llama): export --format hf, a run started
from such a folder (config.init_from), and, where torch and transformers are installed (the
optional extra [hf]), transformers' own LlamaForCausalLM on the exported folder."""

import importlib.util
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdp_jax.models import hf_llama
from sdp_jax.models.llama import LlamaConfig
from sdp_jax.tools import export, trained
from sdp_jax.train import families, loop
from sdp_jax.train import run as run_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "configs"))
import llama_tiny  # noqa: E402

HAVE_HF = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))


def _tiny(**kw):
    c = llama_tiny.get_config()
    c.update(dict(steps=2, eval_every=0, checkpoint_every=0))
    c.model.update(n_kv_heads=2)   # grouped-query attention
    c.sdp.update(variant="b-sdp", coverage=0.5)
    for k, v in kw.items():
        node, *path = k.split(".")
        (c[node] if path else c).update({path[0] if path else node: v})
    return c


@pytest.fixture(scope="module")
def hf_export(tmp_path_factory):
    """A trained tiny run (untied head) exported in Hugging Face's layout."""
    base = tmp_path_factory.mktemp("hf")
    wd, out = str(base / "run"), str(base / "hf")
    loop.train(_tiny(), wd)
    export.main(["--workdir", wd, "--format", "hf", "--out", out])
    return wd, out


@pytest.mark.parametrize("tie", [False, True])
def test_hf_layout_round_trips_exactly(tie):
    cfg = LlamaConfig(vocab_size=96, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=48,
                      tie_embeddings=tie)
    params = jax.tree.map(np.asarray, families.LanguageModel(cfg).init(3))
    state = hf_llama.to_hf(params, cfg)
    assert ("lm_head.weight" in state) != tie
    assert state["model.layers.2.self_attn.k_proj.weight"].shape == (2 * 8, 32)
    back = hf_llama.from_hf(state, cfg)
    jax.tree.map(np.testing.assert_array_equal, back, params)
    fields = hf_llama.model_fields(hf_llama.hf_config(cfg))
    assert all(getattr(cfg, k) == v for k, v in fields.items()) and len(fields) == 10


def test_export_hf_writes_the_runs_parameters(hf_export):
    wd, out = hf_export
    t = trained.load(wd)
    cfg = trained.language_model(t.config, "test")
    got = hf_llama.read(out, cfg)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, np.asarray(b)), got,
                 t.full_params())
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_key_value_heads"] == 2
    assert json.load(open(os.path.join(out, "sdp_jax_config.json")))["sdp"]["variant"] == "b-sdp"
    with pytest.raises(SystemExit):   # never overwritten
        export.main(["--workdir", wd, "--format", "hf", "--out", out])


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["b-sdp", "nb-sdp", "n-sdp"])
def test_a_run_starts_from_a_hugging_face_folder(hf_export, variant):
    _, out = hf_export
    config = _tiny(init_from=out, **{"sdp.variant": variant})
    run = run_lib.resolve(config, 4)
    builder = run.family.step(run, loop.make_mesh(run))
    lines = []
    state = run.family.initial_state(run, builder, lines.append)
    assert "initialized from the Hugging Face LLaMA" in lines[0]
    want = hf_llama.read(out, run.model)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b),
                 builder.full_params(state), want)


@pytest.mark.slow
def test_init_from_trains_and_refuses_another_shape(hf_export, tmp_path, capsys):
    """A run starts from a copy of the folder, trains, and its tools and resume do not need the
    folder afterwards (it is read only when the run has no checkpoint); a checkpoint of another
    shape, or no checkpoint, is refused before any compile, with nothing written."""
    import shutil
    _, out = hf_export
    copy = str(tmp_path / "hf_copy")
    shutil.copytree(out, copy)
    cont = str(tmp_path / "cont")
    summary = loop.train(_tiny(init_from=copy, stop_at_step=1,
                               **{"sdp.variant": "ddp", "sdp.coverage": 1.0}), cont)
    assert summary["steps"] == 1
    assert "initialized from the Hugging Face LLaMA" in capsys.readouterr().out
    shutil.rmtree(copy)   # moved away: the resume and the tools need it no more
    assert loop.train(_tiny(init_from=copy, **{"sdp.variant": "ddp", "sdp.coverage": 1.0}),
                      cont)["completed"]
    assert np.isfinite(trained.evaluation(trained.load(cont))["val_loss"])
    capsys.readouterr()
    for bad, match in ((dict(init_from=out, **{"model.d_model": 128}),
                        r"another shape.*--config.model.d_model=32"),
                       (dict(init_from=str(tmp_path)), "has no config.json")):
        wd = tmp_path / "refused"
        with pytest.raises(ValueError, match=match):
            loop.train(_tiny(**bad), str(wd))
        assert not wd.exists()   # refused before the workdir is created ...
        assert "data stdlib" not in capsys.readouterr().out   # ... and before the data load
    for key, value in (("rope_scaling", {"type": "linear"}),
                       ("rope_parameters", {"rope_type": "llama3", "factor": 8.0})):
        with pytest.raises(ValueError, match=f"config.json: {key}="):   # the file's own key
            hf_llama.model_fields({"model_type": "llama", key: value})
    with pytest.raises(ValueError, match="is a training run's folder.*--format hf"):
        loop.train(_tiny(init_from=cont), str(tmp_path / "from_a_run"))
    assert hf_llama.model_fields({"model_type": "llama"})["norm_eps"] == 1e-6   # transformers'


def test_the_tools_read_a_hugging_face_export(hf_export, capsys):
    """evaluate and generate take an --format hf folder (the run config it keeps beside
    transformers' config.json); the harness refuses a folder that holds no export in one line."""
    from sdp_jax.tools import evaluate, generate, harness
    wd, out = hf_export
    got = evaluate.main(["--export", out])
    np.testing.assert_allclose(got["val_loss"], trained.evaluation(trained.load(wd))["val_loss"],
                               rtol=1e-5)
    args = ["--prompt", "def ", "--length", "5"]
    assert generate.main(["--export", out] + args) == generate.main(["--workdir", wd] + args)
    with pytest.raises(ValueError, match="workdir=nowhere: no config.json there"):
        harness.check_model_folders(["--model", "sdp_jax", "--model_args", "workdir=nowhere"])
    harness.check_model_folders(["--model", "sdp_jax", "--model_args", f"export={out}"])


@pytest.mark.skipif(not HAVE_HF, reason="needs torch and transformers (pip install -e '.[hf]')")
def test_transformers_loads_the_export_and_its_logits_match(hf_export):
    import torch
    import transformers

    wd, out = hf_export
    config = transformers.AutoConfig.from_pretrained(out)
    assert isinstance(config, transformers.LlamaConfig)
    model = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    t = trained.load(wd)
    cfg = trained.language_model(t.config, "test")
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, t.config.seq_len))
    with torch.no_grad():
        theirs = model(torch.tensor(tokens)).logits.numpy()
    from flax import nnx
    graphdef = families.LanguageModel(cfg).graphdef
    ours = np.asarray(nnx.merge(graphdef, jax.tree.map(jnp.asarray, t.full_params()))(
        jnp.asarray(tokens, jnp.int32)))
    err = float(np.abs(ours - theirs).max())
    print(f"max |logits - transformers' logits| = {err:.2e} (float32, {tokens.shape})")
    assert err < 1e-4


def _source(folder, cfg, shards=1, context=256):
    """A Hugging Face LLaMA folder of ``cfg``'s shape (``max_position_embeddings`` =
    ``context``) with random float32 weights, in ``shards`` safetensors files (with an index
    when > 1), as ``save_pretrained`` writes one; returns its tensors."""
    from safetensors.numpy import save_file
    os.makedirs(folder)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**hf_llama.hf_config(cfg), "max_position_embeddings": context,
                   "bos_token_id": 1, "eos_token_id": 2}, f)
    rng = np.random.default_rng(7)
    tensors = {k: rng.standard_normal(s).astype(np.float32)
               for k, s in hf_llama.tensor_shapes(cfg).items()}
    if shards == 1:
        save_file(tensors, os.path.join(folder, hf_llama.WEIGHTS))
        return tensors
    names, where = list(tensors), {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: tensors[k] for k in names[i::shards]}, os.path.join(folder, name))
        where.update({k: name for k in names[i::shards]})
    with open(os.path.join(folder, hf_llama.INDEX), "w") as f:
        json.dump({"metadata": {}, "weight_map": where}, f)
    return tensors


def test_every_fault_of_a_folder_is_one_line_naming_the_file(tmp_path):
    """A missing shard, a truncated file (cut in its data or in its header), a file that is
    not safetensors, a tensor of the wrong shape or dtype, a missing tensor and a broken index
    are each refused in one line naming the file and the fault, from the headers alone (the
    same from read); the intact folder reads back exactly."""
    from safetensors.numpy import save_file
    import shutil
    cfg = trained.language_model(_tiny(), "test")
    good = str(tmp_path / "good")
    tensors = _source(good, cfg, shards=2)
    jax.tree.map(np.testing.assert_array_equal, hf_llama.read(good, cfg),
                 hf_llama.from_hf(tensors, cfg))
    assert hf_llama.check_folder(good, cfg) == {"folder": good, "max_position_embeddings": 256,
                                                "token_ids": {"bos_token_id": 1,
                                                              "eos_token_id": 2}}
    shard = "model-00002-of-00002.safetensors"

    def cut(path, size):
        os.truncate(path, size(os.path.getsize(path)))

    def rewrite(path, change):
        from safetensors.numpy import load_file
        state = load_file(path)
        change(state)
        save_file(state, path)
    faults = {
        "missing": (lambda p: os.remove(p), shard,
                    f"missing, though model.safetensors.index.json maps {len(tensors) // 2} "
                    "tensors to it"),
        "half": (lambda p: cut(p, lambda n: n // 2), shard, "truncated: its header places "
                 "tensor"),
        "header": (lambda p: cut(p, lambda n: 40), shard, "truncated: its header alone needs"),
        "foreign": (lambda p: open(p, "wb").write(b"\x80\x02}q\x00" * 64), shard,
                    "not a safetensors file"),
        "shape": (lambda p: rewrite(p, lambda s: s.update(
            {"model.layers.0.self_attn.k_proj.weight": np.zeros((8, 32), np.float32)})),
            "model-00001-of-00002.safetensors",
            r"tensor model.layers.0.self_attn.k_proj.weight has shape \[8, 32\], but the "
            r"folder's config.json \(and the run\) give \[16, 32\]"),
        "absent": (lambda p: rewrite(p, lambda s: s.pop("model.norm.weight")),
                   "model-00002-of-00002.safetensors",
                   "no tensor model.norm.weight in .*index.json maps it to "
                   "model-00002-of-00002.safetensors, whose header lacks it"),
        "int8": (lambda p: rewrite(p, lambda s: s.update(
            {"model.norm.weight": np.zeros(32, np.int8)})), shard,
            "tensor model.norm.weight is I8; only float weights"),
        "index": (lambda p: open(p, "w").write("{"), hf_llama.INDEX,
                  "not a safetensors index"),
    }
    for name, (fault, file, match) in faults.items():
        folder = str(tmp_path / name)
        shutil.copytree(good, folder)
        fault(os.path.join(folder, file))
        for check in (hf_llama.check_folder, hf_llama.read):
            with pytest.raises(ValueError, match=match) as e:
                check(folder, cfg)
            msg = str(e.value)
            assert "\n" not in msg and folder in msg, (name, msg)
            assert name == "absent" or os.path.join(folder, file) in msg, (name, msg)


def test_a_broken_folder_ends_train_py_in_one_line_with_no_workdir(tmp_path):
    """python train.py with a truncated shard under init_from: one line, status 2, and no
    workdir (checked before it is created)."""
    import subprocess
    cfg = trained.language_model(_tiny(), "test")
    folder = str(tmp_path / "src")
    _source(folder, cfg, shards=2)
    shard = os.path.join(folder, "model-00002-of-00002.safetensors")
    os.truncate(shard, os.path.getsize(shard) // 2)
    wd = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "train.py"), "--config",
         os.path.join(ROOT, "configs", "llama_tiny.py"), "--config.model.n_kv_heads=2",
         f"--config.init_from={folder}", "--workdir", str(wd)],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu"))
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.startswith(f"python train.py: error: {shard}: truncated: ")
    assert out.stderr.count("\n") == 1 and not wd.exists()


def test_a_hugging_face_llama_converts_and_exports_unchanged(tmp_path, capsys):
    """--config.steps=0 with init_from writes the source's model, laid out under b-sdp's
    masks, as the checkpoint of step 0 (no step compiled); export --format hf writes it back
    bit for bit, with the source's config fields and context length (256, not the run's
    model.max_seq_len 64 or seq_len 32), also as the tokenizer's model_max_length; the same
    command again finds the run complete."""
    import tokenizers
    cfg = trained.language_model(_tiny(), "test")
    src, wd, out = (str(tmp_path / n) for n in ("src", "run", "hf"))
    tensors = _source(src, cfg, shards=3)
    vocab = {f"w{i}": i for i in range(20)} | {"<|endoftext|>": 20}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    words = np.random.default_rng(0).integers(0, 20, 20000)
    (tmp_path / "corpus.txt").write_text(" ".join(f"w{i}" for i in words))
    config = _tiny(steps=0, init_from=src, **{"data.source": "text",
                                               "data.train_files": str(tmp_path / "corpus.txt"),
                                               "data.tokenizer": str(tmp_path)})
    summary = loop.train(config, wd)
    assert summary["steps"] == 0 and summary["completed"] and np.isfinite(
        summary["final_val_loss"])
    log = capsys.readouterr().out
    assert "compiled train step" not in log and "is the checkpoint of step 0" in log
    export.main(["--workdir", wd, "--format", "hf", "--out", out])
    from safetensors.numpy import load_file
    got = load_file(os.path.join(out, hf_llama.WEIGHTS))
    assert sorted(got) == sorted(tensors)
    for k, v in tensors.items():
        assert got[k].dtype == v.dtype and np.array_equal(got[k], v), k   # bit for bit
    theirs, ours = (json.load(open(os.path.join(d, "config.json"))) for d in (src, out))
    for key in list(hf_llama.FIELDS.values()) + ["head_dim", "model_type", "architectures"]:
        assert ours[key] == theirs[key], key
    # the special tokens: the run's tokenizer's end of text, the source's beginning of text
    assert ours["eos_token_id"] == 20 and ours["bos_token_id"] == theirs["bos_token_id"] == 1
    assert ours["max_position_embeddings"] == 256
    assert json.load(open(os.path.join(out, "tokenizer_config.json")))["model_max_length"] == 256
    again = loop.train(_tiny(steps=0, init_from=src, **{
        "data.source": "text", "data.train_files": str(tmp_path / "corpus.txt"),
        "data.tokenizer": str(tmp_path)}), wd)
    assert again["steps"] == 0 and "already complete" in capsys.readouterr().out
