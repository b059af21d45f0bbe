"""Image-text pairs for a vision-language job: a jsonl index of real images, or synthetic ones.

Every sample is a dict of tensors:

- ``pixel_values``: float32 ``(3, S, S)``, the image resized to the encoder's side S and
  normalised with the encoder's pixel mean and std;
- ``input_ids``: int64 ``(max_text_len,)``, BOS then the caption, padded with PAD;
- ``labels``: int64 ``(max_text_len,)``, the caption then EOS, each text position's *next*
  token, padded with IGNORE_INDEX.

So position t of the text predicts token t + 1 of ``[BOS] caption [EOS]``: the labels are
shifted here, once, and a model that copies its input token gains nothing. A caption longer
than ``max_text_len - 1`` tokens is cut (its EOS label is then cut too).

Both datasets are plain map-style datasets read through the same ShardedSampler and
stateful loader as text data, so a run resumes at the exact sample. A bad image never
becomes a silent zero tensor: with ``bad_images = 'skip'`` the sample is replaced by the
next readable one in index order (logged with the file's path), the same on every read, so
resuming stays exact; with ``'fail'`` it is a DataError naming the file and index line.

A sample recorded as bad data (bad_windows.py; window ``i`` is sample ``i``, window length
0) is skipped the same way as a token window: it is read as the next sample of the same
dataset that is not recorded, so the data order and the batch count stay as they were.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from kempnerforge.config.eval import DEFAULT_EVAL_SET
from kempnerforge.config.vlm import VisionSpec, VLMConfig
from kempnerforge.core.errors import DataError, DataPathError
from kempnerforge.core.logging import get_logger
from kempnerforge.data.bad_windows import BAD_DATA_FILE, BadWindowSkipping
from kempnerforge.data.dataset import IGNORE_INDEX, SampleDataset
from kempnerforge.data.tokenizer import Tokenizer

logger = get_logger(__name__)

SYNTHETIC_TRAIN = "synthetic"
SYNTHETIC_EVAL = "synthetic-heldout"

COLOURS: dict[str, tuple[float, float, float]] = {
    "red": (0.9, 0.1, 0.1),
    "green": (0.1, 0.8, 0.2),
    "blue": (0.15, 0.25, 0.95),
    "yellow": (0.95, 0.9, 0.1),
    "white": (0.97, 0.97, 0.97),
    "purple": (0.6, 0.15, 0.75),
}
SHAPES = ("square", "circle", "triangle", "cross")
PLACES = ("top left", "top right", "bottom left", "bottom right", "centre")


def caption_tensors(
    caption_ids: list[int], tokenizer: Tokenizer, max_text_len: int
) -> dict[str, torch.Tensor]:
    """``input_ids`` and shifted ``labels`` of one caption (see the module docstring)."""
    ids = [tokenizer.bos_id, *caption_ids, tokenizer.eos_id][: max_text_len + 1]
    inputs = np.full(max_text_len, tokenizer.pad_id, dtype=np.int64)
    labels = np.full(max_text_len, IGNORE_INDEX, dtype=np.int64)
    inputs[: len(ids) - 1] = ids[:-1]
    labels[: len(ids) - 1] = ids[1:]
    return {"input_ids": torch.from_numpy(inputs), "labels": torch.from_numpy(labels)}


def normalise_pixels(image: np.ndarray, spec: VisionSpec) -> torch.Tensor:
    """(S, S, 3) floats in [0, 1] -> (3, S, S) float32 normalised with the encoder's stats."""
    mean = np.asarray(spec.mean, dtype=np.float32)
    std = np.asarray(spec.std, dtype=np.float32)
    pixels = (image.astype(np.float32) - mean) / std
    return torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1)))


def _require_pillow() -> Any:
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - pillow is part of the vlm extra
        raise DataError(
            "reading image files needs Pillow: pip install 'kempnerforge[vlm]' (or leave "
            "vlm.data empty to train on the built-in synthetic images)"
        ) from None
    return Image


class ImageTextDataset(BadWindowSkipping, Dataset[dict[str, torch.Tensor]]):
    """Pairs listed in a jsonl index: one ``{"image": path, "text": caption}`` per line.

    Image paths are relative to the index's directory (absolute ones are kept). The index
    is read and checked when the dataset opens (a DataError names the line); the images
    are decoded with Pillow when a sample is read, converted to RGB, resized to the
    encoder's side with bicubic filtering and normalised.

    A pair listed in ``skip_windows`` (recorded as bad data) is never read, neither for its
    own sample nor in place of an unreadable image: its sample reads the next pair in index
    order that is neither.
    """

    def __init__(
        self,
        index_path: str,
        spec: VisionSpec,
        tokenizer: Tokenizer,
        max_text_len: int,
        bad_images: str = "skip",
    ) -> None:
        if bad_images not in ("skip", "fail"):
            raise ValueError(f"bad_images must be 'skip' or 'fail', got {bad_images!r}")
        self.path = index_path
        self.spec = spec
        self.tokenizer = tokenizer
        self.max_text_len = max_text_len
        self.bad_images = bad_images
        self.entries = _read_index(index_path)
        self._reported: set[int] = set()
        _require_pillow()

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        size = len(self.entries)
        if not 0 <= index < size:
            raise IndexError(f"sample {index} out of range [0, {size})")
        first = self.window_for(index)
        for offset in range(size):
            i = (first + offset) % size
            if i in self.skip_windows:
                continue
            image_path, text, _ = self.entries[i]
            try:
                pixels = self._load(image_path)
            except (OSError, ValueError, SyntaxError) as e:
                self._bad(i, e, index)
                continue
            ids = self.tokenizer.encode(text)
            caption = caption_tensors(ids, self.tokenizer, self.max_text_len)
            return {"pixel_values": pixels, **caption}
        if self.skip_windows:
            recorded = len(self.skip_windows)
            raise DataError(
                f"{self.path}: {recorded} of its {size} pairs are recorded as bad data "
                f"({BAD_DATA_FILE} in the checkpoint directory) and the images of the other "
                f"{size - recorded} cannot be read (each reported above); fix the image files "
                "or the index, or remove those lines to train on the recorded pairs again"
            )
        raise DataError(
            f"{self.path}: none of its {size} images can be read (each was reported above); "
            "fix the image files or the index"
        )

    def _load(self, image_path: str) -> torch.Tensor:
        image_module = _require_pillow()
        side = self.spec.image_size
        with image_module.open(image_path) as image:
            rgb = image.convert("RGB")
            if rgb.size != (side, side):
                rgb = rgb.resize((side, side), image_module.Resampling.BICUBIC)
            array = np.asarray(rgb, dtype=np.float32) / 255.0
        return normalise_pixels(array, self.spec)

    def _bad(self, i: int, error: Exception, asked: int) -> None:
        image_path, _, line = self.entries[i]
        where = f"{image_path} (line {line} of {self.path})"
        if self.bad_images == "fail":
            raise DataError(
                f"{where}: cannot read the image: {error}; fix or remove the file, or set "
                "vlm.bad_images = 'skip' to train past unreadable images"
            )
        if i not in self._reported:  # once per process: workers each report their own
            self._reported.add(i)
            logger.warning(
                "skipping unreadable image %s: %s; sample %d reads the next readable index "
                "entry instead (vlm.bad_images = 'skip')",
                where,
                error,
                asked,
            )


def _read_index(index_path: str) -> list[tuple[str, str, int]]:
    """(absolute image path, caption, line number) of every pair in the index."""
    try:
        with open(index_path, encoding="utf-8") as f:
            lines = f.readlines()
    except FileNotFoundError:
        raise DataError(
            f"{index_path}: no such file; give a jsonl index of image-text pairs"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{index_path}: cannot read the index: {e}") from None
    base = os.path.dirname(os.path.abspath(index_path))
    entries: list[tuple[str, str, int]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{index_path}, line {number}: not JSON ({e})") from None
        if not isinstance(record, dict):
            record = {}
        image, text = record.get("image"), record.get("text")
        if not isinstance(image, str) or not image or not isinstance(text, str):
            raise DataError(
                f"{index_path}, line {number}: each line must be an object with a non-empty "
                'string "image" (a path) and a string "text" (its caption)'
            )
        entries.append((os.path.join(base, image), text, number))
    if not entries:
        raise DataError(f"{index_path}: the index lists no image-text pairs")
    return entries


class SyntheticImageTextDataset(BadWindowSkipping, Dataset[dict[str, torch.Tensor]]):
    """Deterministic pictures of one coloured shape on a dark background, captioned with
    what they show ("a red circle at the top left").

    Sample i depends only on ``(seed, i)``, so every worker, rank and resumed run sees the
    same picture; a model can only learn the caption's colour, shape and place from the
    pixels, which makes it a real (if small) test that images reach the decoder. A sample
    listed in ``skip_windows`` (recorded as bad data) reads the next one not listed.
    """

    def __init__(
        self,
        num_samples: int,
        seed: int,
        spec: VisionSpec,
        tokenizer: Tokenizer,
        max_text_len: int,
        name: str = SYNTHETIC_TRAIN,
    ) -> None:
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        self.path = name
        self.num_samples = num_samples
        self.seed = seed
        self.spec = spec
        self.tokenizer = tokenizer
        self.max_text_len = max_text_len

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range [0, {self.num_samples})")
        image, caption = synthetic_picture(self.seed, self.window_for(index), self.spec.image_size)
        ids = self.tokenizer.encode(caption)
        return {
            "pixel_values": normalise_pixels(image, self.spec),
            **caption_tensors(ids, self.tokenizer, self.max_text_len),
        }


def synthetic_picture(seed: int, index: int, side: int) -> tuple[np.ndarray, str]:
    """The (side, side, 3) image in [0, 1] and caption of synthetic sample ``index``."""
    digest = hashlib.sha256(f"kempnerforge-synthetic-image:{seed}:{index}".encode()).digest()
    rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
    colour = list(COLOURS)[int(rng.integers(len(COLOURS)))]
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    place = PLACES[int(rng.integers(len(PLACES)))]
    image = np.empty((side, side, 3), dtype=np.float32)
    image[:] = rng.uniform(0.0, 0.2, size=3)  # a dark background of varying tint
    image += rng.normal(0.0, 0.02, size=image.shape).astype(np.float32)
    half = side / 2
    radius = side / 4 * rng.uniform(0.7, 1.0)
    cy = (half / 2 if "top" in place else 3 * half / 2) if place != "centre" else half
    cx = (half / 2 if "left" in place else 3 * half / 2) if place != "centre" else half
    y, x = np.mgrid[0:side, 0:side].astype(np.float32) + 0.5
    dy, dx = y - cy, x - cx
    if shape == "square":
        mask = (np.abs(dy) <= radius * 0.8) & (np.abs(dx) <= radius * 0.8)
    elif shape == "circle":
        mask = dy**2 + dx**2 <= radius**2
    elif shape == "triangle":
        mask = (dy <= radius * 0.8) & (dy >= -radius) & (np.abs(dx) <= (dy + radius) / 2)
    else:
        bar = radius * 0.3
        mask = ((np.abs(dy) <= bar) & (np.abs(dx) <= radius)) | (
            (np.abs(dx) <= bar) & (np.abs(dy) <= radius)
        )
    image[mask] = COLOURS[colour]
    return np.clip(image, 0.0, 1.0), f"a {colour} {shape} at the {place}"


ImageTextSource = ImageTextDataset | SyntheticImageTextDataset


def build_image_text_datasets(
    vlm: VLMConfig,
    spec: VisionSpec,
    tokenizer: Tokenizer,
    seed: int,
    *,
    with_train: bool = True,
) -> tuple[ImageTextSource | None, dict[str, SampleDataset]]:
    """The training set (None when ``with_train`` is false) and the named eval sets of a
    vision-language job.

    ``vlm.data`` empty: synthetic pictures (``vlm.synthetic_samples`` of them, seeded by
    ``seed``) with a held-out synthetic set of a quarter that size from another seed,
    unless ``vlm.eval_data`` names real held-out pairs. A missing or malformed index is a
    DataPathError naming the field that points at it.
    """

    def open_index(path: str, field: str) -> ImageTextDataset:
        try:
            return ImageTextDataset(path, spec, tokenizer, vlm.max_text_len, vlm.bad_images)
        except DataError as e:
            raise DataPathError(field, path, e) from None

    train: ImageTextSource | None = None
    if with_train:
        if vlm.data:
            train = open_index(vlm.data, "vlm.data")
        else:
            train = SyntheticImageTextDataset(
                vlm.synthetic_samples, seed, spec, tokenizer, vlm.max_text_len
            )
    evals: dict[str, SampleDataset] = {}
    if vlm.eval_data:
        evals[DEFAULT_EVAL_SET] = open_index(vlm.eval_data, "vlm.eval_data")
    elif not vlm.data:
        evals[DEFAULT_EVAL_SET] = SyntheticImageTextDataset(
            max(1, vlm.synthetic_samples // 4),
            seed + 1_000_003,
            spec,
            tokenizer,
            vlm.max_text_len,
            name=SYNTHETIC_EVAL,
        )
    return train, evals
