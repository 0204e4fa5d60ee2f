"""Corpora: where a language model's documents come from and how they become tokens.

Document sources (``data.source``; ``llmc`` shards, already tokens, are read by
:mod:`sdp_jax.train.data`):

``stdlib``
    The ``*.py`` files of the running interpreter's standard library (:func:`stdlib_files`);
    a document per file.
``text``
    Files named by ``data.train_files`` (comma-separated globs); a document per file.
``jsonl``
    JSON Lines files: a document per line, the string field ``data.text_field`` of its
    object (blank lines are skipped).
``parquet``
    Parquet files (the form FineWeb and most Hugging Face datasets are published in): a
    document per row, the string column ``data.text_field``.
``tfds``
    A TensorFlow Datasets text dataset (``tfds.data_source``: random access over its
    array_record files); a document per record, the feature ``data.tfds_text_key``.

A source is cut into :class:`Piece` s, the units read at once (a text file, about 8 MiB of a
JSONL file ending at a line break, a Parquet row group, 4096 tfds records). :class:`Documents`
serves the pieces as a grain data source, and :func:`token_stream` tokenizes them in order
through grain (``grain.MapDataset.map`` on reader threads), so a corpus is read the same way
by a run (:func:`sdp_jax.train.data.load_tokens`) and by ``python -m sdp_jax.tools.prepare``,
which writes the same tokens as llm.c shards.

Tokenizers (``data.tokenizer``):

* ``''`` (default): :class:`ByteTokenizer`, UTF-8 bytes as tokens (vocab 256), a document's
  bytes followed by ``DOC_SEPARATOR`` (``b"\\n"``); text files are taken byte for byte
  (invalid UTF-8 included).
* a path to a Hugging Face ``tokenizer.json`` (or a folder holding one):
  :class:`HFTokenizer` (the ``tokenizers`` library), a document's ids (no special tokens
  added) followed by the end-of-text token (``data.eot_token``, or the first of
  :data:`EOT_CANDIDATES` the vocabulary has). It reads text: a document that is not UTF-8 is
  refused, naming its file and the first invalid byte's offset (:func:`invalid_utf8`), as
  the strict decoding of Python's ``open`` and of ``datasets``' text loader would, never
  replaced silently by U+FFFD. :func:`train_bpe` trains a byte-level BPE of a given
  vocabulary on a corpus.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import json
import os
import pathlib
import sysconfig
import zlib
from typing import Any, Callable, Iterable, Iterator, Sequence

import grain
import numpy as np

VOCAB_BYTES = 256
"""Vocabulary size of the byte tokenizer (token id = byte value)."""

DOC_SEPARATOR = b"\n"
"""Bytes appended after every document by the byte tokenizer."""

DOCUMENT_SOURCES = ("stdlib", "text", "jsonl", "parquet", "tfds")
"""The ``data.source`` values whose documents a tokenizer turns into tokens."""

EOT_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
"""End-of-text tokens looked for, in this order, when ``data.eot_token`` is empty (GPT-2 and
the BPE :func:`train_bpe` writes, LLaMA 3, LLaMA 1/2 and Mistral, Gemma)."""

JSONL_PIECE_BYTES = 8 << 20
TFDS_PIECE_RECORDS = 4096
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


# ----------------------------------------------------------------------------------------------
# Files and splits
# ----------------------------------------------------------------------------------------------

def stdlib_root() -> pathlib.Path:
    """The running interpreter's standard-library folder (``sysconfig``'s ``stdlib`` path)."""
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[pathlib.Path]:
    """The ``*.py`` files of the running interpreter's standard library.

    Returns:
      absolute paths, sorted by their POSIX path relative to :func:`stdlib_root`; folders named
      ``site-packages``, ``dist-packages`` and ``__pycache__`` are skipped, links to folders are
      not followed.
    """
    root = stdlib_root()
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        found += [pathlib.Path(dirpath, n) for n in filenames if n.endswith(".py")]
    found.sort(key=lambda p: p.relative_to(root).as_posix())
    return found


def split_by_file(
    files: Iterable[os.PathLike | str], val_fraction: float, root: os.PathLike | str | None = None
) -> tuple[list[pathlib.Path], list[pathlib.Path]]:
    """Splits files into (train, val) deterministically, by a hash of each path.

    A file goes to val iff ``zlib.crc32(key) % 10_000 < val_fraction * 10_000``, where ``key``
    is the UTF-8 POSIX path relative to ``root`` (or the path as given when ``root`` is None).
    The result depends only on the keys, so every host computes the same split, whatever the
    order of ``files``. With at least two files and ``0 < val_fraction``, neither side is left
    empty: if no file hashes into val, the file with the smallest hash bucket is moved there;
    if every file does, the one with the largest is moved back to train.

    Returns:
      ``(train, val)``: lists of ``pathlib.Path``, each sorted by key.

    Raises:
      ValueError: ``val_fraction`` outside [0, 1), or a file not under ``root``.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    root = pathlib.Path(root) if root is not None else None

    def key(path):
        return (pathlib.Path(path).relative_to(root) if root else pathlib.Path(path)).as_posix()

    keyed = sorted(((key(f), pathlib.Path(f)) for f in files), key=lambda kp: kp[0])
    buckets = [zlib.crc32(k.encode("utf-8")) % 10_000 for k, _ in keyed]
    is_val = [b < val_fraction * 10_000 for b in buckets]
    if len(keyed) >= 2 and val_fraction > 0:
        if not any(is_val):
            is_val[min(range(len(keyed)), key=lambda i: (buckets[i], keyed[i][0]))] = True
        elif all(is_val):
            is_val[max(range(len(keyed)), key=lambda i: (buckets[i], keyed[i][0]))] = False
    train = [p for (_, p), v in zip(keyed, is_val) if not v]
    val = [p for (_, p), v in zip(keyed, is_val) if v]
    return train, val


def expand_patterns(patterns: str, field: str) -> list[pathlib.Path]:
    """Comma-separated glob patterns (``~`` expanded, ``**`` recursive) -> the files they match,
    sorted and without repeats.

    Raises:
      ValueError: no pattern, or a pattern matching no file (naming it, its expansion and the
        working folder); ``field`` (``train_files``) names the config field in the message.
    """
    files: dict[str, pathlib.Path] = {}
    parts = [p.strip() for p in patterns.split(",") if p.strip()]
    if not parts:
        raise ValueError(f"data.{field} is empty; give a comma-separated list of file glob "
                         f"patterns (--config.data.{field}=...)")
    for pattern in parts:
        expanded = os.path.expanduser(pattern)
        matches = [m for m in glob.glob(expanded, recursive=True) if os.path.isfile(m)]
        if not matches:
            raise ValueError(f"data.{field}: pattern {pattern!r} matches no file (expanded to "
                             f"{expanded!r}, working directory {os.getcwd()!r})")
        for m in matches:
            files[os.path.abspath(m)] = pathlib.Path(os.path.abspath(m))
    return [files[k] for k in sorted(files)]


# ----------------------------------------------------------------------------------------------
# Pieces and documents
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Piece:
    """A unit of a corpus read at once: ``kind`` ``file`` (a whole text file), ``jsonl`` (bytes
    ``[start, stop)`` of a JSONL file, whole lines), ``parquet`` (row group ``start`` of a
    Parquet file) or ``tfds`` (records ``[start, stop)``; ``path`` is ``name|split|data_dir``)."""

    kind: str
    path: str
    start: int = 0
    stop: int = 0


def _jsonl_pieces(path: str) -> list[Piece]:
    size = os.path.getsize(path)
    bounds = [0]
    with open(path, "rb") as f:
        while bounds[-1] + JSONL_PIECE_BYTES < size:
            f.seek(bounds[-1] + JSONL_PIECE_BYTES)
            f.readline()
            if f.tell() >= size:
                break
            bounds.append(f.tell())
    bounds.append(size)
    return [Piece("jsonl", path, a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def _parquet_file(path: str):
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top (optional at import)
    try:
        return pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 (pyarrow raises ArrowInvalid, OSError, ...)
        raise ValueError(f"parquet file {path}: cannot be read as Parquet "
                         f"({type(e).__name__}: {str(e).splitlines()[0]}); check the file or "
                         "data.source") from None


def file_pieces(kind: str, files: Sequence[os.PathLike | str]) -> list[Piece]:
    """The pieces of ``files`` read as ``kind`` (``text``, ``jsonl`` or ``parquet``), in file
    order.

    Raises:
      ValueError: an unknown kind, or a file that is not Parquet (``parquet``)."""
    out: list[Piece] = []
    for f in map(os.fspath, files):
        if kind == "text":
            out.append(Piece("file", f))
        elif kind == "jsonl":
            out += _jsonl_pieces(f)
        elif kind == "parquet":
            pf = _parquet_file(f)
            out += [Piece("parquet", f, g) for g in range(pf.num_row_groups)]
            pf.close()
        else:
            raise ValueError(f"no file pieces for source {kind!r}")
    return out


def tfds_pieces(name: str, split: str, data_dir: str) -> tuple[list[Piece], int]:
    """The pieces of a tfds split (:data:`TFDS_PIECE_RECORDS` records each) and its record
    count. Raises what opening the dataset raises (:func:`_tfds_source`)."""
    n = len(_tfds_source(name, split, data_dir))
    path = f"{name}|{split}|{data_dir}"
    return [Piece("tfds", path, a, min(n, a + TFDS_PIECE_RECORDS))
            for a in range(0, n, TFDS_PIECE_RECORDS)], n


def _import_tfds():
    try:
        import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
    except ImportError as e:
        raise ImportError("data.source='tfds' needs the optional dependency tensorflow-datasets: "
                          "pip install 'sdp_jax[tfds]' (TensorFlow itself is not required)") from e
    return tfds


@functools.lru_cache(maxsize=8)
def _tfds_source(name: str, split: str, data_dir: str):
    tfds = _import_tfds()
    if not name:
        raise ValueError("data.source='tfds' needs data.tfds_name (--config.data.tfds_name=...)")
    try:
        return tfds.data_source(name, split=split, data_dir=data_dir or None, download=False)
    except Exception as e:  # noqa: BLE001 (tfds raises many types: not found, not prepared, ...)
        where = data_dir or "the default tfds data_dir (~/tensorflow_datasets)"
        raise ValueError(
            f"could not open tfds dataset {name!r} split {split!r} in {where}: "
            f"{type(e).__name__}: {e}. Prepare it first (`tfds build {name} "
            "--file_format=array_record --data_dir DIR`, on a machine with network access) and "
            "set --config.data.tfds_data_dir=DIR, or check the name and split.") from e


def _field(record: Any, field: str, where: str, flag: str) -> str | bytes:
    if not isinstance(record, dict) or field not in record:
        found = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"{where} has no field {field!r} (it has {found}); set "
                         f"--config.data.{flag}=NAME")
    value = record[field]
    if isinstance(value, np.ndarray):
        value = value.item()
    if not isinstance(value, (str, bytes)):
        raise ValueError(f"{where}: field {field!r} is {type(value).__name__}, not text; set "
                         f"--config.data.{flag} to a text field")
    return value


def _jsonl_documents(piece: Piece, field: str) -> list[str]:
    with open(piece.path, "rb") as f:
        f.seek(piece.start)
        chunk = f.read(piece.stop - piece.start)
    docs, offset = [], piece.start
    for line in chunk.split(b"\n"):
        if line.strip():
            where = f"jsonl file {piece.path} (line at byte {offset})"
            try:
                record = json.loads(line)
            except UnicodeDecodeError as e:   # (json reads bytes as UTF-8)
                raise ValueError(invalid_utf8(
                    f"jsonl file {piece.path}", offset + e.start, line,
                    "JSON Lines are UTF-8: convert the file (e.g. iconv -f LATIN1 -t UTF-8) or "
                    "leave the line out")) from None
            except ValueError as e:
                raise ValueError(f"{where}: not JSON ({e}); each line must be one JSON object "
                                 "with a text field") from None
            docs.append(_field(record, field, where, "text_field"))
        offset += len(line) + 1
    return docs


def _parquet_documents(piece: Piece, field: str) -> list[str]:
    pf = _parquet_file(piece.path)
    try:
        if field not in pf.schema_arrow.names:
            raise ValueError(f"parquet file {piece.path} has no column {field!r} (it has "
                             f"{pf.schema_arrow.names}); set --config.data.text_field=NAME")
        column = pf.read_row_group(piece.start, columns=[field]).column(0)
    finally:
        pf.close()
    docs = column.to_pylist()
    bad = [i for i, d in enumerate(docs) if not isinstance(d, (str, bytes))]
    if bad:
        raise ValueError(f"parquet file {piece.path}: column {field!r} holds "
                         f"{type(docs[bad[0]]).__name__} in row {bad[0]} of row group "
                         f"{piece.start} (type {column.type}, {column.null_count} nulls); give "
                         "--config.data.text_field a string column without nulls (filter them "
                         "out first)")
    return docs


class Documents(grain.sources.RandomAccessDataSource):
    """A grain data source over the pieces of a corpus: item ``i`` is the list of documents of
    piece ``i`` (``bytes`` for text files, taken byte for byte; ``str`` for JSONL and Parquet;
    as stored for tfds), or with ``text`` every document as ``str``.

    Args:
      pieces: from :func:`file_pieces` / :func:`tfds_pieces`.
      field: the JSONL field, Parquet column or tfds feature holding the text.
      text: decode ``bytes`` documents as UTF-8 (what a tokenizer that reads text needs,
        :class:`HFTokenizer`; the byte tokenizer reads the raw bytes).

    ``__getitem__`` raises ValueError naming the file (and the line's byte offset) for a JSONL
    line that is not a JSON object with a text ``field`` or not UTF-8, a Parquet file without a
    text column ``field``, a tfds record without the feature, or (``text``) a document that is
    not UTF-8 (naming its file or record and the first invalid byte's offset,
    :func:`invalid_utf8`)."""

    def __init__(self, pieces: Sequence[Piece], field: str = "text", text: bool = False):
        self.pieces, self.field, self.text = list(pieces), field, bool(text)

    def __len__(self) -> int:
        return len(self.pieces)

    def __getitem__(self, index: int) -> list:
        docs = self._read(self.pieces[index])
        if not self.text:
            return docs
        return [_text(d, lambda k=k: self._where(self.pieces[index], k))
                for k, d in enumerate(docs)]

    def _read(self, piece: Piece) -> list:
        if piece.kind == "file":
            return [pathlib.Path(piece.path).read_bytes()]
        if piece.kind == "jsonl":
            return _jsonl_documents(piece, self.field)
        if piece.kind == "parquet":
            return _parquet_documents(piece, self.field)
        name, split, data_dir = piece.path.split("|", 2)
        source = _tfds_source(name, split, data_dir)
        return [_field(source[i], self.field, self._where(piece, i - piece.start),
                       "tfds_text_key") for i in range(piece.start, piece.stop)]

    @staticmethod
    def _where(piece: Piece, k: int) -> str:
        """Document ``k`` of ``piece``, for a message (a text file is one document)."""
        if piece.kind == "file":
            return f"text file {piece.path}"
        if piece.kind == "parquet":
            return f"parquet file {piece.path} (row group {piece.start}, row {k})"
        if piece.kind == "jsonl":
            return f"jsonl file {piece.path}"
        name, split, _ = piece.path.split("|", 2)
        return f"tfds dataset {name!r} split {split!r} record {piece.start + k}"

    def as_text(self) -> "Documents":
        """The same documents as ``str`` (``text=True``)."""
        return Documents(self.pieces, self.field, text=True)

    def __repr__(self) -> str:
        return f"Documents(pieces={len(self.pieces)}, field={self.field!r}, text={self.text})"


# ----------------------------------------------------------------------------------------------
# Tokenizers
# ----------------------------------------------------------------------------------------------

TEXT_TOKENIZER_FIX = ("a tokenizer that reads text (data.tokenizer) needs UTF-8: convert it "
                      "(e.g. iconv -f LATIN1 -t UTF-8) or leave it out, or read raw bytes with "
                      "the byte tokenizer (data.tokenizer='', the default)")


def invalid_utf8(where: str, offset: int, data: bytes, fix: str = TEXT_TOKENIZER_FIX) -> str:
    """The one-line refusal of bytes that are not UTF-8: ``where``, ``offset`` (the first
    invalid byte's offset in ``where``), the count of invalid byte sequences in ``data`` (as
    many as a decoder would replace by U+FFFD) and ``fix``."""
    count = data.decode("utf-8", errors="replace").count("\ufffd") - data.count(
        "\ufffd".encode())
    return (f"{where}: invalid UTF-8 at byte {offset} ({count} invalid byte sequence"
            f"{'s' if count != 1 else ''}); {fix}")


def _text(doc: str | bytes, where: Callable[[], str] = lambda: "a document") -> str:
    """A document as text: ``str`` as it is, ``bytes`` decoded as UTF-8.

    Raises:
      ValueError: bytes that are not UTF-8 (:func:`invalid_utf8`, naming ``where()``): never
        replaced silently by U+FFFD."""
    if not isinstance(doc, bytes):
        return doc
    try:
        return doc.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(invalid_utf8(where(), e.start, doc)) from None


class ByteTokenizer:
    """UTF-8 bytes as tokens (vocab 256): the default of every document source. A document is
    its bytes followed by ``DOC_SEPARATOR`` (id 10, :attr:`eot_id`)."""

    name = "bytes"
    reads_text = False   # documents are taken as bytes (invalid UTF-8 included)
    vocab_size = VOCAB_BYTES
    eot_id = DOC_SEPARATOR[0]
    dtype = np.dtype(np.uint8)

    def encode(self, text: str | bytes) -> list[int]:
        """``text``'s UTF-8 bytes as ids."""
        return list(text.encode("utf-8") if isinstance(text, str) else bytes(text))

    def decode(self, ids: Sequence[int]) -> str:
        """Ids as text (invalid UTF-8, and ids past 255 of a larger vocabulary, become U+FFFD)."""
        return b"".join(bytes([t]) if 0 <= t < 256 else "\ufffd".encode() for t in ids).decode(
            "utf-8", errors="replace")

    def tokenize(self, documents: Sequence[str | bytes]) -> np.ndarray:
        """Documents -> ``uint8[n]``: each document's bytes, then ``DOC_SEPARATOR``."""
        buf = bytearray()
        for doc in documents:
            buf += doc.encode("utf-8") if isinstance(doc, str) else doc
            buf += DOC_SEPARATOR
        return np.frombuffer(bytes(buf), dtype=np.uint8)


def _import_tokenizers():
    try:
        import tokenizers  # pylint: disable=g-import-not-at-top
    except ImportError as e:
        raise ImportError("data.tokenizer needs the Hugging Face tokenizers library: "
                          "pip install tokenizers") from e
    return tokenizers


def tokenizer_file(path: str) -> str:
    """The ``tokenizer.json`` that ``path`` names: the file itself, or the one in the folder.

    Raises:
      ValueError: no such file (naming the path and the fix)."""
    p = os.path.expanduser(path)
    if os.path.isdir(p):
        p = os.path.join(p, "tokenizer.json")
    if not os.path.isfile(p):
        raise ValueError(f"data.tokenizer={path!r}: no tokenizer.json there; give the path of a "
                         "Hugging Face tokenizer.json (or its folder), or train one with python "
                         "-m sdp_jax.tools.prepare --train_tokenizer")
    return os.path.abspath(p)


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer read from a ``tokenizer.json``.

    A document is its ids (``add_special_tokens=False``) followed by :attr:`eot_id`, the
    end-of-text token ``eot_token`` or, when that is empty, the first of
    :data:`EOT_CANDIDATES` the vocabulary holds. Tokens are stored as uint16 when every id fits
    (vocabularies up to 65,536), else uint32.

    ``vocab_size`` is the largest id + 1 (the rows an embedding needs), not the number of
    tokens, where a vocabulary's ids have gaps.

    Raises:
      ValueError: no tokenizer.json at ``path``, a file the library cannot read, or no
        end-of-text token (naming ``--config.data.eot_token``).
      ImportError: the ``tokenizers`` library is missing."""

    name = "huggingface"
    reads_text = True   # documents decoded as UTF-8 first (:class:`Documents` ``text``)

    def __init__(self, path: str, eot_token: str = ""):
        self.path = tokenizer_file(path)
        try:
            self.tok = _import_tokenizers().Tokenizer.from_file(self.path)
        except Exception as e:  # noqa: BLE001 (the library raises its own Exception type)
            raise ValueError(f"data.tokenizer={path!r}: {self.path} is not a tokenizer.json the "
                             f"tokenizers library reads ({str(e).splitlines()[0]})") from None
        # ids may have gaps: the vocabulary a model needs is the largest id + 1
        self.vocab_size = max(self.tok.get_vocab(with_added_tokens=True).values()) + 1
        names = [eot_token] if eot_token else list(EOT_CANDIDATES)
        found = [(n, self.tok.token_to_id(n)) for n in names]
        found = [(n, i) for n, i in found if i is not None]
        if not found:
            raise ValueError(
                f"data.tokenizer={path!r} has no end-of-text token "
                + (f"{eot_token!r}" if eot_token else f"(looked for {', '.join(EOT_CANDIDATES)})")
                + "; name the token that ends a document with --config.data.eot_token=TOKEN")
        self.eot_token, self.eot_id = found[0]
        self.dtype = np.dtype(np.uint16 if self.vocab_size <= 65536 else np.uint32)

    def encode(self, text: str | bytes) -> list[int]:
        """``text``'s ids (no special tokens added)."""
        return list(self.tok.encode(_text(text), add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Ids as text (special tokens kept)."""
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def tokenize(self, documents: Sequence[str | bytes]) -> np.ndarray:
        """Documents -> ``uint16[n]`` or ``uint32[n]`` (:attr:`dtype`): each document's ids, then
        :attr:`eot_id`."""
        encoded = self.tok.encode_batch([_text(d) for d in documents], add_special_tokens=False)
        parts = [np.asarray(e.ids + [self.eot_id], dtype=self.dtype) for e in encoded]
        return np.concatenate(parts) if parts else np.zeros((0,), self.dtype)


@functools.lru_cache(maxsize=8)
def _hf_tokenizer(path: str, eot_token: str, stamp: tuple) -> HFTokenizer:
    return HFTokenizer(path, eot_token)


def load_tokenizer(path: str = "", eot_token: str = "") -> ByteTokenizer | HFTokenizer:
    """The tokenizer ``data.tokenizer`` names: :class:`ByteTokenizer` for ``''``, else an
    :class:`HFTokenizer` (cached per file, its size and modification time). Raises what
    :class:`HFTokenizer` raises."""
    if not path:
        return ByteTokenizer()
    file = tokenizer_file(path)
    st = os.stat(file)
    return _hf_tokenizer(file, eot_token, (st.st_size, st.st_mtime_ns))


def token_stream(documents: Documents, tokenizer, threads: int = 8) -> Iterator[np.ndarray]:
    """The tokens of every piece of ``documents``, in order, one 1-D array per piece
    (``tokenizer.tokenize``, on ``threads`` grain reader threads).

    Raises what reading a piece (:class:`Documents`) raises, invalid UTF-8 included for a
    tokenizer that reads text."""
    if tokenizer.reads_text:
        documents = documents.as_text()
    ds = grain.MapDataset.source(documents).map(tokenizer.tokenize)
    return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=max(1, threads),
                                                     prefetch_buffer_size=2 * max(1, threads))))


def train_bpe(documents: Documents, vocab_size: int, out: str,
              eot_token: str = EOT_CANDIDATES[0], max_documents: int = 0) -> HFTokenizer:
    """Trains a byte-level BPE tokenizer (GPT-2 style: the 256 byte symbols, merges learned from
    the documents, ``eot_token`` as its one special token) with ``tokenizers``' ``BpeTrainer``
    and writes it to ``out`` (a ``tokenizer.json``).

    Args:
      documents: the corpus (its training split).
      vocab_size: tokens in the vocabulary, special token included; at least 257.
      out: the file written (its folder is created).
      max_documents: train on the first this many documents (0 = all).

    Returns:
      the tokenizer, read back from ``out``.

    Raises:
      ValueError: ``vocab_size`` below 257, a corpus without documents, or a document that is
        not UTF-8 (:class:`Documents` ``text``).
    """
    if vocab_size < VOCAB_BYTES + 1:
        raise ValueError(f"vocab_size={vocab_size}: a byte-level BPE needs at least "
                         f"{VOCAB_BYTES + 1} tokens (the 256 bytes and {eot_token})")
    tk = _import_tokenizers()
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=int(vocab_size), special_tokens=[eot_token], show_progress=False,
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    seen, documents = 0, documents.as_text()

    def texts():
        nonlocal seen
        for i in range(len(documents)):
            for doc in documents[i]:
                if max_documents and seen >= max_documents:
                    return
                seen += 1
                yield doc

    tok.train_from_iterator(texts(), trainer=trainer)
    if not seen:
        raise ValueError("train_bpe: the corpus has no documents")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = f"{out}.{os.getpid()}.tmp"   # written whole, then renamed
    tok.save(tmp)
    os.replace(tmp, out)
    return HFTokenizer(out, eot_token)
