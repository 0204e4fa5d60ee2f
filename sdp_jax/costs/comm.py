"""Per-device communication volume of a compiled JAX program, read from its optimized HLO text.

Input is the text of ``jax.jit(f).lower(*args).compile().as_text()``: the optimized,
SPMD-partitioned HLO module, i.e. the program *one* device runs. Every collective instruction
reachable from the ENTRY computation is found, weighted by how many times it executes per
program run (the product of the trip counts of the ``while`` loops around it), and converted to
"bus bytes" with the convention of nccl-tests (``doc/PERFORMANCE.md`` in
https://github.com/NVIDIA/nccl-tests, section "Bus bandwidth"): the bytes each device sends
over its links with a ring / bandwidth-optimal algorithm, which makes the number comparable
across collectives and group sizes. With ``n`` the replica-group size and ``S`` the operand
bytes per device (see :func:`collective_ops` for what ``S`` is for each op):

==================== ===================== ===============================================
op                   bus bytes per exec.   note
==================== ===================== ===============================================
all-reduce           ``2 (n-1)/n * S``     ``S`` = operand = result
all-gather           ``(n-1) * S``         ``S`` = input shard = result / n
reduce-scatter       ``(n-1)/n * S``       ``S`` = full input = result * n
all-to-all           ``(n-1)/n * S``       ``S`` = operand = result
collective-permute   ``S``                 once per instruction; 0 without source-target pairs
collective-broadcast ``(n-1)/n * S``       ``S`` = operand = result
==================== ===================== ===============================================

Groups of one device cost 0. All byte counts are plain bytes (not bits, not MiB).

Scope and limits:

* Trip counts come from ``backend_config={..."known_trip_count":{"n":"5"}...}`` on the ``while``
  instruction, which XLA attaches on CPU for ``lax.scan`` / ``lax.fori_loop`` with static bounds,
  e.g. ``%while.9 = (s32[], f32[1024]{0}) while(%tuple.8), condition=%region_2.3_spmd,
  body=%region_0.2_spmd, ..., backend_config={"dynamic_variables":[],
  "known_induction_variable":{"tuple_index":"0"},"known_init_step":{"init":"0","step":"1"},
  "known_trip_count":{"n":"5"}}``. Without it the count is inferred from the loop condition,
  ``compare(get-tuple-element(param, k), constant)`` with ``direction=LT`` (also ``LE``, ``NE``,
  or the operands swapped with ``GT``/``GE``), possibly wrapped in a fusion, with the initial
  value of element ``k`` taken from ``known_init_step`` or from the constant in the while's
  tuple operand (step 1); failing that the loop counts once and is reported in
  ``unknown_trip_counts`` / ``warnings`` (and its collectives get ``exact=False``). A loop's
  condition computation runs ``trip + 1`` times.
* ``conditional``: every branch is counted once per execution of the ``conditional``, so the
  result is an **upper bound** for programs with collectives inside ``lax.cond`` /
  ``lax.switch`` (those ops carry ``exact=False``).
* ``call``, ``fusion`` (``calls=``), ``async-start`` wrappers, ``custom-call``
  (``called_computations=``) are followed with the caller's count. Async pairs
  (``all-reduce-start``/``-done``, ``all-gather-start``/``-done``,
  ``collective-permute-start``/``-done``, ``reduce-scatter-start``/``-done``, and the generic
  ``async-start``/``-update``/``-done`` around a collective) count once, on the start op.
* ``send``/``recv`` and ``ragged-all-to-all`` are not counted.
* By mesh axis (``comm_bytes_per_device(..., mesh_axes)``): a collective's bytes go to the
  axes its first replica group spans, the device ids read as positions in the mesh's devices in
  row-major order (how a jitted ``shard_map`` numbers them; every group of an op is taken to
  span the same axes). The mesh-axes form GSPMD prints for automatic partitioning
  (``replica_groups=mesh['axis_0'=4,...]``) names XLA's axes, not the mesh's, and counts as
  ``unknown``.
* Collectives the compiler inserted (e.g. by GSPMD for automatic sharding) are counted like any
  other: the text is what actually runs. Note that XLA:CPU (jax 0.10.2) promotes bf16
  collectives to f32 (convert, f32 collective, convert back), so on CPU a bf16 ``psum`` or
  ``all_gather`` counts as much as an f32 one; f16 and the integer types are sent as they are.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

__all__ = ["COLLECTIVE_OPS", "collective_ops", "comm_bytes_per_device", "shape_bytes"]

COLLECTIVE_OPS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "collective-broadcast",
)

# Opcodes that start a collective (counted) -> canonical op name.
_COLLECTIVE_OPCODES = {op: op for op in COLLECTIVE_OPS}
# Async halves: XLA prints an async-wrapped collective as ``<op>-start`` / ``<op>-done`` (e.g.
# all-reduce-start, all-gather-start, collective-permute-start, reduce-scatter-start).
_COLLECTIVE_OPCODES.update({op + "-start": op for op in COLLECTIVE_OPS})

# Ops whose called computations are per-element reductions / comparators (never hold collectives
# and do not run "once per execution"): their callees are not followed.
_NO_FOLLOW_OPCODES = frozenset({
    "all-reduce", "all-reduce-start", "reduce-scatter", "reduce-scatter-start", "reduce",
    "reduce-window", "scatter", "select-and-scatter", "sort", "map",
    # The second half of an async pair points at the same computation as its start op.
    "async-update", "async-done",
})

# Bytes per element of each HLO element type. Types not listed fall back to the bit width in the
# name (``f8e4m3fn`` -> 8 bits), see :func:`_element_bits`.
_ELEMENT_BITS = {
    "pred": 8,
    "s2": 2, "u2": 2, "s4": 4, "u4": 4, "f4e2m1fn": 4,
    "s8": 8, "u8": 8,
    "s16": 16, "u16": 16, "bf16": 16, "f16": 16,
    "s32": 32, "u32": 32, "f32": 32,
    "s64": 64, "u64": 64, "f64": 64,
    "c64": 64, "c128": 128,
    "token": 0, "opaque": 0,
}

_STRING_RE = re.compile(r'"(?:[^"\\]|\\.)*"')
_COMMENT_RE = re.compile(r"/\*.*?\*/")
_ARRAY_RE = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_HEADER_RE = re.compile(r"^(ENTRY\s+)?%?([^\s({]+)")
_INSTR_RE = re.compile(r"^\s*(ROOT\s+)?%?([^\s=]+)\s*=\s*")
_OPCODE_RE = re.compile(r"([A-Za-z][\w\-]*)\(")
_SINGLE_CALLEE_RE = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation|select|scatter|"
    r"comparator)=%?([^\s,{}()]+)"
)
_LIST_CALLEE_RE = re.compile(r"\b(calls|branch_computations|called_computations)=\{([^}]*)\}")
_TRIP_RE = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(-?\d+)"?')
_INIT_STEP_RE = re.compile(
    r'"known_init_step"\s*:\s*\{\s*"init"\s*:\s*"?(-?\d+)"?\s*,\s*"step"\s*:\s*"?(-?\d+)"?'
)


@dataclass
class _Instr:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    operand_shapes: list[str | None]
    attrs: str  # attribute text with string literals blanked out (same length as raw_attrs)
    raw_attrs: str
    is_root: bool


@dataclass
class _Comp:
    name: str
    is_entry: bool
    instrs: list[_Instr] = field(default_factory=list)
    by_name: dict[str, _Instr] = field(default_factory=dict)

    @property
    def root(self) -> _Instr | None:
        for ins in self.instrs:
            if ins.is_root:
                return ins
        return self.instrs[-1] if self.instrs else None


# --------------------------------------------------------------------------------------------
# Text helpers
# --------------------------------------------------------------------------------------------


def _blank(text: str) -> str:
    """Replace the inside of string literals and ``/*...*/`` comments by spaces (length kept)."""
    text = _STRING_RE.sub(lambda m: '"' + " " * (len(m.group(0)) - 2) + '"', text)
    return _COMMENT_RE.sub(lambda m: " " * len(m.group(0)), text)


_OPEN = {"(": ")", "[": "]", "{": "}"}


def _match_close(text: str, start: int) -> int:
    """Index of the bracket closing ``text[start]`` (an opening bracket); -1 if unbalanced."""
    depth = 0
    for i in range(start, len(text)):
        c = text[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i
    return -1


def _split_top(text: str) -> list[str]:
    """Split on commas that are not inside brackets; empty pieces dropped."""
    parts, depth, cur = [], 0, []
    for c in text:
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _element_bits(dtype: str) -> int | None:
    if dtype in _ELEMENT_BITS:
        return _ELEMENT_BITS[dtype]
    m = re.match(r"^[a-z]+?(\d+)", dtype)
    return int(m.group(1)) if m else None


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape string, summed over tuple elements.

    ``"f32[8,4]{1,0}"`` -> 128, ``"(f32[2], bf16[4])"`` -> 16, ``"f32[]"`` -> 4, ``"pred[3]"`` -> 3.
    Dynamic dimensions (``<=10``) count at their bound; sub-byte types are packed (rounded up per
    array). Raises ``ValueError`` for an element type whose width cannot be determined.
    """
    total = 0
    for dtype, dims in _ARRAY_RE.findall(_COMMENT_RE.sub(" ", shape)):
        bits = _element_bits(dtype)
        if bits is None:
            raise ValueError(f"unknown HLO element type {dtype!r} in shape {shape!r}")
        n = 1
        for d in dims.split(","):
            d = d.strip().lstrip("<=").strip()
            if d:
                n *= int(d)
        total += (n * bits + 7) // 8
    return total


def _tuple_elements(shape: str) -> list[str]:
    shape = shape.strip()
    if shape.startswith("("):
        close = _match_close(shape, 0)
        return _split_top(_COMMENT_RE.sub(" ", shape[1:close]))
    return [shape]


# --------------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------------


def _parse_instr(line: str) -> _Instr | None:
    blanked = _blank(line)
    m = _INSTR_RE.match(blanked)
    if not m:
        return None
    pos = m.end()
    rest = blanked[pos:]
    if rest.startswith("("):
        close = _match_close(rest, 0)
        if close < 0:
            return None
        shape, after = rest[: close + 1], close + 1
    else:
        sm = re.match(r"\S+", rest)
        if not sm:
            return None
        shape, after = sm.group(0), sm.end()
    while after < len(rest) and rest[after] == " ":
        after += 1
    om = _OPCODE_RE.match(rest, after)
    if not om:
        return None
    close = _match_close(rest, om.end() - 1)
    if close < 0:
        return None
    operands, operand_shapes = [], []
    for piece in _split_top(rest[om.end(): close]):
        tokens = piece.split()
        operands.append(tokens[-1].lstrip("%"))
        operand_shapes.append(" ".join(tokens[:-1]) or None)
    attr_start = pos + close + 1
    return _Instr(
        name=m.group(2),
        shape=shape,
        opcode=om.group(1),
        operands=operands,
        operand_shapes=operand_shapes,
        attrs=blanked[attr_start:],
        raw_attrs=line[attr_start:],
        is_root=bool(m.group(1)),
    )


def _parse_module(hlo_text: str) -> tuple[dict[str, _Comp], str, int]:
    """Computations by name, the ENTRY name, and the header's device count (partitions*replicas)."""
    comps: dict[str, _Comp] = {}
    entry = None
    header_devices = 1
    cur: _Comp | None = None
    for line in hlo_text.splitlines():
        stripped = line.strip()
        if not stripped:
            continue
        if cur is None:
            if line.startswith("HloModule"):
                parts = dict(re.findall(r"\b(num_partitions|replica_count)=(\d+)", line))
                header_devices = int(parts.get("num_partitions", 1)) * int(
                    parts.get("replica_count", 1)
                )
                continue
            if stripped.endswith("{") and not line[:1].isspace():
                hm = _HEADER_RE.match(stripped)
                if hm:
                    cur = _Comp(name=hm.group(2), is_entry=bool(hm.group(1)))
                    comps[cur.name] = cur
                    if cur.is_entry:
                        entry = cur.name
            continue
        if stripped == "}":
            cur = None
            continue
        ins = _parse_instr(line)
        if ins is not None:
            cur.instrs.append(ins)
            cur.by_name[ins.name] = ins
    if entry is None:
        raise ValueError("no ENTRY computation found in the HLO text")
    return comps, entry, header_devices


def _callees(ins: _Instr) -> list[tuple[str, str]]:
    """(attribute, computation name) pairs for the computations an instruction calls."""
    out = []
    for key, body in _LIST_CALLEE_RE.findall(ins.attrs):
        out.extend((key, n.strip().lstrip("%")) for n in body.split(",") if n.strip())
    for key, name in _SINGLE_CALLEE_RE.findall(ins.attrs):
        out.append((key, name.lstrip("%")))
    return out


# --------------------------------------------------------------------------------------------
# Replica groups and bytes
# --------------------------------------------------------------------------------------------


def _group_size(ins: _Instr, default: int) -> int:
    attrs = ins.attrs
    m = re.search(r"\breplica_groups=", attrs)
    if not m:
        return default
    rest = attrs[m.end():]
    if rest.startswith("mesh["):
        # Mesh-axes form: mesh['axis_0'=2,'axis_1'=4][, device_ids=(...)] {'axis_0'}; the group
        # spans the listed axes (a sub-axis may be written 'name':(pre_size)size).
        close = _match_close(rest, 4)
        raw = ins.raw_attrs[m.end(): m.end() + len(rest)]
        sizes = {k: int(v) for k, v in re.findall(r"'([^']*)'\s*=\s*(\d+)", raw[5:close])}
        brace = raw.find("{", close)
        end = raw.find("}", brace)
        if brace < 0 or end < 0:
            return default
        n = 1
        for name, sub in re.findall(r"'([^']*)'(?:\s*:\s*\(\d+\)\s*(\d+))?", raw[brace:end]):
            n *= int(sub) if sub else sizes.get(name, 1)
        return n
    if rest.startswith("["):
        # Iota form: [num_groups,group_size]<=[...] (optionally followed by T(...)).
        dims = [int(d) for d in re.findall(r"\d+", rest[: rest.find("]")])]
        return dims[-1] if dims else default
    if rest.startswith("{"):
        close = _match_close(rest, 0)
        groups = re.findall(r"\{([^{}]*)\}", rest[1:close])
        sizes = [len(re.findall(r"\d+", g)) for g in groups]
        sizes = [s for s in sizes if s]
        return max(sizes) if sizes else default
    return default


def _unravel(flat: int, shape: list[int]) -> list[int]:
    """The row-major index into an array of ``shape`` of its ``flat``-th element."""
    index = []
    for size in reversed(shape):
        index.append(flat % size)
        flat //= size
    return index[::-1]


def _iota_group(rest: str) -> list[int] | None:
    """The first group of an iota-form ``replica_groups=[G,N]<=[d0,d1,...]T(p0,p1,...)``: the ids
    ``0 .. prod(d) - 1`` laid out as an array of shape ``d``, its axes permuted by ``T`` (none:
    as they are), read in row-major order and cut into ``G`` groups of ``N``."""
    m = re.match(r"\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", rest)
    if not m:
        return None
    n, dims = int(m.group(2)), [int(d) for d in m.group(3).split(",")]
    perm = [int(d) for d in m.group(4).split(",")] if m.group(4) else list(range(len(dims)))
    strides = [math.prod(dims[i + 1:]) for i in range(len(dims))]
    shape = [dims[i] for i in perm]
    first = []
    for flat in range(n):   # the first N entries of the permuted array, row-major
        index = _unravel(flat, shape)
        first.append(sum(index[k] * strides[perm[k]] for k in range(len(perm))))
    return first


def _first_group(ins: _Instr) -> list[int] | None:
    """The device (partition) ids of the first replica group of a collective, from the explicit
    ``{{0,2},{1,3}}`` or the iota ``[2,2]<=[4]`` form; the devices of ``source_target_pairs`` for
    a collective-permute; None for the mesh-axes form or no groups (every device)."""
    pairs = _source_target_pairs(ins)
    if pairs:
        return sorted({d for pair in pairs for d in pair})
    m = re.search(r"\breplica_groups=", ins.attrs)
    if not m:
        return None
    rest = ins.attrs[m.end():]
    if rest.startswith("["):
        return _iota_group(rest)
    if rest.startswith("{"):
        first = re.search(r"\{([^{}]*)\}", rest[1:_match_close(rest, 0)])
        ids = [int(d) for d in re.findall(r"\d+", first.group(1))] if first else []
        return ids or None
    return None


def group_axes(group: list[int] | None, mesh_axes: dict[str, int]) -> tuple[str, ...] | None:
    """The mesh axes a replica group spans: those along which its devices' coordinates differ.

    Args:
        group: device (partition) ids of one group, as the HLO numbers them: a device's id is
            its position in the mesh's devices read in row-major order (``mesh.devices.flat``),
            which is how a jitted ``shard_map`` over a ``jax.sharding.Mesh`` numbers them.
        mesh_axes: axis name -> size, in the mesh's order (``dict(mesh.shape)``).

    Returns:
        The axis names in mesh order, ``()`` for a group of one device, or None when ``group``
        is None or names an id outside the mesh."""
    if group is None or any(not 0 <= d < math.prod(mesh_axes.values()) for d in group):
        return None
    coords = [_unravel(d, list(mesh_axes.values())) for d in group]
    return tuple(name for i, name in enumerate(mesh_axes) if len({c[i] for c in coords}) > 1)


def _source_target_pairs(ins: _Instr) -> list[tuple[int, int]]:
    m = re.search(r"\bsource_target_pairs=\{", ins.attrs)
    if not m:
        return []
    close = _match_close(ins.attrs, m.end() - 1)
    body = ins.attrs[m.end(): close]
    return [(int(a), int(b)) for a, b in re.findall(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}", body)]


def _operand_bytes(ins: _Instr, comp: _Comp, op: str, n: int) -> int:
    """Operand bytes per device (``S``); from the operands' definitions, else from the result."""
    operands = list(zip(ins.operands, ins.operand_shapes, strict=True))
    if op == "collective-permute" and "slice_sizes=" in ins.attrs:
        operands = operands[:1]  # in-place form: (input, output buffer, offsets...)
    shapes = []
    for name, shape in operands:
        if shape is None and name in comp.by_name:
            shape = comp.by_name[name].shape
        shapes.append(shape)
    if shapes and all(s is not None for s in shapes):
        return sum(shape_bytes(s) for s in shapes)
    # Fallback: derive from the result shape.
    result = ins.shape
    if ins.opcode.endswith("-start") and op in ("all-gather", "collective-permute"):
        elems = _tuple_elements(result)
        if len(elems) > 1:
            return shape_bytes(elems[0])  # (operand(s), result(s), ...) tuple
    if op == "all-gather":
        return shape_bytes(result) // max(n, 1)
    if op == "reduce-scatter":
        return shape_bytes(result) * n
    return shape_bytes(result)


def _bus_bytes(op: str, s: float, n: int, pairs: list[tuple[int, int]] | None = None) -> float:
    """Bus bytes of one execution (nccl-tests convention; see the module docstring)."""
    if op == "collective-permute":
        return float(s) if any(a != b for a, b in pairs or []) else 0.0
    if n <= 1:
        return 0.0
    if op == "all-reduce":
        return 2.0 * (n - 1) / n * s
    if op == "all-gather":
        return float(n - 1) * s
    # reduce-scatter, all-to-all, collective-broadcast
    return (n - 1) / n * s


# --------------------------------------------------------------------------------------------
# Trip counts
# --------------------------------------------------------------------------------------------


def _const_value(ins: _Instr) -> int | None:
    if ins.opcode != "constant" or not ins.operands:
        return None
    try:
        return int(float(ins.operands[0]))
    except ValueError:
        return None


def _trace(comp: _Comp, name: str, comps: dict[str, _Comp]) -> _Instr | None:
    """Follow copies / converts / bitcasts to the defining instruction."""
    ins = comp.by_name.get(name)
    for _ in range(16):
        if ins is None or ins.opcode not in ("copy", "convert", "bitcast", "reshape"):
            return ins
        ins = comp.by_name.get(ins.operands[0]) if ins.operands else None
    return ins


@dataclass
class _LoopCompare:
    """The ``compare`` that ends a ``while`` loop: the root of its condition computation
    ``cond``, or (XLA:CPU) the root of the fused computation ``cmp_comp`` that the condition's
    root ``fusion`` instruction ``fused_root`` calls (None when not fused)."""

    cond: _Comp
    cmp_ins: _Instr
    cmp_comp: _Comp
    fused_root: _Instr | None
    comps: dict[str, _Comp]

    @classmethod
    def of(cls, ins: _Instr, comps: dict[str, _Comp]) -> _LoopCompare | None:
        """The compare of the ``while`` ``ins`` (None when its condition's root is none)."""
        names = dict(_callees(ins))
        cond = comps.get(names.get("condition", ""))
        root = cond.root if cond else None
        if root is None:
            return None
        cmp_ins, cmp_comp = root, cond
        fused_root: _Instr | None = None
        if root.opcode == "fusion":  # XLA:CPU wraps the compare: fusion(gte, constant), calls=...
            fused = comps.get(dict(_callees(root)).get("calls", ""))
            if fused is None or fused.root is None:
                return None
            cmp_ins, cmp_comp, fused_root = fused.root, fused, root
        if cmp_ins.opcode != "compare" or len(cmp_ins.operands) != 2:
            return None
        return cls(cond, cmp_ins, cmp_comp, fused_root, comps)

    def resolve(self, name: str) -> _Instr | None:
        """The defining instruction, seen through the fusion boundary into the condition."""
        got = _trace(self.cmp_comp, name, self.comps)
        if self.fused_root is not None and got is not None and got.opcode == "parameter":
            k = int(got.operands[0]) if got.operands else -1
            if 0 <= k < len(self.fused_root.operands):
                return _trace(self.cond, self.fused_root.operands[k], self.comps)
            return None
        return got

    def induction(self) -> tuple[int, int, str] | None:
        """``(k, bound, direction)`` of ``compare(get-tuple-element(param, k), constant)``
        (operands swapped with ``GT``/``GE``), ``direction`` one of LT, LE, NE; None otherwise."""
        dm = re.search(r"\bdirection=(\w+)", self.cmp_ins.attrs)
        direction = dm.group(1) if dm else ""
        lhs, rhs = (self.resolve(a) for a in self.cmp_ins.operands)
        if lhs is None or rhs is None:
            return None
        swap = {"GT": "LT", "GE": "LE", "LT": "GT", "LE": "GE", "NE": "NE"}
        if _const_value(lhs) is not None and rhs.opcode == "get-tuple-element":
            lhs, rhs, direction = rhs, lhs, swap.get(direction, "")
        bound = _const_value(rhs)
        if lhs.opcode != "get-tuple-element" or bound is None \
                or direction not in ("LT", "LE", "NE"):
            return None
        index = self._param_index(lhs)
        return None if index is None else (index, bound, direction)

    def _param_index(self, gte: _Instr) -> int | None:
        """``k`` of the induction variable ``gte`` = ``get-tuple-element(param, index=k)`` when
        it is an element of the condition's own parameter, else None."""
        if not gte.operands:
            return None
        in_fusion = self.fused_root is not None and self.cmp_comp.by_name.get(gte.name) is gte
        src = self.resolve(gte.operands[0]) if in_fusion else self.cond.by_name.get(
            gte.operands[0])
        if src is None or src.opcode != "parameter":
            return None
        im = re.search(r"\bindex=(\d+)", gte.attrs)
        return int(im.group(1)) if im else None


def _loop_init_step(ins: _Instr, comp: _Comp, comps: dict[str, _Comp],
                    index: int) -> tuple[int | None, int]:
    """``(initial value, step)`` of element ``index`` of the ``while`` ``ins``'s carry: from
    ``known_init_step``, else the constant in the while's tuple operand in the caller ``comp``
    (step 1); initial value None when neither says."""
    init, step = None, 1
    sm = _INIT_STEP_RE.search(ins.raw_attrs)
    if sm:
        init, step = int(sm.group(1)), int(sm.group(2))
    if init is None and ins.operands:
        tup = _trace(comp, ins.operands[0], comps)
        if tup is not None and tup.opcode == "tuple" and index < len(tup.operands):
            elem = _trace(comp, tup.operands[index], comps)
            init = _const_value(elem) if elem is not None else None
    return init, step


def _infer_trip_count(ins: _Instr, comp: _Comp, comps: dict[str, _Comp]) -> int | None:
    """Trip count of a ``while`` from ``compare(gte(param, k), constant)`` in its condition."""
    loop = _LoopCompare.of(ins, comps)
    found = loop.induction() if loop is not None else None
    if found is None:
        return None
    index, bound, direction = found
    # Initial value: the index-th element of the while's tuple operand in the caller.
    init, step = _loop_init_step(ins, comp, comps, index)
    if init is None or step <= 0:
        return None
    span = bound - init + (1 if direction == "LE" else 0)
    return max(0, math.ceil(span / step))


def _trip_count(ins: _Instr, comp: _Comp, comps: dict[str, _Comp]) -> int | None:
    bm = re.search(r"\bbackend_config=", ins.attrs)
    if bm:
        raw = ins.raw_attrs[bm.end():]
        tm = _TRIP_RE.search(raw)
        if tm:
            return int(tm.group(1))
        if raw.startswith("{"):  # tolerate other spellings inside the JSON
            try:
                cfg = json.loads(raw[: _match_close(raw, 0) + 1])
                n = cfg.get("known_trip_count", {}).get("n")
                if n is not None:
                    return int(n)
            except (ValueError, AttributeError):
                pass
    return _infer_trip_count(ins, comp, comps)


# --------------------------------------------------------------------------------------------
# Traversal
# --------------------------------------------------------------------------------------------


# JAX names the ops of a scan's backward pass ``.../transpose(jvp(...))/.../while/body/...``.
_BACKWARD_LOOP_RE = re.compile(r"transpose\(jvp\(.*?\)\).*/while/body/")


def _op_name(raw_attrs: str) -> str:
    m = re.search(r'op_name="([^"]*)"', raw_attrs)
    return m.group(1) if m else ""


def _analyze(hlo_text: str, num_devices: int | None) -> tuple[list[dict], int, list[str]]:
    """``(collective records, loops of unknown trip count, warnings)`` of an HLO module: the
    walk behind :func:`collective_ops` and :func:`comm_bytes_per_device`."""
    comps, entry, header_devices = _parse_module(hlo_text)
    default_n = num_devices if num_devices is not None else header_devices
    found: dict[tuple[str, str], dict] = {}
    trips: dict[tuple[str, str], int | None] = {}
    warnings: list[str] = []

    def trip_of(ins: _Instr, cname: str, comp: _Comp) -> int | None:
        key = (cname, ins.name)
        if key not in trips:
            trips[key] = _trip_count(ins, comp, comps)
            if trips[key] is None:
                warnings.append(f"unknown trip count for {ins.name!r} in {cname!r}; counted once")
        return trips[key]

    def visit(cname: str, mult: int, exact: bool, stack: tuple[str, ...]) -> None:
        comp = comps.get(cname)
        if comp is None:
            if cname not in stack:
                warnings.append(f"called computation {cname!r} not found; skipped")
            return
        if cname in stack:  # HLO has no recursion; guard against malformed text
            return
        stack = stack + (cname,)
        for ins in comp.instrs:
            op = _COLLECTIVE_OPCODES.get(ins.opcode)
            if op is not None:
                key = (cname, ins.name)
                if key not in found:
                    found[key] = _collective_record(ins, comp, op, default_n)
                found[key]["count"] += mult
                found[key]["exact"] = found[key]["exact"] and exact
            if ins.opcode in _NO_FOLLOW_OPCODES or ins.opcode.endswith("-done"):
                continue
            callees = _callees(ins)
            if not callees:
                continue
            trip = trip_of(ins, cname, comp) if ins.opcode == "while" else None
            for callee, m, e in _callee_counts(ins.opcode, callees, mult, exact, trip):
                visit(callee, m, e, stack)

    visit(entry, 1, True, ())
    ops = []
    for rec in found.values():
        rec["bus_bytes"] = rec.pop("_bus_once") * rec["count"]
        ops.append(rec)
    unknown = sum(1 for t in trips.values() if t is None)
    return ops, unknown, warnings


def _collective_record(ins: _Instr, comp: _Comp, op: str, default_n: int) -> dict:
    """A new record of :func:`collective_ops` for the collective ``ins`` (canonical name
    ``op``) of ``comp``, with ``count`` 0; ``_bus_once`` holds the bus bytes of one
    execution."""
    n = _group_size(ins, default_n)
    pairs = _source_target_pairs(ins) if op == "collective-permute" else None
    if pairs:
        n = len({d for p in pairs for d in p})
    s = _operand_bytes(ins, comp, op, n)
    return {
        "op": op,
        "bytes": s,
        "group_size": n,
        "count": 0,
        "bus_bytes": 0.0,
        "_bus_once": _bus_bytes(op, s, n, pairs),
        "name": ins.name,
        "computation": comp.name,
        "opcode": ins.opcode,
        "exact": True,
        "in_backward_loop": bool(_BACKWARD_LOOP_RE.search(_op_name(ins.raw_attrs))),
        "group": _first_group(ins),
        "pairs": pairs or None,
    }


def _callee_counts(opcode: str, callees: list[tuple[str, str]], mult: int, exact: bool,
                   trip: int | None) -> list[tuple[str, int, bool]]:
    """``(callee, executions, exact)`` of the computations an instruction calls, run ``mult``
    times by the caller: a ``while``'s body ``trip`` times per execution and its condition
    ``trip + 1`` times (once each, inexact, when ``trip`` is None); every ``conditional``
    branch as if taken (inexact); any other callee with the caller's count."""
    if opcode == "while":
        known = trip is not None
        out = []
        for attr, callee in callees:
            if attr == "body":
                out.append((callee, mult * (trip if known else 1), exact and known))
            elif attr == "condition":
                out.append((callee, mult * (trip + 1 if known else 1), exact and known))
        return out
    if opcode == "conditional":
        return [(callee, mult, False) for _, callee in callees]
    return [(callee, mult, exact) for _, callee in callees]


def collective_ops(hlo_text: str, num_devices: int | None = None) -> list[dict]:
    """Every collective instruction reachable from ENTRY, in program order of first discovery.

    Args:
        hlo_text: optimized HLO module text (``compiled.as_text()``), per-device program.
        num_devices: group size used when an op has no (or empty) ``replica_groups``; defaults to
            ``num_partitions * replica_count`` from the ``HloModule`` header line.

    Returns:
        One dict per instruction (an instruction inside a computation reached from several call
        sites appears once, its ``count`` summed over them):

        * ``op``: one of :data:`COLLECTIVE_OPS` (async ``*-start`` ops are reported under the
          base name; their ``*-done`` halves are not counted).
        * ``bytes``: ``S``, bytes of the operand buffer(s) per device, summed over tuple /
          variadic operands: all-reduce / all-to-all / collective-permute / collective-broadcast:
          the operand (= result); all-gather: the per-device input shard (= result / n);
          reduce-scatter: the full input (= result * n).
        * ``group_size``: ``n``, devices per replica group (explicit ``{{0,1,2,3},...}``, iota
          ``[2,4]<=[8]``, or mesh-axes ``mesh['a'=2,'b'=4] {'b'}`` form; the largest group if
          they differ; ``num_devices`` if absent). For collective-permute: the number of distinct
          devices in ``source_target_pairs``.
        * ``count``: executions per program run, the product of the trip counts of the enclosing
          ``while`` loops (each ``conditional`` branch counted as if taken: an upper bound).
        * ``bus_bytes``: bytes sent per device over all ``count`` executions, nccl-tests bus
          convention (module docstring).
        * ``name``, ``computation``, ``opcode``: where the instruction is.
        * ``exact``: False if the count relied on a ``conditional`` branch or a loop whose trip
          count could not be determined (counted once).
        * ``in_backward_loop``: JAX issued the op inside the body of a loop of the backward pass
          (its ``op_name`` metadata reads ``transpose(jvp(...))/.../while/body/``), e.g. a
          gradient averaged per block as the backward scan produces it, which the hardware can
          overlap with the rest of that loop; True even where XLA unrolled the loop.
        * ``group``: the device ids of its first replica group (:func:`group_axes` maps them to
          mesh axes), or None when the text does not list them; a collective-permute's:
          every device of its pairs.
        * ``pairs``: a collective-permute's ``(source, target)`` device pairs (None for the
          other kinds); the axes it spans are those of its pairs, each pair apart.

    Raises:
        ValueError: no ENTRY computation in ``hlo_text``, or an element type of unknown width.
    """
    return _analyze(hlo_text, num_devices)[0]


def comm_bytes_per_device(hlo_text: str, num_devices: int,
                          mesh_axes: dict[str, int] | None = None) -> dict:
    """Total bus bytes one device sends per run of the compiled program, and (with
    ``mesh_axes``) the bytes on each kind of link.

    Args:
        hlo_text: optimized HLO module text (``compiled.as_text()``).
        num_devices: group size for collectives without ``replica_groups`` (usually the number of
            devices the program was compiled for).
        mesh_axes: the mesh the program was compiled over, axis name -> size in the mesh's order
            (``dict(mesh.shape)``); its product is ``num_devices``.

    Returns:
        ``{"total": float, "by_op": {op: float for every op in COLLECTIVE_OPS},
        "in_backward_loop": float, "ops": int, "unknown_trip_counts": int, "warnings":
        list[str]}`` where ``total``, ``by_op`` and ``in_backward_loop`` (the ops issued inside
        the backward pass's loops) are sums of :func:`collective_ops` ``bus_bytes`` (bytes,
        already multiplied by the execution counts), ``ops`` is the number of collective
        instructions, and ``unknown_trip_counts``
        the number of ``while`` loops reachable from ENTRY whose trip count was neither in
        ``backend_config`` nor inferable (each counted as one iteration). With ``mesh_axes``
        also ``"by_axis": {key: float}``: the same bytes by the mesh axes each collective's
        groups span (:func:`group_axes`; a collective-permute's pairs, each apart), ``key`` the
        axis names joined by ``+`` in mesh order (``"data"``, ``"data+stage"``) or ``"unknown"``
        where the text does not list the groups; only keys with bytes; the values sum to
        ``total``.

    Raises:
        ValueError: no ENTRY computation in ``hlo_text``, an element type of unknown width, or
            ``mesh_axes`` whose product is not ``num_devices``.
    """
    if mesh_axes is not None and math.prod(mesh_axes.values()) != num_devices:
        raise ValueError(f"mesh_axes={mesh_axes} has {math.prod(mesh_axes.values())} devices, "
                         f"num_devices={num_devices}: pass the mesh the program was compiled "
                         "over, dict(mesh.shape)")
    ops, unknown, warnings = _analyze(hlo_text, num_devices)
    by_op = {op: 0.0 for op in COLLECTIVE_OPS}
    for rec in ops:
        by_op[rec["op"]] += rec["bus_bytes"]
    out = {
        "total": float(sum(by_op.values())),
        "by_op": by_op,
        "in_backward_loop": float(sum(r["bus_bytes"] for r in ops if r["in_backward_loop"])),
        "ops": len(ops),
        "unknown_trip_counts": unknown,
        "warnings": warnings,
    }
    if mesh_axes is not None:
        out["by_axis"] = _by_axis(ops, mesh_axes)
    return out


def _spanned(rec: dict, mesh_axes: dict[str, int]) -> tuple[str, ...] | None:
    """The mesh axes a :func:`collective_ops` record spans: its group's, or for a
    collective-permute the union of its pairs' (a pair within one worker spans none of
    ``data``, whatever the other pairs' workers)."""
    if not rec.get("pairs"):
        return group_axes(rec["group"], mesh_axes)
    found = [group_axes(list(p), mesh_axes) for p in rec["pairs"]]
    if any(f is None for f in found):
        return None
    names = set().union(*found)
    return tuple(a for a in mesh_axes if a in names)


def _by_axis(ops: list[dict], mesh_axes: dict[str, int]) -> dict[str, float]:
    """The bus bytes of ``ops`` (:func:`collective_ops` records) summed by spanned mesh axes."""
    out: dict[str, float] = {}
    for rec in ops:
        axes = _spanned(rec, mesh_axes)
        key = "unknown" if axes is None else "+".join(axes)
        if rec["bus_bytes"]:
            out[key] = out.get(key, 0.0) + rec["bus_bytes"]
    return out
