"""sdp_jax: Subnetwork Data Parallelism (Singh et al., arXiv 2507.09029) in JAX and Flax NNX.

Modules: ``masks`` (host-side mask matrices, numpy only), ``plan`` (which parameters each
variant masks), ``sync`` (masked-mean collectives inside ``jax.shard_map``), ``train_step``
(the jitted step for ddp / b-sdp / n-sdp / bb-sdp / nb-sdp), ``trainer`` (the resumable loop),
``data`` (grain pipelines), ``checkpoint`` (orbax), ``bench`` (compiled memory and FLOPs),
``models.llama``; ``models.vision``, ``vision_step``, ``vision_data``, ``vision_trainer``
(ResNet-18, WideResNet-18, Swin-T); ``pipeline`` (the ``stage`` mesh axis, GPipe, compressed
boundaries), ``stiefel`` (the Stiefel-manifold optax transform of MAPL), ``study`` (validation
loss against boundary bytes), ``comm`` (collective bytes of a compiled program).
"""

__version__ = "0.1.0"
