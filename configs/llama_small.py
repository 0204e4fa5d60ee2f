"""The default CPU run: a small byte-level LLaMA on the Python standard library's sources.

8 simulated workers, B-SDP at coverage 1/2 (each worker holds 4 of the 8 blocks).
"""

from sdp_jax.train.config import base_config


def get_config():
    c = base_config()
    c.model.update(vocab_size=256, d_model=128, n_layers=8, n_heads=4, n_kv_heads=2, d_ff=384,
                   max_seq_len=256)
    c.sdp.variant = "b-sdp"
    c.sdp.coverage = 0.5
    c.workers = 8
    c.num_cpu_devices = 8
    c.seq_len = 128
    c.batch_per_worker = 8
    c.steps = 600
    c.eval_every = 200
    c.eval_batches = 8
    c.optim.lr = 3e-3
    c.optim.warmup_steps = 20
    return c
