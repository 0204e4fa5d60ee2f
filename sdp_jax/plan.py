"""The static SDP plan of a run: which parameters are masked, how, and by which mask matrices.

Host-side and static (numpy, Python): built once from (variant, model shape, W, C, scheme, seed)
and closed over by the traced step.

Variants (Singh et al., arXiv 2507.09029, Sec. 3):

| variant  | components                        | regime   | what a worker runs / keeps              |
|----------|-----------------------------------|----------|-----------------------------------------|
| ddp      | blocks, all-ones mask (C = 1)     | forward  | everything                              |
| b-sdp    | transformer blocks                | forward  | its C*L blocks (compact block stack)    |
| n-sdp    | MLP neurons and attention heads   | forward  | C of each block's neurons and heads     |
| bb-sdp   | transformer blocks                | backward | full forward; grads/opt state of its blocks |
| nb-sdp   | MLP neurons and attention heads   | backward | full forward; grads/opt state of its neurons/heads |

Every masked parameter leaf carries a :class:`Rule`: the *kind* of component that indexes it and
the axis along which it does. Neuron-level kinds have one mask matrix per block (layer), each with
uniform representation over its own components; with grouped-query attention the component of
the ``heads`` kind is a key/value group, which takes its ``H / K`` query heads with it.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import numpy as np

from sdp_jax import masks as masks_lib
from sdp_jax.models.llama import BLOCK_KEY, LlamaConfig

VARIANTS = ("ddp", "b-sdp", "n-sdp", "bb-sdp", "nb-sdp")
BLOCK_VARIANTS = ("ddp", "b-sdp", "bb-sdp")
BACKWARD_VARIANTS = ("bb-sdp", "nb-sdp")


@dataclasses.dataclass(frozen=True)
class Rule:
    """How a parameter leaf is masked.

    Attributes:
      kind: ``"block"`` (leaf ``[L, ...]``, component = block, axis 0), ``"mlp"`` (component =
        MLP hidden neuron) or ``"heads"`` (component = key/value head group).
      axis: axis of the component index in the full leaf (the stack axis counts: 0).
      expand: indices per component along ``axis`` (``H / K`` for query-head leaves, else 1).
    """

    kind: str
    axis: int
    expand: int = 1


# Neuron-level rules of the LLaMA block, keyed by (module, parameter); see models/llama.py.
def _neuron_rules(cfg: LlamaConfig) -> dict[tuple[str, str], Rule]:
    group = cfg.n_heads // cfg.n_kv_heads
    return {("mlp", "w_gate"): Rule("mlp", 2), ("mlp", "w_up"): Rule("mlp", 2),
            ("mlp", "w_down"): Rule("mlp", 1),
            ("attn", "wq"): Rule("heads", 2, group), ("attn", "wk"): Rule("heads", 2),
            ("attn", "wv"): Rule("heads", 2), ("attn", "wo"): Rule("heads", 1, group)}


@dataclasses.dataclass
class KindTables:
    """Static tables of one component kind.

    For ``block``: ``masks`` bool [1, W, L] (one matrix), ``held`` int32 [W, k] indices of held
    blocks, ``slot`` int32 [W, L] (-1 = not held), ``counts`` int32 [L].
    For ``mlp`` / ``heads``: ``masks`` bool [L, W, G] (one per block), ``held`` int32 [W, L, k],
    ``counts`` int32 [L, G].
    """

    kind: str
    masks: np.ndarray
    held: np.ndarray
    counts: np.ndarray
    slot: np.ndarray | None = None
    recipe: dict | None = None

    @property
    def full(self) -> bool:
        """Every worker holds every component."""
        return bool(self.masks.all())

    @property
    def k(self) -> int:
        return int(self.held.shape[-1])


def _layer_masks(recipe: masks_lib.MaskRecipe, layers: int) -> np.ndarray:
    """One mask per layer: the cyclic scheme shifts its windows by one component per layer; the
    random scheme draws each layer with seed ``seed * 1009 + layer``. [L, W, G] bool."""
    out = []
    for layer in range(layers):
        if recipe.scheme == "cyclic":
            out.append(np.roll(recipe.matrix(), layer, axis=1))
        else:
            out.append(dataclasses.replace(recipe, seed=recipe.seed * 1009 + layer).matrix())
    return np.stack(out)


def summary_head(plan) -> dict[str, Any]:
    """The fields of a plan's ``summary()`` shared by every model: variant, regime, coverage,
    workers, the spectral gap of its mask graph and an empty ``kinds`` dict to fill."""
    gap = round(masks_lib.spectral_gap(plan.mask_matrix()), 6) if plan.workers > 1 else 1.0
    return {"variant": plan.variant, "regime": plan.regime, "coverage": plan.coverage,
            "workers": plan.workers, "spectral_gap": gap, "kinds": {}}


class SDPPlan:
    """Which parameters are masked and the tables that go with them.

    Args:
      variant: one of :data:`VARIANTS`.
      cfg: the model shape.
      workers: ``W``.
      coverage: ``C`` (ignored for ``ddp``).
      scheme, seed, allow_nonuniform: mask recipe (see :mod:`sdp_jax.masks`).

    Raises:
      ValueError: unknown variant; a coverage not realizable for some component kind (names the
        kind, its count and the nearest valid coverages).
    """

    def __init__(self, variant: str, cfg: LlamaConfig, workers: int, coverage: float,
                 scheme: str = "cyclic", seed: int = 0, allow_nonuniform: bool = False):
        if variant not in VARIANTS:
            raise ValueError(f"unknown variant {variant!r}; choose one of {', '.join(VARIANTS)}.")
        self.variant, self.cfg, self.workers = variant, cfg, workers
        self.coverage = 1.0 if variant == "ddp" else float(coverage)
        self.scheme, self.seed, self.allow_nonuniform = scheme, seed, allow_nonuniform
        self.backward = variant in BACKWARD_VARIANTS
        self.regime = "backward" if self.backward else "forward"
        self.kinds: dict[str, KindTables] = {}
        if variant in BLOCK_VARIANTS:
            self.kinds["block"] = self._block_tables()
        else:
            self.kinds["mlp"] = self._neuron_tables("mlp", cfg.d_ff,
                                                    "MLP hidden neurons per block")
            self.kinds["heads"] = self._neuron_tables("heads", cfg.n_kv_heads,
                                                      "key/value head groups per block")
        self._neuron = _neuron_rules(cfg)

    def _recipe(self, components: int, what: str) -> masks_lib.MaskRecipe:
        try:
            return masks_lib.MaskRecipe(self.scheme, self.workers, components, self.coverage,
                                        self.seed, self.allow_nonuniform)
        except ValueError as e:
            raise ValueError(f"{self.variant} masks {components} {what}: {e}") from None

    def _block_tables(self) -> KindTables:
        recipe = self._recipe(self.cfg.n_layers, "blocks")
        m = recipe.matrix()
        return KindTables("block", m[None], masks_lib.held_table(m),
                          masks_lib.multiplicities(m), masks_lib.slot_table(m),
                          recipe.to_dict())

    def _neuron_tables(self, kind: str, components: int, what: str) -> KindTables:
        recipe = self._recipe(components, what)
        ms = _layer_masks(recipe, self.cfg.n_layers)
        held = np.stack([masks_lib.held_table(m) for m in ms], axis=1)  # [W, L, k]
        counts = np.stack([masks_lib.multiplicities(m) for m in ms])   # [L, G]
        return KindTables(kind, ms, held, counts, None, recipe.to_dict())

    # ------------------------------------------------------------------ rules
    def rule(self, path: tuple[str, ...]) -> Rule | None:
        """The rule of the parameter at ``path`` (dict keys), or None if every worker holds it."""
        if not path or path[0] != BLOCK_KEY:
            return None
        if "block" in self.kinds:
            return Rule("block", 0)
        return self._neuron.get(tuple(path[-2:]))

    def rules(self, tree: Any) -> Any:
        """Pytree of :class:`Rule` / None matching ``tree`` (nested dicts)."""
        def walk(t, path):
            if isinstance(t, dict):
                return {k: walk(v, path + (k,)) for k, v in t.items()}
            return self.rule(path)
        return walk(tree, ())

    def compact_shape(self, path: tuple[str, ...], full_shape: tuple[int, ...]) -> tuple:
        """Per-worker shape of a leaf (without the leading W axis)."""
        r = self.rule(path)
        if r is None:
            return tuple(full_shape)
        shape = list(full_shape)
        shape[r.axis] = self.kinds[r.kind].k * r.expand
        return tuple(shape)

    def indices(self, rule: Rule, worker: int) -> np.ndarray:
        """Held indices along ``rule.axis`` for one worker: [k] (block) or [L, k*expand]."""
        held = self.kinds[rule.kind].held[worker]
        if rule.expand == 1:
            return held
        e = rule.expand
        return (held[..., :, None] * e + np.arange(e)).reshape(held.shape[:-1] + (-1,))

    # ------------------------------------------------------------------ facts
    def mask_matrix(self) -> np.ndarray:
        """All masks side by side, bool [W, total components] (for the mask graph)."""
        return np.concatenate([np.concatenate(list(t.masks), axis=1)
                               for t in self.kinds.values()], axis=1)

    def summary(self) -> dict[str, Any]:
        """Plain-JSON facts: variant, regime, per-kind k / G / multiplicities, spectral gap."""
        out = summary_head(self)
        for name, t in self.kinds.items():
            out["kinds"][name] = {"per_worker": t.k, "components": int(t.masks.shape[-1]),
                                  "multiplicity_min": int(t.counts.min()),
                                  "multiplicity_max": int(t.counts.max())}
        return out

    def record(self) -> dict[str, Any]:
        """What a checkpoint stores to recognise these masks: recipes and a hash of every mask
        matrix (DESIGN.md invariant 7)."""
        h = hashlib.sha256()
        for name, t in sorted(self.kinds.items()):
            h.update(name.encode())
            h.update(np.ascontiguousarray(t.masks).tobytes())
        return {"variant": self.variant,
                "recipes": {n: t.recipe for n, t in sorted(self.kinds.items())},
                "mask_sha256": h.hexdigest()}

    def describe(self) -> str:
        """One line for the run log."""
        if self.variant == "ddp":
            return "variant ddp: every worker holds the full model (coverage C=1)"
        parts = []
        for name, t in self.kinds.items():
            what = {"block": "blocks", "mlp": "MLP neurons/block", "heads": "kv-head groups/block"}
            parts.append(f"{t.k}/{t.masks.shape[-1]} {what[name]}")
        return (f"variant {self.variant} ({self.regime} masking), coverage C={self.coverage:g}: "
                f"each worker holds {', '.join(parts)}; scheme {self.scheme}")
