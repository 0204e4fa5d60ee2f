"""``python -m sdp_jax.bench.device --out DIR``: the figures of one accelerator, in one command.

Prepared for a lent NVIDIA H200 (15 minutes of device time at a time, docs/benchmarks.md): it
finishes inside ``--budget_s`` seconds (default 520, compilation included; the last section
is stopped 15 s after it at the latest) and writes
``device_tables.md``, ``device_rows.json`` and ``environment.txt`` (jax, jaxlib, flax, optax,
orbax, grain versions, the device, ``jax.print_environment_info()``) to ``--out``. Sections,
each in its own process (the device's peak-memory counter starts at zero in each; this
process never starts a JAX backend, which would hold the accelerator):

* ``jit``: our DDP step (:class:`sdp_jax.step.SDPStep`, one worker) against the plain-jit
  reference (:mod:`sdp_jax.bench.jit_reference`) at ``llama_134m`` and ``llama_500m``, bf16,
  ``cudnn`` attention where the backend has it: step times interleaved (the ratio is the median
  of the per-round ratios, :func:`sdp_jax.bench.measure.paired_ratio`), tokens/s and MFU (model
  FLOPs, :func:`sdp_jax.models.llama.model_flops_per_token`, over the device's bf16 peak,
  :func:`sdp_jax.costs.peak_flops`); and the *worker floor*: plain jit of ``llama_500m`` cut to
  ``k`` of its ``L`` blocks (C = 1/2 and 11/16), the compute a B-SDP worker cannot go below.
* ``attention``: ``dot_product``, ``cudnn`` and ``chunked`` attention in our DDP step at
  ``llama_134m``, sequences of 1024 and 4096 tokens (8192 tokens per step).
* ``pair``: DDP against B-SDP at C = 1/2, 8 workers emulated on the one device
  (``configs/llama_27m.py``, the default corpus), FLOP-matched (B-SDP takes ``1/C`` times the
  steps, Singh et al., arXiv 2507.09029, Sec. 5): validation loss at equal FLOPs. The DDP run's
  steps fit the time left (a few timed steps of both programs first).

Every row has its compiled peak (``memory_analysis()``, :func:`sdp_jax.costs.memory_stats`) and,
where the device reports one, its measured peak (``memory_stats()['peak_bytes_in_use']`` after
real steps; the programs of a group run alone in ascending order of compiled peak, and a
reading that does not rise above the process's peak before it is an upper bound, ``<=``).

``--dry_run`` runs the same sections on tiny models (a CPU is enough; the test suite runs it),
so that the command cannot rot between lendings.
"""

from __future__ import annotations

import copy
import ctypes
import dataclasses
import importlib.metadata as md
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
from absl import flags

from sdp_jax import mesh as mesh_lib
from sdp_jax.bench import device_tables, measure
from sdp_jax.costs import program as costs
from sdp_jax.models import llama
from sdp_jax.models.llama import LlamaConfig
from sdp_jax.train import cli, loop

PROG = "python -m sdp_jax.bench.device"
SECTIONS = ("jit", "attention", "pair")
SHARE = {"jit": 0.35, "attention": 0.2, "pair": 0.45}   # of --budget_s, in this order
FLOOR = (0.5, 0.6875)          # the coverages whose worker floor is measured
ATTENTION = ("dot_product", "cudnn", "chunked")
FILES = ("device_tables.md", "device_rows.json", "environment.txt")


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What the sections run: the device's sizes, or the dry run's tiny ones.

    Attributes:
      jit_models: config files of the ours-against-jit rows; floor_model: the one cut to
        ``k`` of ``L`` blocks; attention_model: the attention rows' config; seq_lens,
        tokens_per_step: the attention rows' sequences and tokens per step; steps, warmup:
        timed and untimed steps per program; pair_steps: bounds of the pair's DDP steps;
        model: overrides of every model section (the dry run's tiny shapes); run: other
        config overrides (dotted names)."""

    jit_models: tuple = ("llama_134m.py", "llama_500m.py")
    floor_model: str = "llama_500m.py"
    attention_model: str = "llama_134m.py"
    seq_lens: tuple = (1024, 4096)
    tokens_per_step: int = 8192
    steps: int = 10
    warmup: int = 2
    pair_steps: tuple = (100, 3000)
    model: dict = dataclasses.field(default_factory=dict)
    run: dict = dataclasses.field(default_factory=dict)


DRY = Sizes(jit_models=("llama_500m.py",), seq_lens=(32,), tokens_per_step=64, steps=2,
            warmup=1, pair_steps=(2, 3),
            model=dict(vocab_size=256, d_model=32, n_layers=16, n_heads=2, n_kv_heads=2,
                       d_ff=64, max_seq_len=64),
            run={"seq_len": 16, "batch_per_worker": 2, "eval_batches": 2, "log_every": 1})


def _config(name: str, sizes: Sizes, **fields):
    """A config file of ``configs/`` with the sizes' overrides and ``fields`` (dotted names),
    given as ``--config.FIELD=VALUE`` flags: loaded, overridden and checked as every command's
    ``--config`` is (:func:`sdp_jax.train.cli.parse`)."""
    overrides = {**{f"model.{k}": v for k, v in sizes.model.items()}, **sizes.run, **fields}
    argv = [PROG] + [f"--config.{k}={v}" for k, v in overrides.items()]
    fv = cli.flag_values(cli.config_file(name), argv, PROG)
    cli.parse(fv, argv, PROG)
    return fv.config


def _gpu() -> bool:
    return jax.default_backend() == "gpu"


def _one_line(e: Exception) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"


# ------------------------------------------------------------------------------ the programs
@dataclasses.dataclass
class Program:
    """One compiled train step of a group: its label, model, batch and figures."""

    label: str
    config: object
    blocks: int | None = None        # plain jit of the model cut to this many blocks
    ours: bool = True                # our SDPStep (one worker) or the plain-jit reference
    builder: object = None
    compiled: object = None
    error: str | None = None
    row: dict = dataclasses.field(default_factory=dict)

    def build(self, mesh) -> None:
        """Build and compile (AOT, for the config's batch); a failure is kept as ``error``."""
        c = self.config
        try:
            if self.ours:
                self.builder, _ = measure.lm_step(c, "ddp", 1, 1.0, mesh, fsdp=False,
                                                  remat=c.remat, dtype=c.dtype)
            else:
                self.builder = measure.reference_step(c, mesh, c.remat, c.dtype,
                                                      blocks=self.blocks)
            shape = jax.ShapeDtypeStruct((c.batch_per_worker, c.seq_len + 1), np.int32)
            self.compiled = self.builder.compiled_train_step(shape)
        except Exception as e:  # noqa: BLE001 (e.g. cudnn attention where it does not run)
            self.error = _one_line(e)

    def job(self) -> list:
        """A fresh :func:`sdp_jax.bench.measure.timing_job` of the compiled step."""
        return measure.timing_job(self.builder, measure.random_tokens(self.config, 1,
                                                                      self.builder),
                                  self.compiled)

    def figures(self) -> dict:
        """The row's static fields: model, tokens, model FLOPs, compiled peak."""
        c = self.config   # (the attention implementation changes no count; cudnn is
        cfg = LlamaConfig.from_config({**c.model, "attention": "dot_product"})  # GPU-only)
        tokens = c.batch_per_worker * c.seq_len
        out = {"setting": self.label, "params": cfg.param_count()["total"],
               "blocks": self.blocks or cfg.n_layers, "n_layers": cfg.n_layers,
               "attention": c.model.attention, "seq_len": c.seq_len, "tokens_per_step": tokens,
               "dtype": c.dtype, "error": self.error,
               "model_flops_per_step": llama.model_flops_per_token(cfg, c.seq_len,
                                                                   self.blocks) * tokens}
        if self.compiled is not None:
            out["compiled_peak_bytes"] = costs.memory_stats(self.compiled)[
                "peak_bytes_per_device"]
        return out


def build_group(name: str, programs: list[Program]) -> list[Program]:
    """Build and compile every program of a group; their rows gain ``group``."""
    mesh = mesh_lib.make_mesh(1)
    for p in programs:
        p.build(mesh)
        p.row = {"group": name, **p.figures()}
    return programs


def _peak_in_use() -> int | None:
    return (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")


def _measured_peaks(programs: list[Program], warmup: int) -> None:
    """Each program alone, in ascending order of compiled peak: a fresh state, ``warmup``
    steps, then the device's ``peak_bytes_in_use`` (None where the device reports none). The
    counter only rises in a process, so a reading that did not rise above the one before (or
    above the process's peak so far: compiles, earlier groups) is an upper bound
    (``measured_peak_is_bound``). A program that fails to run keeps the error and no time."""
    last = _peak_in_use()
    for p in sorted((p for p in programs if p.compiled is not None),
                    key=lambda p: p.row["compiled_peak_bytes"]):
        try:
            measure.time_interleaved([p.job()], 0, warmup)
        except Exception as e:  # noqa: BLE001 (e.g. out of memory: the other rows go on)
            p.error = p.row["error"] = _one_line(e)
            continue
        peak = _peak_in_use()
        p.row["measured_peak_bytes"] = peak
        p.row["measured_peak_is_bound"] = peak is not None and last is not None and peak <= last
        last = peak if peak is not None else last


def run_group(programs: list[Program], sizes: Sizes) -> list[dict]:
    """Measure the peaks of and time (interleaved) one built group (:func:`build_group`); the
    rows gain ``step_times_s``, ``step_time_s`` (median), ``tokens_per_s``, ``mfu`` (or
    ``error``)."""
    _measured_peaks(programs, sizes.warmup)
    ok = [p for p in programs if p.compiled is not None and p.error is None]
    peak = costs.peak_flops(jax.devices()[0].device_kind)
    try:
        times = measure.time_interleaved([p.job() for p in ok], sizes.steps, sizes.warmup)
    except Exception as e:  # noqa: BLE001 (the group's rows keep their memory figures)
        for p in ok:
            p.row["error"] = "timing: " + _one_line(e)
        return [p.row for p in programs]
    for p, t in zip(ok, times):
        median = statistics.median(t)
        p.row.update(step_times_s=t, step_time_s=median,
                     tokens_per_s=p.row["tokens_per_step"] / median)
        p.row["mfu"] = (None if peak is None
                        else p.row["model_flops_per_step"] / median / peak)
    return [p.row for p in programs]


# ------------------------------------------------------------------------------ the sections
def section_jit(sizes: Sizes, deadline: float, save) -> list[dict]:
    """Our DDP step against plain jit per model, and the worker floor (see the module
    docstring); ``save(rows)`` after each group."""
    rows = []
    for name in sizes.jit_models:
        if time.time() > deadline:
            break
        for attention in ("cudnn", "dot_product") if _gpu() else ("dot_product",):
            group = build_group(name.removesuffix(".py"),
                                _jit_programs(name, sizes, attention))
            if not any(p.error for p in group):
                break   # (cudnn failed to compile: the same programs with dot_product)
        rows += run_group(group, sizes)
        save(rows)
    return rows


def _jit_programs(name: str, sizes: Sizes, attention: str) -> list[Program]:
    """Ours and plain jit of one model (bf16), and of the floor model its cut copies."""
    config = _config(name, sizes, dtype="bfloat16", **{"model.attention": attention})
    programs = [Program("ours-ddp", config), Program("jit-ddp", config, ours=False)]
    if name == sizes.floor_model:
        L = config.model.n_layers
        programs += [Program(f"jit-ddp {round(c * L)}/{L}", config, blocks=round(c * L),
                             ours=False) for c in FLOOR]
    return programs


def section_attention(sizes: Sizes, deadline: float, save) -> list[dict]:
    """Our DDP step with each attention implementation at each sequence length."""
    rows = []
    for seq in sizes.seq_lens:
        if time.time() > deadline:
            break
        programs = []
        for impl in ATTENTION:
            config = _config(sizes.attention_model, sizes, dtype="bfloat16", seq_len=seq,
                             batch_per_worker=max(sizes.tokens_per_step // seq, 1),
                             **{"model.attention": impl,
                                "model.max_seq_len": max(sizes.seq_lens)})
            programs.append(Program(f"{impl} T={seq}", config))
        rows += run_group(build_group(f"attention T={seq}", programs), sizes)
        save(rows)
    return rows


def _variant(config, variant: str, coverage: float):
    c = copy.deepcopy(config)
    c.sdp.variant, c.sdp.coverage = variant, coverage
    return c


PAIR = (("ddp", 1.0), ("b-sdp", 0.5))


def _pair_steps(config, sizes: Sizes, deadline: float) -> tuple[int, dict]:
    """The DDP run's steps that fit the time left: a few interleaved steps of both emulated
    programs on random tokens (their compiles timed too), then 60% of what is left after
    twice that overhead, over ``t_ddp + 2 t_bsdp`` (B-SDP takes twice the steps), at most
    ``sizes.pair_steps[1]``.

    Raises:
      TimeoutError: fewer than ``sizes.pair_steps[0]`` steps fit."""
    W, t0 = config.workers, time.time()
    mesh = mesh_lib.make_mesh(W, emulated=True)
    jobs = []
    for variant, cov in PAIR:
        builder, _ = measure.lm_step(_variant(config, variant, cov), variant, W, cov, mesh,
                                     fsdp=False, remat="none", dtype=config.dtype,
                                     emulate_workers=True)
        jobs.append(measure.timing_job(builder, measure.random_tokens(config, W, builder)))
    times = {v: statistics.median(t) for (v, _), t in
             zip(PAIR, measure.time_interleaved(jobs, 3, 1))}
    overhead = 2 * (time.time() - t0)   # the two runs' compiles, evaluations, data
    fit = 0.6 * (deadline - time.time() - overhead) / (times["ddp"] + 2 * times["b-sdp"])
    lo, hi = sizes.pair_steps
    if fit < lo:
        raise TimeoutError(f"{max(fit, 0):.0f} DDP steps fit the {deadline - time.time():.0f} s "
                           f"left after {overhead:.0f} s for the two runs' compiles (at "
                           f"{times['ddp'] * 1e3:.0f} / {times['b-sdp'] * 1e3:.0f} ms a DDP / "
                           f"B-SDP step), fewer than {lo}; give --budget_s more")
    return int(min(fit, hi)), times


def section_pair(sizes: Sizes, deadline: float, save) -> list[dict]:
    """DDP and B-SDP (C = 1/2) FLOP-matched with 8 emulated workers (module docstring)."""
    config = _config("llama_27m.py", sizes, dtype="bfloat16" if _gpu() else "float32",
                     flop_matched=True, eval_every=0)
    steps, calibration = _pair_steps(config, sizes, deadline)
    config.steps = steps
    config.optim.warmup_steps = min(config.optim.warmup_steps, max(steps // 10, 1))
    rows = []
    with tempfile.TemporaryDirectory(prefix="sdp_jax_device_pair_") as tmp:
        for variant, cov in PAIR:
            s = loop.train(_variant(config, variant, cov), os.path.join(tmp, variant))
            rows.append({"group": "pair", "setting": variant, "coverage": cov,
                         "workers": s["workers"], "params": s["params_total"],
                         "steps": s["steps"], "tokens": s["tokens"],
                         "model_flops": s["model_flops_per_step"] * s["steps"],
                         "final_val_loss": s["final_val_loss"],
                         "final_val_bpb": s["final_val_bpb"], "wall_s": s["wall_s"],
                         "dtype": s["dtype"], "completed": s["completed"],
                         "calibration_step_s": calibration[variant]})
            save(rows)
    return rows


def section_env(sizes: Sizes, deadline: float, save) -> list[dict]:
    """The device, backend and versions (one row; the parent never starts a JAX backend,
    which would hold the accelerator the sections need)."""
    versions = {}
    for pkg in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "numpy"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = "-"
    dev = jax.devices()[0]
    line = (f"{dev.device_kind} ({jax.default_backend()}, {jax.device_count()} device(s)); "
            f"Python {sys.version.split()[0]}; "
            + ", ".join(f"{k} {v}" for k, v in versions.items()))
    return [{"line": line, "backend": jax.default_backend(),
             "text": jax.print_environment_info(return_string=True)}]


RUNNERS = {"env": section_env, "jit": section_jit, "attention": section_attention,
           "pair": section_pair}


# ------------------------------------------------------------------------------ the command
def _define(argv):
    fv = flags.FlagValues()
    flags.DEFINE_string("out", None, "folder for device_tables.md, device_rows.json and "
                        "environment.txt", flag_values=fv)
    flags.DEFINE_bool("dry_run", False, "tiny models (any device): checks the command",
                      flag_values=fv)
    flags.DEFINE_float("budget_s", 520.0, "wall seconds for the sections, compiles included",
                       flag_values=fv)
    flags.DEFINE_list("sections", list(SECTIONS), "sections to run, in order",
                      flag_values=fv)
    flags.DEFINE_string("section", None, "(internal) run this one section", flag_values=fv)
    flags.DEFINE_string("rows", None, "(internal) where the section writes", flag_values=fv)
    flags.DEFINE_float("deadline", 0.0, "(internal) the section's end (epoch s)",
                       flag_values=fv)
    return fv


def _check(fv) -> None:
    """One-line errors (exit 2) before anything runs."""
    if not fv.out:
        cli.error(PROG, "--out is required: the folder for the tables (e.g. --out runs/device)")
    if not (0 < fv.budget_s <= 86400):
        cli.error(PROG, f"--budget_s={fv.budget_s} must be a positive number of seconds, at "
                  "most 86400 (520 fits the 10 minutes of a lent GPU's command)")
    bad = [s for s in fv.sections if s not in SECTIONS]
    if bad or not fv.sections or len(set(fv.sections)) < len(fv.sections):
        cli.error(PROG, f"--sections={','.join(fv.sections)}: choose each at most once from "
                  f"{','.join(SECTIONS)}")
    measure.out_folder(PROG, fv.out)


def _child(fv, sizes: Sizes) -> int:
    """A section's process: run it, writing its rows to ``--rows`` as they come; a section
    that cannot start (too little time) writes why."""
    if fv.section not in RUNNERS or not fv.rows:
        cli.error(PROG, f"--section={fv.section} is internal (with --rows); run {PROG} "
                  "--out DIR [--sections ...]")
    def save(rows):
        loop.write_atomically(fv.rows, json.dumps(rows, indent=1))
    try:
        save(RUNNERS[fv.section](sizes, fv.deadline, save))
    except TimeoutError as e:
        save([{"group": fv.section, "skipped": str(e)}])
    return 0


class Stopped(Exception):
    """A signal (SIGINT, SIGTERM, SIGHUP) reached the command while a section ran: its rows so
    far and a note, for the tables written before the command exits ``128 + signum``."""

    def __init__(self, signum: int, rows: list | None = None, note: str = ""):
        super().__init__(signum)
        self.signum, self.rows, self.note = signum, rows or [], note


def _raise_stopped(signum, frame):
    raise Stopped(signum)


def _die_with_parent() -> None:
    """In a section's process (before it starts): end when the command's process ends, even
    by SIGKILL (Linux ``prctl(PR_SET_PDEATHSIG)``; elsewhere the command's signal handlers
    end it)."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _run_section(fv, name: str, end: float, hard: float, cache: str) -> tuple[list, str]:
    """Run section ``name`` in a child process (its own process group, its temporary files in
    ``cache``) until ``hard`` (epoch s; it starts no new group after ``end``); ``(its rows, a
    note: empty, or why it stopped early)``.

    Raises:
      Stopped: a signal came (the child's group is ended first; its rows so far kept)."""
    rows_path = os.path.join(cache, f"{name}.json")
    args = [sys.executable, "-m", "sdp_jax.bench.device", "--section", name, "--rows",
            rows_path, "--deadline", repr(end), "--out", fv.out] + (
        ["--dry_run"] if fv.dry_run else [])
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": cache}
    env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(cache, "xla"))
    t0, note = time.time(), ""
    proc = subprocess.Popen(args, env=env, start_new_session=True, preexec_fn=_die_with_parent)
    try:
        rc = proc.wait(timeout=max(hard - time.time(), 1))
        if rc:
            why = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit {rc}"
            note = f"{name}: failed ({why}) after {time.time() - t0:.0f} s; see the log"
    except subprocess.TimeoutExpired:
        note = f"{name}: stopped at its time limit after {time.time() - t0:.0f} s"
    except Stopped as e:
        _end_group(proc)
        e.rows, e.note = _read_rows(rows_path)[0], (
            f"{name}: interrupted by {signal.Signals(e.signum).name} after "
            f"{time.time() - t0:.0f} s")
        raise
    finally:
        _end_group(proc)
    rows, skipped = _read_rows(rows_path)
    return rows, (f"{name}: skipped, {skipped}" if skipped else note)


def _read_rows(path: str) -> tuple[list, str | None]:
    """A section's rows so far, and why it was skipped (None: it ran)."""
    rows = []
    if os.path.exists(path):
        with open(path) as f:
            rows = json.load(f)
    skipped = [r["skipped"] for r in rows if "skipped" in r]
    return ([], skipped[0]) if skipped else (rows, None)


def _end_group(proc) -> None:
    """Kill the section's process group (our own child's) if it still runs."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass


def main(argv=None, check_only: bool = False) -> int:
    """The command line (``argv`` without the program name; default ``sys.argv[1:]``): run
    the sections (see the module docstring) and return 0 (a section that failed or was
    stopped is named in the tables); a bad flag, or no accelerator without ``--dry_run``,
    exits with status 2 and one line; a signal (SIGINT, SIGTERM, SIGHUP) writes the tables
    of what was measured and exits ``128 + signum``. ``check_only``: stop after the flags'
    checks (the documentation check, ``tests/test_docs.py``)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    fv = cli.command_flags(_define, [PROG] + argv, PROG, __doc__, "--out runs/device")
    sizes = DRY if fv.dry_run else Sizes()
    if fv.section:
        return _child(fv, sizes)
    _check(fv)
    if check_only:
        return 0
    old = {sig: signal.signal(sig, _raise_stopped)
           for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
           if signal.getsignal(sig) is not signal.SIG_IGN}
    try:
        with tempfile.TemporaryDirectory(prefix="sdp_jax_device_") as cache:
            return _sections(fv, cache)
    except Stopped as e:   # (between sections: the tables written so far stand)
        print(f"{PROG}: interrupted by {signal.Signals(e.signum).name}", file=sys.stderr)
        return 128 + e.signum
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _sections(fv, cache: str) -> int:
    """The environment, then each section in turn within its share of the budget; the tables
    after each (see :func:`main`)."""
    env, note = _run_section(fv, "env", time.time() + 60, time.time() + 120, cache)
    env_line = env[0]["line"] if env else f"an unknown device ({note})"
    _write(fv.out, "environment.txt", env[0]["line"] + "\n\n" + env[0]["text"] if env else note)
    if env and env[0]["backend"] == "cpu" and not fv.dry_run:
        cli.error(PROG, "no accelerator: JAX's backend is cpu, where the full-size models do "
                  "not fit; run on a GPU or TPU, or add --dry_run to check the command here")
    start, rows, notes, end = time.time(), {}, [], time.time()
    _write_outputs(fv, rows, ["sections running"], env_line, 0.0)   # (no earlier run's)
    for name in fv.sections:
        end = min(end + SHARE[name] * fv.budget_s, start + fv.budget_s)
        if name == fv.sections[-1]:
            end = start + fv.budget_s
        if end - time.time() < 5:
            notes.append(f"{name}: skipped, {max(end - time.time(), 0):.0f} s of the budget "
                         "left")
            continue
        print(f"[{PROG}] section {name}: until +{end - start:.0f} s", flush=True)
        hard = min(end + 0.1 * fv.budget_s, start + fv.budget_s + 15)
        try:
            rows[name], note = _run_section(fv, name, end, hard, cache)
        except Stopped as e:
            rows[name] = e.rows
            _write_outputs(fv, rows, notes + [e.note], env_line, time.time() - start)
            print(f"{PROG}: {e.note}; the tables of what was measured are in {fv.out}",
                  file=sys.stderr)
            return 128 + e.signum
        notes += [note] if note else []
        _write_outputs(fv, rows, notes, env_line, time.time() - start)
    print(_write_outputs(fv, rows, notes, env_line, time.time() - start))
    return 0


def _write(folder: str, name: str, text: str) -> None:
    loop.write_atomically(os.path.join(folder, name), text)


def _write_outputs(fv, rows: dict, notes: list, env_line: str, wall: float) -> str:
    """Write device_tables.md and device_rows.json (after every section); the tables."""
    sections = "" if fv.sections == list(SECTIONS) else f" --sections {','.join(fv.sections)}"
    text = device_tables.tables(rows, notes, env_line, wall,
                                f"{PROG} --out {fv.out} --budget_s {fv.budget_s:g}{sections}"
                                + (" --dry_run" if fv.dry_run else ""))
    _write(fv.out, "device_tables.md", text)
    _write(fv.out, "device_rows.json", json.dumps(rows, indent=1))
    return text


if __name__ == "__main__":
    sys.exit(main())
