"""Image-text indexes for tests: PNG images of distinct solid colours and their jsonl index."""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image


def write_pairs(root: Path, captions: list[str], *, size: int = 20) -> Path:
    """One size x size PNG per caption, each its own colour, and ``root``/index.jsonl."""
    images = root / "images"
    images.mkdir(parents=True, exist_ok=True)
    with open(root / "index.jsonl", "w") as f:
        for i, caption in enumerate(captions):
            colour = (10 * i % 256, 200, 255 - 10 * i % 256)
            Image.new("RGB", (size, size), colour).save(images / f"{i}.png")
            f.write(json.dumps({"image": f"images/{i}.png", "text": caption}) + "\n")
    return root / "index.jsonl"
