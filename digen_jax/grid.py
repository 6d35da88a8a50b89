"""Sample grids: images side by side, nearest-upscaled, each with its prompt written under it."""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from PIL import Image, ImageDraw, ImageFont


def _wrap(text: str, font, width: int) -> list[str]:
    """`text` in lines no wider than `width` pixels (at word breaks; a longer word is cut)."""
    lines: list[str] = []
    for word in text.split():
        line = f"{lines[-1]} {word}" if lines else word
        if lines and font.getlength(line) <= width:
            lines[-1] = line
            continue
        while font.getlength(word) > width and len(word) > 1:
            cut = 1
            while font.getlength(word[: cut + 1]) <= width:
                cut += 1
            lines.append(word[:cut])
            word = word[cut:]
        lines.append(word)
    return lines


def image_grid(images: np.ndarray, captions: Sequence[str] | None = None, scale: int = 8) -> Image.Image:
    """(B, H, W, 3) floats in [0, 1] -> one RGB grid on white, each image `scale` times larger
    (nearest) and its caption, when given, wrapped to the image's width in a band under it."""
    batch, h, w, _ = images.shape
    cols = math.ceil(math.sqrt(batch))
    rows = math.ceil(batch / cols)
    cell_w, cell_h, gap = w * scale, h * scale, scale
    font = ImageFont.load_default()
    lines = [_wrap(c, font, cell_w - 4) for c in captions] if captions is not None else [[] for _ in range(batch)]
    if len(lines) != batch:
        raise ValueError(f"{len(lines)} captions for {batch} images")
    line_h = font.getbbox("Ag")[3] + 2
    band = max(len(x) for x in lines) * line_h + 4 if any(lines) else 0
    grid = Image.new("RGB", (cols * (cell_w + gap) - gap, rows * (cell_h + band + gap) - gap), "white")
    draw = ImageDraw.Draw(grid)
    pixels = (np.clip(images, 0, 1) * 255).round().astype(np.uint8)
    for n in range(batch):
        r, c = divmod(n, cols)
        x, y = c * (cell_w + gap), r * (cell_h + band + gap)
        grid.paste(Image.fromarray(pixels[n]).resize((cell_w, cell_h), Image.NEAREST), (x, y))
        for i, line in enumerate(lines[n]):
            draw.text((x + 2, y + cell_h + 2 + i * line_h), line, fill="black", font=font)
    return grid
