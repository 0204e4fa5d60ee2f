"""sdp_jax: Subnetwork Data Parallelism (Singh et al., arXiv 2507.09029) in JAX and Flax NNX.

Modules: ``masks`` (host-side mask matrices, numpy only), ``spec`` (a model's declared component
rules -> masks, mask pytrees and tables; built-in models and your own go through it),
``layout`` (full and compact parameters), ``sync`` (masked-mean collectives inside
``jax.shard_map``, tree-level ``average`` and holder-correct clipping), ``step`` (the one SDP
step of any model from a spec, a loss and an optax optimizer: FSDP, activation checkpointing,
bf16, periodic averaging, the pipeline ``stage`` axis), ``train_step`` (optimizer, schedule, the
LLaMA spec, compiled-program figures), ``tasks`` (the model families: their hooks for the step
and for the loop), ``config`` (the one run-config schema and its one validation place,
``resolve``), ``loop`` (the one resumable training loop), ``cli`` (the config loader of
``train.py``, ``bench`` and ``study``), ``data`` and ``vision_data`` (grain pipelines),
``checkpoint`` (orbax), ``models.llama``, ``models.vision`` (ResNet-18, WideResNet-18, Swin-T),
``pipeline`` (GPipe and 1F1B with compressed boundaries), ``stiefel`` (the Stiefel-manifold optax
transform of MAPL), ``bench`` (compiled memory and FLOPs), ``study`` (validation loss against
boundary bytes), ``comm`` (collective bytes of a compiled program).
"""

__version__ = "0.1.0"
