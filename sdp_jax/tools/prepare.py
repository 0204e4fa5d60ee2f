"""Tokenize a corpus once: write it as llm.c token shards, after training a byte-level BPE
tokenizer on it if asked.

    python -m sdp_jax.tools.prepare --config.data.source=parquet \\
        --config.data.train_files='corpus/*.parquet' --train_tokenizer --vocab_size=8192 \\
        --out=data/corpus_bpe8k
    python -m sdp_jax.tools.prepare --config.data.source=jsonl \\
        --config.data.train_files='docs/*.jsonl' --config.data.tokenizer=llama/tokenizer.json \\
        --out=data/docs_llama

The documents, the train/validation split and the tokenizer are the run's own: the data section
of ``--config`` (default ``configs/llama_small.py``) with any ``--config.data.FIELD=VALUE``
override (:mod:`sdp_jax.train.data`, :mod:`sdp_jax.train.data.corpus`), so a run on the shards
reads the tokens a run on the documents would tokenize at every start. ``--train_tokenizer``
first trains a byte-level BPE of ``--vocab_size`` tokens on the training split and uses it.

Writes into ``--out`` (which must not hold shards or a tokenizer already): ``train_000000.bin``,
... and ``val_000000.bin``, ... of at most ``--shard_tokens`` tokens each (llm.c version 1,
uint16 tokens, when the vocabulary has at most 65,536 tokens; version 7, uint32, otherwise),
``tokenizer.json`` (trained, or a copy of ``data.tokenizer``) and ``prepare.json`` (the
counts). Each shard is written under a temporary name and renamed when complete. A progress bar
counts the pieces read (files, Parquet row groups, 8 MiB of JSONL); the last lines give the
flags of a run on the shards.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any

import numpy as np
import tqdm
from absl import flags

from sdp_jax.train import cli, loop
from sdp_jax.train.data import corpus
from sdp_jax.train.data import tokens as data_lib

PROG = "python -m sdp_jax.tools.prepare"
SHARD_PATTERN = "{split}_{index:06d}.bin"


def _define(argv) -> flags.FlagValues:
    fv = cli.flag_values(cli.config_file("llama_small.py"), argv, PROG)
    flags.DEFINE_string("out", None, "folder the shards and tokenizer.json are written to",
                        flag_values=fv)
    flags.DEFINE_integer("shard_tokens", 100_000_000, "tokens per shard at most",
                         flag_values=fv)
    flags.DEFINE_bool("train_tokenizer", False, "train a byte-level BPE of --vocab_size tokens "
                      "on the training split first, and tokenize with it", flag_values=fv)
    flags.DEFINE_integer("vocab_size", 0, "the trained tokenizer's vocabulary (at most; a small "
                         "corpus may give fewer), with --train_tokenizer", flag_values=fv)
    flags.DEFINE_integer("tokenizer_documents", 0, "train the tokenizer on the first this many "
                         "documents (0 = all)", flag_values=fv)
    return fv


def _check(fv) -> None:
    """Every flag mistake, in one line, before anything is read."""
    if not fv.out:
        cli.error(PROG, "give --out=DIR, the folder the shards are written to")
    if fv.shard_tokens < 1024:
        cli.error(PROG, f"--shard_tokens={fv.shard_tokens}: give at least 1024 tokens per shard")
    if fv.train_tokenizer and fv.config.data.tokenizer:
        cli.error(PROG, f"--train_tokenizer trains a new tokenizer, but data.tokenizer="
                  f"{fv.config.data.tokenizer!r} names one; give one of the two")
    if not fv.train_tokenizer and (fv["vocab_size"].present or fv.tokenizer_documents):
        cli.error(PROG, "--vocab_size and --tokenizer_documents are for --train_tokenizer")
    if fv.train_tokenizer and fv.vocab_size < corpus.VOCAB_BYTES + 1:
        cli.error(PROG, f"--train_tokenizer needs --vocab_size=N, the tokens of the BPE, at "
                  f"least {corpus.VOCAB_BYTES + 1} (the 256 bytes and <|endoftext|>), e.g. "
                  f"--vocab_size=8192; got {fv.vocab_size}")
    if fv.tokenizer_documents < 0:
        cli.error(PROG, "--tokenizer_documents must be >= 0")
    if os.path.isdir(fv.out):
        taken = sorted(n for n in os.listdir(fv.out) if _ours(n))
        if taken:
            cli.error(PROG, f"--out={fv.out!r} already holds {', '.join(taken[:3])}"
                      f"{' ...' if len(taken) > 3 else ''}; choose another --out")


def _ours(name: str) -> bool:
    """Whether a file name is one this command writes (shards, their temporary files, the
    tokenizer, prepare.json)."""
    return name in ("tokenizer.json", "prepare.json") or name.endswith(".tmp") or (
        name.endswith(".bin") and name.split("_")[0] in ("train", "val"))


def _remove_written(out: str, before: set) -> None:
    """Remove the files of ours in ``out`` that were not there at the start (a run that
    fails leaves the folder as it found it; :func:`_check` refused a folder holding any)."""
    for name in set(os.listdir(out)) - before:
        if _ours(name):
            os.remove(os.path.join(out, name))


class ShardWriter:
    """Writes a stream of token arrays as llm.c shards ``OUT/{split}_{index:06d}.bin`` of at
    most ``shard_tokens`` tokens (:func:`sdp_jax.train.data.write_llmc_shard`, ``version``),
    each under a temporary name renamed when complete."""

    def __init__(self, out: str, split: str, shard_tokens: int, version: int):
        self.out, self.split, self.limit, self.version = out, split, shard_tokens, version
        self.parts: list[np.ndarray] = []
        self.held = 0
        self.paths: list[str] = []
        self.tokens = 0

    def add(self, tokens: np.ndarray) -> None:
        """Queue tokens; full shards are written."""
        self.parts.append(tokens)
        self.held += tokens.size
        while self.held >= self.limit:
            whole = np.concatenate(self.parts)
            self._write(whole[:self.limit])
            rest = whole[self.limit:]
            self.parts, self.held = ([rest] if rest.size else []), rest.size

    def close(self) -> list[str]:
        """Write what is left; returns the shard paths."""
        if self.held or not self.paths:
            self._write(np.concatenate(self.parts) if self.parts else np.zeros(0, np.uint16))
        return self.paths

    def _write(self, tokens: np.ndarray) -> None:
        path = os.path.join(self.out, SHARD_PATTERN.format(split=self.split,
                                                           index=len(self.paths)))
        tmp = f"{path}.{os.getpid()}.tmp"
        data_lib.write_llmc_shard(tmp, tokens, version=self.version)
        os.replace(tmp, path)
        self.paths.append(path)
        self.tokens += tokens.size


def write_shards(c: data_lib.Corpus, out: str, shard_tokens: int,
                 val_fraction: float) -> dict[str, Any]:
    """Tokenizes the corpus ``c`` (:func:`sdp_jax.train.data.document_corpus`) into llm.c shards
    in ``out``: version 1 (uint16) when the tokenizer has at most 65,536 tokens, else 7
    (uint32). A corpus of one file is tokenized whole and split by
    :func:`sdp_jax.train.data.split_tokens` (``val_fraction``), as a run splits it.

    Returns:
      ``{"train": [paths], "val": [paths], "train_tokens": int, "val_tokens": int,
      "version": 1 | 7}``."""
    version = 1 if c.tokenizer.vocab_size <= 65536 else 7
    writers = {s: ShardWriter(out, s, shard_tokens, version) for s in ("train", "val")}
    total = len(c.train) + len(c.val or [])
    with tqdm.tqdm(total=total, desc="tokenizing", unit="piece") as bar:
        if c.val is None:
            whole = np.concatenate([np.zeros(0, c.tokenizer.dtype)]
                                   + list(data_lib.token_parts(c.train, c, bar)))
            for split, tokens in zip(("train", "val"), data_lib.split_tokens(whole, val_fraction)):
                writers[split].add(tokens)
        else:
            for split in ("train", "val"):
                for part in data_lib.token_parts(getattr(c, split), c, bar):
                    writers[split].add(part)
    paths = {s: w.close() for s, w in writers.items()}
    return {**paths, "train_tokens": writers["train"].tokens,
            "val_tokens": writers["val"].tokens, "version": version}


def _with_tokenizer(fv, c: data_lib.Corpus) -> data_lib.Corpus:
    """``c`` with the tokenizer the shards are written with: a BPE trained now
    (``--train_tokenizer``) or the config's, written (copied) to ``OUT/tokenizer.json``.

    Raises:
      ValueError: the tokenizer's training refused (:func:`sdp_jax.train.data.corpus.train_bpe`)."""
    out = os.path.join(fv.out, "tokenizer.json")
    if fv.train_tokenizer:
        print(f"training a byte-level BPE of {fv.vocab_size:,} tokens on {len(c.train)} train "
              "pieces", flush=True)
        tok = corpus.train_bpe(corpus.Documents(c.train, c.field), fv.vocab_size, out,
                               max_documents=fv.tokenizer_documents)
        if tok.vocab_size < fv.vocab_size:
            print(f"the corpus gave {tok.vocab_size:,} tokens: no pair of tokens was left to "
                  f"merge before {fv.vocab_size:,}", flush=True)
        return c._replace(tokenizer=tok)
    if c.tokenizer.name != "bytes":
        tmp = f"{out}.{os.getpid()}.tmp"
        shutil.copyfile(c.tokenizer.path, tmp)
        os.replace(tmp, out)
    return c


def main(argv=None) -> dict:
    """The command line; returns what ``prepare.json`` holds."""
    argv = [PROG] + (sys.argv[1:] if argv is None else list(argv))
    fv = cli.command_flags(_define, argv, PROG, __doc__, "--out=data/shards")
    _check(fv)
    config = fv.config
    try:
        c = data_lib.document_corpus(config.data)
    except (ValueError, ImportError) as e:
        cli.error(PROG, str(e))
    made = not os.path.isdir(fv.out)
    os.makedirs(fv.out, exist_ok=True)
    before = set(os.listdir(fv.out))
    try:
        c = _with_tokenizer(fv, c)
        done = write_shards(c, fv.out, fv.shard_tokens, float(config.data.val_fraction))
    except (ValueError, KeyboardInterrupt) as e:
        _remove_written(fv.out, before)
        if made and not os.listdir(fv.out):
            os.rmdir(fv.out)
        if isinstance(e, KeyboardInterrupt):
            cli.exit_on_signal(2, f"stopped; the files it had written in {fv.out} are removed")
        cli.error(PROG, f"{e} (the files it had written in {fv.out} are removed)")
    done.update(tokenizer=c.tokenizer.name, vocab_size=c.tokenizer.vocab_size,
                eot_token=getattr(c.tokenizer, "eot_token", "\n"),
                source=str(config.data.source))
    loop.write_atomically(os.path.join(fv.out, "prepare.json"), json.dumps(done, indent=1))
    tokenizer_out = os.path.join(fv.out, "tokenizer.json")
    print(f"wrote {len(done['train'])} train and {len(done['val'])} val shards "
          f"(llm.c version {done['version']}): {done['train_tokens']:,} train and "
          f"{done['val_tokens']:,} val tokens in {fv.out}")
    tok_flag = (f" --config.data.tokenizer={tokenizer_out}" if c.tokenizer.name != "bytes"
                else "")
    print(f"train on them with: --config.data.source=llmc "
          f"--config.data.train_files='{os.path.join(fv.out, 'train_*.bin')}' "
          f"--config.data.val_files='{os.path.join(fv.out, 'val_*.bin')}'{tok_flag} "
          f"--config.model.vocab_size={max(c.tokenizer.vocab_size, 256)}")
    return done


if __name__ == "__main__":
    main()
