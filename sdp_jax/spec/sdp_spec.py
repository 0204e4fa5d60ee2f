"""The SDP spec: from a model's declared component rules to static masks and holder tables.

A model, built-in or a user's own, declares which of its parameters SDP may switch off, as
*rules* (host-side, no tracing):

* :class:`Blocks` ``(path, stacked, key, pad)``: the residual blocks under ``path``. Either a
  *list* of blocks (the children of ``path`` keyed ``0 .. L-1``, as ``nnx.List`` gives, or by the
  format ``key``, e.g. ``b0, b1``; ``pad`` for blocks that differ in leaf shapes only) or a
  *stacked* block axis (every leaf under ``path`` is ``[L, ...]``, as ``nnx.vmap``-built blocks
  give). Several rules declare several stacks (stage-balanced masks, e.g. a ResNet's stages).
  Used by the block variants (``ddp``, ``b-sdp``, ``bb-sdp``); a dropped block is its shortcut
  (docs/design.md invariant 5), so the model must add each block's output to a residual stream.
* :class:`Neurons` ``(pattern, axis, kind, expand, stacked)``: the leaves matching ``pattern``
  carry components of ``kind`` (MLP neurons, attention key/value head groups, conv channels)
  along ``axis``; ``expand`` indices per component (a key/value head group takes its ``H / K``
  query heads with it). One mask per layer: a layer is one match of the wildcards of ``pattern``
  (list form) or one index of the leading axis (``stacked=True``). Used by ``n-sdp`` / ``nb-sdp``.

Every leaf no active rule matches is *always-kept*: held by every worker, averaged over all.
The rules and their resolution against a parameter tree (no masks) live in
:mod:`sdp_jax.spec.rules`; every name there is importable from here too.

:func:`build` turns (parameters, rules, variant, W, C, scheme, seed) into an :class:`SDPSpec`:
the mask matrices of every component kind (:mod:`sdp_jax.spec.masks`, uniform representation,
Singh et al., arXiv 2507.09029, Sec. 3), the per-leaf :class:`Rule`, the static mask pytree
(same structure as the parameters; a leaf is a bool array ``[W, ...]`` broadcastable to the
parameter, or None), the multiplicities and the compact (pruned) shapes. It accepts what Flax
NNX users hold: an ``nnx.Module``, an ``nnx.State``, a nested dict of arrays or of
``jax.ShapeDtypeStruct``; the trees it returns are nested dicts like ``nnx.to_pure_dict`` gives.
It refuses what it cannot interpret unambiguously (a rule matching no leaf, a leaf matched
twice, block leaves whose leading sizes differ, a neuron axis out of range or of another size
than the same layer's other leaves), naming the leaf and the fix.

Variants (Singh et al., Sec. 3):

| variant  | components (rules) | regime   | what a worker runs / keeps                          |
|----------|--------------------|----------|-----------------------------------------------------|
| ddp      | blocks, all held   | forward  | everything (SDP at C = 1, the same code path)       |
| b-sdp    | blocks             | forward  | its C*L blocks (compact block stack)                |
| n-sdp    | neurons            | forward  | C of each layer's components of each kind           |
| bb-sdp   | blocks             | backward | full forward; grads/opt state of its blocks         |
| nb-sdp   | neurons            | backward | full forward; grads/opt state of its components     |
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import jax
import numpy as np

from sdp_jax.spec import masks as masks_lib
from sdp_jax.spec.rules import (BLOCK, Blocks, Neurons, Rule, Stack, flat_shapes, flatten,
                                match_neurons, neuron_layers, path_keys, path_str, pure_tree,
                                resolve_stack, unflatten)

VARIANTS = ("ddp", "b-sdp", "n-sdp", "bb-sdp", "nb-sdp")
BLOCK_VARIANTS = ("ddp", "b-sdp", "bb-sdp")
BACKWARD_VARIANTS = ("bb-sdp", "nb-sdp")


# ----------------------------------------------------------------------------------------------
# Mask tables
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class KindTables:
    """Static tables of one component kind.

    A block kind (``"block"``, or ``"{path}.blocks"`` of one of several stacks): ``masks`` bool
    [1, W, L], ``held`` int32 [W, k] (held blocks, depth order), ``slot`` int32 [W, L] (-1 = not
    held), ``counts`` int32 [L].
    A neuron kind: ``masks`` bool [Lg, W, G] (one per layer), ``held`` int32 [W, Lg, k],
    ``counts`` int32 [Lg, G], ``layers`` the key of each layer (the keys ``*`` caught, in mask
    order; ``(i,)`` for stacked leaves).
    """

    kind: str
    masks: np.ndarray
    held: np.ndarray
    counts: np.ndarray
    slot: np.ndarray | None = None
    recipe: dict | None = None
    layers: tuple = ()

    @property
    def full(self) -> bool:
        """Every worker holds every component."""
        return bool(self.masks.all())

    @property
    def k(self) -> int:
        """Components each worker holds (per layer for neuron kinds)."""
        return int(self.held.shape[-1])


def layer_masks(recipe: masks_lib.MaskRecipe, layers: int) -> np.ndarray:
    """One mask per layer: the cyclic scheme shifts its windows by one component per layer; the
    random scheme draws layer ``l`` with seed ``seed * 1009 + l``. bool [layers, W, G]."""
    out = []
    for layer in range(layers):
        if recipe.scheme == "cyclic":
            out.append(np.roll(recipe.matrix(), layer, axis=1))
        else:
            out.append(dataclasses.replace(recipe, seed=recipe.seed * 1009 + layer).matrix())
    return np.stack(out)



# ----------------------------------------------------------------------------------------------
# The spec
# ----------------------------------------------------------------------------------------------

class SDPSpec:
    """Which parameters each worker holds, built by :func:`build` (host-side, static).

    Attributes:
      variant, workers (``W``), coverage (``C``; 1 for ddp), scheme, seed, allow_nonuniform,
        stage_blocks: the arguments of :func:`build`.
      stacks: {kind: :class:`Stack`} of the declared block stacks (declared but inactive
        under the neuron variants).
      backward: the variant masks gradients only (full forward pass); regime: its name.
      kinds: {kind: :class:`KindTables`} of the active rules.
      leaf_rules: {path: :class:`Rule`} of every masked leaf (paths are tuples of keys).
      component_axes: {path: (axis, expand)} of every leaf a :class:`Neurons` rule matches,
        whatever the variant: the axes tensor parallelism splits (``axis`` of the full leaf,
        ``expand`` indices per component; :class:`sdp_jax.step.inner.InnerLayout`).
      shapes: {path: full shape} of every parameter leaf; dtypes: {path: its dtype}.
      blocks_stacked, block_path, n_blocks: the only block stack's form (stacked or a list),
        subtree and ``L`` (None when the rules declare no blocks or several stacks).
    """

    def __init__(self, shapes: dict, variant: str, workers: int, coverage: float,
                 scheme: str, seed: int, allow_nonuniform: bool, names: dict | None = None,
                 matrices: dict | None = None):
        self.shapes = shapes
        self.dtypes = {p: np.dtype(np.float32) for p in shapes}
        self.variant, self.workers = variant, workers
        self.coverage = 1.0 if variant == "ddp" else coverage
        if isinstance(coverage, (int, float, np.integer, np.floating)) \
                and not isinstance(coverage, bool) and variant != "ddp":
            self.coverage = float(coverage)
        self.scheme, self.seed, self.allow_nonuniform = scheme, seed, allow_nonuniform
        self.backward = variant in BACKWARD_VARIANTS
        self.regime = "backward" if self.backward else "forward"
        self.kinds: dict[str, KindTables] = {}
        self.leaf_rules: dict[tuple, Rule] = {}
        self.component_axes: dict[tuple, tuple[int, int]] = {}
        self._str_rules: dict[tuple, Rule] = {}   # the same, keyed by string keys
        self.stacks: dict[str, Stack] = {}
        self.stage_blocks: tuple = ()
        self._names = names or {}
        self._given = dict(matrices or {})

    @property
    def _stack(self) -> Stack | None:
        return next(iter(self.stacks.values())) if len(self.stacks) == 1 else None

    @property
    def block_path(self) -> tuple | None:
        """The subtree of the only block stack (None: no Blocks rule, or several)."""
        return self._stack.path if self._stack else None

    @property
    def blocks_stacked(self) -> bool | None:
        """Whether the only block stack has a leading block axis (None: none or several)."""
        return self._stack.stacked if self._stack else None

    @property
    def n_blocks(self) -> int | None:
        """``L`` of the only block stack (None: none or several)."""
        return self._stack.n if self._stack else None

    # ------------------------------------------------------------------ building
    def _what(self, kind: str) -> str:
        """What a kind's components are called in messages ("blocks", "mlp per layer")."""
        if kind in self._names:
            return self._names[kind]
        if kind in self.stacks and kind != BLOCK:
            return f"blocks of {path_str(self.stacks[kind].path)}"
        return "blocks" if kind == BLOCK else f"{kind} per layer"

    def _matrices(self, kind: str, components: int, layers: int, k_want: int | None = None):
        """A kind's mask matrices [layers, W, G] given to :func:`build`, checked; or None."""
        m = self._given.get(kind)
        if m is None:
            return None
        given = np.asarray(m)
        m = np.broadcast_to(given, (layers,) + given.shape) if given.ndim == 2 else given
        if m.dtype != bool or m.shape != (layers, self.workers, components):
            raise ValueError(f"matrices[{kind!r}] must be bool [W, G] = [{self.workers}, "
                             f"{components}] (or [{layers}, W, G], one per layer); got "
                             f"{given.dtype} {given.shape}.")
        for one in m:
            try:
                masks_lib.validate_mask(one, require_uniform=False)
            except ValueError as e:
                raise ValueError(f"matrices[{kind!r}]: {e}") from None
        ks = sorted({int(r) for r in m.sum(-1).flat})
        if len(ks) > 1:
            raise ValueError(f"matrices[{kind!r}]: layers hold {ks} components per worker; "
                             "every layer must hold the same number (C * G).")
        k = ks[0]
        if k_want is not None and k != k_want:
            raise ValueError(f"matrices[{kind!r}] gives each worker {k} of {components} blocks "
                             f"but this stack holds {k_want} (stage_blocks or C's "
                             "apportionment over the stacks); give that many per row.")
        if k_want is None and abs(k - self.coverage * components) > 1e-6:
            raise ValueError(f"matrices[{kind!r}] gives each worker {k} of {components} "
                             f"components (C={k / components:g}) but coverage={self.coverage:g}; "
                             f"pass coverage={k / components:g}.")
        return np.ascontiguousarray(m)

    def _recipe(self, components: int, what: str) -> masks_lib.MaskRecipe:
        try:
            return masks_lib.MaskRecipe(self.scheme, self.workers, components, self.coverage,
                                        self.seed, self.allow_nonuniform)
        except ValueError as e:
            raise ValueError(f"{self.variant} masks {components} {what}: {e}") from None

    def _masks(self, kind: str, components: int, layers: int, draw) -> tuple[np.ndarray, dict]:
        """A kind's masks bool [layers, W, G] and record: the hand-made matrices given to
        :func:`build` and ``{"given": True}``, else ``draw(recipe, layers)`` and the recipe's
        dict."""
        given = self._matrices(kind, components, layers)
        if given is not None:
            return given, {"given": True}
        recipe = self._recipe(components, self._what(kind))
        return draw(recipe, layers), recipe.to_dict()

    def _add_blocks(self, rules: list[Blocks], active: bool = True,
                    stage_blocks: tuple = (), stage_balanced: bool | None = None) -> None:
        """Resolve the block stacks and draw their masks. One stack holds ``C * L`` blocks per
        worker; several (or ``stage_balanced``) are stage-balanced (see :func:`build`)."""
        several = len(rules) > 1 if stage_balanced is None else bool(stage_balanced)
        for rule in rules:
            kind = f"{rule.path.strip('/')}.blocks" if several else BLOCK
            if kind in self.stacks:
                raise ValueError(f"two Blocks rules for {rule.path!r}; declare each stack once.")
            stack, claims = resolve_stack(self.shapes, rule, kind, active)
            for path, leaf_rule in claims:
                self._claim(path, leaf_rule, rule)
            self.stacks[kind] = stack
        if not active:
            return
        if several:
            self._add_stages(stage_blocks)
            return
        st = next(iter(self.stacks.values()))
        m, rec = self._masks(st.kind, st.n, 1, lambda recipe, _: recipe.matrix()[None])
        self._block_kind(st.kind, m[0], rec)

    def _add_stages(self, stage_blocks: tuple) -> None:
        """Stage-balanced masks of several block stacks: ``k_s`` blocks of stack ``s`` per worker
        (:func:`stage_balance`), stack ``s`` drawn with seed ``seed * 1009 + s``."""
        stacks = list(self.stacks.values())
        try:
            ks = stage_balance(self.coverage, [st.n for st in stacks], self.workers,
                               stage_blocks, [path_str(st.path) for st in stacks])
        except ValueError as e:
            raise ValueError(f"{self.variant}: {e}") from None
        for s, (st, k) in enumerate(zip(stacks, ks)):
            given = self._matrices(st.kind, st.n, 1, k)
            if given is not None:
                self._block_kind(st.kind, given[0], {"given": True})
                continue
            try:
                recipe = masks_lib.MaskRecipe(self.scheme, self.workers, st.n, k / st.n,
                                              self.seed * 1009 + s, self.allow_nonuniform)
            except ValueError as e:
                raise ValueError(f"{self.variant}: stack {path_str(st.path)!r} holds {k} of its "
                                 f"{st.n} blocks per worker: {e}") from None
            m = recipe.matrix()
            if self.scheme == "cyclic":   # slide the windows one worker per stack
                m = np.roll(m, s, axis=0)
            self._block_kind(st.kind, m, recipe.to_dict())

    def _block_kind(self, kind: str, m: np.ndarray, recipe: dict) -> None:
        self.kinds[kind] = KindTables(kind, m[None], masks_lib.held_table(m),
                                      masks_lib.multiplicities(m), masks_lib.slot_table(m),
                                      recipe)

    def _claim(self, path, leaf_rule: Rule, rule) -> None:
        if path in self.leaf_rules:
            raise ValueError(f"parameter {path_str(path)!r} is matched by two rules (the second "
                             f"is {rule}); each leaf may carry one component axis.")
        self.leaf_rules[path] = leaf_rule
        self._str_rules[tuple(str(k) for k in path)] = leaf_rule

    def _add_neurons(self, rules: list[Neurons]) -> None:
        """Match the :class:`Neurons` rules, draw each kind's masks (one per layer) and claim
        its leaves."""
        found, per_kind = match_neurons(self.shapes, rules, self.stacks)
        self.component_axes = {p: (axis, rule.expand) for p, (rule, _, axis) in found.items()}
        for kind, layers in per_kind.items():
            keys, g = neuron_layers(kind, layers, found)
            ms, rec = self._masks(kind, g, len(keys), layer_masks)
            held = np.stack([masks_lib.held_table(m) for m in ms], axis=1)   # [W, Lg, k]
            counts = np.stack([masks_lib.multiplicities(m) for m in ms])    # [Lg, G]
            self.kinds[kind] = KindTables(kind, ms, held, counts, None, rec, tuple(keys))
            index = {k: i for i, k in enumerate(keys)}
            for p, (rule, caught, axis) in found.items():
                if rule.kind == kind:
                    self._claim(p, Rule(kind, axis, rule.expand,
                                        None if rule.stacked else index[caught]), rule)

    # ------------------------------------------------------------------ queries
    def rule(self, path: tuple) -> Rule | None:
        """The :class:`Rule` of the leaf at ``path`` (tuple of keys; ints and digit strings
        both name list entries), or None if every worker holds it (always-kept)."""
        r = self.leaf_rules.get(tuple(path))
        if r is None:
            r = self._str_rules.get(tuple(str(k) for k in path))
        return r

    def rules(self, tree: Any) -> Any:
        """Pytree of :class:`Rule` / None matching ``tree`` (nested dicts)."""
        return jax.tree_util.tree_map_with_path(
            lambda p, _: self.rule(path_keys(p)), pure_tree(tree))

    @property
    def local_blocks(self) -> int | None:
        """Blocks in a worker's local model: ``k`` for forward block variants, ``L`` otherwise
        (None when the rules declare no blocks). Build the worker's local model at this
        depth.

        Raises:
          ValueError: several block stacks (read ``kinds[kind].k`` of each)."""
        if len(self.stacks) > 1:
            raise ValueError(f"the spec has {len(self.stacks)} block stacks "
                             f"({sorted(self.stacks)}); read each one's kinds[kind].k.")
        t = self.kinds.get(BLOCK)
        return t.k if t is not None and not self.backward else self.n_blocks

    def indices(self, rule: Rule, worker: int) -> np.ndarray:
        """Held indices along ``rule.axis`` for one worker: int32 [k] (stacked block; list
        neuron leaf: [k * expand]) or [L, k * expand] (stacked neuron leaf)."""
        held = self.kinds[rule.kind].held[worker]
        if rule.layer is not None:
            held = held[rule.layer]
        if rule.expand == 1:
            return held
        e = rule.expand
        return (held[..., :, None] * e + np.arange(e)).reshape(held.shape[:-1] + (-1,))

    def compact_shape(self, path: tuple, full_shape: tuple | None = None) -> tuple:
        """Per-worker shape of a leaf in the compact layout (no worker axis). A list-form block
        leaf keeps its shape, padded to the stack's largest (the worker stores ``k`` such
        blocks)."""
        full_shape = tuple(self.shapes[tuple(path)] if full_shape is None else full_shape)
        r = self.rule(path)
        if r is not None and r.block is not None:   # a slot: the stack's (padded) shape
            st = self.stacks[r.kind]
            return st.union[tuple(path)[len(st.path) + 1:]]
        if r is None:
            return full_shape
        shape = list(full_shape)
        shape[r.axis] = self.kinds[r.kind].k * r.expand
        return tuple(shape)

    def leaf_mask(self, path: tuple) -> np.ndarray | None:
        """bool ``[W, ...]`` broadcastable to the full leaf: which of its entries each worker
        holds; None for an always-kept leaf."""
        r = self.rule(path)
        if r is None:
            return None
        shape = self.shapes[tuple(path)]
        t = self.kinds[r.kind]
        W = self.workers
        if r.kind in self.stacks:
            m = t.masks[0]
            if r.block is not None:
                return m[:, r.block].reshape((W,) + (1,) * len(shape))
            return m.reshape((W, shape[0]) + (1,) * (len(shape) - 1))
        held = np.repeat(t.masks, r.expand, axis=2)        # [Lg, W, G * e]
        out = [1] * len(shape)
        out[r.axis] = shape[r.axis]
        if r.layer is not None:
            return held[r.layer].reshape((W,) + tuple(out))
        m = np.moveaxis(held, 1, 0)                        # [W, L, G * e]
        return m.reshape((W, shape[0]) + (1,) * (r.axis - 1) + (shape[r.axis],)
                         + (1,) * (len(shape) - r.axis - 1))

    def mask_tree(self) -> dict:
        """The static mask pytree: nested dict like the parameters, each leaf
        :meth:`leaf_mask` (None for always-kept leaves)."""
        return unflatten({p: self.leaf_mask(p) for p in self.shapes})

    def holders(self, kind: str, component: int, layer: int = 0) -> list[int]:
        """Workers holding ``component`` of ``kind`` (in ``layer`` for neuron kinds)."""
        t = self.kinds[kind]
        return np.flatnonzero(t.masks[layer][:, component]).tolist()

    def held_by(self, worker: int) -> dict[str, list]:
        """{kind: the components ``worker`` holds} (neuron kinds: one list per layer)."""
        out = {}
        for name, t in self.kinds.items():
            h = t.held[worker]
            out[name] = h.tolist()
        return out

    # ------------------------------------------------------------------ facts
    def mask_matrix(self) -> np.ndarray:
        """All masks side by side, bool [W, total components] (for the mask graph)."""
        if not self.kinds:
            return np.ones((self.workers, 1), bool)
        return np.concatenate([np.concatenate(list(t.masks), axis=1)
                               for t in self.kinds.values()], axis=1)

    def spectral_gap(self) -> float:
        return round(masks_lib.spectral_gap(self.mask_matrix()), 6) if self.workers > 1 else 1.0

    def summary(self) -> dict[str, Any]:
        """Plain-JSON facts: variant, regime, coverage, W, spectral gap and, per kind, ``k``,
        ``G`` and the multiplicity range."""
        out = {"variant": self.variant, "regime": self.regime, "coverage": self.coverage,
               "workers": self.workers, "spectral_gap": self.spectral_gap(), "kinds": {}}
        for name, t in self.kinds.items():
            out["kinds"][name] = {"per_worker": t.k, "components": int(t.masks.shape[-1]),
                                  "multiplicity_min": int(t.counts.min()),
                                  "multiplicity_max": int(t.counts.max())}
        if not self.kinds:
            out["kinds"]["all"] = {"per_worker": 1, "components": 1,
                                   "multiplicity_min": self.workers,
                                   "multiplicity_max": self.workers}
        return out

    def record(self) -> dict[str, Any]:
        """What a checkpoint stores to recognise these masks: recipes and a SHA-256 of every
        mask matrix (docs/design.md invariant 7)."""
        h = hashlib.sha256()
        for name, t in sorted(self.kinds.items()):
            h.update(name.encode())
            h.update(np.ascontiguousarray(t.masks).tobytes())
        return {"variant": self.variant,
                "recipes": {n: t.recipe for n, t in sorted(self.kinds.items())},
                "mask_sha256": h.hexdigest()}

    def describe(self) -> str:
        """One line for a run log."""
        if self.variant == "ddp":
            return "variant ddp: every worker holds the full model (coverage C=1)"
        parts = [f"{t.k}/{t.masks.shape[-1]} {self._what(n)}" for n, t in self.kinds.items()]
        return (f"variant {self.variant} ({self.regime} masking), coverage C={self.coverage:g}: "
                f"each worker holds {', '.join(parts)}; "
                + ("hand-made masks" if self._given else f"scheme {self.scheme}"))


def _apportion(coverage: float, depths: list, workers: int) -> list[int]:
    """Largest-remainder apportionment of ``C * L`` over stacks (ties to the earlier stack), at
    least ``ceil(L_s / W)`` per stack so that every block has a holder."""
    total = round(coverage * sum(depths))
    quota = [coverage * d for d in depths]
    need = [max(1, -(-d // workers)) for d in depths]
    k = [max(int(np.floor(q + 1e-9)), n) for q, n in zip(quota, need)]
    order = sorted(range(len(depths)), key=lambda s: (-(quota[s] - np.floor(quota[s] + 1e-9)), s))
    for s in order:
        if sum(k) >= total:
            break
        if k[s] < depths[s]:
            k[s] += 1
    return k


def stage_balance(coverage: float, depths: list, workers: int, stage_blocks: tuple = (),
                  names: list | None = None) -> list[int]:
    """Blocks per worker in each of several block stacks (stage-balanced masks).

    Blocks of different stacks differ in shape, and an SPMD program needs every worker's compact
    model to have the same shapes (docs/design.md invariant 4), so each worker holds ``k_s`` blocks
    of stack ``s``: ``C * L`` in all (``L`` = all blocks; must be whole), split as the
    largest-remainder apportionment of ``C * L_s`` (ties to the earlier stack, in a vision
    model the one with the fewest parameters per block), with at least ``ceil(L_s / W)`` per
    stack so that every block has a holder; ``stage_blocks`` gives the counts instead. Our
    choice: the SDP paper (Singh et al., arXiv 2507.09029, Sec. 3) gives C over all blocks but
    not how it splits over stages.

    Args:
      coverage: ``C``; depths: ``L_s`` of every stack; workers: ``W``; stage_blocks: optional
        counts, one per stack; names: the stacks' paths, for messages.
    Returns:
      ``k_s`` for every stack.
    Raises:
      ValueError: ``C * L`` not whole or below the least realizable count (names the nearest
        valid coverages); ``stage_blocks`` of the wrong length or sum.
    """
    total = sum(depths)
    c = coverage
    ok = isinstance(c, (int, float)) and not isinstance(c, bool) and 0 < c <= 1
    whole = ok and masks_lib.whole_count(c, total)
    if not whole or sum(_apportion(c, depths, workers)) != round(c * total):
        valid = [k / total for k in range(1, total + 1)
                 if sum(_apportion(k / total, depths, workers)) == k]
        target = min(max(c, 0.0), 1.0) if isinstance(c, (int, float)) and c == c else 0.5
        least = round(min(valid) * total)
        raise ValueError(
            f"coverage C={c!r} is not realizable for {total} blocks in stages {list(depths)}: "
            f"C * {total} must be a whole number of blocks from {least} (every stage keeps a "
            f"block on each worker) to {total}; nearest valid coverages: "
            f"{masks_lib.nearest_coverages(valid, target)}.")
    ks = _apportion(c, depths, workers)
    if stage_blocks:
        given = list(stage_blocks)
        if len(given) != len(depths) or any(
                isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= d
                for k, d in zip(given, depths)) or sum(given) != round(c * total):
            raise ValueError(
                f"sdp.stage_blocks={tuple(stage_blocks)!r}: give one count per stage (stages "
                f"{names or list(depths)} of {list(depths)} blocks), each in [1, its blocks], "
                f"adding up to C * {total} = {c * total:g} (coverage C={c:g}); default "
                f"apportionment: {ks}.")
        ks = [int(k) for k in given]
    return ks


def build(params: Any, rules, variant: str, workers: int, coverage: float = 1.0, *,
          scheme: str = "cyclic", seed: int = 0, allow_nonuniform: bool = False,
          names: dict | None = None, matrices: dict | None = None,
          allow_disconnected: bool = False, stage_blocks: tuple = (),
          stage_balanced: bool | None = None) -> SDPSpec:
    """Build the :class:`SDPSpec` of a model.

    Args:
      params: the model's parameters: an ``nnx.Module`` or ``nnx.State`` (its ``nnx.Param``
        variables only; other state such as BatchNorm statistics is not part of the spec), or
        a nested dict of arrays / ``jax.ShapeDtypeStruct`` (only shapes are read).
      rules: a sequence of :class:`Blocks` and :class:`Neurons`; the block variants use the
        ``Blocks`` rules, the neuron variants the ``Neurons`` rules. One ``Blocks`` rule: each
        worker holds ``C * L`` of its blocks (kind ``"block"``). Several (stages of blocks of
        different shapes): stage-balanced masks, ``k_s`` blocks of stack ``s`` per worker
        (:func:`stage_balance`), kind ``"{path}.blocks"``, stack ``s`` drawn with seed
        ``seed * 1009 + s`` and, for the cyclic scheme, its windows slid by ``s`` workers (with
        two blocks per stage and ``k_s = 1``, unshifted windows would split the workers into
        groups that share no block).
      variant: one of :data:`VARIANTS`.
      workers: ``W`` (>= 1).
      coverage: ``C`` in (0, 1] (ignored for ``ddp``); ``C * G`` and ``W * C`` must be whole
        for every kind (``allow_nonuniform`` relaxes the second).
      scheme, seed, allow_nonuniform: the mask recipe (:class:`sdp_jax.spec.masks.MaskRecipe`).
      names: optional wording for errors and logs, {kind: what its components are called},
        e.g. ``{"mlp": "MLP hidden neurons per block"}``.
      matrices: hand-made mask matrices instead of the recipe's, {kind: bool [W, G]} (neuron
        kinds may give ``[layers, W, G]``); every row must hold ``C * G`` components (``C`` =
        ``coverage``) and every component a holder (uniformity is not required). Not with ddp.
      allow_disconnected: accept masks whose mask graph has spectral gap 0 (groups of workers
        that share no component, so their copies never mix; Singh et al., Sec. 4).
      stage_blocks: several block stacks: blocks per worker in each, instead of the default
        apportionment (must add up to ``C * L``).
      stage_balanced: None (default): stage-balanced masks and ``"{path}.blocks"`` kinds when
        there are several ``Blocks`` rules; True: also for one rule (a model family whose
        stages are its stacks, e.g. a one-stage ResNet); False: refuse several rules.

    Returns:
      the spec; the same inputs give the same masks on every host and after a restart.

    Raises:
      ValueError: unknown variant; no rule for the variant's components; a rule that matches
        nothing or is ambiguous (see the module docstring); a coverage not realizable for a kind
        (names the kind, its count and the nearest valid coverages); a disconnected mask graph
        (unless ``allow_disconnected``).
    """
    _check_arguments(rules, variant, workers, matrices)
    spec = SDPSpec(flat_shapes(params), variant, workers, coverage, scheme, seed,
                   allow_nonuniform, names, matrices)
    spec.stage_blocks = tuple(stage_blocks or ())
    spec.dtypes = {p: np.dtype(getattr(x, "dtype", np.float32))
                   for p, x in flatten(pure_tree(params)).items()}
    _add_rules(spec, list(rules), stage_blocks, stage_balanced)
    _check_masks(spec, matrices, allow_disconnected)
    return spec


def _check_arguments(rules, variant: str, workers: int, matrices: dict | None) -> None:
    """:func:`build`'s refusals of its arguments, before it reads the parameters."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose one of {', '.join(VARIANTS)}.")
    if isinstance(workers, bool) or not isinstance(workers, (int, np.integer)) or workers < 1:
        raise ValueError(f"workers W={workers!r} must be a positive integer.")
    if not isinstance(rules, (list, tuple)):
        raise ValueError(f"rules={rules!r} must be a list of sdp_jax.spec.Blocks / Neurons, "
                         "e.g. [Blocks('blocks')].")
    for r in rules:
        if not isinstance(r, (Blocks, Neurons)):
            raise ValueError(f"rule {r!r} is not a sdp_jax.spec.Blocks or Neurons.")
    if matrices and variant == "ddp":
        raise ValueError("variant ddp holds every component; hand-made matrices need an SDP "
                         "variant (b-sdp, n-sdp, bb-sdp, nb-sdp).")


def _add_rules(spec: SDPSpec, rules: list, stage_blocks, stage_balanced: bool | None) -> None:
    """Resolve the rules the spec's variant uses and draw their masks: the ``Blocks`` rules
    under the block variants, the ``Neurons`` rules (and the inactive block stacks) under the
    neuron variants. A block variant still resolves its unused ``Neurons`` rules, on a probe
    spec, so that a typo is refused."""
    variant = spec.variant
    blocks = [r for r in rules if isinstance(r, Blocks)]
    neurons = [r for r in rules if isinstance(r, Neurons)]
    if stage_balanced is False and len(blocks) > 1:
        raise ValueError(f"{len(blocks)} Blocks rules but stage_balanced=False; declare one "
                         "block stack or leave stage_balanced unset.")
    balanced = len(blocks) > 1 if stage_balanced is None else bool(stage_balanced)
    if stage_blocks and (variant not in ("b-sdp", "bb-sdp") or not balanced):
        raise ValueError(f"stage_blocks={tuple(stage_blocks)!r} splits C over several block "
                         "stacks: it applies to b-sdp / bb-sdp with several Blocks rules, not "
                         f"to {variant} with {len(blocks)}; leave it empty.")
    if variant in BLOCK_VARIANTS:
        if blocks:
            spec._add_blocks(blocks, True, tuple(stage_blocks), stage_balanced)
        elif variant != "ddp":
            raise ValueError(f"variant {variant} drops whole blocks, but the rules declare no "
                             "Blocks(...); add one, or use a neuron variant (n-sdp, nb-sdp).")
    else:
        if not neurons:
            raise ValueError(f"variant {variant} masks neurons, but the rules declare no "
                             "Neurons(...); add them, or use a block variant (b-sdp, bb-sdp).")
        if blocks:
            spec._add_blocks(blocks, False, (), stage_balanced)
        spec._add_neurons(neurons)
    if variant in BLOCK_VARIANTS and neurons:   # unused here, but a typo is still refused
        probe = SDPSpec(spec.shapes, "n-sdp", spec.workers, 1.0, "cyclic", 0, False)
        if blocks:
            probe._add_blocks(blocks, False, (), stage_balanced)
        probe._add_neurons(neurons)
        spec.component_axes = probe.component_axes


def _check_masks(spec: SDPSpec, matrices: dict | None, allow_disconnected: bool) -> None:
    """:func:`build`'s refusals of the masks drawn: a disconnected mask graph (unless
    ``allow_disconnected``), hand-made matrices for a kind the spec does not have."""
    if spec.workers > 1 and spec.coverage < 1 and not allow_disconnected \
            and spec.spectral_gap() < 1e-9:
        raise ValueError(
            f"the mask graph of {'hand-made' if matrices else spec.scheme} {spec.variant} masks "
            f"for W={spec.workers}, C={spec.coverage:g} is disconnected (spectral gap 0): some "
            "groups of workers share no component, so their copies never mix. Choose a larger "
            "coverage, another scheme, or set allow_disconnected=True "
            "(--config.sdp.allow_disconnected=True).")
    unknown = sorted(set(matrices or {}) - set(spec.kinds))
    if unknown:
        raise ValueError(f"matrices for {unknown}, which are not component kinds of "
                         f"{spec.variant} with these rules (kinds: {sorted(spec.kinds)}); use "
                         "those keys.")
