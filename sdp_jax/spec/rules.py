"""The declared component rules and how they resolve against a parameter tree (host-side).

A model declares which of its parameters SDP may switch off as :class:`Blocks` and
:class:`Neurons` rules (see :mod:`sdp_jax.spec`, which re-exports every name here). This module
reads the parameters as flat ``{path: shape}`` and resolves the rules against them, with no
masks involved: :func:`resolve_stack` turns one ``Blocks`` rule into a :class:`Stack` and the
:class:`Rule` of each of its leaves; :func:`match_neurons` and :func:`neuron_layers` find the
leaves, component axes and layers of the ``Neurons`` rules. Each refuses what it cannot
interpret unambiguously, naming the leaf and the fix; :func:`sdp_jax.spec.build` draws the
masks.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

BLOCK = "block"


# ----------------------------------------------------------------------------------------------
# Declared rules
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Blocks:
    """The residual blocks under ``path`` (``"/"``-separated keys, e.g. ``"blocks"``).

    Several ``Blocks`` rules declare several stacks (e.g. the stages of a ResNet, whose blocks
    differ in width from stage to stage); see :func:`sdp_jax.spec.build` for how ``C`` splits
    over them.

    Attributes:
      path: the subtree holding the blocks.
      stacked: True: every leaf under ``path`` has a leading block axis ``[L, ...]``; False: the
        children of ``path`` keyed ``key.format(0) .. key.format(L-1)`` are the blocks (other
        children, e.g. a stage's projection shortcut, are always-kept); None (default): False
        when such children exist, else True.
      key: list form: the format of block ``j``'s key, e.g. ``"b{}"`` for children ``b0, b1``
        (default ``"{}"``: keyed ``0 .. L-1`` as ``nnx.List`` gives).
      pad: list form: the blocks may differ in the shapes (not the structure) of their leaves,
        e.g. a downsampling first block with fewer input channels; a worker's slots then hold
        each block zero-padded at the end of every axis to the largest shape, and the model
        must run a padded block (see :mod:`sdp_jax.models.vision`).
    """

    path: str
    stacked: bool | None = None
    key: str = "{}"
    pad: bool = False


@dataclasses.dataclass(frozen=True)
class Stack:
    """A block stack as :func:`sdp_jax.spec.build` resolved it from a :class:`Blocks` rule.

    Attributes:
      kind: its component kind (``"block"`` for the only stack; ``"{path}.blocks"`` when the
        rules declare several).
      path: the subtree holding the blocks (keys as the tree spells them).
      stacked: leading block axis (True) or a list of blocks (False).
      n: ``L``, its number of blocks.
      keys: list form: the key of each block under ``path`` (block order).
      union: list form: {path inside a block: the largest shape over the blocks} (the shape of
        a stored slot; equal to every block's shape unless the rule has ``pad=True``).
    """

    kind: str
    path: tuple
    stacked: bool
    n: int
    keys: tuple = ()
    union: dict = dataclasses.field(default_factory=dict)

    def block_key(self, g: int):
        """The key of block ``g`` under :attr:`path` (list form)."""
        return self.keys[g]


@dataclasses.dataclass(frozen=True)
class Neurons:
    """Components along one axis of the leaves matching ``pattern``.

    Attributes:
      pattern: ``"/"``-separated keys; ``*`` matches any one key (e.g. ``"blocks/*/up/kernel"``).
      axis: the component axis of each matching leaf (negative counts from the end; the layer
        axis 0 of a stacked leaf counts).
      kind: the component kind, e.g. ``"mlp"``, ``"heads"``, ``"channels"``; every layer has
        one mask per kind, and all leaves of one kind in one layer share it.
      expand: indices per component along ``axis`` (``H / K`` for query-head leaves under
        grouped-query attention, else 1).
      stacked: the leaves carry a leading layer axis (one mask per index of axis 0).
    """

    pattern: str
    axis: int
    kind: str = "neurons"
    expand: int = 1
    stacked: bool = False


@dataclasses.dataclass(frozen=True)
class Rule:
    """How one parameter leaf is masked (what :meth:`sdp_jax.spec.SDPSpec.rule` returns).

    Attributes:
      kind: a block kind (``"block"``; ``"{path}.blocks"`` with several stacks) or a neuron
        kind.
      axis: component axis of the full leaf (0 for stacked blocks; the layer axis counts);
        None for a list-form block leaf, which belongs to one block as a whole.
      expand: indices per component along ``axis``.
      layer: neuron leaves of the list form: the layer (mask) index; None when stacked.
      block: block leaves of the list form: the block this leaf belongs to; None when stacked.
    """

    kind: str
    axis: int | None
    expand: int = 1
    layer: int | None = None
    block: int | None = None


# ----------------------------------------------------------------------------------------------
# Parameter trees as flat {path: shape}
# ----------------------------------------------------------------------------------------------

def _key(k) -> Any:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return getattr(k, attr)
    return k


def path_keys(path) -> tuple:
    """The plain keys (dict keys, list indices) of a ``jax.tree_util`` key path."""
    return tuple(_key(k) for k in path)


def pure_tree(params: Any) -> Any:
    """An ``nnx.Module`` or ``nnx.State`` -> nested dict of its ``nnx.Param`` values (as
    ``nnx.to_pure_dict`` gives); any other pytree is returned as it is."""
    from flax import nnx  # pylint: disable=g-import-not-at-top
    if isinstance(params, nnx.Module):
        params = nnx.state(params, nnx.Param)
    if isinstance(params, nnx.State):
        return nnx.to_pure_dict(params)
    return params


def flat_shapes(params: Any) -> dict[tuple, tuple]:
    """{path (tuple of keys): shape} of every array leaf (anything with ``.shape``).

    Raises:
      ValueError: a leaf without a shape (names its path)."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(pure_tree(params))[0]:
        keys = path_keys(path)
        if not hasattr(leaf, "shape"):
            raise ValueError(f"parameter {path_str(keys)!r} is a {type(leaf).__name__}, not an "
                             "array; pass the model's parameters (nnx.state(model, nnx.Param)).")
        out[keys] = tuple(leaf.shape)
    return out


def flatten(tree: Any) -> dict[tuple, Any]:
    """{path (tuple of dict keys / list indices): leaf} of a pytree (nested dicts)."""
    return {path_keys(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def unflatten(flat: dict) -> dict:
    """{path (tuple of keys): leaf} -> nested dict."""
    out: dict = {}
    for path, v in flat.items():
        d = out
        for k in path[:-1]:
            d = d.setdefault(k, {})
        d[path[-1]] = v
    return out


def path_str(path: tuple) -> str:
    return "/".join(str(k) for k in path)


def _strs(path: tuple) -> tuple:
    return tuple(str(k) for k in path)


def _match(pattern: tuple[str, ...], path: tuple) -> tuple | None:
    """The keys that ``*`` matched, or None if ``path`` does not match ``pattern``."""
    if len(pattern) != len(path):
        return None
    caught = []
    for p, k in zip(pattern, path):
        if p == "*":
            caught.append(k)
        elif p != str(k):
            return None
    return tuple(caught)


def _natural(keys: tuple) -> tuple:
    return tuple((0, int(k), "") if str(k).isdigit() else (1, 0, str(k)) for k in keys)


def _nearest_keys(shapes: dict, depth: int) -> list[str]:
    return sorted({path_str(p[:depth]) for p in shapes})[:12]


# ----------------------------------------------------------------------------------------------
# Block stacks
# ----------------------------------------------------------------------------------------------

def resolve_stack(shapes: dict, rule: Blocks, kind: str,
                  active: bool = True) -> tuple[Stack, list[tuple[tuple, Rule]]]:
    """Resolve one :class:`Blocks` rule against ``shapes`` ({path: shape}): its form (stacked
    or a list of blocks), ``L`` and slot shapes.

    Returns:
      the :class:`Stack` of kind ``kind``, and the ``(path, Rule)`` of every leaf it masks (none
      when not ``active``: a neuron variant declares its blocks but does not mask or stack
      them, so the blocks of a list need not be equal).
    Raises:
      ValueError: a bad ``key`` format; a path matching nothing or a leaf; blocks keyed with
        gaps, or not as ``key`` says; a child named ``slots``; a form contradicting
        ``stacked=``; stacked leaves of different leading sizes, or with ``key=`` / ``pad=``;
        list blocks that differ (in shape, unless ``pad=True``). Each names the rule and the fix.
    """
    prefix, under = _blocks_under(shapes, rule)
    children = sorted({p[len(prefix)] for p in under}, key=lambda k: _natural((k,)))
    block_keys, stacked = _block_form(rule, children)
    if stacked:
        return _stacked_stack(rule, kind, prefix, under, active)
    return _list_stack(rule, kind, prefix, under, block_keys, active)


def _blocks_under(shapes: dict, rule: Blocks) -> tuple[tuple, dict]:
    """The keys of ``rule.path`` as the tree spells them, and {path: shape} of the leaves under
    it."""
    want = tuple(k for k in rule.path.split("/") if k)
    under = {p: s for p, s in shapes.items()
             if _strs(p[:len(want)]) == want and len(p) > len(want)}
    if not isinstance(rule.key, str) or rule.key.count("{}") != 1:
        raise ValueError(f"rule Blocks({rule.path!r}, key={rule.key!r}): key must be a "
                         "format with one '{}' for the block index, e.g. 'b{}'.")
    if not under:
        if any(_strs(p) == want for p in shapes):
            raise ValueError(f"rule Blocks({rule.path!r}) names a parameter leaf, not the "
                             "subtree that holds the blocks; give the blocks' parent path "
                             "(e.g. 'blocks').")
        raise ValueError(f"rule Blocks({rule.path!r}) matches no parameter; paths start "
                         f"with {_nearest_keys(shapes, len(want) or 1)}.")
    return next(iter(under))[:len(want)], under


def _block_form(rule: Blocks, children: list) -> tuple[list, bool]:
    """The blocks' keys among the children of ``rule.path`` (block order; none when the leaves
    carry a block axis), and whether the stack is stacked."""
    by_name = {str(c): c for c in children}
    block_keys = []
    while rule.key.format(len(block_keys)) in by_name:
        block_keys.append(by_name[rule.key.format(len(block_keys))])
    head, tail = rule.key.split("{}")
    like = sorted(str(c) for c in children if str(c).startswith(head)
                  and str(c).endswith(tail) and str(c)[len(head):len(str(c)) - len(tail)]
                  .isdigit())
    as_list = bool(block_keys)
    if rule.key == "{}" and len(block_keys) != len(children):
        as_list = False   # an nnx.List has only its blocks as children
    if as_list and len(like) != len(block_keys):
        raise ValueError(f"rule Blocks({rule.path!r}, key={rule.key!r}): the blocks must be "
                         f"keyed {rule.key.format(0)}..{rule.key.format(len(like) - 1)} "
                         f"without gaps, but the children are {like[:8]}; rename them or "
                         "declare each run of blocks as its own rule.")
    if rule.key != "{}" and not block_keys:
        raise ValueError(f"rule Blocks({rule.path!r}, key={rule.key!r}): no child of "
                         f"{rule.path!r} is keyed {rule.key.format(0)} (children: "
                         f"{[str(c) for c in children][:8]}); fix the key format.")
    if as_list and "slots" in by_name:
        raise ValueError(f"rule Blocks({rule.path!r}): a child named 'slots' collides with "
                         "the stored stack of the blocks' slots "
                         f"({rule.path}/slots/...); rename it.")
    stacked = (not as_list) if rule.stacked is None else rule.stacked
    if stacked and as_list:
        raise ValueError(f"rule Blocks({rule.path!r}, stacked=True): the children of "
                         f"{rule.path!r} are keyed {rule.key.format(0)}.."
                         f"{rule.key.format(len(block_keys) - 1)}, a list of blocks, so a "
                         "leading axis of their leaves is a feature axis, not a block axis; "
                         "drop stacked=True.")
    if not stacked and not as_list:
        raise ValueError(f"rule Blocks({rule.path!r}, stacked=False): the children of "
                         f"{rule.path!r} are {[str(c) for c in children][:8]}, not keyed "
                         f"{rule.key.format(0)}..{rule.key.format('L-1')}; use stacked=True "
                         "for a leading block axis, or key= for the blocks' key format.")
    return block_keys, stacked


def _stacked_stack(rule: Blocks, kind: str, prefix: tuple, under: dict, active: bool):
    """A stack whose leaves carry a leading block axis: every leaf under it is masked."""
    sizes = {p: (s[0] if s else None) for p, s in under.items()}
    distinct = sorted({v for v in sizes.values() if v is not None})
    if None in sizes.values() or len(distinct) != 1:
        bad = sorted(under, key=lambda p: str(sizes[p]))
        raise ValueError(
            f"rule Blocks({rule.path!r}, stacked): leaves under it must all have the "
            f"same leading block axis, but {path_str(bad[0])!r} has shape "
            f"{under[bad[0]]} and {path_str(bad[-1])!r} has shape {under[bad[-1]]}; "
            "declare stacked=False for a list of blocks, or move leaves without a "
            "block axis out of the blocks' subtree.")
    if rule.key != "{}" or rule.pad:
        raise ValueError(f"rule Blocks({rule.path!r}) is stacked (a leading block axis), "
                         "so key= and pad= do not apply; drop them.")
    claims = [(p, Rule(kind, 0)) for p in under] if active else []
    return Stack(kind, prefix, True, distinct[0]), claims


def _list_stack(rule: Blocks, kind: str, prefix: tuple, under: dict, block_keys: list,
                active: bool):
    """A list of blocks: each leaf of block ``j`` belongs to it as a whole; the slot of a path
    inside a block has the largest shape over the blocks."""
    n = len(block_keys)
    per = [{p[len(prefix) + 1:]: s for p, s in under.items() if p[len(prefix)] == key}
           for key in block_keys]
    for j in range(1, n if active else 1):   # inactive (neuron variants): not stacked
        same = set(per[j]) == set(per[0]) and (rule.pad or per[j] == per[0]) and all(
            len(per[j][r]) == len(per[0][r]) for r in per[0] if r in per[j])
        if not same:
            diff = sorted(set(per[j].items()) ^ set(per[0].items()), key=str)[:2]
            raise ValueError(
                f"rule Blocks({rule.path!r}): block {j} differs from block 0 in "
                f"{'structure' if set(per[j]) != set(per[0]) or rule.pad else 'shape'} "
                f"({diff}); SDP stacks a worker's blocks (and their gradients) into one "
                "array, so the blocks under one rule must have the same parameters: set "
                "pad=True for blocks that differ only in shape (stored zero-padded), "
                "declare each group of equal blocks as its own Blocks rule, or use a "
                "neuron variant.")
    union = ({r: tuple(int(v) for v in np.max([b[r] for b in per], axis=0))
              for r in per[0]} if active else {})
    claims = [(p, Rule(kind, None, block=block_keys.index(p[len(prefix)])))
              for p in under if p[len(prefix)] in block_keys] if active else []
    return Stack(kind, prefix, False, n, tuple(block_keys), union), claims


# ----------------------------------------------------------------------------------------------
# Neurons
# ----------------------------------------------------------------------------------------------

def match_neurons(shapes: dict, rules: list[Neurons], stacks: dict) -> tuple[dict, dict]:
    """The leaves, component axes and layers of :class:`Neurons` rules (rule order).

    Args:
      shapes: {path: shape} of the parameters; rules: the ``Neurons`` rules; stacks: {kind:
        :class:`Stack`} of the declared block stacks (a neuron leaf under stacked blocks must
        be stacked; their kinds are taken).
    Returns:
      ``found`` {path: (rule, the keys ``*`` caught (the layer key; None when stacked), axis)}
      and ``per_kind`` {kind: {layer key: (G, first path)}}.
    Raises:
      ValueError: a bad ``expand`` or ``axis``; a kind named like a block stack; a leaf matched
        twice; an axis out of range or not dividing by ``expand``; a list-form rule under
        stacked blocks; stacked leaves of one kind with different depths; leaves of one layer
        and kind with different component counts; a rule matching nothing.
    """
    per_kind: dict[str, dict] = {}   # kind -> {layer key: (G, first path)}
    stacked_len: dict[str, tuple] = {}   # kind -> (layers, first path) of stacked rules
    found: dict[tuple, tuple] = {}   # path -> (rule, layer key, axis)
    for rule in rules:
        _check_neuron_rule(rule, stacks)
        pattern = tuple(k for k in rule.pattern.split("/") if k)
        hits = 0
        for p, s in shapes.items():
            caught = _match(pattern, p)
            if caught is None:
                continue
            hits += 1
            if p in found:
                raise ValueError(f"parameter {path_str(p)!r} is matched by two rules "
                                 f"({found[p][0]} and {rule}); each leaf may carry one "
                                 "component axis.")
            axis = _neuron_axis(rule, p, s, stacks, stacked_len)
            if pattern[-1] == "*":   # a '*' for the leaf name: leaves of one layer
                caught = caught[:-1]
            _record_layer_counts(rule, p, s, axis, caught, per_kind.setdefault(rule.kind, {}))
            found[p] = (rule, None if rule.stacked else caught, axis)
        if not hits:
            raise ValueError(f"rule {rule} matches no parameter; paths look like "
                             f"{[path_str(p) for p in list(shapes)[:6]]} ('*' "
                             "matches one key).")
    return found, per_kind


def _check_neuron_rule(rule: Neurons, stacks: dict) -> None:
    if isinstance(rule.expand, bool) or not isinstance(rule.expand, int) \
            or rule.expand < 1:
        raise ValueError(f"{rule}: expand={rule.expand!r} must be a positive integer.")
    if isinstance(rule.axis, bool) or not isinstance(rule.axis, (int, np.integer)):
        raise ValueError(f"{rule}: axis={rule.axis!r} must be an integer.")
    if rule.kind in stacks or rule.kind == BLOCK:
        raise ValueError(f"{rule}: kind {rule.kind!r} is the name of a block stack; "
                         "give the neuron kind another name.")


def _neuron_axis(rule: Neurons, p: tuple, s: tuple, stacks: dict, stacked_len: dict) -> int:
    """The component axis of leaf ``p`` (shape ``s``) under ``rule``, checked."""
    nd = len(s)
    axis = rule.axis + nd if rule.axis < 0 else rule.axis
    if not 0 <= axis < nd or (rule.stacked and axis == 0):
        raise ValueError(f"{rule}: axis {rule.axis} is not a component axis of "
                         f"{path_str(p)!r} with shape {s}"
                         + (" (axis 0 is the layer axis of a stacked leaf)"
                            if rule.stacked else "") + "; fix the rule's axis.")
    if s[axis] % rule.expand:
        raise ValueError(f"{rule}: {path_str(p)!r} has {s[axis]} indices on axis "
                         f"{axis}, not a multiple of expand={rule.expand}.")
    under = [st for st in stacks.values() if st.stacked and
             _strs(p[:len(st.path)]) == _strs(st.path)]
    if not rule.stacked and under:
        raise ValueError(
            f"{rule}: {path_str(p)!r} lies under the stacked blocks "
            f"{path_str(under[0].path)!r}, so its axis 0 is the layer axis; set "
            "stacked=True (one mask per layer).")
    if rule.stacked:
        first = stacked_len.setdefault(rule.kind, (s[0], p))
        if first[0] != s[0]:
            raise ValueError(
                f"{rule}: {path_str(p)!r} stacks {s[0]} layers but "
                f"{path_str(first[1])!r} of the same kind stacks {first[0]}; give "
                "stacks of other depths their own kind.")
    return axis


def _record_layer_counts(rule: Neurons, p: tuple, s: tuple, axis: int, caught: tuple,
                         seen: dict) -> None:
    """Record the component count of leaf ``p`` in each of its layers (``seen``: {layer key:
    (G, first path)} of the rule's kind); the leaves of one layer and kind must agree."""
    g = s[axis] // rule.expand
    layers = [(i,) for i in range(s[0])] if rule.stacked else [caught]
    for lk in layers:
        if lk in seen and seen[lk][0] != g:
            raise ValueError(
                f"{rule}: {path_str(p)!r} has {g} {rule.kind} components on axis "
                f"{axis}, but {path_str(seen[lk][1])!r} of the same layer has "
                f"{seen[lk][0]}; leaves of one kind in one layer share a mask, so "
                "check the rule's axis (e.g. a feature width equal to the "
                "component count) or give them different kinds.")
        seen.setdefault(lk, (g, p))


def neuron_layers(kind: str, layers: dict, found: dict) -> tuple[list, int]:
    """The layer keys of a neuron kind (natural order: the order of its masks) and its
    component count ``G`` per layer.

    Args:
      kind: the neuron kind; layers: its {layer key: (G, first path)}; found: {path: (rule,
        layer key, axis)} (:func:`match_neurons`).
    Raises:
      ValueError: the kind mixes stacked and list-form rules, or its layers differ in ``G``.
    """
    keys = sorted(layers, key=_natural)
    stacked_kind = {found[p][0].stacked for p in found if found[p][0].kind == kind}
    if len(stacked_kind) > 1:
        raise ValueError(f"neuron kind {kind!r} mixes stacked and list-form rules; "
                         "give them different kinds.")
    gs = {layers[k][0] for k in keys}
    if len(gs) > 1:  # one recipe per kind: every layer must have as many components
        raise ValueError(f"neuron kind {kind!r} has layers with different component "
                         f"counts {sorted(gs)}; give each width its own kind.")
    return keys, gs.pop()
