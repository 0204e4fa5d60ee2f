"""Plain ``jax.jit`` data parallelism of the built-in LLaMA: the baseline users compare with.

This is the program a JAX user writes without this project (as in the flax examples or
MaxText's DDP setting): one ``jax.jit`` of the whole train step, the global batch sharded over
the mesh axis ``data`` (``P('data')``), parameters and optimizer state replicated, and XLA's
SPMD partitioner inserting the gradient all-reduce. The model, its loss
(:meth:`sdp_jax.train.families.LanguageModel.loss`), the optimizer
(:func:`sdp_jax.train.optimizer.make_optimizer`), the clipped update
(:func:`sdp_jax.step.update.clipped_update`), mixed precision and activation checkpointing are the
SDP step's, so in float32 the only difference from :class:`sdp_jax.step.SDPStep`'s DDP is the
formulation: ``jax.jit`` with shardings against ``jax.shard_map`` with explicit collectives
(``tests/test_bench.py`` checks that both take the same steps). In bfloat16 one more difference is
jit's own: the partitioner all-reduces each weight gradient where the bf16 matmul produces it, in
bf16, where the SDP step averages in float32 (XLA:CPU widens bf16 collectives to float32, so CPU
byte counts do not show it).
``python -m sdp_jax.bench --reference`` compiles and times it beside the variants.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sdp_jax.mesh import DATA
from sdp_jax.models.llama import BLOCK_KEY, LlamaConfig
from sdp_jax.options import StepOptions
from sdp_jax.step import runner, update
from sdp_jax.step import sdp_step as step_lib
from sdp_jax.step import state as state_lib
from sdp_jax.train import families
from sdp_jax.train import optimizer as optim_lib

LABEL = "jit-ddp"


class JitDDP:
    """The plain-jit DDP train step of a LLaMA config (see the module docstring).

    Args:
      cfg: the model.
      optim: optimizer settings (AdamW or SGD, warm-up + cosine over ``options.total_steps``).
      mesh: a mesh whose axis ``data`` has the ``W`` devices (other axes unused).
      options: the SDP step's :class:`sdp_jax.options.StepOptions`, of which this step reads
        ``total_steps`` (the schedule's length), ``remat`` (activation checkpointing of each
        block), ``dtype`` (compute dtype; parameters and optimizer state stay float32, as in
        the SDP step; see the module docstring on bf16 gradients), ``grad_clip`` and
        ``unroll`` (the block scan unrolled: XLA's cost analysis counts a loop body once).

    Raises:
      ValueError: ``options`` without ``total_steps``.
    """

    def __init__(self, cfg: LlamaConfig, optim: optim_lib.OptimConfig, mesh,
                 options: StepOptions):
        if options.total_steps is None:
            raise ValueError("JitDDP needs StepOptions(total_steps=...), the schedule's length.")
        self.cfg, self.remat, self.unroll = cfg, options.remat, options.unroll
        # The same devices with automatic (GSPMD) sharding propagation, as plain-jit programs
        # are written: no sharding in the types (jax.make_mesh's default axis type is Explicit).
        self.mesh = Mesh(mesh.devices, mesh.axis_names,
                         axis_types=(AxisType.Auto,) * len(mesh.axis_names))
        self.dtype = options.compute_dtype
        self.grad_clip = options.grad_clip
        self.model = families.LanguageModel(cfg)
        self.optimizer = optim_lib.make_optimizer(optim, options.total_steps)
        self.compact_shapes = self.model.shapes   # (every device holds every parameter)
        self._step = None

    @property
    def workers(self) -> int:
        return self.mesh.shape[DATA]

    def batch_sharding(self) -> NamedSharding:
        """Rows of the global batch split over ``data``."""
        return step_lib.batch_sharding(self.mesh)

    def _replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def shardings(self) -> dict:
        """The train state's shardings: every leaf replicated."""
        opt = jax.eval_shape(self.optimizer.init, self.model.shapes)
        return jax.tree.map(lambda _: self._replicated(),
                            {"params": self.model.shapes, "opt_state": opt, "step": 0})

    def per_device_param_count(self) -> int:
        """Every parameter on every device (replicated)."""
        return sum(x.size for x in jax.tree.leaves(self.model.shapes))

    def init_state(self, seed: int) -> dict:
        """``{params, opt_state, step}``, replicated on the mesh (float32)."""
        params = self.model.init(seed)
        state = {"params": params, "opt_state": self.optimizer.init(params),
                 "step": jnp.zeros((), jnp.int32)}
        return jax.device_put(state, self._replicated())

    def loss(self, params: dict, tokens: jax.Array) -> jax.Array:
        """Mean next-token loss (nats/token, float32) of the global batch ``tokens`` int32
        ``[W b, T + 1]``, computed in the compute dtype."""
        p = jax.tree.map(lambda x: runner.cast_floating(x, self.dtype), params)
        run = runner.scan_runner(lambda h, block: (self.model.block(block, h), None),
                                   p[BLOCK_KEY], train=True, remat=self.remat,
                                   unroll=self.unroll)
        return self.model.loss(p, tokens, run)

    def _train_step(self, state, tokens):
        loss, grads = jax.value_and_grad(self.loss)(state["params"], tokens)
        norm = optax.global_norm(grads)
        params, opt_state = update.clipped_update(self.optimizer, grads, norm, self.grad_clip,
                                                    state["opt_state"], state["params"])
        new = {"params": params, "opt_state": opt_state, "step": state["step"] + 1}
        return new, {"train_loss": loss, "grad_norm": norm}

    def train_step_fn(self):
        """Jitted ``(state, tokens) -> (state, metrics)`` (``state`` donated); ``tokens`` int32
        ``[W b, T + 1]`` sharded ``P('data')``; metrics ``train_loss`` and ``grad_norm``
        (float32 scalars)."""
        if self._step is None:
            rep = self._replicated()
            self._step = jax.jit(self._train_step, in_shardings=(rep, self.batch_sharding()),
                                 out_shardings=(rep, rep), donate_argnums=0)
        return self._step

    def skips_unheld(self) -> bool:
        """False: every worker computes every block (the question
        :meth:`sdp_jax.step.SDPStep.skips_unheld` answers for an SDP step, asked by the
        bench's FLOP count)."""
        return False

    def compiled_train_step(self, batch: jax.ShapeDtypeStruct):
        """The step compiled for abstract inputs (nothing materialized): ``batch`` the global
        batch's shape, int32 ``[W b, T + 1]``."""
        state = state_lib.abstract_state(self.optimizer, {"params": self.model.shapes},
                                         self.model.shapes, self.shardings())
        tokens = jax.ShapeDtypeStruct(batch.shape, batch.dtype, sharding=self.batch_sharding())
        return self.train_step_fn().lower(state, tokens).compile()
