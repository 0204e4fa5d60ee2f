"""The vision family: ResNet-18, WideResNet-18 and Swin-T, their hooks for the one step and for the
one training loop.

Vision models (:mod:`sdp_jax.models.vision`) declare their components as spec rules
(:func:`vision_rules`): one :class:`sdp_jax.spec.Blocks` rule per stage (blocks ``s{i}/b{j}``,
stage-balanced masks; the first block of a downsampling ResNet stage is stored zero-padded to
the other blocks' shape: its first conv has half the input channels), and per stage one neuron
kind per block component (ResNet ``channels``: the inner channels of each basic block with
their BatchNorm; Swin ``mlp`` hidden units and attention ``heads``). The BatchNorm running
statistics follow the same rules (:func:`vision_spec`). :class:`VisionModel` gives the step its
loss, :func:`vision_step` builds it, :class:`VisionEval` evaluates the full model, and
:class:`VisionFamily` implements :class:`sdp_jax.train.task.Family` for the loop.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from sdp_jax.mesh import DATA
from sdp_jax.models import vision as vm
from sdp_jax.options import ModelHooks, StepOptions
from sdp_jax.spec import sdp_spec as spec_lib
from sdp_jax.step import sdp_step as step_lib
from sdp_jax.sync import collectives as sync
from sdp_jax.train import config as config_lib
from sdp_jax.train import migrations
from sdp_jax.train import optimizer as optim_lib
from sdp_jax.train.data import vision as vision_data
from sdp_jax.train.task import Family, compiled_flops, schedule_steps

VISION_REMAT = ("none", "full")   # activation checkpointing modes of the vision models

def vision_rules(cfg: vm.VisionConfig, *, blocks: bool = True, stats: bool = False) -> list:
    """The SDP rules of a vision model: ``Blocks("s{i}", key="b{}")`` per stage (``pad`` for
    a downsampling ResNet stage) when ``blocks``, and the neuron kinds ``"s{i}.{kind}"`` of
    :func:`sdp_jax.models.vision.components`; ``stats``: the rules of the BatchNorm running
    statistics instead of the parameters."""
    stages, kinds = vm.components(cfg)
    rules = [spec_lib.Blocks(st.key, key="b{}", pad=st.down) for st in stages] if blocks else []
    for st in stages:
        for kind in kinds:
            for sub, (axis, expand) in (kind.stats if stats else kind.leaves).items():
                rules.append(spec_lib.Neurons("/".join((st.key, "*") + sub), axis,
                                              f"{st.key}.{kind.name}", expand))
    return rules


def vision_spec(cfg: vm.VisionConfig, variant: str, workers: int, coverage: float,
                scheme: str = "cyclic", seed: int = 0, allow_nonuniform: bool = False,
                stage_blocks: tuple = (), allow_disconnected: bool = True) -> spec_lib.SDPSpec:
    """The spec of a vision model's parameters.

    Block variants hold ``k_s`` blocks of stage ``s`` (:func:`sdp_jax.spec.stage_balance`:
    Swin-T, depths (2, 2, 6, 2), at C = 2/3 holds (2, 1, 4, 1) blocks per worker; ResNet-18 at
    C = 1/2 one block of every stage); neuron variants hold ``C`` of each kind's components in
    every block (``C * G`` whole for every kind and stage: Swin-T's 3 heads in stage 0 allow C in
    {1/3, 2/3, 1}). ``ddp`` declares no components (every leaf always-kept).

    Raises:
      ValueError: what :func:`sdp_jax.spec.build` refuses, prefixed with the model's name
        (unknown variant, ``C`` not realizable for a stage or kind, bad ``stage_blocks``, a
        disconnected mask graph unless ``allow_disconnected``: True by default, for specs built
        to inspect; runs pass the config's ``sdp.allow_disconnected``).
    """
    return _vision_build(cfg, False, variant, workers, coverage, scheme, seed,
                         allow_nonuniform, stage_blocks, allow_disconnected)


def vision_stats_spec(cfg: vm.VisionConfig, spec: spec_lib.SDPSpec) -> spec_lib.SDPSpec:
    """The spec of the BatchNorm running statistics (an empty spec for a model without
    BatchNorm), built from the parameters' spec's arguments, so that its masks are the same."""
    stats = _vision_build(cfg, True, spec.variant, spec.workers, spec.coverage, spec.scheme,
                          spec.seed, spec.allow_nonuniform, spec.stage_blocks, True)
    if stats is None:   # no BatchNorm (Swin): an empty state, as vision checkpoints store it
        return spec_lib.SDPSpec({}, spec.variant, spec.workers, spec.coverage, spec.scheme,
                                spec.seed, spec.allow_nonuniform)
    for kind, t in (stats.kinds.items() if stats else ()):
        if not np.array_equal(t.masks, spec.kinds[kind].masks):
            raise ValueError(f"the BatchNorm statistics' {kind} masks differ from the "
                             "parameters'; build the spec with sdp_jax.train.families.vision_spec.")
    return stats


def _vision_build(cfg, stats, variant, workers, coverage, scheme, seed, allow_nonuniform,
                  stage_blocks, allow_disconnected):
    model = nnx.eval_shape(lambda: vm.build(cfg))
    tree = model.batch_stats() if stats else model.params()
    if not tree:
        return None
    stages, kinds = vm.components(cfg)
    names = {f"{st.key}.{k.name}": f"{k.name} per block of stage {st.key}"
             for st in stages for k in kinds}
    names.update({f"{st.key}.blocks": f"blocks of stage {st.key}" for st in stages})
    try:
        return spec_lib.build(tree, vision_rules(cfg, blocks=variant != "ddp", stats=stats),
                              variant, workers, coverage, scheme=scheme, seed=seed,
                              allow_nonuniform=allow_nonuniform, names=names,
                              allow_disconnected=allow_disconnected,
                              stage_blocks=tuple(stage_blocks or ()),
                              stage_balanced=True)
    except ValueError as e:
        raise ValueError(f"{cfg.name}: {e}") from None


def vision_record(spec: spec_lib.SDPSpec) -> dict:
    """What a vision checkpoint stores to recognise its masks (docs/design.md invariant 7): the
    block recipes and a SHA-256 over each stage's block mask ``[W, L_s]`` and each block's
    neuron masks ``[W, G]``, in the form vision checkpoints have always recorded (so runs
    written before the spec existed still resume)."""
    h = hashlib.sha256()
    blocks = {k[:-len(".blocks")]: t for k, t in spec.kinds.items() if k in spec.stacks}
    for name, t in sorted(blocks.items()):
        h.update(name.encode())
        h.update(np.ascontiguousarray(t.masks[0]).tobytes())
    neurons = []
    for k, t in spec.kinds.items():
        if k not in spec.stacks:
            stage, kind = k.split(".", 1)
            neurons += [((stage, str(key[0]), kind), m) for key, m in zip(t.layers, t.masks)]
    for name, m in sorted(neurons, key=lambda e: e[0]):
        h.update("/".join(name).encode())
        h.update(np.ascontiguousarray(m).tobytes())
    return {"variant": spec.variant,
            "recipes": {f"{k}.blocks": blocks[k].recipe for k in sorted(blocks)},
            "mask_sha256": h.hexdigest()}


def _decay(params):
    """Weight decay on conv / linear weights only (not norms, biases, relative position bias)."""
    def decayed(path, _):
        key = str(getattr(path[-1], "key", path[-1]))
        return key == "kernel" or key.endswith("_w")
    return jax.tree_util.tree_map_with_path(decayed, params)


class VisionModel:
    """An image classifier of :mod:`sdp_jax.models.vision` as the hooks of :class:`SDPStep`:
    its loss on a worker's parameters (list-form block slots stacked, ``stacked_slots``) and
    BatchNorm statistics, and its initial parameters and statistics.

    Args:
      cfg: :class:`sdp_jax.models.vision.VisionConfig`; spec: the parameters' spec
        (:func:`vision_spec`); dtype: compute dtype of the images (the step casts the
        parameters); remat: activation checkpointing of every block (``jax.checkpoint``);
        unroll: the checkpointed blocks' scans unrolled (FLOP counting,
        :func:`sdp_jax.models.vision.forward`).
    """

    def __init__(self, cfg: vm.VisionConfig, spec: spec_lib.SDPSpec, dtype=jnp.float32,
                 remat: bool = False, unroll: bool = False):
        self.cfg, self.spec, self.dtype, self.remat = cfg, spec, jnp.dtype(dtype), remat
        self.unroll = unroll
        self.stats_spec = vision_stats_spec(cfg, spec)
        self.held = {st.path[0]: spec.kinds[k].held for k, st in spec.stacks.items()
                     if k in spec.kinds}
        # What slot 0 of each downsampling stage holds on every worker (static; see
        # models.vision._first_slot): block 0 everywhere, never, or on some workers.
        self.slot0 = {key: ("down" if (h[:, 0] == 0).all() else
                            "regular" if (h[:, 0] != 0).all() else "mixed")
                      for key, h in self.held.items()}

    def _forward(self, params, stats, images, train: bool):
        slots = None
        if not self.spec.backward and self.held:   # this worker's held blocks per stage
            my = sync.worker_index()
            slots = {k: jnp.asarray(h)[my] for k, h in self.held.items()}
        return vm.forward(self.cfg, params, stats, images.astype(self.dtype), train, slots,
                          self.slot0, self.remat and train, self.unroll)

    def loss(self, params, batch, stats):
        """``(loss nats, {"train_acc": fraction}, new BatchNorm statistics)`` of a worker's
        batch ``(images float32 [b, H, W, C], labels int32 [b])``."""
        images, labels = batch
        logits, new = self._forward(params, stats, images, True)
        acc = jnp.mean((jnp.argmax(logits, -1) == labels).astype(jnp.float32))
        return vm.cross_entropy(logits, labels), {"train_acc": acc}, new

    def init(self, seed: int):
        """The full model's ``(parameters, BatchNorm statistics)`` (``{}`` for Swin)."""
        m = vm.build(self.cfg, seed)
        return m.params(), m.batch_stats()


def vision_step(cfg: vm.VisionConfig, spec: spec_lib.SDPSpec, optim, mesh,
                options: StepOptions) -> step_lib.SDPStep:
    """The :class:`sdp_jax.step.SDPStep` of a vision run: AdamW (or SGD) from ``optim`` over
    ``options.total_steps``, with weight decay on conv / linear weights only, ``options``
    (:class:`sdp_jax.options.StepOptions`, clipping at ``options.grad_clip``), the BatchNorm
    statistics as model state (averaged over each layer's holders after every step), metrics
    ``train_acc`` and ``lr``; ``init_state(seed)`` from the model's initializer; the
    :class:`VisionModel` as the step's ``extras``. With ``fsdp`` the parameters, gradients and
    optimizer state are sharded over the workers (ZeRO-3; the whole model is gathered at the
    start of each step, see :class:`sdp_jax.step.SDPStep`); the BatchNorm statistics are not.
    With ``remat="full"`` and ``unroll`` the block scans are unrolled (the same results; XLA
    counts a loop body's FLOPs once, so the FLOP count needs it).

    Raises:
      ValueError: ``remat`` not ``none`` / ``full``; ``options`` without ``total_steps``; and
        everything :class:`SDPStep` refuses.
    """
    total = schedule_steps(options)
    options.check_for(spec, VISION_REMAT)
    task = VisionModel(cfg, spec, options.compute_dtype or jnp.float32,
                       options.remat == "full", options.unroll)
    hooks = ModelHooks(task.loss, init_fn=task.init, has_aux=True, state_spec=task.stats_spec,
                       stacked_slots=True, extras=task)
    # the model runs its own slots, checkpointed and unrolled inside it (no block runner)
    own = dataclasses.replace(options, remat="none", unroll=False)
    return step_lib.SDPStep(spec, hooks,
                            optim_lib.make_optimizer(optim, total, decay_mask=_decay), mesh,
                            own, optim_lib.lr_schedule(optim, total))


class VisionEval:
    """Full-model evaluation of a vision :class:`SDPStep` (:func:`vision_step`).

    Args:
      step: the step; its ``extras`` is the :class:`VisionModel`.
    """

    def __init__(self, step: step_lib.SDPStep):
        if not isinstance(step.extras, VisionModel):
            raise ValueError("VisionEval evaluates a step built by sdp_jax.train.families.vision_step.")
        self.step, self.task = step, step.extras
        self._fns: dict = {}
        self._stats_spec = jax.tree.map(lambda _: P(), self._full_stats_shapes())

    def _full_stats_shapes(self):
        return nnx.eval_shape(lambda: vm.build(self.task.cfg)).batch_stats()

    @property
    def recalibrate(self) -> bool:
        """Whether full-model evaluation should re-estimate BatchNorm statistics
        (:meth:`bn_stats_fn`): forward masking with some BatchNorm not held by every worker.
        The running statistics averaged over holders were measured inside subnetworks; the
        full model's activations differ (more blocks summed, more channels), so its BatchNorm
        layers need their own statistics, as slimmable networks re-estimate them per width (Yu
        et al. 2019, "Slimmable neural networks", Sec. 3.3). Measured on the digits default
        (B-SDP C = 1/2, 40 steps): test accuracy 0.26 with the averaged running statistics,
        0.69 with re-estimated ones."""
        sspec = self.task.stats_spec
        if self.step.spec.backward or not sspec.shapes:
            return False
        return any(not t.full for t in sspec.kinds.values())

    def _sspec(self):
        return self.step.state_specs.get("stats", {})

    def _gather(self, params, stats):
        full_p, full_s = self.step.gather(params, stats)
        return full_p, (full_s or {})

    def _logits(self, full_p, full_s, images, train=False):
        cast = jax.tree.map(lambda x: x.astype(self.task.dtype), full_p)
        return vm.forward(self.task.cfg, cast, full_s, images.astype(self.task.dtype), train)

    def bn_stats_fn(self):
        """Jitted ``(params, stats, images [W*b, H, W, C]) -> full-model BatchNorm statistics``
        (nested dict like the model's ``batch_stats``, replicated): each worker's batch mean and
        (biased) variance of every BatchNorm of the full model, averaged over workers. Average
        them over a few batches and pass them to ``eval_step_fn(recalibrated=True)``."""
        if "bn" not in self._fns:
            def local(params, stats, images):
                full_p, full_s = self._gather(params, stats)
                zeros = jax.tree.map(jnp.zeros_like, full_s)
                _, new = self._logits(full_p, zeros, images, train=True)
                # From zero running statistics one update leaves (1 - momentum) * batch stats.
                return jax.tree.map(lambda x: jax.lax.pmean(x / (1 - vm.BN_MOMENTUM), DATA),
                                    new)
            self._fns["bn"] = jax.jit(self.step.per_worker(
                local, (self.step.param_specs, self._sspec(), P(DATA)), self._stats_spec))
        return self._fns["bn"]

    def eval_step_fn(self, recalibrated: bool = False):
        """Jitted full-model evaluation ``(params, stats, images, labels, valid bool [N]
        [, full BatchNorm statistics]) -> (summed loss nats, correct count, example count)``
        over a batch sharded ``P('data')`` (``stats``: the state's, ``{}`` without BatchNorm):
        every block with every channel / neuron / head, BatchNorm in inference mode with the
        running statistics averaged over holders, or (``recalibrated``) with statistics from
        :meth:`bn_stats_fn` as the last argument."""
        if recalibrated not in self._fns:
            def local(params, stats, images, labels, valid, *recal):
                full_p, full_s = self._gather(params, stats)
                logits, _ = self._logits(full_p, recal[0] if recal else full_s, images)
                logz = jax.nn.logsumexp(logits, -1)
                nll = logz - jnp.take_along_axis(logits, labels[:, None], -1)[:, 0]
                right = (jnp.argmax(logits, -1) == labels) & valid
                return (jax.lax.psum(jnp.sum(jnp.where(valid, nll, 0.0)), DATA),
                        jax.lax.psum(jnp.sum(right), DATA),
                        jax.lax.psum(jnp.sum(valid), DATA))
            specs = (self.step.param_specs, self._sspec(), P(DATA), P(DATA), P(DATA))
            if recalibrated:
                specs += (self._stats_spec,)
            self._fns[recalibrated] = jax.jit(self.step.per_worker(local, specs,
                                                                   (P(), P(), P())))
        return self._fns[recalibrated]

    def full_model(self, state) -> tuple[dict, dict]:
        """(params, stats) of the full model as nested dicts of replicated arrays: each
        component the mean over its holders (equal to every holder's copy after a step)."""
        if "full" not in self._fns:
            pspec = jax.tree.map(lambda _: P(), spec_lib.unflatten(
                {p: 0 for p in self.step.spec.shapes}))
            # Every worker returns the same values; an FSDP all_gather is not typed invariant.
            self._fns["full"] = jax.jit(self.step.per_worker(
                self._gather, (self.step.param_specs, self._sspec()),
                (pspec, self._stats_spec), check_vma=not self.step.options.fsdp))
        return self._fns["full"](state["params"], state.get("stats", {}))


class VisionFamily(Family):
    """An image-classification run (ResNet-18, WRN-18, Swin-T) in :func:`sdp_jax.train.loop.train`:
    validation of the model and data fields, the stage-balanced spec, the data, the step, the
    full model's test accuracy and loss (BatchNorm statistics re-estimated when subnetworks
    trained them, :attr:`VisionEval.recalibrate`) and the summary fields."""

    kind = "vision"
    declared = (config_lib.VisionRun, vision_data.VisionDataConfig)
    remat = VISION_REMAT
    tensor_parallel = False   # (list-form slots of padded blocks: mesh.fsdp only)
    rate_key = "images_per_s"

    def template(self, config):
        return (config_lib.vision_config(config.model.name, config.data.get("dataset", "digits")),
                "sdp_jax.train.config.vision_config()")

    def model_config(self, config) -> vm.VisionConfig:
        ds = config.data.dataset
        if ds not in vision_data.DATASETS:
            raise ValueError(f"unknown data.dataset={ds!r}; choose one of "
                             f"{', '.join(vision_data.DATASETS)} (--config.data.dataset=...).")
        model_cfg, classes = dict(config.model), vision_data.CLASSES[ds]
        if model_cfg.get("num_classes", 0) in (0, None):
            model_cfg["num_classes"] = classes
        elif model_cfg["num_classes"] != classes:
            raise ValueError(f"model.num_classes={model_cfg['num_classes']} but {ds} has "
                             f"{classes} classes; set --config.model.num_classes=0 (= the "
                             "dataset's).")
        return vm.VisionConfig.from_config(model_cfg)

    def plan(self, config, model, workers, pipe) -> spec_lib.SDPSpec:
        s = config.sdp
        stage_blocks = tuple(s.stage_blocks or ())
        if stage_blocks and s.variant not in ("b-sdp", "bb-sdp"):
            raise ValueError(f"config.sdp.stage_blocks={stage_blocks} applies to block variants "
                             f"(b-sdp, bb-sdp), not {s.variant}; leave it empty.")
        return vision_spec(model, s.variant, workers, s.coverage, s.scheme, s.mask_seed,
                           s.allow_nonuniform, stage_blocks, s.allow_disconnected)

    def record(self, plan) -> dict:
        return vision_record(plan)

    def added_fields(self) -> dict:
        """:data:`sdp_jax.train.migrations.VISION_ADDED` (a copy)."""
        return copy.deepcopy(migrations.VISION_ADDED)

    def _train(self, run, seed, rows):
        """The :class:`sdp_jax.train.data.Stream` (``start -> iterator``) of this process's
        ``rows`` of the training batches."""
        m, data = run.model, run.config.data
        kw = dict(image_size=m.image_size, channels=m.in_channels,
                  global_batch=run.global_batch, seed=seed, rows=rows)
        return vision_data.train_stream(data, **kw)   # bad sizes fail here

    def data(self, run, rows, log, train: bool = True):
        """``(start -> train iterator, (test batches, BatchNorm batches))`` of this process's
        ``rows``; the BatchNorm batches (``start -> iterator``, another seed) re-estimate the
        full model's statistics."""
        m, config = run.model, run.config
        log(vision_data.describe(config.data))
        test = vision_data.make_eval_batches(
            config.data, image_size=m.image_size, channels=m.in_channels,
            global_batch=run.global_batch, rows=rows, limit=config.eval_limit)
        return (self._train(run, config.seed, rows),
                (test, self._train(run, config.seed + 7919, rows)))

    def step(self, run, mesh, unroll: bool = False) -> step_lib.SDPStep:
        """The run's step (:func:`vision_step`; ``unroll`` for FLOP counting)."""
        return vision_step(run.model, run.plan, run.optim, mesh,
                           dataclasses.replace(run.options, unroll=unroll))

    def batch_shapes(self, run):
        m, G = run.model, run.global_batch
        return (jax.ShapeDtypeStruct((G, m.image_size, m.image_size, m.in_channels),
                                     jnp.float32), jax.ShapeDtypeStruct((G,), jnp.int32))

    def items_per_step(self, run) -> int:
        return run.global_batch

    def model_flops_per_item(self, run) -> None:
        """No closed-form count for the vision models: no FLOPs/s or MFU is reported."""
        return None

    def compiled(self, run, compiled) -> tuple[list[str], dict]:
        """``model_flops_per_step``: XLA's FLOP count of the compiled train step (without
        activation checkpointing the vision step has no loop, so every layer is counted;
        backward variants count their full backward pass) times the devices of the ``W``
        workers (``RunSpec.worker_devices``: ``W x F``, or 1 when emulated); None under
        ``remat`` (a scan, whose body XLA counts once)."""
        return [], compiled_flops(compiled, run.worker_devices,
                                  run.options.flops_counted)

    def param_count(self, run) -> int:
        return vm.param_count(run.model)

    def evaluator(self, run, builder, eval_data, put, log):
        """``state -> {test_loss, test_acc}``: the full model on the test batches."""
        test_batches, bn_batches = eval_data
        evaluation = VisionEval(builder)
        eval_fn = evaluation.eval_step_fn()
        images, labels = self.batch_shapes(run)
        config = run.config
        recal = evaluation.recalibrate and config.eval_bn_batches > 0
        if evaluation.recalibrate and not recal:
            log("warning: --config.eval_bn_batches=0: the full model is evaluated with the "
                "running BatchNorm statistics of subnetworks, which do not describe it (expect "
                "a much lower test accuracy than with re-estimated statistics)")
        if recal:
            log(f"evaluation re-estimates the full model's BatchNorm statistics on "
                f"{config.eval_bn_batches} training batches (--config.eval_bn_batches; the "
                "running statistics of subnetworks do not describe the full model)")
            eval_fn = evaluation.eval_step_fn(recalibrated=True)
            bn_fn = evaluation.bn_stats_fn()

        def bn_stats(state):
            it, total = bn_batches(0), None
            for _ in range(config.eval_bn_batches):
                s = bn_fn(state["params"], state.get("stats", {}), put(next(it)[0], images))
                jax.block_until_ready(s)  # one collective program in flight (docs/design.md, CPU)
                total = s if total is None else jax.tree.map(jnp.add, total, s)
            return jax.tree.map(lambda a: a / config.eval_bn_batches, total)

        def evaluate(state):
            loss = right = count = 0.0
            extra = (bn_stats(state),) if recal else ()
            for x, y, valid in test_batches:
                a, b, c = eval_fn(state["params"], state.get("stats", {}), put(x, images),
                                  put(y, labels), put(valid, labels), *extra)
                loss, right, count = loss + float(a), right + float(b), count + float(c)
            return {"test_loss": loss / count, "test_acc": right / count}
        return evaluate

    def postfix(self, rec) -> dict:
        post = {"loss": f"{rec['train_loss']:.3f}", "acc": f"{rec['train_acc']:.3f}"}
        if "test_acc" in rec:
            post["test_acc"] = f"{rec['test_acc']:.4f}"
        return post

    def summary(self, run, step, last_eval, last_rec) -> dict:
        return {"model": run.model.name, "dataset": run.config.data.dataset,
                "images": step * run.global_batch, "final_test_acc": last_eval.get("test_acc"),
                "final_test_loss": last_eval.get("test_loss")}

    def done_line(self, s) -> str:
        return (f"final test accuracy {s['final_test_acc']:.4f} (loss "
                f"{s['final_test_loss']:.4f} nats)")
