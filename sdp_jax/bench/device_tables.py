"""The tables of ``python -m sdp_jax.bench.device`` (:mod:`sdp_jax.bench.device`), in markdown,
from its rows: our DDP step against plain jit, the worker floor, compiled against measured
peak memory, the attention implementations and the FLOP-matched pair."""

from __future__ import annotations

import time

from sdp_jax.bench.measure import paired_ratio

GIB = 2.0 ** 30


def _gib(n) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


def _ms(row: dict) -> str:
    return "-" if "step_time_s" not in row else f"{row['step_time_s'] * 1e3:.1f}"


def _num(x, fmt: str = "{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def _paired(row: dict, base: dict | None) -> float | None:
    if base is None or "step_times_s" not in row or "step_times_s" not in base:
        return None
    return paired_ratio(row["step_times_s"], base["step_times_s"])


def _div(a, b) -> float | None:
    return None if a is None or not b else a / b


def _groups(rows: list[dict]) -> dict[str, dict[str, dict]]:
    out: dict[str, dict[str, dict]] = {}
    for r in rows:
        out.setdefault(r["group"], {})[r["setting"]] = r
    return out


def jit_table(rows: list[dict]) -> list[str]:
    """Our DDP step (one worker) against plain ``jax.jit`` per model."""
    lines = ["| model | params | tokens/step | attention | ours ms | jit ms | ours / jit "
             "(paired) | ours tok/s | jit tok/s | ours MFU | jit MFU |", "|" + "---|" * 11]
    for model, g in _groups(rows).items():
        ours, jit = g.get("ours-ddp"), g.get("jit-ddp")
        failed = [r for r in (ours, jit) if r is None or r["error"]]
        if failed:
            lines.append(f"| {model} | not run: "
                         f"{failed[0]['error'] if failed[0] else 'missing'} |" + " |" * 9)
            continue
        lines.append(
            f"| {model} | {ours['params'] / 1e6:.1f} M | {ours['tokens_per_step']} | "
            f"{ours['attention']} | {_ms(ours)} | {_ms(jit)} | {_num(_paired(ours, jit))} | "
            f"{_num(ours.get('tokens_per_s'), '{:,.0f}')} | "
            f"{_num(jit.get('tokens_per_s'), '{:,.0f}')} | "
            f"{_num(ours.get('mfu'), '{:.1%}')} | {_num(jit.get('mfu'), '{:.1%}')} |")
    return lines


def floor_table(rows: list[dict]) -> list[str]:
    """Plain jit of ``k`` of ``L`` blocks against the full model: what a B-SDP worker's compute
    costs on the device."""
    lines = ["| model | blocks | C | step ms | time / full (paired) | compiled peak / full | "
             "measured peak / full | model FLOPs / full |", "|" + "---|" * 8]
    for model, g in _groups(rows).items():
        full = g.get("jit-ddp")
        for r in g.values():
            if r["setting"].startswith("jit-ddp ") and full is not None:
                lines.append(
                    f"| {model} | {r['blocks']}/{r['n_layers']} | "
                    f"{r['blocks'] / r['n_layers']:.4g} | {_ms(r)} | {_num(_paired(r, full))} | "
                    f"{_num(_div(r.get('compiled_peak_bytes'), full.get('compiled_peak_bytes')))} | "
                    f"{_num(_div(r.get('measured_peak_bytes'), full.get('measured_peak_bytes')))} | "
                    f"{_num(_div(r['model_flops_per_step'], full['model_flops_per_step']))} |")
    return lines


def memory_table(rows: list[dict]) -> list[str]:
    """Compiled peak (``memory_analysis()``) against the device's measured peak."""
    lines = ["| group | setting | compiled peak GiB | measured peak GiB | measured / compiled |",
             "|" + "---|" * 5]
    for r in rows:
        if "compiled_peak_bytes" not in r:
            continue
        measured = r.get("measured_peak_bytes")
        bound = "<= " if r.get("measured_peak_is_bound") else ""
        lines.append(f"| {r['group']} | {r['setting']} | {_gib(r['compiled_peak_bytes'])} | "
                     f"{bound if measured is not None else ''}{_gib(measured)} | "
                     f"{_num(_div(measured, r['compiled_peak_bytes']))} |")
    return lines


def attention_table(rows: list[dict]) -> list[str]:
    """Each attention implementation at each sequence length, against ``dot_product``."""
    lines = ["| T | attention | sequences/step | step ms | tok/s | time / dot_product (paired) | "
             "compiled peak GiB | measured peak GiB |", "|" + "---|" * 8]
    for g in _groups(rows).values():
        base = next((r for r in g.values() if r["attention"] == "dot_product"), None)
        for r in g.values():
            if r.get("error"):
                lines.append(f"| {r['seq_len']} | {r['attention']} | - | not run: "
                             f"{r['error']} | | | | |")
                continue
            lines.append(f"| {r['seq_len']} | {r['attention']} | "
                         f"{r['tokens_per_step'] // r['seq_len']} | {_ms(r)} | "
                         f"{_num(r.get('tokens_per_s'), '{:,.0f}')} | "
                         f"{_num(_paired(r, base))} | {_gib(r.get('compiled_peak_bytes'))} | "
                         f"{_gib(r.get('measured_peak_bytes'))} |")
    return lines


def pair_table(rows: list[dict]) -> list[str]:
    """The FLOP-matched DDP / B-SDP pair."""
    lines = ["| variant | C | workers | params | steps | tokens | model FLOPs | FLOPs / DDP | "
             "val loss (nats/token) | bits/byte | wall s |", "|" + "---|" * 11]
    ddp = next((r for r in rows if r["setting"] == "ddp"), None)
    for r in rows:
        lines.append(
            f"| {r['setting']} | {r['coverage']:g} | {r['workers']} (emulated) | "
            f"{r['params'] / 1e6:.1f} M | {r['steps']} | {r['tokens']:,} | "
            f"{r['model_flops']:.3e} | "
            f"{_num(_div(r['model_flops'], ddp and ddp['model_flops']))} | "
            f"{_num(r['final_val_loss'], '{:.4f}')} | {_num(r['final_val_bpb'])} | "
            f"{r['wall_s']:.0f} |")
    return lines


SECTION_TABLES = (
    ("jit", "Our DDP step against plain jax.jit (one worker, bf16)", jit_table),
    ("jit", "Worker floor: plain jit of k of L blocks against the whole model", floor_table),
    ("jit", "Compiled against measured peak memory", memory_table),
    ("attention", "Attention implementations (our DDP step, bf16, 8192 tokens per step "
                  "at the device's sizes)", attention_table),
    ("attention", "Compiled against measured peak memory (attention rows)", memory_table),
    ("pair", "FLOP-matched pair: DDP against B-SDP at C = 1/2, 8 emulated workers",
     pair_table),
)


def tables(rows: dict[str, list[dict]], notes: list[str], env_line: str, wall: float,
           command: str) -> str:
    """The whole ``device_tables.md``: a header (the device and versions, the command, its
    wall time), each section's tables, and the notes (sections skipped, stopped or failed)."""
    out = [f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {env_line}.",
           "", f"Command: `{command}`; {wall:.0f} s wall, compiles included.", ""]
    for section, title, fn in SECTION_TABLES:
        if rows.get(section):
            out += [f"### {title}", "", *fn(rows[section]), ""]
    out += [f"- {n}" for n in notes]
    return "\n".join(out) + "\n"
