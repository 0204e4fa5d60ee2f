"""Default run configuration (``ml_collections.ConfigDict``) shared by the files in ``configs/``.

Every field can be overridden on the command line: ``--config.sdp.coverage=0.5``.
"""

from __future__ import annotations

import ml_collections

from sdp_jax import data


def base_config() -> ml_collections.ConfigDict:
    """Fields common to every run; the ``configs/*.py`` files set the model shape on top.

    Sections: ``model`` (:class:`sdp_jax.models.llama.LlamaConfig` fields), ``data``
    (:func:`sdp_jax.data.default_data_config`), ``sdp`` (variant and mask recipe), ``optim``
    (:class:`sdp_jax.train_step.OptimConfig` fields), and run control at the top level.
    """
    c = ml_collections.ConfigDict()
    c.model = ml_collections.ConfigDict(dict(
        name="llama", vocab_size=256, d_model=128, n_layers=4, n_heads=4, n_kv_heads=4, d_ff=384,
        max_seq_len=256, tie_embeddings=False, rope_theta=10000.0, norm_eps=1e-5, init_std=0.02))
    c.data = data.default_data_config()
    c.sdp = ml_collections.ConfigDict(dict(
        variant="ddp",            # ddp | b-sdp
        coverage=1.0,             # C: fraction of blocks each worker holds (ignored for ddp)
        scheme="cyclic",          # cyclic | random
        mask_seed=0,              # seed of the random scheme
        allow_nonuniform=False,   # accept W*C not whole (near-uniform multiplicities)
        allow_disconnected=False, # accept a mask graph with spectral gap 0
        averaging="auto",         # auto | blockwise | reference (see sdp_jax.sync)
    ))
    c.optim = ml_collections.ConfigDict(dict(
        lr=3e-3, min_lr_ratio=0.1, warmup_steps=20, weight_decay=0.1, b1=0.9, b2=0.95, eps=1e-8,
        grad_clip=1.0))
    c.workers = 0               # W data-parallel workers; 0 = every device
    c.num_cpu_devices = 8       # simulated devices when only a CPU is present
    c.seq_len = 128             # tokens per sequence (T)
    c.batch_per_worker = 8      # sequences per worker per step (b); global batch = W * b
    c.steps = 300               # optimizer steps (the DDP budget when flop_matched)
    c.flop_matched = False      # SDP runs ceil(steps / C) steps (the paper's FLOP-matched budget)
    c.eval_every = 100          # steps between full-model validations (and at the end)
    c.eval_batches = 8          # validation batches of W * b sequences
    c.log_every = 10            # steps between progress updates
    c.checkpoint_every = 100    # steps between checkpoints (and at the end); 0 = only at the end
    c.keep_checkpoints = 2
    c.stop_at_step = 0          # stop (as if preempted) once this step is reached; 0 = off
    c.seed = 0
    return c
