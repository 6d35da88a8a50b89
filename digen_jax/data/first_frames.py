"""The images image-conditioned videos start from (Wan2.2-TI2V, `data.first_frames`), per prompt.

`data.first_frames` names the source:

* ``'synthetic'``: a deterministic image per prompt (smooth colours and a disc drawn from the
  seed and the prompt's id), for tests, throughput runs and random prompt embeddings;
* the path of a text file: line i holds the image (a path; relative paths start at the file's
  folder) for the prompt on line i of the prompt file the embedding cache was encoded from (the
  cache's `prompt_ids`), so one image list serves every cache made from that prompt file. Images
  are resized to the video's size (Lanczos, aspect not kept: give images of the video's aspect)
  and mapped to [-1, 1], as diffusers' Wan image-to-video pipeline preprocesses its image.

Either gives ``images(prompt_ids)``: (n, 3, H, W) float32 in [-1, 1], where `prompt_ids` are
the prompts' source ids (`prompt_metadata`'s 'prompt_id'). The run encodes them with the VAE's
encoder into the latent the sampler keeps clean (`rl.rollout.Conditioning.first_frame`).
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
from PIL import Image

SYNTHETIC = "synthetic"


class SyntheticImages:
    """A deterministic (3, H, W) image per prompt id: a two-colour gradient of random direction
    and a disc of a third colour, all drawn from (seed, id)."""

    def __init__(self, height: int, width: int, seed: int):
        self.height, self.width, self.seed = height, width, seed

    def __call__(self, prompt_ids: Sequence[int]) -> np.ndarray:
        y, x = np.meshgrid(np.linspace(-1, 1, self.height), np.linspace(-1, 1, self.width), indexing="ij")
        out = []
        for i in prompt_ids:
            rng = np.random.default_rng([self.seed, int(i)])
            colours = rng.uniform(-1, 1, (3, 3, 1, 1)).astype(np.float32)
            angle, (cy, cx), radius = rng.uniform(0, 2 * np.pi), rng.uniform(-0.5, 0.5, 2), rng.uniform(0.2, 0.6)
            ramp = (np.cos(angle) * x + np.sin(angle) * y + 1) / 2
            image = colours[0] * (1 - ramp) + colours[1] * ramp
            out.append(np.where((x - cx) ** 2 + (y - cy) ** 2 < radius**2, colours[2], image))
        return np.stack(out).astype(np.float32)


class ImageList:
    """Images named one per line of a text file, line i for the prompt of source line i."""

    def __init__(self, path: str, height: int, width: int):
        self.path, self.height, self.width = path, height, width
        with open(path, encoding="utf-8") as f:
            lines = [line.strip() for line in f]
        folder = os.path.dirname(os.path.abspath(path))
        self.files = [os.path.join(folder, line) if line else "" for line in lines]

    def check(self, prompt_ids: Sequence[int]) -> None:
        """ValueError naming the first prompt (source line) without a readable image file."""
        for i in sorted({int(i) for i in prompt_ids}):
            if i >= len(self.files) or not self.files[i]:
                raise ValueError(f"{self.path} names no image on line {i + 1} (prompt-file line {i + 1}); "
                                 "give one image path per line of the prompt file")
            if not os.path.isfile(self.files[i]):
                raise ValueError(f"{self.path} line {i + 1}: no image file {self.files[i]}")

    def __call__(self, prompt_ids: Sequence[int]) -> np.ndarray:
        return np.stack([self._load(self.files[int(i)]) for i in prompt_ids])

    def _load(self, file: str) -> np.ndarray:
        with Image.open(file) as image:
            image = image.convert("RGB").resize((self.width, self.height), Image.Resampling.LANCZOS)
        return (np.asarray(image, np.float32) / 127.5 - 1.0).transpose(2, 0, 1)


def open_first_frames(source: str, height: int, width: int, seed: int) -> SyntheticImages | ImageList:
    """The images of `data.first_frames` = `source` at the video's size."""
    if source == SYNTHETIC:
        return SyntheticImages(height, width, seed)
    return ImageList(source, height, width)
