"""sdp_jax: Subnetwork Data Parallelism (Singh et al., arXiv 2507.09029) in JAX and Flax NNX.

Modules: ``masks`` (host-side mask matrices, numpy only), ``spec`` (a model's declared component
rules -> masks, mask pytrees and tables; built-in models and your own go through it),
``layout`` (full and compact parameters), ``sync`` (masked-mean collectives inside
``jax.shard_map``, tree-level ``average`` and holder-correct clipping), ``step`` (the SDP step of
any model from a spec, a loss and an optax optimizer), ``train_step`` (the LLaMA step with FSDP,
activation checkpointing and bf16), ``loop`` (the one resumable training loop), ``trainer``
(language-model runs), ``data`` (grain pipelines), ``checkpoint`` (orbax), ``bench`` (compiled
memory and FLOPs), ``tasks`` (the model families' hooks for the step), ``models.llama``;
``models.vision``, ``vision_data``, ``vision_trainer`` (ResNet-18, WideResNet-18, Swin-T); ``pipeline`` (the ``stage`` mesh axis,
GPipe, compressed boundaries), ``stiefel`` (the Stiefel-manifold optax transform of MAPL),
``study`` (validation loss against boundary bytes), ``comm`` (collective bytes of a compiled
program).
"""

__version__ = "0.1.0"
