"""Data: token arrays, windows and batches of a language model run, the documents they come from,
and the vision datasets.

The public face of the wing; ``sdp_jax.train.data.DataConfig``,
``sdp_jax.train.data.layout_free_batches`` as before. Its members, from the top:

* :mod:`sdp_jax.train.data.vision`: the image datasets (scikit-learn's digits, CIFAR-10/100
  through TFDS) and their batches through grain;
* :mod:`sdp_jax.train.data.tokens`: the ``data`` config section, token arrays, llm.c shards,
  windows, batches that do not depend on the worker count, and where a run is in its stream;
* :mod:`sdp_jax.train.data.corpus`: documents of text, JSONL, Parquet and tfds read through
  grain, and the tokenizers.
"""

from sdp_jax.train.data.tokens import (LLMC_FORMATS, LLMC_HEADER_BYTES, LLMC_HEADER_INTS,
                                       LLMC_MAGIC, LLMC_VERSION, SOURCES, Corpus, DataConfig,
                                       Origin, Stream, TokenWindowSource, byte_level, check,
                                       clear_cache, default_data_config, describe, document_corpus,
                                       first_example, iterate, layout_free_batches, load_tokens,
                                       make_train_iterator, make_val_batches, process_rows,
                                       read_llmc_shard, sharding_rows, split_tokens, token_parts,
                                       tokenize_pieces, tokenizer_of, train_dataset, train_stream,
                                       write_llmc_shard)

__all__ = ["SOURCES", "LLMC_MAGIC", "LLMC_VERSION", "LLMC_FORMATS", "LLMC_HEADER_INTS",
           "LLMC_HEADER_BYTES", "DataConfig", "default_data_config", "tokenizer_of", "byte_level",
           "check", "write_llmc_shard", "read_llmc_shard", "Corpus", "document_corpus",
           "split_tokens", "token_parts", "tokenize_pieces", "clear_cache", "load_tokens",
           "TokenWindowSource", "process_rows", "sharding_rows", "iterate", "Origin",
           "first_example", "layout_free_batches", "train_dataset", "make_train_iterator", "Stream",
           "train_stream", "make_val_batches", "describe"]
