"""The FLOP-matched DDP / B-SDP pair of the device bench (``python -m sdp_jax.bench.device``,
docs/benchmarks.md): the SDP study's byte-level LLaMA (``configs/llama_study.py``: 8 blocks,
8 heads) at 60 times its parameters, 27.5 M: d_model=512, SwiGLU width 1536, 256-token
sequences; 8 workers emulated on one device (``emulate_workers``), so that it runs on one GPU
(or one CPU device); the default corpus.

    python train.py --config configs/llama_27m.py --config.sdp.variant=b-sdp \\
        --config.sdp.coverage=0.5 --config.flop_matched=True --config.dtype=bfloat16
"""

from sdp_jax.train.config import base_config


def get_config():
    c = base_config()
    c.model.update(vocab_size=256, d_model=512, n_layers=8, n_heads=8, n_kv_heads=8, d_ff=1536,
                   max_seq_len=256)
    c.sdp.variant = "ddp"
    c.sdp.coverage = 1.0
    c.workers = 8
    c.emulate_workers = True
    c.num_cpu_devices = 1
    c.seq_len = 256
    c.batch_per_worker = 8
    c.steps = 1000
    c.eval_every = 250
    c.eval_batches = 16
    c.log_every = 50
    c.checkpoint_every = 0
    c.optim.lr = 1e-3
    c.optim.warmup_steps = 100
    return c
