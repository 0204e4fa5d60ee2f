"""Input pipeline of the language models: token arrays, llm.c token shards, and the windows and
batches served through grain.

Sources (``data_cfg.source``):

``stdlib`` (default, needs no download), ``text``, ``jsonl``, ``parquet``, ``tfds``
    Documents (:mod:`sdp_jax.train.data.corpus`: the standard library's ``*.py`` files; text files,
    JSON Lines or Parquet files named by ``train_files``; a TensorFlow Datasets text dataset)
    turned into tokens by ``data.tokenizer``: bytes (vocab 256, the default) or a Hugging Face
    ``tokenizer.json``, documents joined by the tokenizer's end-of-text token. A split is
    tokenized once per process at load; ``python -m sdp_jax.tools.prepare`` writes the same
    tokens as llm.c shards for corpora too large to tokenize at every start.
``llmc``
    Pre-tokenized llm.c shards (the format FineWeb is commonly distributed in): a
    header of 256 little-endian int32 (``[0]`` magic, ``[1]`` version, ``[2]`` token
    count), then ``count`` little-endian tokens: uint16 for magic 20240520 version 1,
    uint32 for magic 20240801 version 7 (vocabularies past 65,535). Shards are
    memory-mapped and never read whole. ``data.tokenizer`` may name the tokenizer that wrote
    them, for the tools that decode text (``generate``, the harness).

Model inputs are windows of ``seq_len + 1`` tokens taken with stride ``seq_len``
(so consecutive windows share one token: the last target of window i is the
first input of window i+1); windows never straddle two llm.c shards (the few
tokens at a shard's end that do not fill a window are skipped).

Train/validation split (the same on every host, no randomness):

* ``stdlib``, ``text``, ``jsonl`` and ``parquet`` without ``val_files``: by file, with
  ``zlib.crc32(relative POSIX path) % 10_000 < val_fraction * 10_000`` -> val
  (see :func:`sdp_jax.train.data.corpus.split_by_file`). A glob that matches exactly one file is
  split by tokens instead: the last ``ceil(val_fraction * n_tokens)`` tokens are val.
* ``llmc``: ``val_files`` if given; otherwise the last (sorted) train shard is
  held out when there are at least two, else ``ValueError``.
* ``tfds``: the named splits ``tfds_train_split`` / ``tfds_val_split`` (tfds
  slicing syntax such as ``'train[:95%]'`` / ``'train[95%:]'`` works).

Token-range check: every split is checked once at load (in-memory tokens by their maximum;
every llm.c shard by a chunked ``max`` over the memmap, cached per path, size and mtime;
about 0.1 s per 100 M tokens from the page cache), so a token id >= ``vocab_size`` stops the
run before any compute; windows are checked again when read (cheap, defensive).

Loaded token arrays are cached per process (keyed by the data config values
that determine them), so train and val, the iterator and :func:`describe` read
the corpus once. :func:`clear_cache` drops the cache.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
import os
import sys
from typing import Any, Iterator, NamedTuple, Sequence

import grain
import ml_collections
import numpy as np
import tqdm

from sdp_jax import fields
from sdp_jax.fields import setting
from sdp_jax.train.data import corpus

SOURCES = corpus.DOCUMENT_SOURCES[:4] + ("llmc",) + corpus.DOCUMENT_SOURCES[4:]

LLMC_MAGIC = 20240520
LLMC_VERSION = 1
LLMC_FORMATS = {(20240520, 1): "<u2", (20240801, 7): "<u4"}
"""llm.c shard formats, ``(magic, version) -> token dtype``: GPT-2-style uint16 shards and the
uint32 shards llm.c writes for vocabularies past 65,535 (LLaMA 3)."""
LLMC_HEADER_INTS = 256
LLMC_HEADER_BYTES = LLMC_HEADER_INTS * 4

_SPLITS = ("train", "val")
_FILE_SOURCES = ("text", "jsonl", "parquet", "llmc")


# ----------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The ``data`` section of a language-model run, each field declared once
    (:func:`sdp_jax.fields.setting`; docs/configuration.md lists them).

    Raises:
      ValueError: a field of the wrong type, an unknown source, ``val_fraction`` outside
        [0, 1), a negative ``worker_count`` (naming ``config.data.FIELD``)."""

    SECTION = "data"

    source: str = setting("stdlib", "stdlib (the Python standard library's sources), text, "
                          "jsonl, parquet, llmc (token shards) or tfds (docs/data.md)",
                          choices=SOURCES)
    train_files: str = setting("", "comma-separated glob patterns (~ expanded, ** recursive) of "
                               "the text, jsonl, parquet and llmc sources")
    val_files: str = setting("", "the same for validation; '' = the files split by "
                             "val_fraction")
    val_fraction: float = setting(0.05, "fraction of the files (of the tokens, for a single "
                                  "file) held out for validation", low=0, high=1,
                                  open_high=True)
    tokenizer: str = setting("", "a Hugging Face tokenizer.json (or its folder) for the "
                             "document sources; '' = UTF-8 bytes, vocab 256")
    eot_token: str = setting("", "the token appended after every document ('' = the "
                             "tokenizer's usual end-of-text token; bytes end documents with a "
                             "newline)")
    text_field: str = setting("text", "the JSONL field or Parquet column of a document's text")
    tfds_name: str = setting("", "tfds: a TensorFlow Datasets text dataset")
    tfds_train_split: str = setting("train", "tfds: its training split")
    tfds_val_split: str = setting("validation", "tfds: its validation split")
    tfds_text_key: str = setting("text", "tfds: the feature that holds the text")
    tfds_data_dir: str = setting("", "TFDS' data folder ('' = its default, "
                                 "~/tensorflow_datasets)")
    worker_count: int = setting(0, "grain worker processes that load batches (0 = in the "
                                "training process); the batches do not depend on it", low=0,
                                    control=True)

    def __post_init__(self):
        fields.check_settings(self)


def default_data_config() -> ml_collections.ConfigDict:
    """The ``data`` section with its defaults (:class:`DataConfig`)."""
    return ml_collections.ConfigDict(dataclasses.asdict(DataConfig()))


def _cfg_get(cfg: Any, name: str) -> Any:
    defaults = default_data_config()
    try:
        return cfg[name]
    except (KeyError, AttributeError, TypeError):
        return getattr(cfg, name, defaults[name])


class _Key(NamedTuple):
    """The config values that determine a corpus's token arrays (hashable)."""

    source: str
    train_files: str = ""
    val_files: str = ""
    val_fraction: float = 0.0
    field: str = ""
    tokenizer: tuple = ()     # (tokenizer.json, eot_token, size, mtime) or () for bytes
    tfds: tuple = ()          # (name, train split, val split, data_dir)


def _cache_key(cfg: Any) -> _Key:
    """Validates the data config's fields (one-line errors naming the field and the fix) and
    returns what determines its token arrays."""
    get = functools.partial(_cfg_get, cfg)
    DataConfig(**{f.name: get(f.name) for f in dataclasses.fields(DataConfig)})   # the rules
    source, val_fraction = str(get("source")), float(get("val_fraction"))
    for field in ("train_files", "val_files"):
        if str(get(field)).strip() and source not in _FILE_SOURCES:
            raise ValueError(
                f"data.{field}={get(field)!r} is set but data.source={source!r} does not read "
                f"files; set --config.data.source to one of {', '.join(_FILE_SOURCES)}")
    if str(get("tfds_name")) and source != "tfds":
        raise ValueError(f"data.tfds_name={get('tfds_name')!r} is set but data.source={source!r}"
                         "; set --config.data.source=tfds")
    tok = ()
    if str(get("tokenizer")):
        file = corpus.tokenizer_file(str(get("tokenizer")))
        st = os.stat(file)
        tok = (file, str(get("eot_token")), st.st_size, st.st_mtime_ns)
    elif str(get("eot_token")):
        raise ValueError(f"data.eot_token={get('eot_token')!r} needs data.tokenizer (the byte "
                         "tokenizer ends documents with a newline)")
    if source == "stdlib":
        return _Key(source, val_fraction=val_fraction, tokenizer=tok)
    if source == "tfds":
        return _Key(source, field=str(get("tfds_text_key")), tokenizer=tok, tfds=tuple(
            str(get(f"tfds_{n}")) for n in ("name", "train_split", "val_split", "data_dir")))
    return _Key(source, str(get("train_files")), str(get("val_files")), val_fraction,
                str(get("text_field")) if source in ("jsonl", "parquet") else "",
                tok if source != "llmc" else ())


def tokenizer_of(data_cfg: Any):
    """The tokenizer of a data config (:func:`sdp_jax.train.data.corpus.load_tokenizer`): a
    :class:`~sdp_jax.train.data.corpus.ByteTokenizer` unless ``data.tokenizer`` names a Hugging Face
    one; ``None`` for llm.c shards without ``data.tokenizer`` (their text cannot be decoded).

    Raises:
      ValueError: a bad data config (:func:`check`'s errors)."""
    _cache_key(data_cfg)
    path = str(_cfg_get(data_cfg, "tokenizer"))
    if str(_cfg_get(data_cfg, "source")) == "llmc" and not path:
        return None
    return corpus.load_tokenizer(path, str(_cfg_get(data_cfg, "eot_token")))


def byte_level(data_cfg: Any) -> bool:
    """Whether a data config's tokens are bytes (then losses convert to bits per byte)."""
    return isinstance(tokenizer_of(data_cfg), corpus.ByteTokenizer)


def check(data_cfg: Any, vocab_size: int) -> None:
    """Validates a data config against a model's vocabulary, before anything is read.

    Raises:
      ValueError: an unknown source, ``val_fraction`` outside [0, 1), files given to a source
        that reads none, no tokenizer at ``data.tokenizer``, a tokenizer without an end-of-text
        token, or a tokenizer with more tokens than ``vocab_size`` (naming
        ``--config.model.vocab_size``).
      ImportError: ``data.tokenizer`` without the ``tokenizers`` library."""
    tok = tokenizer_of(data_cfg)
    if tok is not None and tok.vocab_size > vocab_size:
        what = (f"data.tokenizer={_cfg_get(data_cfg, 'tokenizer')!r}" if tok.name != "bytes"
                else "byte-level data")
        raise ValueError(f"{what} has {tok.vocab_size} tokens but model.vocab_size="
                         f"{vocab_size}; set --config.model.vocab_size={tok.vocab_size} (or more)")


# ----------------------------------------------------------------------------
# llm.c shards
# ----------------------------------------------------------------------------


def write_llmc_shard(path: os.PathLike | str, tokens: Any, version: int | None = None) -> None:
    """Writes tokens as an llm.c shard.

    Args:
      path: output file (overwritten).
      tokens: 1-D integer array-like of token ids, each in [0, 2**32 - 1].
      version: 1 (uint16 tokens, magic 20240520) or 7 (uint32 tokens, magic 20240801);
        default: 1 when every id fits in uint16, else 7.

    Raises:
      ValueError: tokens not 1-D, an unknown version, or a token outside the version's range.
    """
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
    top = int(tokens.max()) if tokens.size else 0
    if version is None:
        version = 1 if top <= 65535 else 7
    formats = {v: (m, d) for (m, v), d in LLMC_FORMATS.items()}
    if version not in formats:
        raise ValueError(f"version={version!r}: llm.c shards are version 1 (uint16 tokens) "
                         "or 7 (uint32 tokens)")
    magic, dtype = formats[version]
    limit = np.iinfo(np.dtype(dtype)).max
    if tokens.size and (tokens.min() < 0 or top > limit):
        raise ValueError(
            f"llm.c version-{version} shards hold {np.dtype(dtype).name} tokens; got values "
            f"in [{tokens.min()}, {top}], outside [0, {limit}]"
            + ("; use version=7 (uint32)" if version == 1 else "")
        )
    header = np.zeros(LLMC_HEADER_INTS, dtype="<i4")
    header[0] = magic
    header[1] = version
    header[2] = tokens.size
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype(dtype).tobytes())


def read_llmc_shard(path: os.PathLike | str) -> np.ndarray:
    """Memory-maps the tokens of an llm.c shard (read-only, nothing is loaded).

    Returns:
      A read-only ``np.memmap`` of shape ``[count]`` (the header's token count), of dtype
      little-endian uint16 (magic 20240520, version 1) or uint32 (magic 20240801, version 7).

    Raises:
      ValueError: naming the path, the expected and found values and a hint, when
        the file is shorter than the 1024-byte header, its magic is neither llm.c magic,
        its version is not the magic's, or its size is not ``1024 + itemsize * count``
        bytes (truncated or trailing bytes).
    """
    path = os.fspath(path)
    hint = (
        "convert your tokens with sdp_jax.train.data.write_llmc_shard(path, tokens) "
        "or check that the file was copied completely"
    )
    size = os.path.getsize(path)
    if size < LLMC_HEADER_BYTES:
        raise ValueError(
            f"llm.c shard {path}: file shorter than the {LLMC_HEADER_BYTES}-byte "
            f"header: expected at least {LLMC_HEADER_BYTES} bytes, found {size} "
            f"bytes; {hint}"
        )
    header = np.fromfile(path, dtype="<i4", count=LLMC_HEADER_INTS)
    magic, version, count = int(header[0]), int(header[1]), int(header[2])
    versions = {m: v for m, v in LLMC_FORMATS}
    if magic not in versions:
        raise ValueError(
            f"llm.c shard {path}: bad magic number, expected {LLMC_MAGIC} (uint16 tokens) or "
            f"20240801 (uint32 tokens), found {magic}; this is not an llm.c token shard; {hint}"
        )
    if version != versions[magic]:
        raise ValueError(
            f"llm.c shard {path}: unsupported version, expected {versions[magic]} for magic "
            f"{magic}, found {version}; llm.c writes version 1 (magic 20240520, uint16 tokens) "
            "and version 7 (magic 20240801, uint32 tokens); rewrite the shard with "
            "write_llmc_shard"
        )
    dtype = np.dtype(LLMC_FORMATS[magic, version])
    expected = LLMC_HEADER_BYTES + dtype.itemsize * count
    if count < 0 or size != expected:
        what = "truncated" if size < expected else "trailing bytes after the tokens"
        raise ValueError(
            f"llm.c shard {path}: file size mismatch ({what}): header says {count} "
            f"tokens, so expected {expected} bytes "
            f"({LLMC_HEADER_BYTES} + {dtype.itemsize} * {count}), found {size} bytes; {hint}"
        )
    return np.memmap(path, dtype=dtype, mode="r", offset=LLMC_HEADER_BYTES, shape=(count,))



# ----------------------------------------------------------------------------
# Loading (cached)
# ----------------------------------------------------------------------------


def _file_lists(key: _Key) -> tuple[list, list | None]:
    """The (train, val) files of a file source; val None: one file, split by tokens."""
    if key.source == "stdlib":
        return corpus.split_by_file(corpus.stdlib_files(), key.val_fraction,
                                    root=corpus.stdlib_root())
    train = corpus.expand_patterns(key.train_files, "train_files")
    if key.val_files.strip():
        return train, corpus.expand_patterns(key.val_files, "val_files")
    if len(train) == 1:
        return train, None
    root = os.path.commonpath([str(f) for f in train])
    return corpus.split_by_file(train, key.val_fraction,
                                root=os.path.dirname(root) if os.path.isfile(root) else root)


class Corpus(NamedTuple):
    """The documents of a data config, as :func:`document_corpus` finds them: the pieces of each
    split (``val`` None: one file, whose tokens :func:`split_tokens` divides), their counts and
    unit (``files`` or ``records``), the field holding the text, the tokenizer, and the names
    of each split's files (a tfds split by name) for messages."""

    train: list
    val: list | None
    counts: tuple[int, int]
    unit: str
    field: str
    tokenizer: Any
    files: tuple


def _corpus(key: _Key) -> Corpus:
    tokenizer = (corpus.load_tokenizer(*key.tokenizer[:2]) if key.tokenizer
                 else corpus.ByteTokenizer())
    if key.source == "tfds":
        name, train_split, val_split, data_dir = key.tfds
        (train, n_train), (val, n_val) = (corpus.tfds_pieces(name, s, data_dir)
                                          for s in (train_split, val_split))
        return Corpus(train, val, (n_train, n_val), "records", key.field, tokenizer,
                      tuple([f"tfds dataset {name!r} split {s!r}"]
                            for s in (train_split, val_split)))
    kind = "text" if key.source == "stdlib" else key.source
    train, val = _file_lists(key)
    return Corpus(corpus.file_pieces(kind, train),
                  None if val is None else corpus.file_pieces(kind, val),
                  (len(train), 1 if val is None else len(val)), "files", key.field, tokenizer,
                  tuple([str(f) for f in fs] for fs in (train, train if val is None else val)))


def document_corpus(data_cfg: Any) -> Corpus:
    """The documents and tokenizer of a data config whose source is a document source (not
    ``llmc``): what a run tokenizes at load and ``python -m sdp_jax.tools.prepare`` writes.

    Raises:
      ValueError: ``source='llmc'``, plus :func:`check`'s errors and bad files or patterns."""
    key = _cache_key(data_cfg)
    if key.source == "llmc":
        raise ValueError("data.source='llmc' is already tokens; give a document source "
                         f"({', '.join(corpus.DOCUMENT_SOURCES)})")
    return _corpus(key)


def split_tokens(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """The (train, val) tokens of a corpus of one file: the last
    ``ceil(val_fraction * len(tokens))`` tokens are val."""
    n_val = math.ceil(val_fraction * tokens.size)
    return tokens[: tokens.size - n_val], tokens[tokens.size - n_val:]


def token_parts(pieces: list, c: Corpus, bar=None) -> Iterator[np.ndarray]:
    """The tokens of ``pieces`` (of the corpus ``c``), a 1-D array per piece, in order
    (:func:`sdp_jax.train.data.corpus.token_stream`), each counted on the ``tqdm`` progress bar
    ``bar`` (pieces, and the tokens so far on that bar, over every call that shares it).
    Raises what reading a piece raises."""
    for part in corpus.token_stream(corpus.Documents(pieces, c.field), c.tokenizer):
        if bar is not None:
            bar.tokens = getattr(bar, "tokens", 0) + part.size
            bar.update(1)
            bar.set_postfix_str(f"{bar.tokens:,} tokens", refresh=False)
        yield part


def tokenize_pieces(pieces: list, c: Corpus, what: str) -> np.ndarray:
    """Every token of ``pieces`` (of the corpus ``c``) in one read-only array of the
    tokenizer's dtype, with a progress bar for a Hugging Face tokenizer over many pieces
    (``what`` names the split on it)."""
    bar = tqdm.tqdm(total=len(pieces), desc=f"tokenizing {what}", unit="piece", leave=False,
                    disable=c.tokenizer.name == "bytes" or len(pieces) < 16)
    with bar:
        out = np.concatenate([np.zeros((0,), c.tokenizer.dtype)]
                             + list(token_parts(pieces, c, bar)))
    out.flags.writeable = False
    return out


def _document_splits(key: _Key) -> dict:
    c = _corpus(key)
    if c.val is None:
        train, val = split_tokens(tokenize_pieces(c.train, c, "train"), key.val_fraction)
        return dict(train=(train,), val=(val,), counts=(1, 1 if val.size else 0),
                    unit="file (split by tokens)", files=c.files)
    return dict(train=(tokenize_pieces(c.train, c, "train"),),
                val=(tokenize_pieces(c.val, c, "val"),), counts=c.counts, unit=c.unit,
                files=c.files)


def _llmc_splits(key: _Key) -> dict:
    train_files = corpus.expand_patterns(key.train_files, "train_files")
    if key.val_files.strip():
        val_files = corpus.expand_patterns(key.val_files, "val_files")
    elif len(train_files) >= 2:
        train_files, val_files = train_files[:-1], train_files[-1:]
    else:
        raise ValueError(
            f"data.source='llmc' has a single train shard ({train_files[0]}) and "
            "no validation shards: set --config.data.val_files=GLOB, or give at "
            "least two train shards (the last one is then held out for validation)"
        )
    return dict(train=tuple(read_llmc_shard(f) for f in train_files),
                val=tuple(read_llmc_shard(f) for f in val_files),
                counts=(len(train_files), len(val_files)), unit="shards",
                files=tuple([str(f) for f in fs] for fs in (train_files, val_files)))


def _split_origin(data_cfg: Any, split: str, shown: int = 3) -> str:
    """Where a split's tokens come from, for a message: its file (``(empty)`` when it has no
    bytes), or the count of its files, the first ``shown`` and the empty ones; a tfds split by
    name."""
    files = _load_splits(_cache_key(data_cfg))["files"][_SPLITS.index(split)]
    empty = [f for f in files if os.path.isfile(f) and os.path.getsize(f) == 0]
    more = lambda fs: ", ".join(fs[:shown]) + (", ..." if len(fs) > shown else "")  # noqa: E731
    if len(files) == 1:
        return files[0] + (" (empty)" if empty else "")
    return (f"{len(files)} files ({more(files)})"
            + (f", {len(empty)} of them empty ({more(empty)})" if empty else ""))


@functools.lru_cache(maxsize=8)
def _load_splits(key: _Key) -> dict:
    """Loads both splits for a cache key. In-memory arrays are read-only."""
    out = _llmc_splits(key) if key.source == "llmc" else _document_splits(key)
    for split in _SPLITS:
        for arr in out[split]:
            if not isinstance(arr, np.memmap):
                arr.flags.writeable = False
    return out


def clear_cache() -> None:
    """Drops the per-process cache of loaded token arrays."""
    _load_splits.cache_clear()


@functools.lru_cache(maxsize=1024)
def _shard_max(path: str, size: int, mtime: float) -> int:
    # One pass over a memory-mapped shard, in chunks; cached per (path, size, mtime).
    arr = read_llmc_shard(path)
    top = 0
    for start in range(0, arr.size, 1 << 24):
        top = max(top, int(arr[start : start + (1 << 24)].max()))
    return top


def _check_vocab_at_load(arrays: Sequence[np.ndarray], vocab_size: int) -> None:
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    for arr in arrays:
        if not arr.size or vocab_size > np.iinfo(arr.dtype).max:
            continue
        if isinstance(arr, np.memmap):
            # llm.c shards: scanned once before training, so a bad token stops the run before
            # any compute rather than at the batch that holds it.
            where = str(arr.filename)
            st = os.stat(where)
            top = _shard_max(where, st.st_size, st.st_mtime)
        else:
            where, top = "the tokenized corpus", int(arr.max())
        if top >= vocab_size:
            need = corpus.VOCAB_BYTES if arr.dtype == np.uint8 else top + 1
            raise ValueError(
                f"token id {top} in {where} is >= the model's vocab_size {vocab_size}; "
                f"set --config.model.vocab_size={need} (or your tokenizer's size)"
            )


def _split_shards(data_cfg: Any, split: str, vocab_size: int) -> tuple[np.ndarray, ...]:
    if split not in _SPLITS:
        raise ValueError(f"split must be one of {_SPLITS}, got {split!r}")
    arrays = _load_splits(_cache_key(data_cfg))[split]
    _check_vocab_at_load(arrays, vocab_size)
    return arrays


def load_tokens(data_cfg: Any, split: str, vocab_size: int) -> np.ndarray:
    """Returns the tokens of one split as a 1-D array.

    Args:
      data_cfg: the data ConfigDict (see :func:`default_data_config`).
      split: ``'train'`` or ``'val'``.
      vocab_size: the model's vocabulary size.

    Returns:
      1-D read-only array: the tokenizer's dtype for document sources (uint8 for bytes,
      uint16 or uint32 for a Hugging Face tokenizer; cached, shared between calls), the
      shards' token type for ``llmc`` (a memmap when the split is one shard; several shards
      are concatenated into memory here, which :func:`make_train_iterator` avoids by
      windowing the memmaps directly).

    Raises:
      ValueError: unknown source or split, bad files or patterns, bad llm.c shard, or a
        token id >= ``vocab_size`` (every split is checked at load, see the module
        docstring).
      ImportError: ``source='tfds'`` without tensorflow-datasets installed.
    """
    arrays = _split_shards(data_cfg, split, vocab_size)
    if len(arrays) == 1:
        return arrays[0]
    if not arrays:
        return np.zeros((0,), np.uint16)
    return np.concatenate(arrays)



# ----------------------------------------------------------------------------
# Windows
# ----------------------------------------------------------------------------


class TokenWindowSource(grain.sources.RandomAccessDataSource):
    """Random-access windows over one or more 1-D token arrays.

    Item ``i`` of shard ``s`` is ``tokens_s[i * seq_len : i * seq_len + seq_len + 1]``
    as ``np.int32[seq_len + 1]`` (inputs ``[:-1]``, targets ``[1:]``). Windows are
    numbered shard after shard; each shard has ``(len(shard) - 1) // seq_len``
    windows, and windows that would cross a shard boundary are skipped.

    Memory-mapped shards are pickled by file name and offset (for grain worker
    processes), never by content.

    Args:
      tokens: a 1-D integer array, or a sequence of them (e.g. llm.c memmaps).
      seq_len: model sequence length (tokens per input), >= 1.
      vocab_size: if given, every window is checked to hold only ids < vocab_size
        (skipped when the dtype cannot exceed it).

    Raises:
      ValueError: at construction for ``seq_len < 1`` or a non-1-D array; in
        ``__getitem__`` for a token >= ``vocab_size`` (naming the id, the vocab
        size and ``--config.model.vocab_size``).
    """

    def __init__(
        self, tokens: np.ndarray | Sequence[np.ndarray], seq_len: int, vocab_size: int | None = None
    ):
        if isinstance(tokens, np.ndarray):
            tokens = [tokens]
        self._shards = list(tokens)
        for arr in self._shards:
            if np.ndim(arr) != 1:
                raise ValueError(f"token arrays must be 1-D, got shape {np.shape(arr)}")
        if int(seq_len) < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self._seq_len = int(seq_len)
        self._vocab_size = None if vocab_size is None else int(vocab_size)
        self._counts = [max(0, (len(a) - 1) // self._seq_len) for a in self._shards]
        self._starts = [0]
        for c in self._counts:
            self._starts.append(self._starts[-1] + c)
        self._needs_check = [
            self._vocab_size is not None and np.iinfo(a.dtype).max >= self._vocab_size
            for a in self._shards
        ]

    @property
    def seq_len(self) -> int:
        return self._seq_len

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, index: int) -> np.ndarray:
        index = int(index)
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} out of range [0, {len(self)})")
        s = bisect.bisect_right(self._starts, index) - 1
        start = (index - self._starts[s]) * self._seq_len
        window = np.asarray(self._shards[s][start : start + self._seq_len + 1], dtype=np.int32)
        if self._needs_check[s]:
            top = int(window.max())
            if top >= self._vocab_size:
                where = getattr(self._shards[s], "filename", None) or f"shard {s}"
                raise ValueError(
                    f"token id {top} in {where} (window {index}) is >= the model's "
                    f"vocab_size {self._vocab_size}; set --config.model.vocab_size="
                    f"{top + 1} or more (e.g. the tokenizer's vocabulary size)"
                )
        return window

    def __repr__(self) -> str:
        return (
            f"TokenWindowSource(shards={len(self._shards)}, "
            f"tokens={sum(len(a) for a in self._shards)}, "
            f"seq_len={self._seq_len}, windows={len(self)})"
        )

    def __getstate__(self):
        state = dict(self.__dict__)
        shards = []
        for a in self._shards:
            if isinstance(a, np.memmap) and a.filename is not None:
                shards.append(("memmap", a.filename, a.offset, a.shape, a.dtype.str))
            else:
                shards.append(("array", np.asarray(a)))
        state["_shards"] = shards
        return state

    def __setstate__(self, state):
        shards = []
        for entry in state["_shards"]:
            if entry[0] == "memmap":
                _, filename, offset, shape, dtype = entry
                shards.append(
                    np.memmap(filename, dtype=dtype, mode="r", offset=offset, shape=shape)
                )
            else:
                shards.append(entry[1])
        state["_shards"] = shards
        self.__dict__.update(state)


# ----------------------------------------------------------------------------
# Iterators
# ----------------------------------------------------------------------------


def process_rows(global_batch: int, process_index: int = 0, process_count: int = 1,
                 rows: tuple[int, int] | None = None) -> tuple[int, int]:
    """The rows ``(first, count)`` of every global batch that one process loads.

    ``rows`` (from :func:`sharding_rows`) wins; otherwise process ``p`` of ``P`` loads the
    ``p``-th contiguous ``global_batch // P`` rows.

    Raises:
      ValueError: bad process arguments, a ``global_batch`` not a positive multiple of
        ``process_count``, or ``rows`` that do not tile the global batch (``count`` must divide
        ``global_batch`` and ``first``)."""
    if rows is None:
        if process_count < 1 or not 0 <= process_index < process_count:
            raise ValueError(
                f"need 0 <= process_index < process_count, got "
                f"process_index={process_index}, process_count={process_count}"
            )
        if global_batch < 1 or global_batch % process_count:
            raise ValueError(
                f"global_batch ({global_batch}) must be a positive multiple of "
                f"process_count ({process_count})"
            )
        per = global_batch // process_count
        return process_index * per, per
    first, count = (int(r) for r in rows)
    if count < 1 or global_batch % count or first % count or first + count > global_batch:
        raise ValueError(
            f"rows {(first, count)} do not tile a global batch of {global_batch}: a process "
            "loads `count` consecutive rows starting at a multiple of `count`, and `count` "
            "divides the global batch; give every process the same number of workers"
        )
    return first, count


def sharding_rows(sharding: Any, global_batch: int) -> tuple[int, int]:
    """The rows ``(first, count)`` of a ``[global_batch, ...]`` array that this process's
    devices hold under ``sharding`` (a ``jax.sharding.Sharding`` over dimension 0), as
    :func:`process_rows` takes them: with a pipeline a process may hold every stage of one
    worker or one stage of every worker, so its rows are not always ``1 / process_count``.

    Raises:
      ValueError: the process's rows are not one contiguous range (a mesh whose devices
        interleave processes along ``data``)."""
    spans = sorted({(idx[0].start or 0, global_batch if idx[0].stop is None else idx[0].stop)
                    for idx in sharding.addressable_devices_indices_map(
                        (global_batch,)).values()})
    first, stop = spans[0][0], spans[-1][1]
    covered = sum(b - a for a, b in spans)
    if covered != stop - first or any(b != c for (_, b), (c, _) in zip(spans, spans[1:])):
        raise ValueError(
            f"this process's devices hold rows {spans} of the global batch, not one contiguous "
            "range; order the devices so that each process's devices are adjacent on the "
            "'data' mesh axis"
        )
    return first, stop - first


def iterate(ds: grain.MapDataset, start: int = 0, worker_count: int = 0,
            read_options: grain.ReadOptions | None = None) -> grain.DatasetIterator:
    """An iterator over the endless batch dataset ``ds`` from batch ``start`` (the optimizer
    step a run resumes at: batch ``s`` is step ``s + 1``'s, whatever the process layout), with
    ``grain.ReadOptions`` prefetching and, when ``worker_count > 0``, grain's ``mp_prefetch``
    over that many worker processes (the same batches in the same order)."""
    it_ds = ds[int(start):].to_iter_dataset(
        read_options or grain.ReadOptions(num_threads=8, prefetch_buffer_size=16))
    if worker_count > 0:
        _ensure_absl_flags_parsed()
        it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=int(worker_count)))
    return iter(it_ds)


class Origin(NamedTuple):
    """Where a run's stream of training examples begins: optimizer step ``step`` (the batch
    index :func:`iterate` starts at) reads the example at ``example`` of the shuffled stream
    (epoch ``example // N``, position ``example % N`` of that epoch's order, ``N`` examples per
    epoch). Every run starts at ``Origin(0, 0)``; an elastic resume that changes the global
    batch starts a new one where the previous stream stopped (:func:`first_example`), so no
    example is skipped or read twice across the switch."""

    step: int = 0
    example: int = 0


def first_example(origin: Origin, batch: int, global_batch: int, examples: int,
                  drop_epoch_remainder: bool) -> int:
    """The stream index of the first example of global batch ``batch`` (step ``batch + 1``):
    ``G = global_batch`` examples per batch from ``origin``; with ``drop_epoch_remainder``
    a batch never straddles two epochs of ``N = examples`` (the epoch's last ``< G`` examples
    are skipped and the next batch starts the next epoch), otherwise batches run on across
    epochs. ``first_example(o, b, ...)`` is also the stream position after ``b`` batches.

    Raises:
      ValueError: ``batch`` before ``origin.step``."""
    k, e0 = int(batch) - int(origin.step), int(origin.example)
    if k < 0:
        raise ValueError(f"batch {batch} is before the stream's origin (step {origin.step}); "
                         "a run resumes at or after the step its data stream begins.")
    if not drop_epoch_remainder:
        return e0 + k * global_batch
    epoch, offset = divmod(e0, examples)
    rest = (examples - offset) // global_batch   # whole batches left in the origin's epoch
    if k < rest:
        return e0 + k * global_batch
    k, per_epoch = k - rest, examples // global_batch
    return (epoch + 1 + k // per_epoch) * examples + (k % per_epoch) * global_batch


class _StreamBatch:
    """``batch index -> this process's rows of that global batch`` (picklable, for grain's
    worker processes)."""

    def __init__(self, ds, origin, global_batch, examples, drop, rows, batch_fn):
        self.ds, self.origin, self.G, self.N, self.drop = ds, origin, global_batch, examples, drop
        self.rows, self.batch_fn = rows, batch_fn

    def __call__(self, index: int, _):
        start = first_example(self.origin, index, self.G, self.N, self.drop) + self.rows[0]
        items = [self.ds[n] for n in range(start, start + self.rows[1])]
        return self.batch_fn(items) if self.batch_fn is not None else np.stack(items)


def layout_free_batches(ds: grain.MapDataset, *, examples: int, global_batch: int,
                        rows: tuple[int, int], drop_epoch_remainder: bool,
                        batch_fn=None, origin: Origin = Origin()) -> grain.MapDataset:
    """Batches of one process's ``rows`` of every global batch, the same global batches on
    every process layout (docs/design.md invariant 8).

    ``ds`` is the shuffled example stream (``examples`` per epoch; index ``n`` is epoch
    ``n // examples``'s permutation at ``n % examples``, as grain's ``shuffle`` gives them).
    Global batch ``s`` (step ``s + 1``) is the stream's ``G`` examples from
    :func:`first_example` (``[s G, (s + 1) G)`` from ``Origin(0, 0)`` without
    ``drop_epoch_remainder``; with it every epoch holds ``examples // G`` whole global
    batches); this process gets its rows ``[first, first + count)`` of it, stacked
    (``np.stack``, or ``batch_fn(list of examples)``).

    Returns:
      an endless ``grain.MapDataset`` of this process's batches, indexed by batch (indices
      before ``origin.step`` raise ValueError when read)."""
    return grain.MapDataset.range(sys.maxsize).map_with_index(_StreamBatch(
        ds, origin, int(global_batch), int(examples), bool(drop_epoch_remainder),
        (int(rows[0]), int(rows[1])), batch_fn))


def _ensure_absl_flags_parsed() -> None:
    """grain's worker processes read absl flags; mark them parsed outside absl.app."""
    from absl import flags  # pylint: disable=g-import-not-at-top

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def train_dataset(
    data_cfg: Any,
    *,
    seq_len: int,
    global_batch: int,
    seed: int,
    vocab_size: int,
    process_index: int = 0,
    process_count: int = 1,
    rows: tuple[int, int] | None = None,
    origin: Origin = Origin(),
) -> grain.MapDataset:
    """The endless, shuffled training batches of this process, as a ``grain.MapDataset``.

    All train windows (see :class:`TokenWindowSource`) are shuffled with ``seed`` (a fresh
    permutation every epoch); global batch ``k`` is windows ``[k G, (k + 1) G)`` of that order
    (each epoch's last partial global batch is dropped), and this process gets its ``rows`` of
    it (:func:`process_rows`; :func:`layout_free_batches`). The global batch of a step is
    therefore the same for any number of processes, devices or grain workers, so a run
    resumes on another process layout on the same trajectory (docs/design.md invariant 8).
    The data position of a run is its step: :func:`iterate` starts at any batch.

    Args:
      data_cfg: the data ConfigDict.
      seq_len: tokens per model input; windows hold ``seq_len + 1`` tokens.
      global_batch: windows per step over all processes (``G``).
      seed: shuffle seed (int).
      vocab_size: model vocabulary size (token ids must be below it).
      process_index, process_count: this process and the number of processes
        (``jax.process_index()``, ``jax.process_count()``); ignored when ``rows`` is given.
      rows: ``(first, count)`` rows of every global batch (:func:`sharding_rows`).
      origin: where the stream begins (:class:`Origin`; another one after an elastic resume
        that changed the global batch).

    Returns:
      an endless ``grain.MapDataset`` of ``np.int32`` arrays ``[count, seq_len + 1]``.

    Raises:
      ValueError: bad batch / process arguments, a train split with fewer windows than one
        global batch (names its files, the empty ones, the sizes and what to change), plus the
        errors of :func:`load_tokens`; token ids >= ``vocab_size`` in llm.c shards raise
        ``ValueError`` when read.
      ImportError: ``source='tfds'`` without tensorflow-datasets.
    """
    rows = process_rows(global_batch, process_index, process_count, rows)
    source = _train_windows(data_cfg, seq_len, vocab_size, global_batch)
    ds = grain.MapDataset.source(source).shuffle(seed=int(seed))
    return layout_free_batches(ds, examples=len(source), global_batch=global_batch, rows=rows,
                               drop_epoch_remainder=True, origin=origin)


def _train_windows(data_cfg: Any, seq_len: int, vocab_size: int,
                   global_batch: int) -> "TokenWindowSource":
    """The train split's windows. Raises ValueError when they fill no global batch (naming
    the split's files, :func:`_split_origin`)."""
    shards = _split_shards(data_cfg, "train", vocab_size)
    source = TokenWindowSource(shards, seq_len, vocab_size)
    n_windows = len(source)
    if n_windows < global_batch:
        n_tokens = sum(len(a) for a in shards)
        raise ValueError(
            f"train split too small for one batch: {n_tokens} tokens from "
            f"{_split_origin(data_cfg, 'train')} give "
            f"{n_windows} windows of seq_len+1={seq_len + 1} tokens, but one global_batch "
            f"needs {global_batch} windows; use more training data, a smaller global batch "
            f"or a shorter seq_len"
        )
    return source


def make_train_iterator(data_cfg: Any, *, start: int = 0, **kwargs) -> grain.DatasetIterator:
    """The iterator of :func:`train_dataset` (same keyword arguments) from batch ``start``,
    with ``data_cfg.worker_count`` grain worker processes (:func:`iterate`); it yields
    ``np.int32`` arrays ``[count, seq_len + 1]``. Raises what :func:`train_dataset` raises."""
    return iterate(train_dataset(data_cfg, **kwargs), start,
                   int(_cfg_get(data_cfg, "worker_count")))


class Stream:
    """A run's training batches: ``stream(start, origin)`` is the iterator over this process's
    rows of the global batches from batch ``start`` (step ``start + 1``) of the stream that
    begins at ``origin`` (:class:`Origin`).

    Attributes:
      examples: examples per epoch (``N``); drop_epoch_remainder: whether a batch never
        straddles two epochs (:func:`first_example`)."""

    def __init__(self, make, examples: int, drop_epoch_remainder: bool):
        self._make, self.examples = make, int(examples)
        self.drop_epoch_remainder = bool(drop_epoch_remainder)

    def __call__(self, start: int, origin: Origin = Origin()):
        return self._make(start, origin)

    def position(self, origin: Origin, batch: int, global_batch: int) -> int:
        """The stream index read first by batch ``batch`` (the examples read before it, from
        the stream's beginning) of a run with ``global_batch`` examples per step."""
        return first_example(origin, batch, global_batch, self.examples,
                             self.drop_epoch_remainder)


def train_stream(data_cfg: Any, **kwargs) -> Stream:
    """The :class:`Stream` of :func:`make_train_iterator` (the keyword arguments of
    :func:`train_dataset` but ``origin``); bad data and sizes raise here, as
    :func:`train_dataset` raises."""
    train_dataset(data_cfg, **kwargs)
    n = len(_train_windows(data_cfg, kwargs["seq_len"], kwargs["vocab_size"],
                           kwargs["global_batch"]))
    return Stream(lambda start, origin: make_train_iterator(data_cfg, start=start, origin=origin,
                                                            **kwargs), n, True)


def make_val_batches(
    data_cfg: Any,
    *,
    seq_len: int,
    global_batch: int,
    num_batches: int,
    vocab_size: int,
    process_index: int = 0,
    process_count: int = 1,
    rows: tuple[int, int] | None = None,
) -> list[np.ndarray]:
    """Returns the first validation batches of this process (no shuffling).

    Global batch ``b`` is val windows ``[b * global_batch, (b + 1) * global_batch)``;
    a process gets its ``rows`` of it (:func:`process_rows`: by default process ``p``
    gets the ``p``-th contiguous ``global_batch // process_count``), so the processes'
    batches together are the single-process batch.

    Args:
      data_cfg: the data ConfigDict.
      seq_len: tokens per model input; windows hold ``seq_len + 1`` tokens.
      global_batch: windows per batch over all processes.
      num_batches: batches wanted; fewer are returned if the split holds fewer
        full global batches.
      vocab_size: model vocabulary size.
      process_index, process_count, rows: as for :func:`train_dataset`.

    Returns:
      ``min(num_batches, windows // global_batch)`` arrays, each ``np.int32``
      ``[count, seq_len + 1]``; identical on every call.

    Raises:
      ValueError: ``num_batches < 1``, bad batch / process arguments, a val split
        without one full global batch (names its files, the sizes and fixes), a token id
        >= ``vocab_size``, plus the errors of :func:`load_tokens`.
    """
    first, per_process = process_rows(global_batch, process_index, process_count, rows)
    if num_batches < 1:
        raise ValueError(f"num_batches must be >= 1, got {num_batches}")
    shards = _split_shards(data_cfg, "val", vocab_size)
    source = TokenWindowSource(shards, seq_len, vocab_size)
    fit = len(source) // global_batch
    if fit < 1:
        n_tokens = sum(len(a) for a in shards)
        raise ValueError(
            f"validation split too small for one batch: {n_tokens} tokens from "
            f"{_split_origin(data_cfg, 'val')} give "
            f"{len(source)} windows of seq_len+1={seq_len + 1} tokens, but one "
            f"global batch needs {global_batch}; use more validation data "
            f"(data.val_fraction / data.val_files), a smaller batch or a shorter "
            f"seq_len"
        )
    batches = []
    for b in range(min(num_batches, fit)):
        lo = b * global_batch + first
        batches.append(np.stack([source[i] for i in range(lo, lo + per_process)]))
    return batches


def describe(data_cfg: Any) -> str:
    """One line for the progress output: source, file counts, token counts.

    Loads (and caches) the splits; raises what :func:`load_tokens` raises.
    """
    key = _cache_key(data_cfg)
    loaded = _load_splits(key)
    n_train = sum(len(a) for a in loaded["train"])
    n_val = sum(len(a) for a in loaded["val"])
    c_train, c_val = loaded["counts"]
    name = f"tfds:{key.tfds[0]}" if key.source == "tfds" else key.source
    tok = tokenizer_of(data_cfg)
    how = ("" if tok is None or tok.name == "bytes" else
           f"; tokenizer {tok.path} ({tok.vocab_size:,} tokens, documents end with "
           f"{tok.eot_token!r})")
    return (
        f"data {name}: {c_train} train / {c_val} val {loaded['unit']}, "
        f"{n_train:,} train tokens, {n_val:,} val tokens{how}"
    )
