"""Image classification input pipelines: CIFAR-10 / CIFAR-100 through TensorFlow Datasets and
grain, and an embedded default of real images that needs no download.

Datasets (``data.dataset``):

``digits`` (default)
    The 1,797 handwritten digits (8x8, 17 grey levels) that scikit-learn ships inside its
    package (UCI "Optical Recognition of Handwritten Digits"), bilinearly resized to
    ``image_size`` and repeated over ``in_channels``; a fixed split of 1,437 training and 360
    test images (seed 0). Optional dependency: ``pip install 'sdp_jax[vision]'``.
``cifar10`` / ``cifar100``
    Read with ``tfds.data_source(name, split=..., data_dir=data.tfds_data_dir)`` (random access
    to TFDS' ArrayRecord files; ``tfds build cifar10`` prepares them once). Splits ``train`` and
    ``test``. Optional dependency: ``pip install 'sdp_jax[tfds]'``.

Training batches: the process's share of the training split, reshuffled every epoch, with the
standard CIFAR augmentation (He et al. 2016, Sec. 4.2): zero-pad 4 pixels, random 32x32 crop,
random horizontal flip (for digits: random shifts of up to 2 pixels and no flip, since digits are
not mirror-symmetric), then per-channel normalization:
``grain.MapDataset.source(...).shuffle(seed).repeat().random_map(augment).map(normalize).batch()``.
A run's data position is its step (the same global batches on any process layout).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import grain
import numpy as np

from sdp_jax import fields
from sdp_jax.fields import setting
from sdp_jax.train.data.tokens import Origin, Stream, iterate, layout_free_batches, process_rows

DATASETS = ("digits", "cifar10", "cifar100")
CLASSES = {"digits": 10, "cifar10": 10, "cifar100": 100}
# Per-channel mean / std of the training images in [0, 1] (the values torchvision users quote).
_STATS = {"cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
          "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))}
DIGITS_TEST = 360


@dataclasses.dataclass(frozen=True)
class VisionDataConfig:
    """The ``data`` section of a vision run, each field declared once
    (:func:`sdp_jax.fields.setting`).

    Raises:
      ValueError: an unknown dataset or a field of the wrong type (naming
        ``config.data.FIELD``)."""

    SECTION = "data"

    dataset: str = setting("digits", "digits (scikit-learn's handwritten digits, no download), "
                           "cifar10 or cifar100 (TFDS)", choices=DATASETS)
    tfds_data_dir: str = setting("", "TFDS' data folder for CIFAR ('' = its default, "
                                 "~/tensorflow_datasets)")
    augment: bool = setting(True, "training augmentation: pad-crop and flip for CIFAR, shifts "
                            "of up to 2 pixels for the digits")
    worker_count: int = setting(0, "grain worker processes that load batches (0 = in the "
                                "training process)", low=0, control=True)

    def __post_init__(self):
        fields.check_settings(self)


class ArraySource(grain.sources.RandomAccessDataSource):
    """In-memory (image uint8 [N, H, W, C], label int32 [N]) records for grain."""

    def __init__(self, images: np.ndarray, labels: np.ndarray):
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        return {"image": self.images[i], "label": self.labels[i]}

    def __repr__(self) -> str:
        return f"ArraySource({len(self)} images {self.images.shape[1:]})"


@functools.lru_cache(maxsize=4)
def _digits(image_size: int, channels: int) -> tuple:
    try:
        from sklearn.datasets import load_digits  # pylint: disable=g-import-not-at-top
    except ImportError as e:
        raise ImportError("data.dataset='digits' needs scikit-learn (it ships the images): "
                          "pip install 'sdp_jax[vision]'") from e
    import jax  # pylint: disable=g-import-not-at-top

    d = load_digits()
    x = d.images.astype(np.float32) / 16.0  # [1797, 8, 8] in [0, 1]
    x = np.asarray(jax.image.resize(x, (len(x), image_size, image_size), "bilinear"))
    x = np.clip(np.round(x * 255), 0, 255).astype(np.uint8)[..., None].repeat(channels, -1)
    y = d.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(y))
    test, train = order[:DIGITS_TEST], order[DIGITS_TEST:]
    return (x[train], y[train]), (x[test], y[test])


def _tfds_source(name: str, split: str, data_dir: str):
    try:
        import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
    except ImportError as e:
        raise ImportError(f"data.dataset={name!r} reads TensorFlow Datasets: "
                          "pip install 'sdp_jax[tfds]'") from e
    try:
        return tfds.data_source(name, split=split, data_dir=data_dir or None, download=False)
    except Exception as e:  # tfds raises many types (not prepared, no network, bad dir)
        where = data_dir or "the default tfds data_dir (~/tensorflow_datasets)"
        raise ValueError(
            f"could not open tfds dataset {name!r} split {split!r} in {where}: "
            f"{type(e).__name__}: {str(e)[:300]}. Prepare it first (`tfds build {name} "
            f"--file_format=array_record{' --data_dir=' + data_dir if data_dir else ''}` on a "
            "machine with network: random access needs ArrayRecord files) "
            "or point --config.data.tfds_data_dir at a directory that has it.") from e


def _check(cfg: Any):
    fields.from_section(VisionDataConfig, cfg, "data")   # unknown keys, the declared rules


def open_split(data_cfg: Any, split: str, image_size: int, channels: int):
    """A grain random-access source of ``split`` (``train`` or ``test``) whose records are
    ``{"image": uint8 [H, W, C], "label": int}``, checked against the model's input.

    Raises:
      ValueError: unknown dataset; images whose shape is not ``[image_size, image_size,
        channels]`` (names both shapes and the fix); a split that cannot be opened.
      ImportError: the optional dependency of the dataset is missing.
    """
    _check(data_cfg)
    if data_cfg.dataset == "digits":
        tr, te = _digits(image_size, channels)
        src = ArraySource(*(tr if split == "train" else te))
    else:
        src = _tfds_source(data_cfg.dataset, split, data_cfg.tfds_data_dir)
    if len(src) == 0:
        raise ValueError(f"data.dataset={data_cfg.dataset!r} split {split!r} is empty.")
    first = src[0]
    if "image" not in first or "label" not in first:
        raise ValueError(f"data.dataset={data_cfg.dataset!r}: records need 'image' and 'label' "
                         f"features, got {sorted(first)}.")
    shape = tuple(np.asarray(first["image"]).shape)
    if shape != (image_size, image_size, channels):
        raise ValueError(
            f"data.dataset={data_cfg.dataset!r} has images of shape {shape}, but the model "
            f"expects {(image_size, image_size, channels)} (model.image_size={image_size}, "
            f"model.in_channels={channels}); set --config.model.image_size / in_channels to "
            "match the data.")
    return src


def normalization(data_cfg: Any, image_size: int, channels: int) -> tuple:
    """(mean, std) float32 [C] of the training images in [0, 1]."""
    if data_cfg.dataset in _STATS:
        m, s = _STATS[data_cfg.dataset]
        return np.asarray(m[:channels], np.float32), np.asarray(s[:channels], np.float32)
    (x, _), _ = _digits(image_size, channels)
    x = x.astype(np.float32) / 255
    return x.mean((0, 1, 2)), x.std((0, 1, 2))


def _augment(rec, rng: np.random.Generator, pad: int, flip: bool):
    img = np.asarray(rec["image"])
    h, w = img.shape[:2]
    padded = np.pad(img, ((pad, pad), (pad, pad), (0, 0)))
    i, j = rng.integers(0, 2 * pad + 1, 2)
    img = padded[i:i + h, j:j + w]
    if flip and rng.random() < 0.5:
        img = img[:, ::-1]
    return {"image": img, "label": rec["label"]}


def _normalize(rec, mean, std):
    x = (np.asarray(rec["image"], np.float32) / 255.0 - mean) / std
    return x, np.int32(rec["label"])


def _collate(items):
    return (np.stack([x for x, _ in items]).astype(np.float32),
            np.asarray([y for _, y in items], np.int32))


def train_dataset(data_cfg: Any, *, image_size: int, channels: int, global_batch: int,
                  seed: int, process_index: int = 0, process_count: int = 1,
                  rows: tuple[int, int] | None = None, origin: Origin = Origin()):
    """The endless, shuffled, augmented training batches of this process (a
    ``grain.MapDataset``).

    The stream of training images (reshuffled every epoch, augmented with a seed per example)
    is cut into global batches of ``global_batch`` (running on across epochs), and this
    process gets its ``rows`` of each (:func:`sdp_jax.train.data.process_rows`,
    :func:`sdp_jax.train.data.layout_free_batches`): the same global batches on any process layout.
    ``origin``: where the stream begins (:class:`sdp_jax.train.data.Origin`).

    Returns:
      a ``grain.MapDataset`` of (images float32 [b, H, W, C] normalized, labels int32 [b])
      with ``b`` the process's row count (``global_batch // process_count`` by default).

    Raises:
      ValueError: see :func:`open_split`; a split with fewer images than a global batch.
    """

    rows = process_rows(global_batch, process_index, process_count, rows)
    src = open_split(data_cfg, "train", image_size, channels)
    if len(src) < global_batch:
        raise ValueError(f"the train split has {len(src)} images, fewer than one global batch "
                         f"of {global_batch}; lower --config.batch_per_worker.")
    mean, std = normalization(data_cfg, image_size, channels)
    ds = grain.MapDataset.source(src).shuffle(seed=int(seed)).repeat()
    if data_cfg.augment:
        digits = data_cfg.dataset == "digits"
        pad = 2 if digits else 4
        ds = ds.random_map(functools.partial(_augment, pad=pad, flip=not digits),
                           seed=int(seed) + 1)
    ds = ds.map(functools.partial(_normalize, mean=mean, std=std))
    return layout_free_batches(ds, examples=len(src), global_batch=global_batch, rows=rows,
                               drop_epoch_remainder=False, batch_fn=_collate, origin=origin)


READ_OPTIONS = grain.ReadOptions(num_threads=4, prefetch_buffer_size=4)


def make_train_iterator(data_cfg: Any, *, start: int = 0, **kwargs):
    """The iterator of :func:`train_dataset` (same keyword arguments) from batch ``start``
    (:func:`sdp_jax.train.data.iterate`, with ``data_cfg.worker_count`` grain worker processes)."""

    return iterate(train_dataset(data_cfg, **kwargs), start, int(data_cfg.worker_count),
                   READ_OPTIONS)


def train_stream(data_cfg: Any, **kwargs) -> Stream:
    """The :class:`sdp_jax.train.data.Stream` of :func:`make_train_iterator` (the keyword
    arguments of :func:`train_dataset` but ``origin``); raises what :func:`train_dataset`
    raises, here."""
    train_dataset(data_cfg, **kwargs)
    n = len(open_split(data_cfg, "train", kwargs["image_size"], kwargs["channels"]))
    return Stream(lambda start, origin: make_train_iterator(data_cfg, start=start, origin=origin,
                                                            **kwargs), n, False)


def make_eval_batches(data_cfg: Any, *, image_size: int, channels: int, global_batch: int,
                      process_index: int = 0, process_count: int = 1, limit: int = 0,
                      rows: tuple[int, int] | None = None) -> list:
    """The whole test split (or its first ``limit`` images) as this process's batches.

    Returns:
      list of (images float32 [b, H, W, C], labels int32 [b], valid bool [b]); the last batch is
      padded (``valid`` False) so that every example is counted exactly once.
    """

    first, per = process_rows(global_batch, process_index, process_count, rows)
    src = open_split(data_cfg, "test", image_size, channels)
    mean, std = normalization(data_cfg, image_size, channels)
    n = len(src) if limit <= 0 else min(limit, len(src))
    steps = -(-n // global_batch)
    out = []
    for s in range(steps):
        idx = [s * global_batch + first + i for i in range(per)]
        recs = [_normalize(src[i], mean, std) if i < n else None for i in idx]
        blank = np.zeros((image_size, image_size, channels), np.float32)
        x = np.stack([r[0] if r else blank for r in recs])
        y = np.asarray([r[1] if r else 0 for r in recs], np.int32)
        out.append((x, y, np.asarray([r is not None for r in recs])))
    return out


def describe(data_cfg: Any) -> str:
    """One line for the run log."""
    _check(data_cfg)
    if data_cfg.dataset == "digits":
        return ("data: digits (scikit-learn's 1,797 handwritten digits, resized; 1,437 train / "
                "360 test)")
    return (f"data: tfds:{data_cfg.dataset} ({data_cfg.tfds_data_dir or '~/tensorflow_datasets'})"
            f", augment={'on' if data_cfg.augment else 'off'}")
