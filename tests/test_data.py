"""Tests for sdp_jax.train.data (CPU only, small files under tmp_path, no downloads)."""

import importlib.util
import pathlib
import sys
import zlib

import numpy as np
import pytest

from sdp_jax.train.data import corpus
from sdp_jax.train.data import tokens as data


def _cfg(**overrides):
    cfg = data.default_data_config()
    for k, v in overrides.items():
        cfg[k] = v
    return cfg


def _write_texts(tmp_path, n_files=6, size=3000, seed=0):
    """Writes n_files files of random printable bytes; returns their paths."""
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(n_files):
        p = tmp_path / f"doc_{i:02d}.txt"
        p.write_bytes(rng.integers(32, 127, size=size, dtype=np.uint8).tobytes())
        paths.append(p)
    return paths


# ----------------------------------------------------------------------------
# config / stdlib
# ----------------------------------------------------------------------------


def test_default_config_fields():
    cfg = data.default_data_config()
    assert cfg.source == "stdlib" and cfg.val_fraction == 0.05
    assert cfg.worker_count == 0 and cfg.tfds_text_key == "text"
    assert cfg.tfds_train_split == "train" and cfg.tfds_val_split == "validation"
    assert cfg.train_files == cfg.val_files == cfg.tfds_name == cfg.tfds_data_dir == ""


def test_unknown_source_lists_valid_ones():
    with pytest.raises(ValueError, match="stdlib, text, jsonl, parquet, llmc, tfds"):
        data.load_tokens(_cfg(source="nope"), "train", 256)


def test_stdlib_split_deterministic_disjoint_and_sized():
    files = corpus.stdlib_files()
    assert len(files) > 100
    assert not any("site-packages" in p.parts or "dist-packages" in p.parts for p in files)
    assert all(p.suffix == ".py" for p in files)
    root = corpus.stdlib_root()
    train, val = corpus.split_by_file(files, 0.05, root=root)
    # Same split from a shuffled file list (what another host computes).
    shuffled = list(files)
    np.random.default_rng(0).shuffle(shuffled)
    train2, val2 = corpus.split_by_file(shuffled, 0.05, root=root)
    assert (train, val) == (train2, val2)
    assert train and val and not set(train) & set(val)
    assert len(train) + len(val) == len(files)
    assert 0.02 < len(val) / len(files) < 0.09
    # The rule is the documented crc32 bucket of the relative POSIX path.
    for p in val[:20]:
        key = p.relative_to(root).as_posix().encode()
        assert zlib.crc32(key) % 10_000 < 500


def test_stdlib_tokens_are_file_bytes():
    cfg = _cfg()
    root = corpus.stdlib_root()
    train_files, val_files = corpus.split_by_file(corpus.stdlib_files(), 0.05, root=root)
    for split, files in (("train", train_files), ("val", val_files)):
        tokens = data.load_tokens(cfg, split, 256)
        assert tokens.ndim == 1 and tokens.dtype == np.uint8
        head = b"".join(f.read_bytes() + corpus.DOC_SEPARATOR for f in files[:3])
        assert tokens[: len(head)].tobytes() == head
        assert tokens.size == sum(f.stat().st_size + 1 for f in files)
    # Cached: the same array object comes back.
    assert data.load_tokens(cfg, "train", 256) is data.load_tokens(cfg, "train", 256)
    line = data.describe(cfg)
    assert "stdlib" in line and "train" in line and "val" in line


def test_byte_source_with_too_small_vocab():
    with pytest.raises(ValueError, match="vocab_size=256"):
        data.load_tokens(_cfg(), "train", 100)


# ----------------------------------------------------------------------------
# text source
# ----------------------------------------------------------------------------


def test_text_windows_reproduce_bytes(tmp_path):
    paths = _write_texts(tmp_path, n_files=2, size=500)
    cfg = _cfg(source="text", train_files=str(paths[0]), val_files=str(paths[1]))
    tokens = data.load_tokens(cfg, "train", 256)
    expected = paths[0].read_bytes() + corpus.DOC_SEPARATOR
    assert tokens.tobytes() == expected
    seq_len = 16
    src = data.TokenWindowSource(tokens, seq_len)
    assert len(src) == (len(expected) - 1) // seq_len
    for i in (0, 1, len(src) - 1):
        w = src[i]
        assert w.dtype == np.int32 and w.shape == (seq_len + 1,)
        assert w.astype(np.uint8).tobytes() == expected[i * seq_len : i * seq_len + seq_len + 1]
    val = data.make_val_batches(cfg, seq_len=seq_len, global_batch=4, num_batches=2, vocab_size=256)
    val_bytes = paths[1].read_bytes()
    assert val[0][0].astype(np.uint8).tobytes() == val_bytes[: seq_len + 1]
    assert val[1][0].astype(np.uint8).tobytes() == val_bytes[4 * seq_len : 5 * seq_len + 1]


def test_text_glob_split_by_file_and_single_file_by_bytes(tmp_path):
    paths = _write_texts(tmp_path, n_files=6, size=300)
    cfg = _cfg(source="text", train_files=str(tmp_path / "*.txt"), val_fraction=0.3)
    train = data.load_tokens(cfg, "train", 256)
    val = data.load_tokens(cfg, "val", 256)
    assert train.size and val.size
    assert train.size + val.size == sum(p.stat().st_size + 1 for p in paths)
    # One matching file: the last ceil(val_fraction * n) bytes are val.
    one = _cfg(source="text", train_files=str(paths[0]), val_fraction=0.1)
    whole = paths[0].read_bytes() + corpus.DOC_SEPARATOR
    n_val = int(np.ceil(0.1 * len(whole)))
    assert data.load_tokens(one, "val", 256).tobytes() == whole[-n_val:]
    assert data.load_tokens(one, "train", 256).tobytes() == whole[:-n_val]


def test_text_glob_without_match_names_pattern(tmp_path):
    _write_texts(tmp_path, n_files=1)
    pattern = str(tmp_path / "missing_*.txt")
    cfg = _cfg(source="text", train_files=f"{tmp_path / '*.txt'},{pattern}")
    with pytest.raises(ValueError, match="missing_"):
        data.load_tokens(cfg, "train", 256)
    with pytest.raises(ValueError, match="train_files"):
        data.load_tokens(_cfg(source="text"), "train", 256)


def test_split_by_file_keeps_both_sides_nonempty():
    files = [f"/data/f{i}.txt" for i in range(3)]
    train, val = corpus.split_by_file(files, 0.01, root="/data")
    assert len(val) == 1 and len(train) == 2
    assert corpus.split_by_file(files, 0.0, root="/data") == ([pathlib.Path(f) for f in files], [])


# ----------------------------------------------------------------------------
# llm.c shards
# ----------------------------------------------------------------------------


def test_llmc_round_trip(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 65536, size=1000).astype(np.uint16)
    path = tmp_path / "shard.bin"
    data.write_llmc_shard(path, tokens)
    assert path.stat().st_size == 1024 + 2 * tokens.size
    got = data.read_llmc_shard(path)
    assert isinstance(got, np.memmap) and got.shape == (1000,)
    np.testing.assert_array_equal(got, tokens)
    header = np.fromfile(path, dtype="<i4", count=3)
    assert header.tolist() == [20240520, 1, 1000]


def _corrupt(path, *, header=None, append=b"", truncate=None):
    raw = bytearray(path.read_bytes())
    if header is not None:
        idx, value = header
        raw[4 * idx : 4 * idx + 4] = np.int32(value).tobytes()
    raw += append
    if truncate is not None:
        raw = raw[:truncate]
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    "kind, patterns",
    [
        ("magic", ["bad magic", "expected 20240520", "found 12345", "write_llmc_shard"]),
        ("version", ["unsupported version", "expected 1", "found 2"]),
        ("truncated", ["truncated", "expected 1224 bytes", "found 1200"]),
        ("trailing", ["trailing bytes", "expected 1224 bytes", "found 1227"]),
        (
            "short",
            ["shorter than the 1024-byte header", "expected at least 1024", "found 100 bytes"],
        ),
    ],
)
def test_llmc_bad_files(tmp_path, kind, patterns):
    path = tmp_path / "shard.bin"
    data.write_llmc_shard(path, np.arange(100, dtype=np.uint16))
    if kind == "magic":
        _corrupt(path, header=(0, 12345))
    elif kind == "version":
        _corrupt(path, header=(1, 2))
    elif kind == "truncated":
        _corrupt(path, truncate=1200)
    elif kind == "trailing":
        _corrupt(path, append=b"xyz")
    else:
        _corrupt(path, truncate=100)
    with pytest.raises(ValueError) as info:
        data.read_llmc_shard(path)
    msg = str(info.value)
    assert str(path) in msg
    for p in patterns:
        assert p in msg, (p, msg)


def test_llmc_uint32_shards(tmp_path):
    """llm.c's version-7 shards (magic 20240801, uint32 tokens, for vocabularies past 65,535)
    were called 'not an llm.c token shard'."""
    rng = np.random.default_rng(2)
    shards = [rng.integers(0, 128_256, size=700) for _ in range(3)]
    for i, s in enumerate(shards):
        data.write_llmc_shard(tmp_path / f"train_{i}.bin", s)
    header = np.fromfile(tmp_path / "train_0.bin", dtype="<i4", count=3)
    assert header.tolist() == [20240801, 7, 700]   # llm.c's own header for uint32 tokens
    got = data.read_llmc_shard(tmp_path / "train_0.bin")
    assert got.dtype == np.dtype("<u4") and got.max() > 65535
    np.testing.assert_array_equal(got, shards[0])
    cfg = _cfg(source="llmc", train_files=str(tmp_path / "train_*.bin"))
    batch = next(data.make_train_iterator(cfg, seq_len=64, global_batch=4, seed=0,
                                          vocab_size=128_256))
    assert batch.dtype == np.int32 and batch.max() > 65535
    with pytest.raises(ValueError, match=r"token id 1\d{5} in .*train_0\.bin"):
        data.make_train_iterator(cfg, seq_len=64, global_batch=2, seed=0, vocab_size=65_536)
    with pytest.raises(ValueError, match="use version=7"):
        data.write_llmc_shard(tmp_path / "x.bin", [70_000], version=1)


def test_llmc_source_splits_and_vocab_check(tmp_path):
    rng = np.random.default_rng(1)
    shards = [rng.integers(0, 500, size=600).astype(np.uint16) for _ in range(3)]
    for i, s in enumerate(shards):
        data.write_llmc_shard(tmp_path / f"train_{i}.bin", s)
    cfg = _cfg(source="llmc", train_files=str(tmp_path / "train_*.bin"))
    # No val_files: the last shard is held out.
    np.testing.assert_array_equal(data.load_tokens(cfg, "val", 512), shards[2])
    np.testing.assert_array_equal(data.load_tokens(cfg, "train", 512), np.concatenate(shards[:2]))
    assert "2 train / 1 val shards" in data.describe(cfg)
    # Windows do not cross shards: 2 shards of 600 tokens, seq_len 64 -> 9 + 9.
    it = data.make_train_iterator(cfg, seq_len=64, global_batch=6, seed=0, vocab_size=512)
    seen = {tuple(w) for _ in range(3) for w in next(it)}
    allowed = {
        tuple(s[i * 64 : i * 64 + 65].astype(np.int32)) for s in shards[:2] for i in range(9)
    }
    assert len(seen) == 18 and seen == allowed
    # Token ids >= vocab_size.
    with pytest.raises(ValueError, match=r"vocab_size 256.*--config.model.vocab_size="):
        data.make_val_batches(cfg, seq_len=64, global_batch=2, num_batches=1, vocab_size=256)
    # ... found when the iterator is made (a scan of the shards), before any batch is read
    with pytest.raises(ValueError, match=r"token id 4\d\d in .*train_0\.bin"):
        data.make_train_iterator(cfg, seq_len=64, global_batch=2, seed=0, vocab_size=256)


def test_llmc_single_shard_without_val_errors(tmp_path):
    data.write_llmc_shard(tmp_path / "only.bin", np.arange(100, dtype=np.uint16))
    cfg = _cfg(source="llmc", train_files=str(tmp_path / "only.bin"))
    with pytest.raises(ValueError, match="val_files"):
        data.load_tokens(cfg, "train", 256)


def test_source_pickles_memmaps_by_name(tmp_path):
    import pickle

    path = tmp_path / "s.bin"
    data.write_llmc_shard(path, np.arange(10_000, dtype=np.uint16) % 300)
    src = data.TokenWindowSource([data.read_llmc_shard(path)], 32, vocab_size=300)
    blob = pickle.dumps(src)
    assert len(blob) < 2_000  # the 20 kB of tokens are not in the pickle
    again = pickle.loads(blob)
    assert len(again) == len(src)
    np.testing.assert_array_equal(again[17], src[17])


# ----------------------------------------------------------------------------
# train iterator / val batches
# ----------------------------------------------------------------------------


def _text_cfg(tmp_path, n_files=4, size=4000):
    paths = _write_texts(tmp_path, n_files=n_files, size=size)
    return _cfg(
        source="text", train_files=",".join(str(p) for p in paths[:-1]), val_files=str(paths[-1])
    )


def test_train_iterator_shapes_and_dtype(tmp_path):
    cfg = _text_cfg(tmp_path)
    it = data.make_train_iterator(cfg, seq_len=32, global_batch=8, seed=0, vocab_size=256)
    for _ in range(3):
        b = next(it)
        assert isinstance(b, np.ndarray)
        assert b.shape == (8, 33) and b.dtype == np.int32
        assert b.min() >= 0 and b.max() < 256
    it2 = data.make_train_iterator(
        cfg, seq_len=32, global_batch=8, seed=0, vocab_size=256, process_index=1, process_count=2
    )
    assert next(it2).shape == (4, 33)


def test_train_iterator_epochs_cover_data_and_reshuffle(tmp_path):
    cfg = _text_cfg(tmp_path, n_files=2, size=1000)  # 1001 tokens -> 31 windows
    it = data.make_train_iterator(cfg, seq_len=32, global_batch=4, seed=3, vocab_size=256)
    # 31 windows -> 7 batches per epoch (3 windows dropped per epoch).
    epoch1 = [next(it) for _ in range(7)]
    epoch2 = [next(it) for _ in range(7)]
    rows1 = {tuple(r) for b in epoch1 for r in b}
    assert len(rows1) == 28
    assert not all(np.array_equal(a, b) for a, b in zip(epoch1, epoch2))
    same_seed = data.make_train_iterator(cfg, seq_len=32, global_batch=4, seed=3, vocab_size=256)
    np.testing.assert_array_equal(next(same_seed), epoch1[0])
    other_seed = data.make_train_iterator(cfg, seq_len=32, global_batch=4, seed=4, vocab_size=256)
    assert not np.array_equal(next(other_seed), epoch1[0])


def test_two_processes_get_disjoint_windows(tmp_path):
    cfg = _text_cfg(tmp_path)
    # 3 train files of 4001 bytes -> 12003 tokens -> 375 windows of 33; 187 each.
    rows = []
    for p in range(2):
        it = data.make_train_iterator(
            cfg,
            seq_len=32,
            global_batch=8,
            seed=0,
            vocab_size=256,
            process_index=p,
            process_count=2,
        )
        rows.append({tuple(r) for _ in range(46) for r in next(it)})  # 184 windows
    assert len(rows[0]) == len(rows[1]) == 184
    assert not rows[0] & rows[1]


def test_start_resumes_at_any_step(tmp_path):
    """The data position of a run is its step: an iterator started at batch 50 yields what
    the uninterrupted one yields after 50 batches (across an epoch boundary)."""
    cfg = _text_cfg(tmp_path)
    kw = dict(seq_len=32, global_batch=8, seed=7, vocab_size=256)
    it = data.make_train_iterator(cfg, **kw)
    for _ in range(50):  # crosses an epoch boundary (46 batches per epoch)
        next(it)
    expected = [next(it) for _ in range(5)]
    fresh = data.make_train_iterator(cfg, start=50, **kw)
    for want in expected:
        np.testing.assert_array_equal(next(fresh), want)


@pytest.mark.parametrize("processes", [2, 4, 8])
def test_global_batches_do_not_depend_on_the_process_layout(tmp_path, processes):
    """docs/design.md invariant 8: the processes' batches of a step, concatenated, are the
    1-process batch of that step, across epochs and from any start step."""
    cfg = _text_cfg(tmp_path)
    kw = dict(seq_len=32, global_batch=8, seed=7, vocab_size=256)
    one = data.make_train_iterator(cfg, start=40, **kw)
    parts = [data.make_train_iterator(cfg, start=40, process_index=p, process_count=processes,
                                      **kw) for p in range(processes)]
    for _ in range(12):   # steps 41..52: 46 global batches per epoch
        np.testing.assert_array_equal(np.concatenate([next(p) for p in parts]), next(one))


def test_rows_from_a_sharding(tmp_path):
    """A process loads the rows its devices hold (all of them when it holds every worker's
    stage 0 of a pipeline); rows that do not tile the batch are refused."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    assert data.sharding_rows(NamedSharding(mesh, P("data")), 8) == (0, 8)
    assert data.sharding_rows(NamedSharding(mesh, P()), 8) == (0, 8)
    cfg = _text_cfg(tmp_path)
    kw = dict(seq_len=32, global_batch=8, seed=7, vocab_size=256)
    whole = next(data.make_train_iterator(cfg, **kw))
    np.testing.assert_array_equal(next(data.make_train_iterator(cfg, rows=(4, 2), **kw)),
                                  whole[4:6])
    with pytest.raises(ValueError, match=r"rows \(2, 4\) do not tile a global batch of 8"):
        data.make_train_iterator(cfg, rows=(2, 4), **kw)


def test_train_too_small_raises(tmp_path):
    cfg = _text_cfg(tmp_path, n_files=2, size=200)
    with pytest.raises(ValueError, match=r"train split too small.*global_batch"):
        data.make_train_iterator(cfg, seq_len=64, global_batch=8, seed=0, vocab_size=256)
    with pytest.raises(ValueError, match="multiple of process_count"):
        data.make_train_iterator(
            cfg, seq_len=8, global_batch=3, seed=0, vocab_size=256, process_count=2
        )


def test_a_split_too_small_names_its_files_and_the_empty_ones(tmp_path):
    """An empty train file (text or JSONL) is refused naming it, marked empty; a split of
    several files names their count, the first ones and the empty ones; a validation split
    too small names its file."""
    empty, val = tmp_path / "empty.txt", _write_texts(tmp_path, n_files=1, size=2000)[0]
    empty.write_bytes(b"")
    kw = dict(seq_len=16, global_batch=2, seed=0, vocab_size=256)
    with pytest.raises(ValueError, match=rf"too small for one batch: 1 tokens from {empty} "
                                         r"\(empty\) give 0 windows"):
        data.make_train_iterator(_cfg(source="text", train_files=str(empty),
                                      val_files=str(val)), **kw)
    jsonl = tmp_path / "empty.jsonl"
    jsonl.write_bytes(b"")
    with pytest.raises(ValueError, match=rf"0 tokens from {jsonl} \(empty\)"):
        data.make_train_iterator(_cfg(source="jsonl", train_files=str(jsonl),
                                      val_files=str(jsonl)), **kw)
    folder = tmp_path / "many"
    folder.mkdir()
    for i in range(5):
        (folder / f"{i}.txt").write_bytes(b"x" * (i % 2))
    with pytest.raises(ValueError) as e:
        data.make_train_iterator(_cfg(source="text", train_files=str(folder / "*.txt"),
                                      val_files=str(val)), **kw)
    assert (f"from 5 files ({folder}/0.txt, {folder}/1.txt, {folder}/2.txt, ...), 3 of them "
            f"empty ({folder}/0.txt, {folder}/2.txt, {folder}/4.txt) give 0 windows"
            in str(e.value))
    with pytest.raises(ValueError, match=rf"validation split too small for one batch: 2 tokens "
                                         rf"from {folder}/1.txt give"):
        data.make_val_batches(_cfg(source="text", train_files=str(val),
                                   val_files=str(folder / "1.txt")), seq_len=16,
                              global_batch=2, num_batches=1, vocab_size=256)


def test_val_batches_deterministic_and_sharded(tmp_path):
    cfg = _text_cfg(tmp_path)  # val: 4001 tokens -> 125 windows of 33
    kw = dict(seq_len=32, global_batch=8, vocab_size=256)
    a = data.make_val_batches(cfg, num_batches=3, **kw)
    b = data.make_val_batches(cfg, num_batches=3, **kw)
    assert len(a) == 3
    for x, y in zip(a, b):
        assert x.shape == (8, 33) and x.dtype == np.int32
        np.testing.assert_array_equal(x, y)
    # Asking for more than fit: 125 // 8 = 15 batches.
    assert len(data.make_val_batches(cfg, num_batches=100, **kw)) == 15
    # Two processes: their halves make up the single-process batch.
    halves = [
        data.make_val_batches(cfg, num_batches=3, process_index=p, process_count=2, **kw)
        for p in range(2)
    ]
    for i in range(3):
        np.testing.assert_array_equal(np.concatenate([halves[0][i], halves[1][i]]), a[i])


def test_val_too_small_raises(tmp_path):
    paths = _write_texts(tmp_path, n_files=2, size=2000)
    small = tmp_path / "small.txt"
    small.write_bytes(b"tiny")
    cfg = _cfg(source="text", train_files=str(paths[0]), val_files=str(small))
    with pytest.raises(ValueError, match=r"validation split too small.*5 tokens"):
        data.make_val_batches(cfg, seq_len=16, global_batch=2, num_batches=1, vocab_size=256)


def test_worker_processes(tmp_path):
    """worker_count > 0 goes through grain's mp_prefetch: the same batches in the same order
    as in-process, from any start step."""
    cfg = _text_cfg(tmp_path)
    cfg.worker_count = 2
    kw = dict(seq_len=32, global_batch=8, seed=1, vocab_size=256)
    in_process = data.make_train_iterator(_text_cfg(tmp_path), **kw)
    it = data.make_train_iterator(cfg, start=3, **kw)
    ref = [next(in_process) for _ in range(7)]
    for want in ref[3:]:
        np.testing.assert_array_equal(next(it), want)
    del it


# ----------------------------------------------------------------------------
# tfds
# ----------------------------------------------------------------------------


def test_tfds_missing_gives_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)
    cfg = _cfg(source="tfds", tfds_name="whatever")
    data.clear_cache()
    with pytest.raises(ImportError, match=r"pip install 'sdp_jax\[tfds\]'"):
        data.load_tokens(cfg, "train", 256)


_HAVE_TFDS = importlib.util.find_spec("tensorflow_datasets") is not None


@pytest.mark.skipif(
    not _HAVE_TFDS, reason="tensorflow-datasets not installed (pip install 'sdp_jax[tfds]')"
)
def test_tfds_source_reads_array_record_dataset(tmp_path):
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

    train_texts = [f"train document {i}: " + "abc" * (i + 1) for i in range(40)]
    val_texts = ["validation text one", "validation text two é"]

    class SdpTinyText(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        """Tiny text dataset written in TFDS's own array_record format."""

        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return tfds.core.DatasetInfo(
                builder=self, features=tfds.features.FeaturesDict({"text": tfds.features.Text()})
            )

        def _split_generators(self, dl_manager):
            return {
                "train": self._generate_examples(train_texts),
                "validation": self._generate_examples(val_texts),
            }

        def _generate_examples(self, texts):
            for i, t in enumerate(texts):
                yield i, {"text": t}

    builder = SdpTinyText(data_dir=str(tmp_path), file_format="array_record")
    builder.download_and_prepare()
    assert list(pathlib.Path(builder.data_dir).glob("*.array_record-*"))

    cfg = _cfg(source="tfds", tfds_name="sdp_tiny_text", tfds_data_dir=str(tmp_path))
    data.clear_cache()
    for split, texts in (("train", train_texts), ("val", val_texts)):
        tokens = data.load_tokens(cfg, split, 256)
        assert tokens.dtype == np.uint8
        got = tokens.tobytes().split(corpus.DOC_SEPARATOR)[:-1]
        # tfds shuffles records on write; compare as multisets of documents.
        assert sorted(got) == sorted(t.encode("utf-8") for t in texts)
    it = data.make_train_iterator(cfg, seq_len=16, global_batch=4, seed=0, vocab_size=256)
    assert next(it).shape == (4, 17)
    assert "tfds:sdp_tiny_text" in data.describe(cfg)
    with pytest.raises(ValueError, match="tfds_text_key"):
        data.clear_cache()
        data.load_tokens(
            _cfg(
                source="tfds",
                tfds_name="sdp_tiny_text",
                tfds_data_dir=str(tmp_path),
                tfds_text_key="body",
            ),
            "train",
            256,
        )
    data.clear_cache()
