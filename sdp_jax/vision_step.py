"""SDP for the vision models: the plan (which blocks / channels / neurons / heads each worker holds)
and one builder for every variant's jitted ``train_step`` and accuracy evaluation.

Components and masks (:class:`VisionPlan`):

* block variants (``b-sdp``, ``bb-sdp``): the blocks of each stage. Blocks of different stages have
  different shapes, and an SPMD program needs every worker's compact subnetwork to have the same
  shapes (DESIGN.md invariant 4), so masks are *stage-balanced*: each worker holds ``k_s`` blocks
  of stage ``s``, one mask matrix per stage. ``C * L`` (L = all blocks) must be whole; the
  ``k_s`` add up to it and are the largest-remainder apportionment of ``C * L_s`` (ties go to the
  earlier stage, whose blocks have the fewest parameters), with at least ``ceil(L_s / W)`` per
  stage so that every block has a holder; ``sdp.stage_blocks`` sets the counts instead (e.g.
  to spare activation memory in early stages). The cyclic scheme slides its windows by one
  *worker* per stage: with two blocks per stage and k_s = 1, unshifted windows would split the
  workers into two groups that share no block (a disconnected mask graph). So Swin-T (depths 2,
  2, 6, 2) at C = 2/3 holds (2, 1, 4, 1) blocks per worker; ResNet-18 at C = 1/2 holds one
  block of every stage. Our choice: the SDP paper gives C over all blocks but not how it splits
  over stages.
* neuron variants (``n-sdp``, ``nb-sdp``): in every block, ``C`` of each kind's components
  (ResNet: inner channels; Swin: MLP hidden units and attention heads). The cyclic scheme shifts
  its windows by one component per block, as for LLaMA. ``C * G`` must be whole for every kind
  and stage (e.g. Swin-T's 3 heads in stage 0 allow C in {1/3, 2/3, 1}).
* ``ddp``: nothing masked; every parameter is always-kept (the same builder and step; invariant 1).

Layouts (mesh axis ``data``, W workers): always-kept leaves replicated ``P()``; a masked leaf of a
forward variant is stored compact, a global ``[W, ...]`` array sharded ``P('data')``: for blocks,
the stage's ``k_s`` held blocks stacked as *slots* ``{stage}/slots/...`` ``[W, k_s, ...]`` in depth
order (block 0 of a downsampling ResNet stage is zero-padded to the other blocks' shape: its first
conv has half the input channels); for neurons, narrower matrices. Backward variants store the full
parameters replicated and the optimizer state compact.

BatchNorm under SDP (our choice, documented in the README): each worker normalizes by its own
batch's statistics; after every step the running mean and variance of a layer are averaged over
the workers that hold it, like its parameters: block holders for the BatchNorms inside a block
(B-SDP), channel holders for ``bn1`` (N-SDP), all workers for the stem, the projection shortcuts
and ``bn2`` under N-SDP, and all workers under backward masking (every worker runs the full
model forward).

Averaging moves only held bytes (:func:`sdp_jax.sync.holder_mean`); clipping uses the global
norm of the averaged gradient with every component counted once (invariant 6).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sdp_jax import masks as masks_lib
from sdp_jax import layout as layout_lib
from sdp_jax import spec as spec_lib
from sdp_jax import step as step_lib
from sdp_jax import sync
from sdp_jax import train_step as ts
from sdp_jax.models import vision as vm
from sdp_jax.spec import BACKWARD_VARIANTS, BLOCK_VARIANTS, VARIANTS, layer_masks

AXIS = sync.AXIS
STEP_BYTES = sync.STEP_BYTES  # holder averaging: rows moved per loop step


def _apportion(coverage: float, depths: tuple, workers: int) -> list[int]:
    """Blocks per worker in each stage (see the module docstring)."""
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


@dataclasses.dataclass
class StageBlocks:
    """Block masks of one stage: ``mask`` bool [W, L_s], ``held`` int32 [W, k_s], ``counts``
    int32 [L_s]."""

    key: str
    mask: np.ndarray
    held: np.ndarray
    counts: np.ndarray
    recipe: dict


@dataclasses.dataclass
class BlockNeurons:
    """Neuron masks of one kind in one block: ``mask`` bool [W, G], ``held`` int32 [W, k]."""

    kind: str
    mask: np.ndarray
    held: np.ndarray
    counts: np.ndarray


class VisionPlan:
    """Which components of a vision model each worker holds (host-side, static).

    Args:
      variant: one of ``ddp``, ``b-sdp``, ``n-sdp``, ``bb-sdp``, ``nb-sdp``.
      cfg: :class:`sdp_jax.models.vision.VisionConfig`.
      workers: ``W``; coverage: ``C`` (ignored for ddp); scheme, seed, allow_nonuniform: mask
        recipe (:mod:`sdp_jax.masks`).
      stage_blocks: block variants: blocks per worker in each stage instead of the default
        apportionment (must add up to ``C * L``), e.g. ``(1, 2, 4, 1)`` for Swin-T at C = 2/3.

    Raises:
      ValueError: unknown variant; ``C`` not realizable for the model's blocks or for a neuron
        kind (names the stage, the kind, its count and the nearest valid coverages).
    """

    def __init__(self, variant: str, cfg: vm.VisionConfig, workers: int, coverage: float,
                 scheme: str = "cyclic", seed: int = 0, allow_nonuniform: bool = False,
                 stage_blocks: tuple = ()):
        if variant not in VARIANTS:
            raise ValueError(f"unknown variant {variant!r}; choose one of {', '.join(VARIANTS)}.")
        self.variant, self.cfg, self.workers = variant, cfg, workers
        self.coverage = 1.0 if variant == "ddp" else coverage
        self.scheme, self.seed, self.allow_nonuniform = scheme, seed, allow_nonuniform
        self.stage_blocks = tuple(stage_blocks or ())
        self.backward = variant in BACKWARD_VARIANTS
        self.regime = "backward" if self.backward else "forward"
        self.stages, self.kinds = vm.components(cfg)
        self.blocks: dict[str, StageBlocks] = {}
        self.neurons: dict[tuple[str, str, str], BlockNeurons] = {}
        if variant == "ddp":
            return
        if variant in BLOCK_VARIANTS:
            self._block_masks()
        else:
            self._neuron_masks()

    def _recipe(self, components, coverage, seed, what):
        try:
            return masks_lib.MaskRecipe(self.scheme, self.workers, components, coverage, seed,
                                        self.allow_nonuniform)
        except ValueError as e:
            raise ValueError(f"{self.variant} on {self.cfg.name}: {what}: {e}") from None

    def _block_masks(self):
        depths = tuple(st.blocks for st in self.stages)
        total = sum(depths)
        c = self.coverage
        ok = isinstance(c, (int, float)) and not isinstance(c, bool) and 0 < c <= 1
        whole = ok and abs(round(c * total) - c * total) <= 1e-6
        # Every stage keeps at least ceil(L_s / W) >= 1 blocks per worker, so small C may not fit.
        if not whole or sum(_apportion(c, depths, self.workers)) != round(c * total):
            valid = [k / total for k in range(1, total + 1)
                     if sum(_apportion(k / total, depths, self.workers)) == k]
            target = min(max(c, 0.0), 1.0) if isinstance(c, (int, float)) and c == c else 0.5
            near = sorted(sorted(valid, key=lambda v: abs(v - target))[:3])
            least = round(min(valid) * total)
            raise ValueError(
                f"{self.variant} on {self.cfg.name}: coverage C={c!r} is not realizable for its "
                f"{total} blocks (stages {list(depths)}): C * {total} must be a whole number of "
                f"blocks from {least} (every stage keeps a block on each worker) to {total}; "
                f"nearest valid coverages: {[round(v, 6) for v in near]}.")
        ks = _apportion(c, depths, self.workers)
        if self.stage_blocks:
            ks = list(self.stage_blocks)
            if len(ks) != len(depths) or any(
                    isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= d
                    for k, d in zip(ks, depths)) or sum(ks) != round(c * total):
                raise ValueError(
                    f"sdp.stage_blocks={self.stage_blocks!r}: give one count per stage "
                    f"(stages {list(depths)}), each in [1, its blocks], adding up to C * "
                    f"{total} = {c * total:g} (coverage C={c:g}); default apportionment: "
                    f"{_apportion(c, depths, self.workers)}.")
        for s, (st, k) in enumerate(zip(self.stages, ks)):
            recipe = self._recipe(st.blocks, k / st.blocks, self.seed * 1009 + s,
                                  f"stage {st.key} holds {k} of its {st.blocks} blocks per worker")
            m = recipe.matrix()
            if self.scheme == "cyclic":  # slide the windows one worker per stage
                m = np.roll(m, s, axis=0)
            self.blocks[st.key] = StageBlocks(st.key, m, masks_lib.held_table(m),
                                              masks_lib.multiplicities(m), recipe.to_dict())

    def _neuron_masks(self):
        for s, st in enumerate(self.stages):
            for kind in self.kinds:
                g = vm.neuron_count(self.cfg, s, kind.name)
                recipe = self._recipe(g, self.coverage, self.seed,
                                      f"stage {st.key}: {g} {kind.name} per block")
                for j, m in enumerate(layer_masks(recipe, st.blocks)):
                    self.neurons[(st.key, f"b{j}", kind.name)] = BlockNeurons(
                        kind.name, m, masks_lib.held_table(m), masks_lib.multiplicities(m))

    # ------------------------------------------------------------------ facts
    def mask_matrix(self) -> np.ndarray:
        """All masks side by side, bool [W, total components] (for the mask graph)."""
        parts = [b.mask for b in self.blocks.values()] + [n.mask for n in self.neurons.values()]
        if not parts:
            return np.ones((self.workers, 1), bool)
        return np.concatenate(parts, axis=1)

    def summary(self) -> dict[str, Any]:
        """Plain-JSON facts: variant, regime, per-kind k / G / multiplicities, spectral gap."""
        gap = round(masks_lib.spectral_gap(self.mask_matrix()), 6) if self.workers > 1 else 1.0
        out = {"variant": self.variant, "regime": self.regime, "coverage": self.coverage,
               "workers": self.workers, "spectral_gap": gap, "kinds": {}}
        groups: dict[str, list] = {}
        for key, b in self.blocks.items():
            groups[f"{key}.blocks"] = [b]
        for (stage, _, kind), n in self.neurons.items():
            groups.setdefault(f"{stage}.{kind}", []).append(n)
        for name, items in groups.items():
            out["kinds"][name] = {"per_worker": int(items[0].held.shape[1]),
                                  "components": int(items[0].mask.shape[1]),
                                  "multiplicity_min": int(min(i.counts.min() for i in items)),
                                  "multiplicity_max": int(max(i.counts.max() for i in items))}
        if not groups:
            out["kinds"]["all"] = {"per_worker": 1, "components": 1,
                                   "multiplicity_min": self.workers,
                                   "multiplicity_max": self.workers}
        return out

    def record(self) -> dict[str, Any]:
        """Recipes and a SHA-256 of every mask matrix, for checkpoints (invariant 7)."""
        h = hashlib.sha256()
        for name, b in sorted(self.blocks.items()):
            h.update(name.encode())
            h.update(np.ascontiguousarray(b.mask).tobytes())
        for name, n in sorted(self.neurons.items()):
            h.update("/".join(name).encode())
            h.update(np.ascontiguousarray(n.mask).tobytes())
        recipes = {f"{k}.blocks": b.recipe for k, b in sorted(self.blocks.items())}
        return {"variant": self.variant, "recipes": recipes, "mask_sha256": h.hexdigest()}

    def describe(self) -> str:
        """One line for the run log."""
        if self.variant == "ddp":
            return f"variant ddp: every worker holds the full {self.cfg.name} (coverage C=1)"
        info = self.summary()["kinds"]
        parts = [f"{v['per_worker']}/{v['components']} {k}" for k, v in info.items()]
        if self.neurons:
            seen = {}
            for k, v in info.items():
                seen.setdefault(k.split(".", 1)[1], []).append(f"{v['per_worker']}/"
                                                               f"{v['components']}")
            parts = [f"{kind} {', '.join(x)} per block by stage" for kind, x in seen.items()]
        return (f"variant {self.variant} ({self.regime} masking) on {self.cfg.name}, coverage "
                f"C={self.coverage:g}: each worker holds {'; '.join(parts)}; scheme {self.scheme}")


# ----------------------------------------------------------------------------------------------
# Leaf bookkeeping
# ----------------------------------------------------------------------------------------------

def _flatten(tree, prefix=()) -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, prefix + (k,)))
        else:
            out[prefix + (k,)] = v
    return out


_unflatten = spec_lib.unflatten


@dataclasses.dataclass
class Leaf:
    """A worker's local (compact) leaf.

    kind: ``kept`` | ``slots`` (B-SDP stage stack ``[k_s, *union]``) | ``neurons``.
    shape: local shape (no worker axis). full: the full leaves it comes from (one per block for
    slots). tables: :class:`sync.HolderTables` (masked leaves). axis: component axis of the full
    leaf (neurons). held: int32 [W, k] held indices.
    """

    kind: str
    shape: tuple
    dtype: Any
    full: tuple
    tables: Any = None
    axis: int = 0
    held: Any = None


def _decay(params):
    """Weight decay on conv / linear weights only (not norms, biases, relative position bias)."""
    def decayed(path, _):
        key = str(getattr(path[-1], "key", path[-1]))
        return key == "kernel" or key.endswith("_w")
    return jax.tree_util.tree_map_with_path(decayed, params)


class VisionStepBuilder:
    """State layout, initializer, train step and accuracy evaluation of one vision run.

    Args:
      cfg: :class:`sdp_jax.models.vision.VisionConfig`.
      plan: :class:`VisionPlan` (``W`` = mesh size).
      optim: :class:`sdp_jax.train_step.OptimConfig`.
      mesh: mesh with one axis ``data`` of size ``W``.
      total_steps: schedule length (optimizer steps).
      dtype: compute dtype ``float32`` or ``bfloat16`` (parameters, optimizer state, BatchNorm
        statistics and averaging stay float32).
      remat: activation checkpointing of every block in the train step: ``none`` or ``full``
        (keep each block's input, recompute the rest in the backward pass).

    Raises:
      ValueError: mesh size differs from ``W``; bad dtype or remat.
    """

    def __init__(self, cfg: vm.VisionConfig, plan: VisionPlan, optim: ts.OptimConfig, mesh,
                 total_steps: int, dtype: str = "float32", remat: str = "none"):
        if mesh.shape[AXIS] != plan.workers:
            raise ValueError(f"mesh axis '{AXIS}' has {mesh.shape[AXIS]} devices but the plan "
                             f"has W={plan.workers} workers.")
        if dtype not in ts.DTYPES:
            raise ValueError(f"dtype={dtype!r}; use float32 or bfloat16.")
        if remat not in ("none", "full"):
            raise ValueError(f"remat={remat!r}; use none or full for vision models.")
        self.remat = remat == "full"
        self.cfg, self.plan, self.optim, self.mesh = cfg, plan, optim, mesh
        self.total_steps = int(total_steps)
        self.dtype = jnp.dtype(ts.DTYPES[dtype])
        self.optimizer = ts.make_optimizer(optim, self.total_steps, decay_mask=_decay)
        self.schedule = ts.lr_schedule(optim, self.total_steps)
        model = nnx.eval_shape(lambda: vm.build(cfg))
        self.full_params = _flatten(model.params())
        self.full_stats = _flatten(model.batch_stats())
        self.p_leaves = self._leaves(self.full_params)
        self.s_leaves = self._leaves(self.full_stats)
        W = plan.workers

        def store(leaves, stored):  # "R" replicated full/local, "C" compact [W, ...]
            return {p: ("C" if lf.kind != "kept" and (stored == "opt" or not plan.backward)
                        else "R") for p, lf in leaves.items()}
        self.p_layout = store(self.p_leaves, "params")
        self.o_layout = store(self.p_leaves, "opt")
        self.s_layout = store(self.s_leaves, "params")

        def shapes(leaves, layout, full):
            if plan.backward and layout is not self.o_layout:
                out = {p: jax.ShapeDtypeStruct(s.shape, s.dtype) for p, s in full.items()}
                specs = {p: P() for p in full}
            else:
                out = {p: jax.ShapeDtypeStruct(((W,) if layout[p] == "C" else ()) + lf.shape,
                                               lf.dtype) for p, lf in leaves.items()}
                specs = {p: P(AXIS) if layout[p] == "C" else P() for p in leaves}
            out = {p: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                           sharding=NamedSharding(mesh, specs[p]))
                   for p, s in out.items()}
            return _unflatten(out), _unflatten(specs)

        self.param_shapes, self.param_specs = shapes(self.p_leaves, self.p_layout,
                                                     self.full_params)
        self.compact_shapes, self.compact_specs = shapes(self.p_leaves, self.o_layout,
                                                         self.full_params)
        self.stats_shapes, self.stats_specs = shapes(self.s_leaves, self.s_layout,
                                                     self.full_stats)
        self.opt_specs = layout_lib.opt_state_specs(self.optimizer, self.compact_specs,
                                                    self.compact_shapes)
        self.state_specs = {"params": self.param_specs, "stats": self.stats_specs,
                            "opt_state": self.opt_specs, "step": P()}
        # What slot 0 of each masked stage holds on every worker (static; see
        # models.vision._first_slot): block 0 everywhere, never, or on some workers.
        self.slot0 = {k: ("down" if (b.held[:, 0] == 0).all() else
                          "regular" if (b.held[:, 0] != 0).all() else "mixed")
                      for k, b in plan.blocks.items()}
        self._train_step = None
        self._eval_steps: dict = {}
        self._bn_fn = None
        self._full_fn = None

    # ------------------------------------------------------------------ leaves
    def _leaves(self, full: dict) -> dict[tuple, Leaf]:
        """Local leaves of a worker: always-kept, stage slots (B-SDP) or narrowed (N-SDP)."""
        plan = self.plan
        out: dict[tuple, Leaf] = {}
        neuron_axes = {}
        for kind in plan.kinds:
            for sub, (axis, _) in {**kind.leaves, **kind.stats}.items():
                neuron_axes[sub] = (kind.name, axis)
        for path, sds in full.items():
            stage = path[0]
            in_block = len(path) > 2 and path[1].startswith("b") and path[1][1:].isdigit()
            if in_block and stage in plan.blocks:
                sb = plan.blocks[stage]
                lp = (stage, "slots") + path[2:]
                if lp in out:
                    continue
                fulls = tuple((stage, f"b{j}") + path[2:] for j in range(sb.mask.shape[1]))
                union = tuple(np.max([full[f].shape for f in fulls], axis=0))
                t = sync.HolderTables(sb.held[:, None, :], sb.counts[None, :], 0, False)
                out[lp] = Leaf("slots", (sb.held.shape[1],) + union, sds.dtype, fulls, t, 0,
                               sb.held)
            elif in_block and path[2:] in neuron_axes and \
                    (stage, path[1], neuron_axes[path[2:]][0]) in plan.neurons:
                kind, axis = neuron_axes[path[2:]]
                bn = plan.neurons[(stage, path[1], kind)]
                shape = list(sds.shape)
                shape[axis] = bn.held.shape[1]
                t = sync.HolderTables(bn.held[:, None, :], bn.counts[None, :], axis + 1, True)
                out[path] = Leaf("neurons", tuple(shape), sds.dtype, (path,), t, axis, bn.held)
            else:
                out[path] = Leaf("kept", tuple(sds.shape), sds.dtype, (path,))
        return out

    def _prune(self, leaves: dict, full: dict, w) -> dict:
        """Worker ``w``'s local leaves (no worker axis) from full ones (``w`` may be traced)."""
        out = {}
        for lp, lf in leaves.items():
            if lf.kind == "kept":
                out[lp] = full[lf.full[0]]
            elif lf.kind == "slots":
                stack = jnp.stack([_pad(full[f], lf.shape[1:]) for f in lf.full])
                out[lp] = stack[jnp.asarray(lf.held)[w]]
            else:
                out[lp] = jnp.take(full[lf.full[0]], jnp.asarray(lf.held)[w], axis=lf.axis)
        return out

    def _gather_full(self, leaves: dict, local: dict) -> dict:
        """Inside ``shard_map``: full leaves (invariant, on every worker) from the local ones:
        masked components as the mean over their holders (holder all_to_all, then an
        all-gather); always-kept leaves as they are."""
        out, masked, tabs = {}, {}, {}
        for lp, lf in leaves.items():
            if lf.kind == "kept":
                out[lf.full[0]] = local[lp]
            elif lf.tables.full:
                val = jax.lax.pmean(local[lp], AXIS)
                self._scatter_full(lf, val, out)
            else:
                masked[lp] = local[lp] if lf.kind == "slots" else local[lp][None]
                tabs[lp] = lf.tables
        if masked:
            shards = sync.holder_shards(masked, tabs, AXIS)
            for lp, sh in shards.items():
                lf = leaves[lp]
                g = sync.all_gather_invariant(sh.astype(lf.dtype))
                if lf.kind == "slots":
                    n = len(lf.full)
                    val = sync.from_rows(g, (n,) + lf.shape[1:], lf.tables)
                else:
                    shape = list(lf.shape)
                    shape[lf.axis] = lf.tables.size
                    val = sync.from_rows(g, (1,) + tuple(shape), lf.tables)[0]
                self._scatter_full(lf, val, out)
        return out

    def _scatter_full(self, lf: Leaf, val, out: dict):
        """A full-size local value (all blocks stacked, or all neurons) -> full leaves."""
        if lf.kind == "slots":
            for j, f in enumerate(lf.full):
                shape = (self.full_params[f] if f in self.full_params
                         else self.full_stats[f]).shape
                out[f] = val[(j,) + tuple(slice(0, n) for n in shape)]
        else:
            out[lf.full[0]] = val

    # ------------------------------------------------------------------ layout helpers
    def shardings(self, specs=None):
        """NamedShardings of ``specs`` (default: the state's)."""
        return step_lib.shardings(self.mesh, self.state_specs if specs is None else specs)

    def abstract_state(self):
        """ShapeDtypeStruct tree (with shardings) of the train state."""
        return step_lib.abstract_state(self, {"params": self.param_shapes,
                                              "stats": self.stats_shapes})

    def batch_sharding(self):
        return NamedSharding(self.mesh, P(AXIS))

    def per_device_param_count(self) -> int:
        """Parameter elements stored per device."""
        return int(sum(np.prod(s.shape[1:] if self.p_layout.get(p) == "C" else s.shape)
                       for p, s in _flatten(self.param_shapes).items()))

    def _stored(self, layout: dict, leaves: dict, full: dict):
        """Full leaves -> the stored layout (compact stacked over workers, or replicated)."""
        if self.plan.backward and layout is not self.o_layout:
            return full
        W = self.plan.workers
        per = [self._prune(leaves, full, w) for w in range(W)]
        return {p: jnp.stack([x[p] for x in per]) if layout[p] == "C" else per[0][p]
                for p in leaves}

    def init_state(self, seed: int):
        """Initialize the full model from ``seed`` and store each worker's part (holders of a
        component start from the same values). Returns ``{params, stats, opt_state, step}``."""
        def init():
            m = vm.build(self.cfg, seed)
            p = self._stored(self.p_layout, self.p_leaves, _flatten(m.params()))
            s = self._stored(self.s_layout, self.s_leaves, _flatten(m.batch_stats()))
            return _unflatten(p), _unflatten(s)
        params, stats = jax.jit(init, out_shardings=(self.shardings(self.param_specs),
                                                     self.shardings(self.stats_specs)))()

        def opt_init(params):
            compact = params
            if self.plan.backward:
                compact = _unflatten(self._stored(self.o_layout, self.p_leaves,
                                                  _flatten(params)))
            return self.optimizer.init(compact)
        opt_state = jax.jit(opt_init, out_shardings=self.shardings(self.opt_specs))(params)
        step = jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(self.mesh, P()))
        return {"params": params, "stats": stats, "opt_state": opt_state, "step": step}

    # ------------------------------------------------------------------ step pieces
    def _local(self, tree: dict, layout: dict) -> dict:
        """Flat local view: drop the leading per-worker axis of compact leaves."""
        return {p: (x[0] if layout[p] == "C" else x) for p, x in _flatten(tree).items()}

    def _slots(self):
        my = sync.worker_index(AXIS)
        return {k: jnp.asarray(b.held)[my] for k, b in self.plan.blocks.items()}

    def _cast(self, tree):
        return {p: x.astype(self.dtype) for p, x in tree.items()}

    def _holder_average(self, leaves: dict, local: dict, norm: bool = False):
        """Masked mean over holders of local leaves (and, with ``norm``, the squared L2 norm of
        the result with every component counted once)."""
        out, masked, tabs = {}, {}, {}
        sq = jnp.float32(0.0)
        for lp, x in local.items():
            lf = leaves[lp]
            if lf.kind == "kept" or lf.tables.full:
                out[lp] = jax.lax.pmean(x, AXIS)
                if norm:
                    sq = sq + jnp.sum(jnp.square(out[lp].astype(jnp.float32)))
            else:
                masked[lp] = x if lf.kind == "slots" else x[None]
                tabs[lp] = lf.tables
        if masked:
            shards = sync.holder_shards(masked, tabs, AXIS, STEP_BYTES)
            if norm:
                sq = sq + sync.shards_sq_norm(shards, AXIS)
            back = sync.shards_to_compact(shards, masked, tabs, AXIS, STEP_BYTES)
            out.update({lp: (v if leaves[lp].kind == "slots" else v[0])
                        for lp, v in back.items()})
        return out, sq

    def _loss(self, params: dict, stats: dict, images, labels, train: bool, slots=None):
        logits, new = vm.forward(self.cfg, _unflatten(self._cast(params)), _unflatten(stats),
                                 images.astype(self.dtype), train, slots, self.slot0,
                                 self.remat and train)
        loss = vm.cross_entropy(logits, labels)
        correct = jnp.sum(jnp.argmax(logits, -1) == labels)
        return loss, (_flatten(new) if new else {}, correct)

    def _local_step(self, state, images, labels):
        plan = self.plan
        if plan.backward:  # full forward on every worker; gradients kept for held components
            full = _flatten(state["params"])
            stats = _flatten(state["stats"])
            diff = sync.to_varying(full)
            (loss, (new_stats, correct)), g_full = jax.value_and_grad(
                self._loss, has_aux=True)(diff, stats, images, labels, True)
            my = sync.worker_index(AXIS)
            grads = self._prune(self.p_leaves, g_full, my)
            compact = self._prune(self.p_leaves, full, my)
            new_stats = {p: jax.lax.pmean(x, AXIS) for p, x in new_stats.items()}
        else:
            local = self._local(state["params"], self.p_layout)
            stats = self._local(state["stats"], self.s_layout)
            diff = {p: sync.to_varying(x) if self.p_layout[p] == "R" else x
                    for p, x in local.items()}
            (loss, (new_stats, correct)), grads = jax.value_and_grad(
                self._loss, has_aux=True)(diff, stats, images, labels, True, self._slots())
            compact = local
            new_stats, _ = self._holder_average(self.s_leaves, new_stats)
        grads, sq = self._holder_average(self.p_leaves, grads, norm=True)
        gnorm = jnp.sqrt(sq)
        grads = sync.clip_to(grads, gnorm, self.optim.grad_clip)
        lead = lambda t: {p: (x[None] if self.o_layout[p] == "C" else x)  # noqa: E731
                          for p, x in t.items()}
        updates, opt_state = self.optimizer.update(_unflatten(lead(grads)), state["opt_state"],
                                                   _unflatten(lead(compact)))
        new = _flatten(optax.apply_updates(_unflatten(lead(compact)), updates))
        if plan.backward:
            local_new = {p: (x[0] if self.o_layout[p] == "C" else x) for p, x in new.items()}
            params = _unflatten(self._gather_full(self.p_leaves, local_new))
            stats_out = _unflatten(new_stats)
        else:
            params = _unflatten(new)
            stats_out = _unflatten({p: (x[None] if self.s_layout[p] == "C" else x)
                                    for p, x in new_stats.items()})
        n = images.shape[0] * plan.workers
        metrics = {"train_loss": jax.lax.pmean(loss, AXIS), "grad_norm": gnorm,
                   "train_acc": jax.lax.psum(correct, AXIS) / n,
                   "lr": self.schedule(state["step"])}
        return {"params": params, "stats": stats_out, "opt_state": opt_state,
                "step": state["step"] + 1}, metrics

    def train_step_fn(self):
        """Jitted ``(state, images float32 [W*b, H, W, C], labels int32 [W*b]) -> (state,
        metrics)`` with the batch sharded ``P('data')``; ``state`` is donated. metrics:
        ``train_loss`` (nats, mean over workers), ``train_acc`` (fraction of the global batch),
        ``grad_norm`` (of the averaged gradient, before clipping), ``lr``."""
        if self._train_step is None:
            fn = jax.shard_map(self._local_step, mesh=self.mesh,
                               in_specs=(self.state_specs, P(AXIS), P(AXIS)),
                               out_specs=(self.state_specs, P()))
            self._train_step = jax.jit(fn, donate_argnums=0)
        return self._train_step

    def compiled_train_step(self, batch_per_worker: int):
        """Compile the train step for abstract inputs (no data, no state in device memory)."""
        W, c = self.plan.workers, self.cfg
        sh = self.batch_sharding()
        x = jax.ShapeDtypeStruct((W * batch_per_worker, c.image_size, c.image_size,
                                  c.in_channels), jnp.float32, sharding=sh)
        y = jax.ShapeDtypeStruct((W * batch_per_worker,), jnp.int32, sharding=sh)
        return self.train_step_fn().lower(self.abstract_state(), x, y).compile()

    # ------------------------------------------------------------------ full model
    def _local_full(self, params, stats):
        if self.plan.backward:
            return _flatten(params), _flatten(stats)
        return (self._gather_full(self.p_leaves, self._local(params, self.p_layout)),
                self._gather_full(self.s_leaves, self._local(stats, self.s_layout)))

    @property
    def recalibrate(self) -> bool:
        """Whether full-model evaluation should re-estimate BatchNorm statistics
        (:meth:`bn_stats_fn`): forward masking with some component not held by every worker, on a
        model with BatchNorm. The running statistics averaged over holders were measured inside
        subnetworks; the full model's activations differ (more blocks summed, more channels), so
        its BatchNorm layers need their own statistics, as slimmable networks re-estimate them
        per width (Yu et al. 2019, "Slimmable neural networks", Sec. 3.3). Measured on the digits
        default (B-SDP C = 1/2, 40 steps): test accuracy 0.26 with the averaged running
        statistics, 0.69 with re-estimated ones."""
        if self.plan.backward or not self.full_stats:
            return False
        return any(lf.kind != "kept" and not lf.tables.full for lf in self.s_leaves.values())

    def _local_bn_stats(self, params, stats, images):
        full_p, full_s = self._local_full(params, stats)
        zeros = {p: jnp.zeros_like(x) for p, x in full_s.items()}
        _, new = vm.forward(self.cfg, _unflatten(self._cast(full_p)), _unflatten(zeros),
                            images.astype(self.dtype), True)
        # From zero running statistics one update leaves (1 - momentum) * batch statistics.
        return jax.tree.map(lambda x: jax.lax.pmean(x / (1 - vm.BN_MOMENTUM), AXIS), new)

    def bn_stats_fn(self):
        """Jitted ``(params, stats, images [W*b, H, W, C]) -> full-model BatchNorm statistics``
        (nested dict like the model's ``batch_stats``, replicated): each worker's batch mean and
        (biased) variance of every BatchNorm of the full model, averaged over workers. Average
        them over a few batches and pass them to ``eval_step_fn(recalibrated=True)``."""
        if self._bn_fn is None:
            spec = jax.tree.map(lambda _: P(), _unflatten(self.full_stats))
            self._bn_fn = jax.jit(jax.shard_map(
                self._local_bn_stats, mesh=self.mesh,
                in_specs=(self.param_specs, self.stats_specs, P(AXIS)), out_specs=spec))
        return self._bn_fn

    def _local_eval(self, params, stats, images, labels, valid, full_stats=None):
        full_p, full_s = self._local_full(params, stats)
        if full_stats is not None:
            full_s = _flatten(full_stats)
        logits, _ = vm.forward(self.cfg, _unflatten(self._cast(full_p)), _unflatten(full_s),
                               images.astype(self.dtype), False)
        logz = jax.nn.logsumexp(logits, -1)
        nll = logz - jnp.take_along_axis(logits, labels[:, None], -1)[:, 0]
        right = (jnp.argmax(logits, -1) == labels) & valid
        return (jax.lax.psum(jnp.sum(jnp.where(valid, nll, 0.0)), AXIS),
                jax.lax.psum(jnp.sum(right), AXIS), jax.lax.psum(jnp.sum(valid), AXIS))

    def eval_step_fn(self, recalibrated: bool = False):
        """Jitted full-model evaluation ``(params, stats, images, labels, valid bool [N]
        [, full BatchNorm statistics]) -> (summed loss nats, correct count, example count)`` over
        a batch sharded ``P('data')``: every block with every channel / neuron / head, BatchNorm
        in inference mode with the running statistics averaged over holders, or
        (``recalibrated``) with statistics from :meth:`bn_stats_fn` as the last argument."""
        if recalibrated not in self._eval_steps:
            specs = (self.param_specs, self.stats_specs, P(AXIS), P(AXIS), P(AXIS))
            if recalibrated:
                specs += (jax.tree.map(lambda _: P(), _unflatten(self.full_stats)),)
            fn = jax.shard_map(self._local_eval, mesh=self.mesh, in_specs=specs,
                               out_specs=(P(), P(), P()))
            self._eval_steps[recalibrated] = jax.jit(fn)
        return self._eval_steps[recalibrated]

    def full_model(self, state) -> tuple[dict, dict]:
        """(params, stats) of the full model as nested dicts of replicated arrays: each
        component is the mean over its holders (equal to every holder's copy after a step)."""
        if self._full_fn is None:
            def fn(params, stats):
                p, s = self._local_full(params, stats)
                return _unflatten(p), _unflatten(s)
            pspec = jax.tree.map(lambda _: P(), _unflatten(self.full_params))
            sspec = jax.tree.map(lambda _: P(), _unflatten(self.full_stats))
            self._full_fn = jax.jit(jax.shard_map(
                fn, mesh=self.mesh, in_specs=(self.param_specs, self.stats_specs),
                out_specs=(pspec, sspec)))
        return self._full_fn(state["params"], state["stats"])


def _pad(x, shape):
    """Zero-pad ``x`` at the end of each axis to ``shape``."""
    return jnp.pad(x, [(0, n - m) for m, n in zip(x.shape, shape)])
