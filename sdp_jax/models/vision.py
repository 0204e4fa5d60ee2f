"""Vision models in Flax NNX for SDP: ResNet-18, WideResNet-18 and Swin-Tiny for 32x32 images.

Every model is an ``nnx.Module`` whose parameters (``nnx.Param``) and BatchNorm running statistics
(``nnx.BatchStat``) form nested dicts (``nnx.to_pure_dict(nnx.state(model, nnx.Param))``); the
computation itself is a pure function of those dicts (:func:`forward`), so that the SDP step can run
the same code on a worker's *compact* parameters (fewer blocks, fewer channels / neurons / heads).
Images are NHWC float32 ``[B, 32, 32, C]``; logits float32 ``[B, classes]``.

Maskable components (what each model declares through :func:`components`):

* blocks (B-SDP): the residual blocks of every stage, ``{stage}/b{j}``. A dropped block is its
  shortcut (docs/design.md invariant 5): identity, or for the first block of a downsampling ResNet stage
  the 1x1 projection shortcut ``{stage}/proj`` (always-kept) followed by the block's ReLU.
  Swin patch-merging layers ``{stage}/merge`` are always-kept.
* neurons (N-SDP): ResNet ``channels``: the inner channels of each basic block (the first conv's
  outputs = the second conv's inputs, with their BatchNorm), so neighbouring layers stay
  consistent; Swin ``mlp`` hidden units and attention ``heads`` of each block.

ResNet-18 (He et al. 2016, "Deep residual learning", Sec. 4.2, CIFAR variant): 3x3 stem conv with
no max-pool, 4 stages of 2 basic blocks, widths ``(64, 128, 256, 512) * widen``, post-activation
``relu(bn2(conv2(relu(bn1(conv1 x)))) + shortcut(x))``. WideResNet-18 is the same network widened
(``widen=2`` in ``configs/wrn18_cifar.py``; Zagoruyko & Komodakis 2016 widen the channels of every
block the same way).

Swin-Tiny (Liu et al. 2021, "Swin Transformer", Sec. 3) adapted to 32x32 inputs (our choice; the SDP
paper does not give its adaptation): patch size 2 (16x16 tokens) instead of 4, window 4 instead
of 7; embed dim 96, depths (2, 2, 6, 2), heads (3, 6, 12, 24), MLP ratio 4, so the four stages see
16x16, 8x8, 4x4 and 2x2 tokens. A stage whose resolution is at most the window uses one window of
its whole resolution and no shift (as Swin does at 224 px in its last stage). Relative position
bias, pre-norm LayerNorm, GELU MLP, cyclic-shift shifted windows with the attention mask.

``subnet_rescale``: when a compact N-SDP block runs with ``k`` of its ``G`` channels, MLP neurons
or heads, the branch is multiplied by ``G / k`` (inverted dropout, Srivastava et al. 2014, Sec.
10), as in :class:`sdp_jax.models.llama.LlamaConfig`; no effect on the full model.

BatchNorm statistics: in training, each worker normalizes by its own batch's statistics (as
DDP without SyncBatchNorm does); the running mean / variance (momentum 0.9) are averaged by the SDP
step over the workers that hold the layer, like parameters (see :func:`sdp_jax.train.families.vision_step`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sdp_jax import fields
from sdp_jax.fields import setting

RESNETS = ("resnet18", "wrn18")
MODELS = RESNETS + ("swin_t",)
# The fields of a run config's model section (VisionConfig.section): shared, then per model.
SHARED_FIELDS = ("name", "num_classes", "image_size", "in_channels", "subnet_rescale")
RESNET_FIELDS = ("width", "widen", "depths")
WIDEN = {"wrn18": 2}   # WideResNet-18: ResNet-18 of twice the width (Zagoruyko & Komodakis 2016)
SWIN_FIELDS = ("embed_dim", "depths", "num_heads", "window", "patch", "mlp_ratio")
BN_MOMENTUM = 0.9
BN_EPS = 1e-5
LN_EPS = 1e-5


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """Shape of a vision model. Sizes are element counts.

    Attributes:
      name: ``resnet18``, ``wrn18`` or ``swin_t``.
      num_classes: classifier outputs (10 for CIFAR-10 and digits, 100 for CIFAR-100).
      image_size: input height = width in pixels (32).
      in_channels: 3.
      width: ResNet base width (64: ResNet-18's 64, 128, 256, 512).
      widen: ResNet widening factor (WideResNet-18: 2, which :meth:`section` gives it).
      depths: blocks per stage (default: ResNet-18's (2, 2, 2, 2), Swin-T's (2, 2, 6, 2)).
      embed_dim, num_heads, window, patch, mlp_ratio: Swin shape.
      subnet_rescale: see the module docstring.
    """

    SECTION = "model"

    name: str = setting("resnet18", "the model: resnet18, wrn18 (WideResNet-18) or swin_t",
                        choices=MODELS)
    num_classes: int = setting(10, "classifier outputs (10 for CIFAR-10 and the digits, 100 for "
                               "CIFAR-100; a run config's 0 = the dataset's)", low=1,
                               run_default=0, rule="a positive integer, or 0 in a run config")
    image_size: int = setting(32, "input height = width in pixels", low=1)
    in_channels: int = setting(3, "input channels", low=1)
    width: int = setting(64, "ResNet base width (64: 64, 128, 256, 512 channels per stage)",
                         low=1)
    widen: int = setting(1, "ResNet widening factor (wrn18: 2)", low=1)
    depths: tuple = setting((), "blocks per stage (() = the model's: ResNet-18's (2, 2, 2, 2), "
                            "Swin-T's (2, 2, 6, 2))")
    embed_dim: int = setting(96, "Swin: token width of the first stage", low=1)
    num_heads: tuple = setting((3, 6, 12, 24), "Swin: attention heads per stage")
    window: int = setting(4, "Swin: attention window", low=1)
    patch: int = setting(2, "Swin: patch size", low=1)
    mlp_ratio: int = setting(4, "Swin: MLP width over the token width", low=1)
    subnet_rescale: bool = setting(True, "N-SDP: scale a pruned layer's output by configured / "
                                   "held (inverted dropout), so the full model sees the "
                                   "trained scale")

    def __post_init__(self):
        fields.check_settings(self)
        default = (2, 2, 2, 2) if self.name in RESNETS else (2, 2, 6, 2)
        object.__setattr__(self, "depths", tuple(self.depths) or default)
        object.__setattr__(self, "num_heads", tuple(self.num_heads))
        if not self.depths or any(isinstance(d, bool) or not isinstance(d, int) or d < 1
                                  for d in self.depths):
            raise ValueError(f"model.depths={self.depths!r} must be positive integers.")
        if self.name in RESNETS:
            return
        if len(self.num_heads) != len(self.depths):
            raise ValueError(f"model.num_heads={self.num_heads} needs one entry per stage of "
                             f"model.depths={self.depths}.")
        if self.image_size % self.patch:
            raise ValueError(f"model.image_size={self.image_size} must be a multiple of "
                             f"model.patch={self.patch}.")
        res = self.image_size // self.patch
        for s in range(len(self.depths)):
            d, h = self.embed_dim * 2 ** s, self.num_heads[s]
            if d % h:
                raise ValueError(f"Swin stage {s}: width {d} is not divisible by "
                                 f"model.num_heads[{s}]={h}.")
            if s and res % 2:
                raise ValueError(f"Swin stage {s}: patch merging needs an even resolution, got "
                                 f"{res}; use image_size / patch = a multiple of "
                                 f"{2 ** (len(self.depths) - 1)}.")
            res = res // 2 if s else res
            w = min(self.window, res)
            if res % w:
                raise ValueError(f"Swin stage {s}: resolution {res} is not a multiple of the "
                                 f"window {w}; change model.window or model.image_size.")

    @classmethod
    def section(cls, name: str) -> dict:
        """The ``model`` section of a run config of model ``name``: the fields that model
        reads (the shared ones, then ResNet's or Swin's), with their defaults (the one place
        they are declared: this class; a run config's where it has its own, ``num_classes``
        0 = the dataset's).

        Raises:
          ValueError: an unknown ``name``."""
        own = RESNET_FIELDS if name in RESNETS else SWIN_FIELDS
        values = dataclasses.asdict(cls(name=name, widen=WIDEN.get(name, 1)))
        values.update({f.name: f.metadata["run_default"] for f in fields.settings(cls)
                       if f.metadata["run_default"] != f.default})
        return {k: values[k] for k in SHARED_FIELDS + own}

    @classmethod
    def from_config(cls, cfg: Any) -> "VisionConfig":
        """From an ``ml_collections.ConfigDict`` (or dict) ``model`` section.

        Raises:
          ValueError: unknown keys (listing the valid ones) or a bad value."""
        return fields.from_section(cls, cfg, "model",
                                   f" for model.name={dict(cfg).get('name')!r}")

    @property
    def is_resnet(self) -> bool:
        return self.name in RESNETS

    def stage_width(self, s: int) -> int:
        """Channels (ResNet) or token width (Swin) of stage ``s``."""
        if self.is_resnet:
            return self.width * self.widen * 2 ** s
        return self.embed_dim * 2 ** s

    def stage_resolution(self, s: int) -> int:
        """Feature-map side (pixels or tokens) inside stage ``s``."""
        if self.is_resnet:
            return self.image_size // 2 ** s
        return self.image_size // self.patch // 2 ** s

    def stage_window(self, s: int) -> tuple[int, int]:
        """Swin (window side, shift) of stage ``s``: one whole-resolution window and no shift when
        the resolution is at most ``window``."""
        res = self.stage_resolution(s)
        if res <= self.window:
            return res, 0
        return self.window, self.window // 2


# ------------------------------------------------------------------------------------------
# Component declarations
# ------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Stage:
    """A stage of residual blocks ``key/b0 .. key/b{blocks-1}``; ``down``: block 0 changes the
    shape (ResNet downsampling block: stride 2 and fewer input channels)."""

    key: str
    blocks: int
    down: bool


@dataclasses.dataclass(frozen=True)
class NeuronKind:
    """A neuron-level component kind of a block: ``leaves`` maps a block-relative parameter path
    to (component axis, indices per component); ``stats`` the same for BatchNorm statistics."""

    name: str
    leaves: dict
    stats: dict


def components(cfg: VisionConfig) -> tuple[list[Stage], list[NeuronKind]]:
    """The maskable components of a model: its stages of blocks and its neuron-level kinds."""
    stages = [Stage(f"s{s}", d, cfg.is_resnet and s > 0) for s, d in enumerate(cfg.depths)]
    if cfg.is_resnet:
        kinds = [NeuronKind("channels",
                            {("conv1", "kernel"): (3, 1), ("bn1", "scale"): (0, 1),
                             ("bn1", "bias"): (0, 1), ("conv2", "kernel"): (2, 1)},
                            {("bn1", "mean"): (0, 1), ("bn1", "var"): (0, 1)})]
    else:
        kinds = [NeuronKind("mlp", {("mlp", "fc1_w"): (1, 1), ("mlp", "fc1_b"): (0, 1),
                                    ("mlp", "fc2_w"): (0, 1)}, {}),
                 NeuronKind("heads", {("attn", "qkv_w"): (2, 1), ("attn", "qkv_b"): (1, 1),
                                      ("attn", "rel_bias"): (1, 1), ("attn", "proj_w"): (0, 1)},
                            {})]
    return stages, kinds


# ------------------------------------------------------------------------------------------
# Layers (pure functions of parameter dicts)
# ------------------------------------------------------------------------------------------

def conv2d(x, kernel, stride: int = 1):
    """x [B, H, W, Cin], kernel [kh, kw, Cin, Cout] -> [B, H/stride, W/stride, Cout]; padding
    kh // 2 on each side (PyTorch's CIFAR ResNet convention)."""
    pad = kernel.shape[0] // 2
    return jax.lax.conv_general_dilated(x, kernel.astype(x.dtype), (stride, stride),
                                        [(pad, pad), (pad, pad)],
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))


def batch_norm(x, p, s, train: bool):
    """BatchNorm (Ioffe & Szegedy 2015, Alg. 1) over all axes but the last.

    Args:
      x: [..., C]. p: {scale, bias} float32 [C]. s: {mean, var} float32 [C] running statistics.
      train: normalize by this batch's statistics and return updated running ones (momentum
        ``BN_MOMENTUM``); else normalize by the running statistics.
    Returns:
      (y with x's dtype, new statistics).
    """
    x32 = x.astype(jnp.float32)
    axes = tuple(range(x.ndim - 1))
    if train:
        mean = jnp.mean(x32, axes)
        var = jnp.mean(jnp.square(x32 - mean), axes)
        new = {"mean": BN_MOMENTUM * s["mean"] + (1 - BN_MOMENTUM) * mean,
               "var": BN_MOMENTUM * s["var"] + (1 - BN_MOMENTUM) * var}
    else:
        mean, var, new = s["mean"], s["var"], s
    y = (x32 - mean) * jax.lax.rsqrt(var + BN_EPS) * p["scale"] + p["bias"]
    return y.astype(x.dtype), new


def layer_norm(x, p):
    """LayerNorm over the last axis; p: {scale, bias} [d]."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, -1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), -1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + LN_EPS) * p["scale"] + p["bias"]
    return y.astype(x.dtype)


# ------------------------------------------------------------------------------------------
# ResNet
# ------------------------------------------------------------------------------------------

def resnet_branch(cfg: VisionConfig, p, s, x, stride: int, train: bool, width: int,
                  scale: float = 1.0):
    """Residual branch ``bn2(conv2(relu(bn1(conv1 x))))`` of a basic block (before the sum).

    ``width``: the block's configured inner channels ``G``; a compact block with ``k < G`` inner
    channels is rescaled by ``G / k`` before ``bn2`` (``subnet_rescale``). ``scale``: factor on
    the branch output (B-SDP, see :func:`block_scale`). Returns (y, stats)."""
    h = conv2d(x, p["conv1"]["kernel"], stride)
    h, s1 = batch_norm(h, p["bn1"], s["bn1"], train)
    h = conv2d(jax.nn.relu(h), p["conv2"]["kernel"])
    held = p["conv2"]["kernel"].shape[2]
    if cfg.subnet_rescale and held != width:
        h = h * (width / held)
    h, s2 = batch_norm(h, p["bn2"], s["bn2"], train)
    if scale != 1.0:
        h = h * scale
    return h, {"bn1": s1, "bn2": s2}


def resnet_projection(p, s, x, train: bool):
    """1x1 stride-2 projection shortcut with BatchNorm. Returns (y, stats)."""
    y = conv2d(x, p["conv"]["kernel"], 2)
    y, st = batch_norm(y, p["bn"], s["bn"], train)
    return y, {"bn": st}


def resnet_block(cfg, p, s, x, train, stage: int, first: bool, proj=None, scale: float = 1.0):
    """One basic block; ``proj`` = (params, stats) of the projection shortcut for the first
    block of a downsampling stage. Returns (y, block stats, projection stats or None)."""
    stride = 2 if (first and stage > 0) else 1
    y, st = resnet_branch(cfg, p, s, x, stride, train, cfg.stage_width(stage), scale)
    pst = None
    if proj is not None:
        short, pst = resnet_projection(proj[0], proj[1], x, train)
    else:
        short = x
    return jax.nn.relu(y + short), st, pst


def _resnet_stem(params, stats, x, train):
    h = conv2d(x, params["stem"]["conv"]["kernel"])
    h, st = batch_norm(h, params["stem"]["bn"], stats["stem"]["bn"], train)
    return jax.nn.relu(h), {"bn": st}


def _head(params, h):
    return (h.astype(jnp.float32) @ params["head"]["kernel"] + params["head"]["bias"])


def _ckpt(remat: bool, fn):
    """Activation checkpointing of one block (Chen et al. 2016, "Training deep nets with sublinear
    memory cost"): keep only its inputs and recompute the rest in the backward pass."""
    if not remat:
        return fn
    return jax.checkpoint(fn, policy=jax.checkpoint_policies.nothing_saveable)


def _run_blocks(fn, inputs: list, h, remat: bool, unroll: bool):
    """Blocks of equal shapes in order: ``h, y_j = fn(inputs[j], h)`` (``inputs[j]`` a pytree:
    block ``j``'s parameters, statistics, flags). Returns ``(h, [y_j])``.

    With activation checkpointing and two or more blocks they run as ``lax.scan`` over the
    stacked inputs with the block checkpointed: XLA:CPU removes ``jax.checkpoint``'s
    optimization barriers before its common-subexpression pass, which then merges a
    recomputation outside a loop back into the forward pass (ResNet-18 DDP at batch 64
    compiled to the same 779 MiB peak with and without it, measured), while a loop body's
    recomputation stays in the backward loop. ``unroll``: the scan unrolled (XLA counts a
    loop body's FLOPs once; for the FLOP count). Otherwise (one block, or no checkpointing)
    the blocks run one after the other."""
    if not (remat and len(inputs) >= 2):
        ys = []
        for x in inputs:
            h, y = _ckpt(remat, fn)(x, h)
            ys.append(y)
        return h, ys
    stacked = jax.tree.map(lambda *xs: jnp.stack([jnp.asarray(x) for x in xs]), *inputs)
    h, ys = jax.lax.scan(_ckpt(True, lambda h, x: fn(x, h)), h, stacked, unroll=unroll)
    return h, [_index(ys, j) for j in range(len(inputs))]


def resnet_forward(cfg: VisionConfig, params, stats, x, train: bool, slots=None, slot0=None,
                   remat: bool = False, unroll: bool = False):
    """ResNet logits.

    Args:
      params, stats: nested dicts (see :class:`ResNet`); a stage given in the *slot* form
        ``{proj?, slots: {...[k, ...]}}`` runs ``k`` blocks whose global indices are
        ``slots[stage_key]`` (int32 [k], ascending, possibly traced; B-SDP), with block 0 of a
        downsampling stage padded to the slot shape.
      x: images [B, H, W, C]; train: batch statistics (and updated running ones).
      slot0: static {stage_key: "down" | "regular" | "mixed"}: what slot 0 of a downsampling
        stage holds on every worker (see :func:`_first_slot`; default mixed).
    Returns:
      (logits float32 [B, classes], new stats with the structure of ``stats``).
    """
    h, st = _resnet_stem(params, stats, x, train)
    new = {"stem": st}
    for s, depth in enumerate(cfg.depths):
        key = f"s{s}"
        sp, ss = params[key], stats[key]
        proj = (sp["proj"], ss["proj"]) if "proj" in sp else None
        if "slots" in sp:
            h, new[key] = _resnet_slots(cfg, sp, ss, h, train, s, slots[key],
                                        (slot0 or {}).get(key, "mixed"), remat, unroll)
            continue
        out, start = {}, 0
        if proj is not None or s > 0:   # block 0 with its projection shortcut, stride 2
            fn = _ckpt(remat, lambda p, st, h, pr, s=s: resnet_block(
                cfg, p, st, h, train, s, True, pr))
            h, out["b0"], pst = fn(sp["b0"], ss["b0"], h, proj)
            if pst is not None:
                out["proj"] = pst
            start = 1
        # the others (stride 1: stage 0's block 0 is one of them) have equal shapes
        h, ys = _run_blocks(lambda ps, h, s=s: resnet_block(cfg, ps[0], ps[1], h, train, s,
                                                           False)[:2],
                            [(sp[f"b{j}"], ss[f"b{j}"]) for j in range(start, depth)], h,
                            remat, unroll)
        out.update({f"b{j}": y for j, y in zip(range(start, depth), ys)})
        new[key] = out
    h = jnp.mean(h, axis=(1, 2))
    return _head(params, h), new


def block_scale(cfg: VisionConfig, stage: int, held: int) -> float:
    """Factor on the residual branch of each held block when a B-SDP worker runs ``held`` of the
    ``L_s`` blocks of ``stage``: ``L_s / held`` with ``subnet_rescale`` (else 1).

    This is stochastic depth's test-time rule applied at training time instead (Huang et al.
    2016, "Deep networks with stochastic depth", Sec. 3: a block that survives with probability
    p contributes p times its branch to the full network): with every block held by a fraction
    ``held / L_s`` of the workers, the full model (all branches, factor 1) then sees residual
    sums of the size its subnetworks were trained at, and so do the BatchNorm running
    statistics downstream. Measured on the digits default (ResNet-18 / 4, B-SDP C = 1/2), the
    full model's test accuracy without it collapsed to 0.41 while every subnetwork fit its
    batches; our choice, the SDP paper does not say."""
    depth = cfg.depths[stage]
    return depth / held if (cfg.subnet_rescale and held != depth) else 1.0


def _index(tree, j):
    return jax.tree.map(lambda a: a[j], tree)


def _first_slot(cfg, p, st, pp, ps, x, train, s, is_down, scale, kind):
    """Slot 0 of a downsampling B-SDP stage: block 0 (``is_down``) or, when block 0 is dropped,
    its projection shortcut followed by the regular block held in the slot.

    Both cases end in the same ``bn1 -> relu -> conv2 -> bn2`` on ``[B, H/2, W/2, C]``; they
    differ in the first conv (stride 2 on ``x`` with ``cin`` input channels, or stride 1 on
    ``relu(proj x)``) and in the shortcut (``proj x`` or ``relu(proj x)``). ``kind`` (static):
    ``down`` / ``regular`` when every worker's slot 0 holds that kind, else ``mixed``: both first
    convs run and the worker's is selected (a conditional would avoid one conv, but
    differentiating convolutions inside ``lax.cond`` ran 6x slower on XLA:CPU, measured).
    Returns (y, slot statistics, projection statistics)."""
    cin = x.shape[-1]
    short, pst = resnet_projection(pp, ps, x, train)
    y1 = jax.nn.relu(short)
    kernel = p["conv1"]["kernel"]
    if kind != "regular":
        a_down = conv2d(x, kernel[:, :, :cin, :], 2)
    if kind != "down":
        a_reg = conv2d(y1, kernel)
    a = a_down if kind == "down" else a_reg if kind == "regular" else jnp.where(
        is_down, a_down, a_reg)
    base = short if kind == "down" else y1 if kind == "regular" else jnp.where(is_down, short, y1)
    h, s1 = batch_norm(a, p["bn1"], st["bn1"], train)
    h = conv2d(jax.nn.relu(h), p["conv2"]["kernel"])
    held, width = p["conv2"]["kernel"].shape[2], cfg.stage_width(s)
    if cfg.subnet_rescale and held != width:
        h = h * (width / held)
    h, s2 = batch_norm(h, p["bn2"], st["bn2"], train)
    return jax.nn.relu(base + h * scale), {"bn1": s1, "bn2": s2}, pst


def _resnet_slots(cfg, sp, ss, h, train, s, ids, first="mixed", remat=False, unroll=False):
    """A B-SDP stage: ``k`` held blocks in depth order; the others are their shortcuts. (Without
    checkpointing a scan over the slots measured more temporary memory than the unrolled loop,
    Swin-T B-SDP; with it the slots after the first run under a scan, :func:`_run_blocks`.)"""
    slots, sstats = sp["slots"], ss["slots"]
    k = jax.tree.leaves(slots)[0].shape[0]
    scale = block_scale(cfg, s, k)
    out, new = {}, []
    start = 0
    if "proj" in sp:  # downsampling stage: block 0 is held (slot 0) or replaced by its shortcut
        fn = _ckpt(remat, lambda p, st, pp, ps, h, down: _first_slot(
            cfg, p, st, pp, ps, h, train, s, down, scale, first))
        h, st0, out["proj"] = fn(_index(slots, 0), _index(sstats, 0), sp["proj"], ss["proj"], h,
                                 ids[0] == 0)
        new.append(st0)
        start = 1
    def block(ps, h):
        r, st = resnet_branch(cfg, ps[0], ps[1], h, 1, train, cfg.stage_width(s), scale)
        return jax.nn.relu(h + r), st
    h, ys = _run_blocks(block, [(_index(slots, j), _index(sstats, j)) for j in range(start, k)],
                        h, remat, unroll)
    new += ys
    new_slots = jax.tree.map(lambda *xs: jnp.stack(xs), *new)
    out["slots"] = new_slots
    return h, out


# ------------------------------------------------------------------------------------------
# Swin
# ------------------------------------------------------------------------------------------

def relative_position_index(w: int) -> np.ndarray:
    """Index into the ``[(2w-1)^2, H]`` bias table for each pair of a w x w window: int32
    [w*w, w*w] (Liu et al. 2021, Sec. 3.2, "Relative position bias")."""
    coords = np.stack(np.meshgrid(np.arange(w), np.arange(w), indexing="ij")).reshape(2, -1)
    rel = coords[:, :, None] - coords[:, None, :] + (w - 1)
    return (rel[0] * (2 * w - 1) + rel[1]).astype(np.int32)


def shift_mask(res: int, w: int, shift: int) -> np.ndarray:
    """Additive attention mask of shifted windows: float32 [nW, w*w, w*w], 0 within a region,
    -100 across regions of the cyclically shifted map (Liu et al. 2021, Sec. 3.2)."""
    region = np.zeros((res, res), np.int32)
    cuts = (slice(0, res - w), slice(res - w, res - shift), slice(res - shift, res))
    n = 0
    for a in cuts:
        for b in cuts:
            region[a, b] = n
            n += 1
    win = region.reshape(res // w, w, res // w, w).transpose(0, 2, 1, 3).reshape(-1, w * w)
    return np.where(win[:, :, None] != win[:, None, :], -100.0, 0.0).astype(np.float32)


def _windows(x, w):
    B, H, W_, C = x.shape
    x = x.reshape(B, H // w, w, W_ // w, w, C).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(B, (H // w) * (W_ // w), w * w, C)


def _unwindows(x, w, res):
    B, _, _, C = x.shape
    x = x.reshape(B, res // w, res // w, w, w, C).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(B, res, res, C)


def swin_attention(cfg, p, x, stage: int, shifted):
    """(Shifted-)window multi-head self-attention of one block.

    Args:
      p: {qkv_w [d, 3, H, hd], qkv_b [3, H, hd], rel_bias [(2w-1)^2, H], proj_w [H, hd, d],
        proj_b [d]} (``H`` may be a compact ``k`` heads).
      x: [B, res, res, d]. shifted: bool (may be traced): shift the windows by ``w // 2``.
    Returns: [B, res, res, d].
    """
    res = cfg.stage_resolution(stage)
    w, shift = cfg.stage_window(stage)
    if shift:
        amount = jnp.where(shifted, shift, 0)
        x = jnp.roll(x, (-amount, -amount), axis=(1, 2))
    xw = _windows(x, w)  # [B, nW, w*w, d]
    qkv = jnp.einsum("bntd,dchk->cbnhtk", xw, p["qkv_w"].astype(x.dtype)) \
        + p["qkv_b"].astype(x.dtype)[:, None, None, :, None, :]
    q, k, v = qkv[0], qkv[1], qkv[2]  # [B, nW, H, T, hd]
    hd = q.shape[-1]
    att = jnp.einsum("bnhtk,bnhsk->bnhts", q, k).astype(jnp.float32) / math.sqrt(hd)
    bias = p["rel_bias"][relative_position_index(w)]  # [T, T, H]
    att = att + jnp.transpose(bias, (2, 0, 1))[None, None]
    if shift:
        mask = jnp.asarray(shift_mask(res, w, shift)) * shifted
        att = att + mask[None, :, None]
    att = jax.nn.softmax(att, axis=-1).astype(x.dtype)
    o = jnp.einsum("bnhts,bnhsk->bnthk", att, v)
    out = jnp.einsum("bnthk,hkd->bntd", o, p["proj_w"].astype(x.dtype)) + p["proj_b"].astype(
        x.dtype)
    held = p["qkv_w"].shape[2]
    if cfg.subnet_rescale and held != cfg.num_heads[stage]:
        out = out * (cfg.num_heads[stage] / held)
    out = _unwindows(out, w, res)
    if shift:
        out = jnp.roll(out, (amount, amount), axis=(1, 2))
    return out


def swin_block(cfg, p, x, stage: int, shifted, scale: float = 1.0):
    """``x + attn(norm1 x)``, then ``x + mlp(norm2 x)`` (GELU MLP), both branches times
    ``scale`` (B-SDP, see :func:`block_scale`). x: [B, res, res, d]."""
    x = x + scale * swin_attention(cfg, p["attn"], layer_norm(x, p["norm1"]), stage, shifted)
    m = p["mlp"]
    h = jax.nn.gelu(layer_norm(x, p["norm2"]) @ m["fc1_w"].astype(x.dtype)
                    + m["fc1_b"].astype(x.dtype))
    out = h @ m["fc2_w"].astype(x.dtype) + m["fc2_b"].astype(x.dtype)
    held, full = m["fc1_w"].shape[1], cfg.stage_width(stage) * cfg.mlp_ratio
    if cfg.subnet_rescale and held != full:
        out = out * (full / held)
    return x + scale * out


def patch_merge(p, x):
    """2x2 neighbouring tokens concatenated (4d), LayerNorm, linear to 2d. [B, r, r, d] ->
    [B, r/2, r/2, 2d]."""
    x = jnp.concatenate([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2],
                         x[:, 1::2, 1::2]], axis=-1)
    return layer_norm(x, p["norm"]) @ p["reduction_w"].astype(x.dtype)


def swin_forward(cfg: VisionConfig, params, stats, x, train: bool, slots=None, slot0=None,
                 remat: bool = False, unroll: bool = False):
    """Swin logits; same contract as :func:`resnet_forward` (``stats`` is empty: no
    BatchNorm). In the slot form a block's shift is that of its global index (odd blocks are
    shifted)."""
    del train, slot0
    e = params["embed"]
    h = conv2d(x, e["kernel"], 1) if cfg.patch == 1 else jax.lax.conv_general_dilated(
        x, e["kernel"].astype(x.dtype), (cfg.patch, cfg.patch), "VALID",
        dimension_numbers=("NHWC", "HWIO", "NHWC"))
    h = layer_norm(h + e["bias"].astype(h.dtype), params["embed_norm"])
    for s, depth in enumerate(cfg.depths):
        sp = params[f"s{s}"]
        if s > 0:
            h = patch_merge(sp["merge"], h)
        # a block's inputs: (parameters, shifted windows?); the shift is traced under the scan
        if "slots" in sp:
            ids = slots[f"s{s}"]
            k = jax.tree.leaves(sp["slots"])[0].shape[0]
            inputs, scale = [(_index(sp["slots"], j), ids[j] % 2 == 1) for j in range(k)], \
                block_scale(cfg, s, k)
        else:
            inputs, scale = [(sp[f"b{j}"], j % 2 == 1) for j in range(depth)], 1.0
        h, _ = _run_blocks(lambda ps, h, s=s, scale=scale: (
            swin_block(cfg, ps[0], h, s, ps[1], scale), None), inputs, h, remat, unroll)
    h = layer_norm(jnp.mean(h, axis=(1, 2)), params["final_norm"])
    return _head(params, h), stats


def forward(cfg: VisionConfig, params, stats, x, train: bool, slots=None, slot0=None,
            remat: bool = False, unroll: bool = False):
    """Logits float32 [B, classes] and new BatchNorm statistics of any vision model (full,
    compact N-SDP, or B-SDP slot form); see :func:`resnet_forward`. ``remat``: activation
    checkpointing of every block (blocks of equal shapes under ``lax.scan``, see
    :func:`_run_blocks`); ``unroll``: those scans unrolled (for FLOP counting)."""
    fn = resnet_forward if cfg.is_resnet else swin_forward
    return fn(cfg, params, stats, x, train, slots, slot0, remat, unroll)


def cross_entropy(logits, labels):
    """Mean softmax cross-entropy (nats); logits float32 [B, K], labels int32 [B]."""
    logz = jax.nn.logsumexp(logits, axis=-1)
    return jnp.mean(logz - jnp.take_along_axis(logits, labels[:, None], axis=-1)[:, 0])


# ------------------------------------------------------------------------------------------
# NNX modules (declare and initialize the parameters; __call__ runs :func:`forward`)
# ------------------------------------------------------------------------------------------

def _he(rngs, shape):
    fan_in = int(np.prod(shape[:-1]))
    return nnx.Param(jax.random.normal(rngs.params(), shape, jnp.float32)
                     * math.sqrt(2.0 / fan_in))


def _trunc(rngs, shape, std=0.02):
    return nnx.Param(jax.random.truncated_normal(rngs.params(), -2, 2, shape, jnp.float32) * std)


class _Conv(nnx.Module):
    def __init__(self, shape, rngs):
        self.kernel = _he(rngs, shape)


class _BN(nnx.Module):
    def __init__(self, c):
        self.scale = nnx.Param(jnp.ones((c,), jnp.float32))
        self.bias = nnx.Param(jnp.zeros((c,), jnp.float32))
        self.mean = nnx.BatchStat(jnp.zeros((c,), jnp.float32))
        self.var = nnx.BatchStat(jnp.ones((c,), jnp.float32))


class _LN(nnx.Module):
    def __init__(self, d):
        self.scale = nnx.Param(jnp.ones((d,), jnp.float32))
        self.bias = nnx.Param(jnp.zeros((d,), jnp.float32))


class _Head(nnx.Module):
    def __init__(self, d, classes, rngs):
        self.kernel = _trunc(rngs, (d, classes))
        self.bias = nnx.Param(jnp.zeros((classes,), jnp.float32))


class BasicBlock(nnx.Module):
    """ResNet basic block parameters: conv1 [3,3,Cin,C], bn1, conv2 [3,3,C,C], bn2."""

    def __init__(self, cin, c, rngs):
        self.conv1 = _Conv((3, 3, cin, c), rngs)
        self.bn1 = _BN(c)
        self.conv2 = _Conv((3, 3, c, c), rngs)
        self.bn2 = _BN(c)


class _Projection(nnx.Module):
    def __init__(self, cin, c, rngs):
        self.conv = _Conv((1, 1, cin, c), rngs)
        self.bn = _BN(c)


class _Stem(nnx.Module):
    def __init__(self, cin, c, rngs):
        self.conv = _Conv((3, 3, cin, c), rngs)
        self.bn = _BN(c)


class _Stage(nnx.Module):
    pass


class _Model(nnx.Module):
    """Shared: pure-dict views and ``__call__`` through :func:`forward`."""

    cfg: VisionConfig

    def params(self) -> dict:
        """Nested dict of float32 parameter arrays."""
        return nnx.to_pure_dict(nnx.state(self, nnx.Param))

    def batch_stats(self) -> dict:
        """Nested dict of BatchNorm running statistics (empty for Swin)."""
        return nnx.to_pure_dict(nnx.state(self, nnx.BatchStat))

    def __call__(self, x, train: bool = False):
        """images float32 [B, H, W, C] -> logits float32 [B, classes]; ``train=True`` normalizes
        by batch statistics and updates the running ones in place."""
        logits, new = forward(self.cfg, self.params(), self.batch_stats(), x, train)
        if train and new:
            state = nnx.state(self, nnx.BatchStat)
            nnx.replace_by_pure_dict(state, new)
            nnx.update(self, state)
        return logits


class ResNet(_Model):
    """ResNet-18 / WideResNet-18 for 32x32 images (see the module docstring). Parameters::

        stem: {conv: {kernel [3,3,Cin,C0]}, bn: {scale, bias [C0]}}
        s{i}: {proj (i > 0): {conv: {kernel [1,1,C_{i-1},C_i]}, bn},
               b{j}: {conv1: {kernel}, bn1, conv2: {kernel}, bn2}}
        head: {kernel [C3, classes], bias [classes]}
    """

    def __init__(self, cfg: VisionConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        c0 = cfg.stage_width(0)
        self.stem = _Stem(cfg.in_channels, c0, rngs)
        cin = c0
        for s, depth in enumerate(cfg.depths):
            c = cfg.stage_width(s)
            st = _Stage()
            if s > 0:
                st.proj = _Projection(cin, c, rngs)
            for j in range(depth):
                setattr(st, f"b{j}", BasicBlock(cin if j == 0 else c, c, rngs))
            setattr(self, f"s{s}", st)
            cin = c
        self.head = _Head(cin, cfg.num_classes, rngs)


class _Attention(nnx.Module):
    def __init__(self, d, heads, w, rngs):
        hd = d // heads
        self.qkv_w = _trunc(rngs, (d, 3, heads, hd))
        self.qkv_b = nnx.Param(jnp.zeros((3, heads, hd), jnp.float32))
        self.rel_bias = _trunc(rngs, ((2 * w - 1) ** 2, heads))
        self.proj_w = _trunc(rngs, (heads, hd, d))
        self.proj_b = nnx.Param(jnp.zeros((d,), jnp.float32))


class _Mlp(nnx.Module):
    def __init__(self, d, f, rngs):
        self.fc1_w = _trunc(rngs, (d, f))
        self.fc1_b = nnx.Param(jnp.zeros((f,), jnp.float32))
        self.fc2_w = _trunc(rngs, (f, d))
        self.fc2_b = nnx.Param(jnp.zeros((d,), jnp.float32))


class SwinBlock(nnx.Module):
    """Swin block parameters: norm1, attn {qkv_w [d,3,H,hd], qkv_b, rel_bias [(2w-1)^2,H],
    proj_w [H,hd,d], proj_b}, norm2, mlp {fc1_w [d,F], fc1_b, fc2_w [F,d], fc2_b}."""

    def __init__(self, d, heads, w, f, rngs):
        self.norm1 = _LN(d)
        self.attn = _Attention(d, heads, w, rngs)
        self.norm2 = _LN(d)
        self.mlp = _Mlp(d, f, rngs)


class _Merge(nnx.Module):
    def __init__(self, d, rngs):
        self.norm = _LN(4 * d)
        self.reduction_w = _trunc(rngs, (4 * d, 2 * d))


class _Embed(nnx.Module):
    def __init__(self, p, cin, d, rngs):
        self.kernel = _trunc(rngs, (p, p, cin, d))
        self.bias = nnx.Param(jnp.zeros((d,), jnp.float32))


class Swin(_Model):
    """Swin-Tiny for 32x32 images (see the module docstring). Parameters::

        embed: {kernel [p,p,Cin,D], bias}, embed_norm: {scale, bias}
        s{i}: {merge (i > 0): {norm [4 d_{i-1}], reduction_w [4 d_{i-1}, d_i]}, b{j}: SwinBlock}
        final_norm, head: {kernel [d_last, classes], bias}
    """

    def __init__(self, cfg: VisionConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = _Embed(cfg.patch, cfg.in_channels, cfg.embed_dim, rngs)
        self.embed_norm = _LN(cfg.embed_dim)
        for s, depth in enumerate(cfg.depths):
            d = cfg.stage_width(s)
            st = _Stage()
            if s > 0:
                st.merge = _Merge(cfg.stage_width(s - 1), rngs)
            w, _ = cfg.stage_window(s)
            for j in range(depth):
                setattr(st, f"b{j}", SwinBlock(d, cfg.num_heads[s], w, d * cfg.mlp_ratio, rngs))
            setattr(self, f"s{s}", st)
        d = cfg.stage_width(len(cfg.depths) - 1)
        self.final_norm = _LN(d)
        self.head = _Head(d, cfg.num_classes, rngs)


def build(cfg: VisionConfig, seed: int = 0) -> _Model:
    """The NNX model of ``cfg`` initialized from ``seed``."""
    cls = ResNet if cfg.is_resnet else Swin
    return cls(cfg, nnx.Rngs(seed))


def param_count(cfg: VisionConfig) -> int:
    """Number of parameters (elements) of the full model."""
    model = nnx.eval_shape(lambda: build(cfg))
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(model.params())))
