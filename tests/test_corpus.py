"""Tokenized corpora (sdp_jax.train.data.corpus, the document sources of sdp_jax.train.data) and the
prepare command (sdp_jax.tools.prepare): small files written by the tests, no downloads."""

import importlib.util
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tokenizers

from sdp_jax.tools import prepare
from sdp_jax.train.data import corpus
from sdp_jax.train.data import tokens as data

DOCS = [f"def f{i}(x):\n    return x * {i} + {i * i}  # é {'ab' * i}\n" for i in range(40)]


def _cfg(**overrides):
    cfg = data.default_data_config()
    cfg.update(overrides)
    return cfg


@pytest.fixture(autouse=True)
def _fresh_cache():
    data.clear_cache()
    yield
    data.clear_cache()


def _write(tmp_path, kind: str, files: int = 4, docs=DOCS):
    """The documents ``docs`` dealt round-robin into ``files`` files of ``kind``."""
    folder = tmp_path / kind
    folder.mkdir()
    for k in range(files):
        part = docs[k::files]
        if kind == "jsonl":
            (folder / f"part_{k}.jsonl").write_text(
                "".join(json.dumps({"id": i, "text": t}) + "\n\n" for i, t in enumerate(part)))
        elif kind == "parquet":
            pq.write_table(pa.table({"text": part, "n": list(range(len(part)))}),
                           folder / f"part_{k}.parquet", row_group_size=3)
        else:
            for i, t in enumerate(part):
                (folder / f"part_{k}_{i:02d}.txt").write_bytes(t.encode())
    return folder


def _in_file_order(folder, kind, files=4, docs=DOCS):
    if kind == "text":
        names = sorted(p.name for p in folder.iterdir())
        return [(folder / n).read_text() for n in names]
    return [d for k in range(files) for d in docs[k::files]]


def _bpe(tmp_path, vocab=320):
    docs = corpus.Documents([corpus.Piece("file", str(p))
                             for p in sorted(_write(tmp_path, "text").iterdir())])
    return corpus.train_bpe(docs, vocab, str(tmp_path / "tok" / "tokenizer.json"))


@pytest.mark.parametrize("kind", ["text", "jsonl", "parquet"])
def test_document_sources_give_each_document_then_the_separator(tmp_path, kind):
    folder = _write(tmp_path, kind)
    cfg = _cfg(source=kind, train_files=str(folder / "*"), val_files=str(folder / "part_0*"))
    train = data.load_tokens(cfg, "train", 256)
    want = "".join(d + "\n" for d in _in_file_order(folder, kind)).encode()
    assert train.dtype == np.uint8 and train.tobytes() == want
    assert "4 train / 1 val files" in data.describe(cfg) if kind != "text" else True


def test_jsonl_pieces_end_at_line_breaks(tmp_path, monkeypatch):
    folder = _write(tmp_path, "jsonl", files=1)
    whole = data.load_tokens(_cfg(source="jsonl", train_files=str(folder / "*"),
                                  val_fraction=0.0), "train", 256)
    monkeypatch.setattr(corpus, "JSONL_PIECE_BYTES", 100)
    pieces = corpus.file_pieces("jsonl", sorted(folder.iterdir()))
    assert len(pieces) > 10
    assert all(p.stop > p.start for p in pieces)
    data.clear_cache()
    again = data.load_tokens(_cfg(source="jsonl", train_files=str(folder / "*"),
                                  val_fraction=0.0), "train", 256)
    np.testing.assert_array_equal(whole, again)


def test_trained_bpe_tokenizes_documents_joined_by_end_of_text(tmp_path):
    tok = _bpe(tmp_path)
    assert tok.vocab_size == 320 and tok.eot_token == "<|endoftext|>"
    assert tok.decode(tok.encode(DOCS[7])) == DOCS[7]
    folder = _write(tmp_path, "parquet")
    cfg = _cfg(source="parquet", train_files=str(folder / "*.parquet"), val_fraction=0.3,
               tokenizer=str(tmp_path / "tok"))
    train, val = (data.load_tokens(cfg, s, 320) for s in ("train", "val"))
    assert train.dtype == np.uint16 and train.size and val.size
    c = data.document_corpus(cfg)
    assert c.counts[0] + c.counts[1] == 4 and c.counts[1] >= 1
    docs = [d for p in c.train for d in corpus.Documents([p])[0]]
    want = [i for d in docs for i in tok.encode(d) + [tok.eot_id]]
    np.testing.assert_array_equal(train, want)
    assert train.size < sum(len(d.encode()) for d in docs)    # merges were learned
    assert "tokenizer" in data.describe(cfg) and "320 tokens" in data.describe(cfg)
    assert not data.byte_level(cfg) and data.byte_level(_cfg())


def test_tokenized_batches_are_layout_free_and_resume(tmp_path):
    _bpe(tmp_path)
    folder = _write(tmp_path, "jsonl")
    cfg = _cfg(source="jsonl", train_files=str(folder / "*"), tokenizer=str(tmp_path / "tok"))
    kw = dict(seq_len=8, global_batch=4, seed=3, vocab_size=320)
    one = data.make_train_iterator(cfg, **kw)
    want = [next(one) for _ in range(5)]
    halves = [data.make_train_iterator(cfg, start=2, process_index=p, process_count=2, **kw)
              for p in range(2)]
    for w in want[2:]:
        np.testing.assert_array_equal(np.concatenate([next(h) for h in halves]), w)


def _word_level(tmp_path, n: int, eot: bool = True) -> str:
    vocab = {f"w{i}": i for i in range(n)}
    if eot:
        vocab["<|endoftext|>"] = n
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path = tmp_path / f"word_{n}_{eot}.json"
    tok.save(str(path))
    return str(path)


def test_large_vocabulary_is_uint32_and_prepare_writes_version_7(tmp_path):
    path = _word_level(tmp_path, 70_000)
    tok = corpus.load_tokenizer(path)
    assert tok.vocab_size == 70_001 and tok.dtype == np.uint32
    np.testing.assert_array_equal(tok.tokenize(["w69999 w3", "w5"]), [69999, 3, 70000, 5, 70000])
    text = tmp_path / "c.txt"
    text.write_text(" ".join(f"w{i * 997 % 70_000}" for i in range(5000)))
    out = tmp_path / "out"
    done = prepare.main([f"--config.data.source=text", f"--config.data.train_files={text}",
                         f"--config.data.tokenizer={path}", f"--out={out}"])
    assert done["version"] == 7
    header = np.fromfile(out / "train_000000.bin", dtype="<i4", count=3)
    assert list(header[:2]) == [20240801, 7]
    cfg = _cfg(source="text", train_files=str(text), tokenizer=path)
    np.testing.assert_array_equal(data.read_llmc_shard(out / "train_000000.bin"),
                                  data.load_tokens(cfg, "train", 70_001))
    np.testing.assert_array_equal(data.read_llmc_shard(out / "val_000000.bin"),
                                  data.load_tokens(cfg, "val", 70_001))


def test_prepare_trains_a_tokenizer_and_writes_the_tokens_a_run_reads(tmp_path, capsys):
    folder = _write(tmp_path, "parquet", docs=[d * 8 for d in DOCS])
    out = tmp_path / "shards"
    argv = ["--config.data.source=parquet", f"--config.data.train_files={folder}/*.parquet",
            "--config.data.val_fraction=0.3", "--train_tokenizer", "--vocab_size=300",
            "--shard_tokens=1024", f"--out={out}"]
    done = prepare.main(argv)
    printed = capsys.readouterr().out
    assert "--config.data.source=llmc" in printed and "--config.model.vocab_size=300" in printed
    assert json.loads((out / "prepare.json").read_text())["train_tokens"] == done["train_tokens"]
    assert len(done["train"]) >= 2 and done["version"] == 1
    cfg = _cfg(source="parquet", train_files=f"{folder}/*.parquet", val_fraction=0.3,
               tokenizer=str(out / "tokenizer.json"))
    shards = np.concatenate([data.read_llmc_shard(p) for p in done["train"]])
    np.testing.assert_array_equal(shards, data.load_tokens(cfg, "train", 300))
    assert all(data.read_llmc_shard(p).size == 1024 for p in done["train"][:-1])
    with pytest.raises(SystemExit) as e:
        prepare.main(argv)
    assert e.value.code == 2
    assert "already holds" in capsys.readouterr().err
    assert not list(out.glob("*.tmp"))
    with pytest.raises(SystemExit):   # no vocabulary: refused before anything is written
        prepare.main([a for a in argv if not a.startswith(("--vocab_size", "--out"))]
                     + [f"--out={tmp_path / 'none'}"])
    assert "--train_tokenizer needs --vocab_size=N" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()


@pytest.mark.parametrize("what, message", [
    ("not json", "line at byte 0.*not JSON"),
    ("no field", "has no field 'text'.*text_field"),
    ("number", "is int, not text"),
])
def test_bad_jsonl_names_the_file(tmp_path, what, message):
    f = tmp_path / "bad.jsonl"
    f.write_text({"not json": "{oops\n", "no field": '{"body": "x"}\n',
                  "number": '{"text": 3}\n'}[what])
    with pytest.raises(ValueError, match=message) as e:
        data.load_tokens(_cfg(source="jsonl", train_files=str(f)), "train", 256)
    assert str(f) in str(e.value)


def test_invalid_utf8_is_refused_for_a_text_tokenizer_and_read_raw_by_bytes(tmp_path, capsys):
    """A text file with invalid UTF-8 (3 invalid sequences, the first at byte 6): the byte
    tokenizer takes its raw bytes; a Hugging Face tokenizer (a run's load, a BPE's training)
    refuses it in one line naming the file, the offset and the count, never turning it into
    U+FFFD; the same in a JSONL file (the offset in the file) and a Parquet binary column."""
    raw = b"hello \xff w1 \xfe\xfe w0 caf\xc3\xa9 \xef\xbf\xbd\n" * 3
    f = tmp_path / "latin.txt"
    f.write_bytes(raw)
    cfg = _cfg(source="text", train_files=str(f), val_fraction=0.0)
    assert data.load_tokens(cfg, "train", 256).tobytes() == raw + b"\n"
    data.clear_cache()
    word = _word_level(tmp_path, 10)
    with pytest.raises(ValueError) as e:
        data.load_tokens(_cfg(source="text", train_files=str(f), val_fraction=0.0,
                              tokenizer=word), "train", 11)
    msg = str(e.value)
    assert msg.startswith(f"text file {f}: invalid UTF-8 at byte 6 (9 invalid byte sequences)")
    assert "iconv" in msg and msg.splitlines()[0].endswith("(data.tokenizer='', the default)")
    with pytest.raises(ValueError, match=r"latin.txt: invalid UTF-8 at byte 6 "):
        corpus.train_bpe(corpus.Documents([corpus.Piece("file", str(f))]), 300,
                         str(tmp_path / "bpe.json"))
    j = tmp_path / "bad.jsonl"
    j.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=rf"jsonl file {j}: invalid UTF-8 at byte 30 \(1 .*JSON "
                                         "Lines are UTF-8"):
        data.load_tokens(_cfg(source="jsonl", train_files=str(j)), "train", 256)
    p = tmp_path / "bin.parquet"
    pq.write_table(pa.table({"text": pa.array([b"w1 w0", b"w1 \xff"], pa.binary())}), p)
    with pytest.raises(ValueError, match=r"bin.parquet \(row group 0, row 1\): invalid UTF-8 "
                                         r"at byte 3 \(1 invalid byte sequence\)"):
        data.load_tokens(_cfg(source="parquet", train_files=str(p), tokenizer=word), "train", 11)


def test_prepare_that_fails_leaves_its_folder_as_it_found_it(tmp_path, capsys):
    """A bad line met while the shards are written: one line, exit 2, the files it had
    written removed (the folder holds what it held), and the fixed corpus then prepares."""
    folder = _write(tmp_path, "jsonl", files=2, docs=[d * 40 for d in DOCS])
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    bad = folder / "part_1.jsonl"
    good_text = bad.read_text()
    bad.write_text(good_text + "{oops\n")
    argv = ["--config.data.source=jsonl", f"--config.data.train_files={folder}/*",
            f"--config.data.val_files={folder}/part_0.jsonl", "--train_tokenizer",
            "--vocab_size=300", "--shard_tokens=1024", f"--out={out}"]
    with pytest.raises(SystemExit) as e:
        prepare.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "not JSON" in err and "removed" in err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    bad.write_text(good_text)
    assert prepare.main(argv)["train_tokens"] > 0


def test_parquet_nulls_and_vocabularies_with_gaps(tmp_path):
    """A null in the text column is a one-line error naming the row; a tokenizer whose ids
    have gaps needs (and stores) its largest id + 1."""
    f = tmp_path / "n.parquet"
    pq.write_table(pa.table({"text": ["a", None, "b"]}), f)
    with pytest.raises(ValueError, match=r"n.parquet: column 'text' holds NoneType in row 1"):
        data.load_tokens(_cfg(source="parquet", train_files=str(f)), "train", 256)
    vocab = {"w0": 0, "w1": 1, "<|endoftext|>": 70_000}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "gaps.json"))
    t = corpus.load_tokenizer(str(tmp_path / "gaps.json"))
    assert t.vocab_size == 70_001 and t.dtype == np.uint32
    np.testing.assert_array_equal(t.tokenize(["w1 w0"]), [1, 0, 70_000])


def test_bad_parquet_and_tokenizers_are_refused_in_one_line(tmp_path):
    good = tmp_path / "a.parquet"
    pq.write_table(pa.table({"body": ["x", "y"]}), good)
    with pytest.raises(ValueError, match=r"has no column 'text' \(it has \['body'\]\)"):
        data.load_tokens(_cfg(source="parquet", train_files=str(good)), "train", 256)
    (tmp_path / "b.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match="b.parquet: cannot be read as Parquet"):
        data.load_tokens(_cfg(source="parquet", train_files=str(tmp_path / "b.parquet")),
                         "train", 256)
    checks = [
        (_cfg(tokenizer=str(tmp_path / "none")), 256, "no tokenizer.json there"),
        (_cfg(tokenizer=_word_level(tmp_path, 10, eot=False)), 256, "eot_token=TOKEN"),
        (_cfg(tokenizer=_word_level(tmp_path, 10), eot_token="<x>"), 256, "'<x>'"),
        (_cfg(eot_token="</s>"), 256, "needs data.tokenizer"),
        (_cfg(train_files="*.txt"), 256, "source='stdlib' does not read files"),
        (_cfg(tokenizer=_word_level(tmp_path, 400)), 256, "model.vocab_size=401"),
        (_cfg(), 100, "model.vocab_size=256"),
    ]
    for cfg, vocab, message in checks:
        with pytest.raises(ValueError, match=message) as e:
            data.check(cfg, vocab)
        assert "\n" not in str(e.value)


@pytest.mark.slow
def test_a_run_on_parquet_with_a_bpe_trains_and_its_tools_speak_text(tmp_path, capsys):
    """train.py's loop on a Parquet folder tokenized by a trained BPE: the loss falls, the
    summary has no bits/byte (tokens are not bytes), and generate and the harness adapter
    encode and decode text with the run's tokenizer; a run on shards without a tokenizer is
    refused a text prompt in one line."""
    import os
    import sys

    from sdp_jax.tools import generate, harness
    from sdp_jax.train import loop

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs"))
    import llama_tiny  # pylint: disable=import-outside-toplevel

    folder = _write(tmp_path, "parquet", docs=[d * 8 for d in DOCS])
    done = prepare.main(["--config.data.source=parquet", f"--config.data.train_files={folder}/*",
                         "--train_tokenizer", "--vocab_size=300", f"--out={tmp_path / 'bpe'}"])
    c = llama_tiny.get_config()
    c.data.update(source="parquet", train_files=f"{folder}/*", val_fraction=0.25,
                  tokenizer=str(tmp_path / "bpe"))
    c.model.vocab_size = 320
    c.update(dict(steps=6, eval_every=0, checkpoint_every=0, seq_len=16, batch_per_worker=2,
                  log_every=1))
    c.optim.update(lr=1e-2, warmup_steps=1)
    wd = str(tmp_path / "run")
    summary = loop.train(c, wd)
    losses = [json.loads(line)["train_loss"] for line in open(os.path.join(wd, "metrics.jsonl"))]
    assert losses[-1] < losses[0] and summary["final_val_bpb"] is None
    text = generate.main(["--workdir", wd, "--prompt", "def f", "--length", "6"])
    assert text.startswith("def f") and len(text) > len("def f")
    model = harness.SDPJaxLM(workdir=wd, batch_size=2)
    assert model.encode("def f1") == corpus.load_tokenizer(str(tmp_path / "bpe")).encode("def f1")
    assert model.tok.decode([model.tok.eot_id]) == "<|endoftext|>"   # documents' separator
    for ctx, cont in (("def f", "1(x)"), ("return x *", " 12")):   # as training tokenized it
        c_ids, k_ids = model.encode_pair(ctx, cont)
        assert c_ids + k_ids == model.encode(ctx + cont) and k_ids
    assert model.encode_pair("return x * ", "12") == model.encode_pair("return x *", " 12")
    from sdp_jax.tools import export   # the Hugging Face export carries the tokenizer
    export.main(["--workdir", wd, "--format", "hf", "--out", str(tmp_path / "hf")])
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == \
        (tmp_path / "bpe" / "tokenizer.json").read_bytes()
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_config["eos_token_id"] == model.tok.eot_id and hf_config["vocab_size"] == 320
    if importlib.util.find_spec("transformers") is not None:   # (the optional extra [hf])
        import transformers
        auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
        assert auto.encode("def f1") == model.encode("def f1")
        assert auto.eos_token == "<|endoftext|>"
    c.data.update(source="llmc", train_files=done["train"][0], val_files=done["val"][0],
                  tokenizer="", val_fraction=0.05)
    c.steps = 1
    loop.train(c, str(tmp_path / "shards"))
    capsys.readouterr()
    with pytest.raises(SystemExit):
        generate.main(["--workdir", str(tmp_path / "shards"), "--prompt", "def"])
    assert "--config.data.tokenizer=PATH" in capsys.readouterr().err
    ids = generate.main(["--workdir", str(tmp_path / "shards"), "--prompt_ids", "5,6",
                         "--length", "3", "--config.data.tokenizer", str(tmp_path / "bpe")])
    assert isinstance(ids, list) and len(ids) == 3
