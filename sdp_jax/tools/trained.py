"""Use a trained run: its config and latest (or a chosen) checkpoint, evaluated, sampled from or
exported, without the training data iterator.

The command lines are thin wrappers over this module:

    python -m sdp_jax.tools.evaluate --workdir runs/default                 # full-model validation loss
    python -m sdp_jax.tools.generate --workdir runs/default --prompt "def " --length 200
    python -m sdp_jax.tools.export --workdir runs/default --out runs/default/export

Each reads ``WORKDIR/config.json`` (written by :func:`sdp_jax.train.loop.train` once a run's step is compiled)
and accepts ``--config.FIELD=VALUE`` overrides of it (e.g. ``--config.data.source=text
--config.data.val_files=...`` to evaluate on other data). The checkpoint must come from the
same trajectory config (:meth:`sdp_jax.train.checkpoint.CheckpointManager.check_compatible`);
it is read under the setting that wrote it (:func:`load`), which after an elastic switch not yet
saved is not config.json's.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import json
import os
import shutil
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sdp_jax import mesh as mesh_lib
from sdp_jax.models import hf_llama
from sdp_jax.models.llama import LlamaConfig, init_cache
from sdp_jax.spec.sdp_spec import flatten, unflatten
from sdp_jax.train import checkpoint as ckpt_lib
from sdp_jax.train import cli, elastic, families, loop, migrations
from sdp_jax.train import run as run_lib
from sdp_jax.train import task as task_lib
from sdp_jax.train.data import tokens as data_lib
from sdp_jax.train.families import LanguageModel

EXPORT_FILE = "model.safetensors"


@dataclasses.dataclass
class Trained:
    """A run restored for use: ``config`` (ConfigDict), ``run`` (the resolved run,
    :class:`sdp_jax.train.run.RunSpec`), ``builder`` (:class:`sdp_jax.step.SDPStep`),
    ``state`` (its train state on the mesh), ``step`` (the checkpoint's step; None for an
    export) and ``init_from`` (what the checkpoint records of the Hugging Face LLaMA the run
    started from, :func:`sdp_jax.models.hf_llama.check_folder`'s; None without one)."""
    config: Any
    run: Any
    builder: Any
    state: dict
    step: int | None
    init_from: dict | None = None

    def full_params(self) -> dict:
        """The full model's parameters (nested dict of host float32 numpy arrays), each
        component from its first holder (:meth:`sdp_jax.step.SDPStep.full_params`)."""
        return self.builder.full_params(self.state["params"])


HF_RUN_CONFIG = "sdp_jax_config.json"   # the run's config beside a Hugging Face export's


def read_config(workdir: str, task=None):
    """``workdir/config.json`` (in a Hugging Face export, ``sdp_jax_config.json``: its
    ``config.json`` is ``transformers``') as a locked ``ml_collections.ConfigDict`` (``task``:
    the :class:`sdp_jax.train.task.Family` of the run when it is not a built-in one).

    Raises:
      ValueError: no config.json (a run from before it was written, or not a run folder)."""
    import ml_collections  # pylint: disable=g-import-not-at-top
    path = os.path.join(workdir, "config.json")
    if os.path.isfile(os.path.join(workdir, HF_RUN_CONFIG)):
        path = os.path.join(workdir, HF_RUN_CONFIG)
    if not os.path.isfile(path):
        raise ValueError(f"{path!r} does not exist: give a run's --workdir (runs write "
                         "config.json when they start; rerun an older run's training command "
                         "once to write it).")
    with open(path) as f:
        config = ml_collections.ConfigDict(json.load(f))
    template = (task or families.family_of(config)).template(config)[0]
    for path in run_lib.CONTROL:   # newer than the run, not part of its trajectory
        *sections, key = path.split(".")
        node, tnode = config, template
        for section in sections:
            if section not in node or section not in tnode:
                break
            node, tnode = node[section], tnode[section]
        else:
            if key not in node and key in tnode:
                node[key] = tnode[key]
    config.lock()
    return config


def _builder(config, task=None):
    import jax  # pylint: disable=g-import-not-at-top

    run = run_lib.resolve(config, jax.device_count(), task)
    return run, loop.make_step(run, loop.make_mesh(run))


def load(workdir: str, config=None, step: int = 0, task=None, log=None) -> Trained:
    """The run in ``workdir`` at checkpoint ``step`` (0: the latest), under the setting that
    wrote that checkpoint: after an elastic switch (``--config.elastic=True``) stopped before
    its first save, ``config.json`` names the new setting while the checkpoint is the old
    one's, whose recorded workers, batch per worker, FSDP and ``sdp`` section are then used
    (:func:`sdp_jax.train.elastic.as_written`; said in one line to ``log``, default stderr).

    Args:
      config: the run's config (default :func:`read_config`), e.g. with overrides.
      task: the run's :class:`sdp_jax.train.task.Family` when it is not a built-in one (a
        user's :class:`sdp_jax.train.task.Task`, as given to :func:`sdp_jax.train.loop.train`).

    Raises:
      ValueError: no config.json or no checkpoint, a missing step (naming those kept), a
        checkpoint of another config, or an unreadable one (before any compute)."""
    saved = read_config(workdir, task)
    config = saved if config is None else config
    log = log or (lambda line: print(line, file=sys.stderr))
    path = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(path):
        raise ValueError(f"{workdir!r} has no checkpoints/" + (
            ": it is an export; give it as --export" if os.path.isfile(
                os.path.join(workdir, EXPORT_FILE)) else "; train first."))
    manager = ckpt_lib.CheckpointManager(path, keep=config.keep_checkpoints)
    try:
        steps = manager.all_steps()
        if not steps:
            raise ValueError(f"{workdir!r} has no checkpoint yet; train first.")
        if step and step not in steps:
            raise ValueError(f"--step={step}: {workdir!r} keeps the checkpoints of steps "
                             f"{steps}; choose one of them (0 = the latest).")
        at = step or max(steps)
        meta = manager.read_meta(at)
        meta["config"] = ckpt_lib.with_defaults(meta.get("config", {}), (
            task or families.family_of(config)).added_fields())
        written = elastic.as_written(config, meta, saved, jax.device_count())
        if written is not config:
            shown = elastic.describe(meta["config"], elastic.saved_workers(meta))
            log(f"the checkpoint at step {at} was written under another setting than "
                "config.json names (an earlier setting of an elastic run): read "
                f"under its own, {', '.join(f'{k} {v}' for k, v in shown.items())}")
        config = written
        run, builder = _builder(config, task)
        # The checkpoint must be of this trajectory; other evaluation data is not another one.
        checked = copy.deepcopy(config)
        if "data" in saved:   # (a user's task may have no data section)
            with checked.unlocked():
                checked.data = copy.deepcopy(saved.data)
        manager.check_compatible(at, loop._meta(checked, run),  # pylint: disable=protected-access
                                 **migrations.compatibility(run))
        init_from = meta.get("init_from")
    except ValueError:
        manager.close()
        raise
    state, _ = loop.restore_or_init(manager, at, builder, config.seed, announce=False)
    manager.close()
    return Trained(config, run, builder, state, at, init_from)


def evaluation(trained: Trained, log=None) -> dict:
    """The run's own evaluation (:meth:`family.evaluator`) of the trained state on the
    config's evaluation data: ``{val_loss[, val_bpb]}`` (nats/token, bits/byte) for language
    models, ``{test_loss, test_acc}`` for vision. Reads only the evaluation data (and, for
    vision, the training images of BatchNorm re-estimation); no training iterator."""
    run, builder = trained.run, trained.builder
    log = log or (lambda _: None)
    rows = loop.process_rows(builder.mesh, run)
    _, eval_data = run.family.data(run, rows, log, train=False)
    return run.family.evaluator(run, builder, eval_data, loop.batch_putter(builder),
                                 log)(trained.state)


def language_model(config, what: str):
    """The LLaMA config of a run that ``what`` (generate, export) serves.

    Raises:
      ValueError: a vision run, or a pipeline with compressed boundaries (its full model is
        not a plain LLaMA)."""
    if config.model.get("name", "llama") != "llama":
        raise ValueError(f"{what} serves language-model runs; {config.model.name} is a vision "
                         "model (python -m sdp_jax.tools.evaluate evaluates it).")
    if config.pipeline.stages > 1 and config.pipeline.method != "none":
        raise ValueError(f"{what}: this run's stage boundaries are compressed "
                         f"(pipeline.method={config.pipeline.method}), so its full model is "
                         "not a plain LLaMA; python -m sdp_jax.tools.evaluate evaluates it.")
    return LlamaConfig.from_config(config.model)


def export(trained: Trained, out: str) -> str:
    """Write the full model (each component from its first holder, :meth:`Trained.full_params`:
    under gradient averaging every holder keeps the same values; under parameter averaging a
    checkpoint between two averagings holds diverged copies, and worker order decides) to
    ``out/model.safetensors`` (flat keys ``embed``,
    ``blocks.attn.wq``…, block leaves stacked ``[L, ...]``, float32) with the run's config
    beside it (``out/config.json``, and in the file's metadata). Returns the file's path.

    Raises:
      ValueError: a run :func:`language_model` does not serve; ``out`` holds an export
        already (never overwritten: choose another folder)."""
    language_model(trained.config, "export")
    path = export_target(out)
    os.makedirs(out, exist_ok=True)
    flat = flatten_export(trained.full_params())
    text = trained.config.to_json(indent=2)
    _save_weights(path, flat, {"sdp_jax_config": text, "step": str(trained.step)})
    loop.write_atomically(os.path.join(out, "config.json"), text)
    return path


def export_hf(trained: Trained, out: str) -> str:
    """Write the full model (as :func:`export` takes it) as a Hugging Face ``transformers``
    LLaMA folder: ``out/config.json`` (``LlamaForCausalLM``'s,
    :func:`sdp_jax.models.hf_llama.hf_config`), ``out/model.safetensors`` (its parameter names
    and layouts, float32, :func:`sdp_jax.models.hf_llama.to_hf`), the run's tokenizer when it
    had a Hugging Face one (``tokenizer.json`` and a ``tokenizer_config.json`` naming
    ``PreTrainedTokenizerFast`` and its end-of-text token) and the run's own config as
    ``sdp_jax_config.json``. The context length (``max_position_embeddings`` and the
    tokenizer's ``model_max_length``) is the one of the Hugging Face LLaMA the run started
    from (``config.init_from``, recorded in its checkpoints) when that gave one and the run
    did not lengthen it (``model.max_seq_len``, ``seq_len``: the longer counts), else the run's
    ``model.max_seq_len`` and ``seq_len``; its special tokens' ids (``bos_token_id``,
    ``eos_token_id``, ``pad_token_id``) are the run's tokenizer's, else that LLaMA's. Returns
    the weights' path.

    Raises:
      ValueError: as :func:`export`."""
    cfg = language_model(trained.config, "export")
    path = export_target(out)
    tok = tokenizer(trained.config)
    hf_tok = tok is not None and tok.name != "bytes"
    # the context of the Hugging Face LLaMA the run started from, when it gave one
    source = (trained.init_from or {}).get("max_position_embeddings")
    if source:   # (never shorter than the run's own: a run may lengthen the context)
        source = max(int(source), cfg.max_seq_len)
        cfg = dataclasses.replace(cfg, max_seq_len=source)
    if os.path.exists(os.path.join(out, HF_RUN_CONFIG)):
        raise ValueError(f"{os.path.join(out, HF_RUN_CONFIG)!r} exists; choose another --out "
                         "(an export is never overwritten).")
    os.makedirs(out, exist_ok=True)
    if hf_tok:
        shutil.copyfile(tok.path, os.path.join(out, "tokenizer.json"))
        loop.write_atomically(os.path.join(out, "tokenizer_config.json"), json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tok.eot_token,
            "model_max_length": max(source or 0, context(trained.config))}, indent=2))
    loop.write_atomically(os.path.join(out, HF_RUN_CONFIG), trained.config.to_json(indent=2))
    hf = hf_llama.hf_config(cfg, tok.eot_id if hf_tok else None)
    for key, value in (trained.init_from or {}).get("token_ids", {}).items():
        if hf.get(key) is None:   # the source's special tokens, where the run gives none
            hf[key] = value
    loop.write_atomically(os.path.join(out, "config.json"), json.dumps(hf, indent=2))
    _save_weights(path, hf_llama.to_hf(trained.full_params(), cfg),
                  {"format": "pt", "step": str(trained.step)})
    return path


def _save_weights(path: str, tensors: dict, metadata: dict) -> None:
    """``tensors`` (``{name: numpy array}``) written to the safetensors file ``path`` whole or
    not at all (a temporary file, readable by all, renamed)."""
    from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top

    save_file(tensors, path + ".tmp", metadata=metadata)
    os.chmod(path + ".tmp", 0o644)
    os.replace(path + ".tmp", path)


def flatten_export(params: dict) -> dict:
    """A nested parameter dict as the export's flat ``{"blocks.attn.wq": float32 array}``."""
    return {".".join(map(str, p)): np.ascontiguousarray(x, np.float32)
            for p, x in flatten(params).items()}


def export_target(out: str) -> str:
    """``out/model.safetensors``, where :func:`export` writes.

    Raises:
      ValueError: it exists (an export is never overwritten) or ``out`` is a file."""
    path = os.path.join(out, EXPORT_FILE)
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out={out!r} is a file; give a folder.")
    if any(os.path.exists(os.path.join(out, n)) for n in ("checkpoints", "metrics.jsonl")):
        raise ValueError(f"--out={out!r} is a training run's folder; give another folder "
                         "(e.g. OUT/export).")
    parts = os.path.abspath(out).split(os.sep)
    if "checkpoints" in parts[:-1] or parts[-1] == "checkpoints":
        raise ValueError(f"--out={out!r} is inside a run's checkpoints/, whose old steps are "
                         "deleted as the run goes on; give a folder outside it.")
    if os.path.exists(path):
        raise ValueError(f"{path!r} exists; choose another --out (an export is never "
                         "overwritten).")
    return path


def read_export(out: str) -> tuple[Any, dict]:
    """``(config, full parameters)`` of an :func:`export` folder (nested dict of numpy), in
    either format (:func:`export_hf`'s is read by :func:`sdp_jax.models.hf_llama.read`).

    Raises:
      ValueError: no export in ``out``."""
    from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top

    path = os.path.join(out, EXPORT_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"{out!r} has no {EXPORT_FILE}: give a folder python -m "
                         "sdp_jax.tools.export wrote.")
    if os.path.isfile(os.path.join(out, HF_RUN_CONFIG)):   # --format hf
        config = read_config(out)
        return config, hf_llama.read(out, language_model(config, "an export"))
    try:
        flat = load_file(path)
    except Exception as e:  # noqa: BLE001 (safetensors' errors of a damaged file)
        raise ValueError(f"{path!r} cannot be read ({type(e).__name__}: "
                         f"{str(e)[:200]}); export the run again into a new folder.") from e
    return read_config(out), unflatten({tuple(k.split(".")): v for k, v in flat.items()})


def from_export(out: str, config=None) -> Trained:
    """An :func:`export` loaded back into the run's step (every worker starts from the
    exported full model), for :func:`evaluation`. ``config``: the export's config with
    overrides (default: as exported)."""
    saved, params = read_export(out)
    config = saved if config is None else config
    run, builder = _builder(config)
    return Trained(config, run, builder, builder.init(params), None)


def sample(config, params: dict, prompt: list[int], length: int, *, temperature: float = 1.0,
           top_k: int = 0, seed: int = 0, check_only: bool = False,
           timings: dict | None = None) -> list[int]:
    """``length`` new token ids after ``prompt`` from the full model (one device), decoded
    with a key/value cache (:meth:`sdp_jax.models.llama.Llama.decode`) in one compiled loop:
    the prompt's last :func:`context` tokens are decoded once (the prefill), then each new
    token alone. Once the tokens outgrow the context (the run's ``seq_len``), each next token
    is predicted from the last ``seq_len`` tokens at positions ``0 ..`` (a sliding window, the
    positions the model was trained on), which decodes that whole window again for every
    token: a cache of earlier positions would hold keys computed with the dropped tokens in
    view. The tokens are those of a full forward pass per token (to float rounding).

    Args:
      params: the full model's parameters (:meth:`Trained.full_params`).
      temperature: softmax temperature (0: the most likely token every time).
      top_k: sample among the ``k`` likeliest tokens only (0: all).
      seed: the sampling key (the same seed, prompt and model give the same tokens; token
        ``i`` is drawn with ``jax.random.fold_in(key(seed), i)``).
      check_only: validate the arguments only (returns ``[]``).
      timings: a dict that gets ``compile_s`` (0.0 when an earlier call compiled the same
        program) and ``decode_s`` (the sampling's seconds, prefill included).

    Raises:
      ValueError: an empty prompt, a token id outside the vocabulary, ``length < 1``,
        ``temperature < 0`` or ``top_k < 0`` (before any compute)."""
    cfg = language_model(config, "generate")
    if not prompt:
        raise ValueError("the prompt is empty; give at least one token.")
    bad = [t for t in prompt if not 0 <= t < cfg.vocab_size]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary "
                         f"[0, {cfg.vocab_size}).")
    if length < 1 or not 0 <= temperature < float("inf") or not 0 <= top_k <= cfg.vocab_size:
        raise ValueError(f"length={length}, temperature={temperature}, top_k={top_k}: need "
                         "length >= 1, temperature >= 0 (0 = greedy), 0 <= top_k <= "
                         f"{cfg.vocab_size} (0 = all).")
    if check_only:
        return []
    window = context(config)
    ctx = prompt[-window:]
    seq = np.zeros(window + length, np.int32)   # the context, then the new tokens
    seq[:len(ctx)] = ctx
    args = (jax.tree.map(jnp.asarray, params), jnp.asarray(seq), jnp.int32(len(ctx)),
            jax.random.key(seed))
    decoder, compile_s = _decoder(cfg, window, length, float(temperature), int(top_k), args)
    t0 = time.perf_counter()
    ids = np.asarray(decoder(*args))
    if timings is not None:
        timings.update(compile_s=compile_s, decode_s=time.perf_counter() - t0)
    return [int(t) for t in ids]


def pick_token(logits, key, temperature: float, top_k: int):
    """The next token id (int32 scalar) from the logits float32 ``[V]``: among the ``top_k``
    likeliest (0: all), the most likely one (``temperature`` 0) or a draw from
    ``softmax(logits / temperature)`` with ``key``."""
    if top_k:
        logits = jnp.where(logits < jax.lax.top_k(logits, top_k)[0][-1], -jnp.inf, logits)
    if temperature == 0:
        return jnp.argmax(logits).astype(jnp.int32)
    return jax.random.categorical(key, logits / temperature).astype(jnp.int32)


_DECODERS: dict = {}   # compiled sampling loops of :func:`sample`, by settings and shapes


def _decoder(cfg: LlamaConfig, window: int, length: int, temperature: float, top_k: int,
             args: tuple):
    """``(the compiled :func:`_sampling_loop` for these settings and ``args``' shapes, its
    compile seconds)``: compiled on first use (0.0 seconds after; the last 8 are kept)."""
    sig = (cfg, window, length, temperature, top_k, jax.tree.structure(args),
           tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(args)))
    if sig in _DECODERS:
        return _DECODERS[sig], 0.0
    while len(_DECODERS) >= 8:
        _DECODERS.pop(next(iter(_DECODERS)))
    t0 = time.perf_counter()
    loop_fn = _sampling_loop(cfg, window, length, temperature, top_k)
    _DECODERS[sig] = jax.jit(loop_fn).lower(*args).compile()
    return _DECODERS[sig], time.perf_counter() - t0


def _sampling_loop(cfg: LlamaConfig, window: int, length: int, temperature: float,
                   top_k: int):
    """``(params, seq int32 [window + length], n int32, key) -> int32 [length]``: the
    ``length`` tokens after the ``n`` context tokens at the start of ``seq`` (zeros after
    them), one per ``fori_loop`` step; :func:`sample` says how."""
    graphdef = LanguageModel(cfg).graphdef

    def run(params, seq, n, key):
        model = nnx.merge(graphdef, params)

        def window_step(seq, c, cache):   # tokens max(c - window, 0) .. at positions 0 ..
            s = jnp.maximum(c - window, 0)
            logits, cache = model.decode(jax.lax.dynamic_slice_in_dim(seq, s, window)[None],
                                         cache, 0)
            return logits[0, c - 1 - s], cache

        def cached_step(seq, c, cache):   # token c - 1 alone, at its position
            logits, cache = model.decode(jax.lax.dynamic_slice_in_dim(seq, c - 1, 1)[None],
                                         cache, c - 1)
            return logits[0, 0], cache

        def body(i, carry):
            seq, cache = carry
            c = n + i   # tokens so far; the last one at position c - 1
            logits, cache = jax.lax.cond((i > 0) & (c <= window), cached_step, window_step,
                                         seq, c, cache)
            tok = pick_token(logits, jax.random.fold_in(key, i), temperature, top_k)
            return jax.lax.dynamic_update_slice_in_dim(seq, tok[None], c, 0), cache

        cache = init_cache(cfg, 1, window, params["embed"].dtype)
        seq, _ = jax.lax.fori_loop(0, length, body, (seq, cache))
        return jax.lax.dynamic_slice_in_dim(seq, n, length)

    return run


def context(config) -> int:
    """The tokens a model sees at once: the run's ``seq_len`` (the positions it was trained
    on; ``model.max_seq_len`` may be longer)."""
    return int(config.seq_len)


def tokenizer(config):
    """The run's tokenizer (:func:`sdp_jax.train.data.tokenizer_of` of its data section, with
    ``encode(text) -> ids``, ``decode(ids) -> text`` and ``eot_id``): bytes, the Hugging Face
    tokenizer of ``data.tokenizer``, or None for llm.c shards without ``data.tokenizer``.

    Raises:
      ValueError: ``data.tokenizer`` names no readable tokenizer.json (override it with
        ``--config.data.tokenizer=PATH``)."""
    return data_lib.tokenizer_of(config.data)


# ---------------------------------------------------------------------------- command lines

def tool_flags(define):
    """A use command's ``FlagValues`` without the config: ``--workdir`` and ``define(fv)``'s
    (the documentation check parses documented commands with it)."""
    from absl import flags  # pylint: disable=g-import-not-at-top
    fv = flags.FlagValues()
    flags.DEFINE_string("workdir", None, "a training run's folder", flag_values=fv)
    define(fv)
    return fv


def _given(argv: list, names: tuple) -> list[tuple[str, str]]:
    """``(flag, value)`` of every ``--flag=value`` or ``--flag value`` in ``argv`` among
    ``names`` (read before the flags are parsed)."""
    out = []
    for i, a in enumerate(argv):
        for name in names:
            if a.startswith(name + "="):
                out.append((name, a.split("=", 1)[1]))
            elif a == name and i + 1 < len(argv):
                out.append((name, argv[i + 1]))
    return out


@functools.lru_cache(maxsize=None)
def task_from(name: str):
    """The :class:`sdp_jax.train.task.Family` that ``--task=module:Class`` names: the class
    (or instance) ``Class`` of the module ``module``, imported from the current directory or
    ``PYTHONPATH``, instantiated without arguments. Needed to read back the run of a user's
    own model (:class:`sdp_jax.train.task.Task`).

    Raises:
      ValueError: not ``module:Class``, a module that does not import, no such class, or not a
        :class:`~sdp_jax.train.task.Family`."""
    module, sep, attr = name.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"--task={name!r}: give module:Class, e.g. --task=my_model:MyTask "
                         "(the module importable from the current folder or PYTHONPATH).")
    try:
        found = getattr(importlib.import_module(module), attr, None)
    except ImportError as e:
        raise ValueError(f"--task={name!r}: cannot import {module!r} ({e}); run from the "
                         "folder that holds it or add that folder to PYTHONPATH.") from None
    if isinstance(found, task_lib.Family):
        return found
    if not (isinstance(found, type) and issubclass(found, task_lib.Family)):
        raise ValueError(f"--task={name!r}: {module}.{attr} is "
                         + ("missing" if found is None else
                            f"not a sdp_jax.train.task.Family ({found!r})")
                         + "; name your subclass of sdp_jax.train.task.Task.")
    try:
        return found()
    except TypeError as e:
        raise ValueError(f"--task={name!r}: {attr}() failed ({e}); the tool builds the task "
                         "without arguments: give it defaults, or name an instance.") from None


CONFIG_HELP = ("--config.FIELD=VALUE: override a field of the run's config.json (e.g. "
               "--config.eval_batches=4, or other evaluation data with --config.data.*; the "
               "model and masks stay the checkpoint's; the fields: docs/configuration.md)")


def command(prog: str, doc: str, argv, define) -> tuple[Any, Any]:
    """Parse a use command's flags: ``--workdir`` (or ``--export`` where ``define`` adds it),
    the tool's own (``define(fv)``), and ``--config.FIELD=VALUE`` overrides of the run's
    config.json. Simulated CPU devices are set from the config before JAX starts. Returns
    ``(flag values, config)``; mistakes exit with one line (status 2); ``--help`` prints
    ``doc``, every flag with its default and :data:`CONFIG_HELP`, and exits 0."""
    from absl import flags  # pylint: disable=g-import-not-at-top
    from ml_collections import config_flags  # pylint: disable=g-import-not-at-top

    if argv is None:   # the command line: a signal ends it with one line, never a traceback
        cli.exit_on_signals()
    argv = [prog] + (sys.argv[1:] if argv is None else list(argv))
    fv = tool_flags(define)
    if cli.asks_help(argv):
        cli.exit_with_help(fv, doc, CONFIG_HELP)
    sources = _given(argv, ("--workdir", "--export"))
    named = [v for _, v in _given(argv, ("--task",))] if "task" in fv else []
    try:   # a user's Task (its module imported now: read_config needs its schema)
        task = task_from(named[-1]) if named else None
    except ValueError as e:
        cli.error(prog, str(e))
    if len(sources) > 1:
        cli.error(prog, f"give one of {' / '.join(n + '=' + v for n, v in sources)}, once")
    source = sources[0] if sources else None
    if source is None:
        cli.error(prog, "give --workdir=RUN_DIR (a training run's folder)"
                  + (" or --export=DIR" if "--export" in doc else ""))
    try:
        config = read_config(source[1], task)
    except ValueError as e:
        cli.error(prog, f"{source[1]!r} has no config.json: give a folder python -m "
                        "sdp_jax.tools.export wrote." if source[0] == "--export" else str(e))
    try:
        config_flags.DEFINE_config_dict("config", config, "the run's config.json; override "
                                        "fields as --config.FIELD=VALUE", flag_values=fv,
                                        lock_config=True, sys_argv=argv)
        rest = fv(argv)
    except flags.Error as e:
        cli.error(prog, f"{e}; see {prog} --help")
    except (AttributeError, KeyError, TypeError, ValueError) as e:   # a config override
        cli._config_error(prog, e)  # pylint: disable=protected-access
    if len(rest) > 1:
        cli.error(prog, f"unexpected arguments {rest[1:]}; flags look like --workdir=DIR")
    if source[0] == "--export" and fv["step"].present:
        cli.error(prog, "--step chooses a checkpoint of --workdir; an export has one step")
    mesh_lib.simulate_cpu_devices(fv.config.num_cpu_devices)
    return fv, fv.config
