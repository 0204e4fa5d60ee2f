"""LLaMA 500m (the paper's scale) for the memory benchmark and real-scale runs.

d_model=1536, 16 blocks, 12 heads (head dim 128), SwiGLU width 4096, vocab 32000 (the LLaMA
tokenizer's size; for llm.c GPT-2 shards set --config.model.vocab_size=50304), tied embeddings:
True. Parameter counts are in docs/models.md (LlamaConfig.param_count()).
"""

from sdp_jax.train.config import paper_scale_config


def get_config():
    return paper_scale_config(d_model=1536, n_layers=16, n_heads=12, d_ff=4096, coverage=0.5,
                              tie_embeddings=True)
