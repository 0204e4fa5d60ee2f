"""MAPL study run: the default byte-level LLaMA (d = 128, 8 blocks) split into 2 pipeline stages.

2 data-parallel workers x 2 stages (4 simulated devices on a CPU), DDP on ``data``, GPipe with 4
microbatches; the boundary method and ratio are set per run by ``python -m sdp_jax.study``.
"""

from sdp_jax.train.config import base_config


def get_config():
    c = base_config()
    c.model.update(vocab_size=256, d_model=128, n_layers=8, n_heads=4, n_kv_heads=2, d_ff=384,
                   max_seq_len=256)
    c.pipeline.update(stages=2, microbatches=4, method="mapl", ratio=4, anchor_rank=16)
    c.workers = 2
    c.num_cpu_devices = 4
    c.seq_len = 128
    c.batch_per_worker = 8
    c.steps = 600
    c.eval_every = 200
    c.eval_batches = 8
    c.checkpoint_every = 200
    c.optim.lr = 3e-3
    c.optim.warmup_steps = 20
    return c
