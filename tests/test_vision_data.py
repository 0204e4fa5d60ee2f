"""Vision data (digits, CIFAR in TFDS' on-disk format), config checks and the command line."""

import io
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from sdp_jax.train.config import vision_config
from sdp_jax.train.data import vision as vd
from sdp_jax.train.run import resolve

ROOT = pathlib.Path(__file__).resolve().parents[1]
sklearn = pytest.importorskip("sklearn", reason="digits need scikit-learn: pip install "
                                                "'sdp_jax[vision]'")


def _data(**kw):
    c = vision_config("resnet18", "digits").data
    c.update(kw)
    return c


def test_digits_batches_and_resume():
    cfg = _data()
    it = vd.make_train_iterator(cfg, image_size=32, channels=3, global_batch=64, seed=0)
    x, y = next(it)
    assert x.shape == (64, 32, 32, 3) and x.dtype == np.float32
    assert y.dtype == np.int32 and set(np.unique(y)) <= set(range(10))
    assert abs(float(x.mean())) < 0.5 and 0.5 < float(x.std()) < 2.0  # normalized
    for _ in range(23):   # 1437 images: step 23 spans the first two epochs
        a = next(it)
    it2 = vd.make_train_iterator(cfg, image_size=32, channels=3, global_batch=64, seed=0,
                                 start=23)   # resumes at a step: nothing per process is stored
    b = next(it2)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    halves = [vd.make_train_iterator(cfg, image_size=32, channels=3, global_batch=64, seed=0,
                                     start=23, process_index=p, process_count=2)
              for p in range(2)]   # the same global batch on 2 processes (augmented alike)
    parts = [next(h) for h in halves]
    np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]), a[0])
    np.testing.assert_array_equal(np.concatenate([p[1] for p in parts]), a[1])
    test = vd.make_eval_batches(cfg, image_size=32, channels=3, global_batch=64)
    assert sum(int(v.sum()) for _, _, v in test) == vd.DIGITS_TEST
    assert len(test) == -(-vd.DIGITS_TEST // 64) and not test[-1][2].all()


def _write_cifar(tmp_path, n_train=24, n_test=10):
    """A tiny dataset written by TFDS itself under the name cifar10 (ArrayRecord files)."""
    tfds = pytest.importorskip("tensorflow_datasets")
    PIL = pytest.importorskip("PIL.Image").__name__ and __import__("PIL.Image")
    rng = np.random.default_rng(0)
    images = {s: rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
              for s, n in (("train", n_train), ("test", n_test))}
    labels = {s: rng.integers(0, 10, len(v)) for s, v in images.items()}

    class Cifar10(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        VERSION = tfds.core.Version("3.0.2")

        def _info(self):
            return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
                "id": tfds.features.Text(), "image": tfds.features.Image(shape=(32, 32, 3)),
                "label": tfds.features.ClassLabel(num_classes=10)}))

        def _split_generators(self, dl_manager):
            return {s: self._generate_examples(s) for s in images}

        def _generate_examples(self, split):
            for i in range(len(labels[split])):  # PNG bytes: encoding arrays would need TF
                buf = io.BytesIO()
                PIL.Image.fromarray(images[split][i]).save(buf, format="PNG")
                yield f"{split}_{i}", {"id": f"{split}_{i}", "image": buf.getvalue(),
                                       "label": int(labels[split][i])}

    Cifar10(data_dir=str(tmp_path), file_format="array_record").download_and_prepare()
    return images, labels


def test_cifar_reads_tfds_on_disk_format(tmp_path):
    images, labels = _write_cifar(tmp_path)
    cfg = _data(dataset="cifar10", tfds_data_dir=str(tmp_path))
    src = vd.open_split(cfg, "train", 32, 3)
    assert len(src) == 24
    seen = sorted(np.asarray(src[i]["image"]).tobytes() for i in range(len(src)))
    assert seen == sorted(im.tobytes() for im in images["train"])
    it = vd.make_train_iterator(cfg, image_size=32, channels=3, global_batch=8, seed=1)
    x, y = next(it)
    assert x.shape == (8, 32, 32, 3) and y.shape == (8,)
    mean, std = vd.normalization(cfg, 32, 3)
    raw = np.round((x * std + mean) * 255)
    # Pad-4 crops keep 32x32 windows of the padded image: at most 4 zero rows/columns per side.
    assert raw.min() >= 0 and raw.max() <= 255
    cfg.augment = False
    plain = vd.make_train_iterator(cfg, image_size=32, channels=3, global_batch=8, seed=1)
    xp, yp = next(plain)
    np.testing.assert_array_equal(yp, y)  # augmentation keeps each label with its image
    pixels = {im.tobytes() for im in images["train"]}
    restored = np.round((xp * std + mean) * 255).astype(np.uint8)
    assert all(im.tobytes() in pixels for im in restored)
    test = vd.make_eval_batches(cfg, image_size=32, channels=3, global_batch=4)
    assert sum(int(v.sum()) for _, _, v in test) == 10
    with pytest.raises(ValueError, match=r"shape \(32, 32, 3\).*expects \(16, 16, 3\)"):
        vd.open_split(cfg, "train", 16, 3)
    with pytest.raises(ValueError, match="could not open tfds dataset 'cifar100'"):
        vd.open_split(_data(dataset="cifar100", tfds_data_dir=str(tmp_path)), "train", 32, 3)


def test_bad_vision_configs():
    c = vision_config("resnet18", "mnist")
    with pytest.raises(ValueError, match="config.data.dataset='mnist'; use one of digits, cifar10"):
        resolve(c, 8)
    c = vision_config("resnet18", "cifar100")
    c.model.num_classes = 10
    with pytest.raises(ValueError, match="num_classes=10 but cifar100 has 100"):
        resolve(c, 8)
    c = vision_config("resnet18", "digits")
    c.sdp.variant, c.sdp.coverage = "b-sdp", 0.3
    with pytest.raises(ValueError, match="not realizable"):
        resolve(c, 8)
    c = vision_config("resnet18", "digits")   # each channel held by one of 2 workers
    c.sdp.variant, c.sdp.coverage = "n-sdp", 0.5
    with pytest.raises(ValueError, match="resnet18: the mask graph .* disconnected.*"
                                         "allow_disconnected=True"):
        resolve(c, 2)
    c.sdp.allow_disconnected = True
    assert resolve(c, 2).plan.spectral_gap() < 1e-9
    c = vision_config("swin_t", "cifar10")
    c.model.depth = 3
    with pytest.raises(ValueError, match=r"unknown model config keys \['depth'\]"):
        resolve(c, 8)
    assert resolve(vision_config("wrn18", "cifar100"), 8).model.num_classes == 100
    c = vision_config("swin_t", "digits")  # every model field is a config field
    c.model.embed_dim, c.model.num_heads = 12, (3, 3, 3, 3)
    assert resolve(c, 8).model.stage_width(3) == 96


def _train(workdir, *extra):
    args = [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs" /
            "resnet18_digits.py"), f"--workdir={workdir}", "--config.model.width=4",
            "--config.model.depths=(2,2)", "--config.workers=4", "--config.num_cpu_devices=4",
            "--config.batch_per_worker=8",
            "--config.steps=4", "--config.eval_every=2", "--config.checkpoint_every=2",
            "--config.log_every=1", "--config.optim.warmup_steps=1", "--config.eval_limit=64",
            "--config.eval_bn_batches=2", "--config.sdp.variant=b-sdp",
            "--config.sdp.coverage=0.5", *extra]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.slow
def test_cli_vision_run_resumes(tmp_path):
    """A B-SDP ResNet run with FSDP (ZeRO-3) stops, resumes (also from a checkpoint of a release
    without ``sdp.method``, ``average``, ``sync_every``), re-estimates BatchNorm statistics for
    evaluation and refuses an unrealizable coverage before compute."""
    wd = tmp_path / "run"
    r = _train(wd, "--config.stop_at_step=2", "--config.fsdp=True")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "stopped at step 2 of 4" in r.stdout and "FSDP (ZeRO-3)" in r.stdout
    assert "re-estimates the full model's BatchNorm statistics" in r.stdout
    meta_file = wd / "checkpoints" / "2" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    for key in ("method", "average", "sync_every"):   # fields earlier releases did not record
        del meta["config"]["sdp"][key]
    meta_file.write_text(json.dumps(meta))
    r = _train(wd, "--config.fsdp=True")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resumed from" in r.stdout and "at step 2" in r.stdout
    summary = json.loads((wd / "summary.json").read_text())
    assert summary["completed"] and summary["steps"] == 4 and summary["model"] == "resnet18"
    assert summary["fsdp"] is True
    assert 0.0 <= summary["final_test_acc"] <= 1.0
    recs = [json.loads(line) for line in (wd / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert all("test_acc" in r for r in recs if r["step"] in (2, 4))
    bad = _train(tmp_path / "bad", "--config.sdp.coverage=0.3")
    assert bad.returncode == 2 and "not realizable" in bad.stderr
    assert not (tmp_path / "bad").exists()
