"""Per-device memory and FLOPs of compiled train steps, without training or an accelerator.

    python -m sdp_jax.bench --config configs/llama_1b.py --workers 8 --variants ddp,b-sdp \\
        --coverage 0.6875 --json out.json

For each variant the train step is lowered for abstract inputs (``jax.ShapeDtypeStruct`` with
shardings: no parameter is materialized) on a mesh of ``--workers`` devices (simulated CPU
devices when no accelerator is present) and compiled; ``compiled.memory_analysis()`` gives the
per-device argument, output, alias and temporary bytes, and ``compiled.cost_analysis()`` the
per-device FLOPs. peak = argument + temp + output - alias (the state is donated, so its output
aliases its input). One JSON row per variant; a table with the ratio to DDP is printed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time


def load_config(path: str):
    """Load a ``get_config()`` file. Raises FileNotFoundError / AttributeError with the path."""
    if not os.path.isfile(path) or not path.endswith(".py"):
        raise FileNotFoundError(f"config file {path!r} does not exist or is not a .py file.")
    spec = importlib.util.spec_from_file_location("_sdp_bench_config", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if not hasattr(mod, "get_config"):
        raise AttributeError(f"config file {path!r} defines no get_config().")
    return mod.get_config()


def measure(config, variant: str, workers: int, coverage: float, mesh) -> dict:
    """Compile one variant's train step and read its per-device memory and FLOPs.

    Returns:
      row dict: ``variant``, ``regime``, ``coverage``, ``workers``, ``held_per_worker``,
      ``argument_bytes``, ``output_bytes``, ``alias_bytes``, ``temp_bytes``,
      ``peak_bytes_per_device`` (bytes), ``flops_per_device`` (FLOPs per step, XLA's count on
      the unrolled program), ``model_flops_per_device`` (ddp and b-sdp: ``6N + 12 L T d`` per
      token times the worker's tokens, :func:`sdp_jax.train_step.model_flops_per_token`),
      ``params_per_device``, ``compile_s``.
    """
    from sdp_jax import train_step as ts
    from sdp_jax.models.llama import LlamaConfig

    model = LlamaConfig.from_config(config.model)
    optim = ts.OptimConfig.from_config(config.optim)
    sdp = config.sdp
    try:
        plan = ts.make_plan(variant, model, workers, coverage, sdp.scheme, sdp.mask_seed)
        uniform_ok = True
    except ValueError:  # e.g. W*C = 5.5 at 1B: near-uniform masks, as in the paper
        plan = ts.make_plan(variant, model, workers, coverage, sdp.scheme, sdp.mask_seed,
                            allow_nonuniform=True)
        uniform_ok = False
    batch_shape = (workers * config.batch_per_worker, config.seq_len + 1)
    t0 = time.time()
    builder = ts.StepBuilder(model, plan, optim, mesh, config.steps, method=sdp.method)
    compiled = builder.compiled_train_step(batch_shape)
    # XLA's cost analysis counts a scan body once: count FLOPs on the unrolled program.
    unrolled = ts.StepBuilder(model, plan, optim, mesh, config.steps, method=sdp.method,
                              unroll=True)
    flops = ts.flops_per_device(unrolled.compiled_train_step(batch_shape))
    tokens = config.batch_per_worker * config.seq_len
    held = {"block": "blocks", "mlp": "neurons", "heads": "kv-groups"}
    row = {"variant": variant, "regime": plan.regime, "coverage": plan.coverage,
           "workers": workers,
           "held_per_worker": ", ".join(f"{t.k}/{t.masks.shape[-1]} {held[k]}"
                                        for k, t in plan.kinds.items()),
           "uniform": uniform_ok, **ts.memory_stats(compiled), "flops_per_device": flops,
           "model_flops_per_device": (
               ts.model_flops_per_token(model, config.seq_len, plan.kinds["block"].k) * tokens
               if variant in ("ddp", "b-sdp") else None),
           "params_per_device": builder.per_device_param_count(),
           "compile_s": round(time.time() - t0, 1)}
    return row


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.2f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _flops(n: float) -> str:
    for unit, scale in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= scale or unit == "MFLOP":
            return f"{n / scale:.3f} {unit}"
    return str(n)


def format_table(rows: list[dict]) -> str:
    """Markdown table of bench rows with ratios to the DDP row (if present)."""
    base = next((r for r in rows if r["variant"] == "ddp"), None)
    head = ("| variant | C | W | held per worker | argument | temp | peak/device | peak / DDP | "
            "FLOPs/device | FLOPs / DDP |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        pr = f"{r['peak_bytes_per_device'] / base['peak_bytes_per_device']:.3f}" if base else "-"
        fr = (f"{r['flops_per_device'] / base['flops_per_device']:.3f}"
              if base and base["flops_per_device"] else "-")
        lines.append(
            f"| {r['variant']} | {r['coverage']:.4g} | {r['workers']} | {r['held_per_worker']} | "
            f"{_bytes(r['argument_bytes'])} | {_bytes(r['temp_bytes'])} | "
            f"{_bytes(r['peak_bytes_per_device'])} | {pr} | {_flops(r['flops_per_device'])} | "
            f"{fr} |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m sdp_jax.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/llama_1b.py", help="get_config() file")
    p.add_argument("--workers", type=int, default=8, help="W data-parallel workers (devices)")
    p.add_argument("--variants", default="ddp,b-sdp",
                   help="comma-separated: ddp,b-sdp,n-sdp,bb-sdp,nb-sdp")
    p.add_argument("--coverage", type=float, default=None,
                   help="C for the SDP variants (default: the config's sdp.coverage)")
    p.add_argument("--batch-per-worker", type=int, default=None, help="override config")
    p.add_argument("--seq-len", type=int, default=None, help="override config")
    p.add_argument("--json", default=None, help="write the rows to this JSON file")
    args = p.parse_args(argv)

    if args.workers < 1:
        p.error(f"--workers={args.workers} must be >= 1")
    for flag, v in (("--batch-per-worker", args.batch_per_worker), ("--seq-len", args.seq_len)):
        if v is not None and v < 1:
            p.error(f"{flag}={v} must be >= 1")
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        p.error(f"--json {args.json!r}: its directory does not exist")
    try:
        config = load_config(args.config)
    except (OSError, AttributeError, SyntaxError) as e:
        p.error(str(e))
    from sdp_jax import train_step as ts
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in ts.VARIANTS]
    if bad or not variants:
        p.error(f"unknown variants {bad or args.variants!r}; choose from {','.join(ts.VARIANTS)}")
    coverage = config.sdp.coverage if args.coverage is None else args.coverage
    with config.unlocked():
        if args.batch_per_worker is not None:
            config.batch_per_worker = args.batch_per_worker
        if args.seq_len is not None:
            config.seq_len = args.seq_len
            config.model.max_seq_len = max(config.model.max_seq_len, args.seq_len)

    import jax
    # Simulated CPU devices (ignored on GPU/TPU); only raised, never lowered, so that a caller
    # that already set more devices (tests) keeps them.
    if args.workers > int(jax.config.jax_num_cpu_devices):
        jax.config.update("jax_num_cpu_devices", args.workers)
    if jax.device_count() < args.workers:
        p.error(f"--workers={args.workers} but only {jax.device_count()} "
                f"{jax.devices()[0].platform} devices are present")
    mesh = jax.make_mesh((args.workers,), ("data",), devices=jax.devices()[:args.workers])

    from sdp_jax.models.llama import LlamaConfig
    model = LlamaConfig.from_config(config.model)
    for v in variants:
        try:
            ts.make_plan(v, model, args.workers, coverage, config.sdp.scheme,
                         config.sdp.mask_seed, allow_nonuniform=True)
        except ValueError as e:
            p.error(str(e))
    L = model.n_layers
    rows = []
    print(f"{args.config}: {L} blocks, batch {config.batch_per_worker} x {config.seq_len} tokens "
          f"per worker, {args.workers} x {jax.devices()[0].platform}", flush=True)
    for v in variants:
        row = measure(config, v, args.workers, coverage, mesh)
        rows.append(row)
        print(f"  compiled {v} in {row['compile_s']}s", flush=True)
    print(format_table(rows))
    for r in rows:
        if not r["uniform"]:
            print(f"note: {r['variant']}: W*C is not whole for some component kind, so its masks "
                  "are near-uniform (multiplicities differ by one), as in the paper's 1B setting.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
        print(f"wrote {args.json}")
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
