"""Images as Idefics3 / SmolVLM take them: the image split into square tiles plus a global image, as transformers'
`Idefics3ImageProcessorPil` makes them, pixel for pixel (converted to RGB, the longest edge resized with PIL, each
edge then resized up to a multiple of the tile size, cut into rows x cols tiles, the whole image resized to one tile
last; rescaled and normalized as `image.rescale_and_normalize`), and the prompt text `Idefics3Processor` writes in
place of each `<image>`.

Every tile is `max_image_size` square (the resize makes each edge a multiple of it), so the processor's padding
never pads a real tile and the tower needs no patch mask."""

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tiffin.engine.multimodal.image import rescale_and_normalize, to_rgb

MAX_IMAGE_SIZE = 4096  # transformers' bound on the resized image's longest edge
FAKE_TOKEN, GLOBAL_TOKEN, IMAGE_TOKEN = "<fake_token_around_image>", "<global-img>", "<image>"


@dataclass(frozen=True)
class TileProcessor:
    """Idefics3ImageProcessor's settings (preprocessor_config.json's fields)."""

    longest_edge: int  # `size`: the longest edge the image is resized to first
    tile: int  # `max_image_size`: a tile's edge
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    resample: int = 1  # PIL's LANCZOS
    do_resize: bool = True
    do_image_splitting: bool = True
    do_rescale: bool = True
    do_normalize: bool = True

    @classmethod
    def read(cls, path: str | Path, tile: int) -> "TileProcessor":
        """The checkpoint's preprocessor_config.json (or processor_config.json's `image_processor`), else Idefics3's
        defaults at the tower's `tile` size."""
        path = Path(path)
        raw = json.loads(f.read_text()) if (f := path / "preprocessor_config.json").exists() else {}
        if not raw and (f := path / "processor_config.json").exists():
            raw = json.loads(f.read_text()).get("image_processor", {})
        if raw.get("do_convert_rgb") is False:
            raise ValueError(f"{path}: do_convert_rgb false is not supported; tiffin converts images to RGB")
        keys = ("image_mean", "image_std", "rescale_factor", "resample", "do_resize", "do_image_splitting",
                "do_rescale", "do_normalize")  # fmt: skip
        return cls(
            longest_edge=(raw.get("size") or {}).get("longest_edge", 4 * tile),
            tile=(raw.get("max_image_size") or {}).get("longest_edge", tile),
            **{k: tuple(raw[k]) if isinstance(raw[k], list) else raw[k] for k in keys if raw.get(k) is not None},
        )

    @property
    def crop_size(self) -> tuple[int, int]:
        """A tile's height and width: every pixel tensor the tower takes is this size."""
        return self.tile, self.tile

    def __call__(self, image) -> tuple[torch.Tensor, int, int]:
        """`image` (a PIL image) as its tiles, float32 [rows * cols + 1, 3, tile, tile] (the global image last; alone
        when the image fits one tile: rows = cols = 0), and the rows and columns of the grid."""
        image = to_rgb(image)
        if self.do_resize:
            image = self.resize(image, *longest_edge_size(image.height, image.width, self.longest_edge))
        if not self.do_image_splitting:
            frames, rows, cols = [self.resize(image, self.tile, self.tile)], 0, 0
        else:
            image = self.resize(image, *tile_multiple_size(image.height, image.width, self.tile))
            pixels = np.asarray(image)
            rows, cols = (image.height - 1) // self.tile + 1, (image.width - 1) // self.tile + 1
            if rows * cols == 1:
                frames, rows, cols = [pixels], 0, 0
            else:
                t = self.tile
                frames = [pixels[r * t : (r + 1) * t, c * t : (c + 1) * t] for r in range(rows) for c in range(cols)]
                frames.append(self.resize(image, t, t))
        pixels = torch.from_numpy(np.stack([np.asarray(f) for f in frames])).permute(0, 3, 1, 2)
        return rescale_and_normalize(pixels, self), rows, cols

    def resize(self, image, height: int, width: int):
        from PIL import Image

        return image.resize((width, height), resample=Image.Resampling(self.resample))


def longest_edge_size(height: int, width: int, longest: int) -> tuple[int, int]:
    """The longest edge made `longest` (the other one even, at least 1), then scaled below MAX_IMAGE_SIZE."""
    aspect = width / height
    if width >= height:
        width, height = longest, int(longest / aspect)
        height += height % 2
    else:
        height, width = longest, int(longest * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    if max(height, width) > MAX_IMAGE_SIZE:  # aspect as the resized image has it, as transformers computes it
        aspect = width / height
        if width >= height:
            width, height = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE / aspect)
        else:
            height, width = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE * aspect)
    return max(height, 1), max(width, 1)


def tile_multiple_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """Each edge rounded up to a multiple of `tile`: the longer first, the shorter from it at the image's aspect."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


def image_prompt(rows: int, cols: int) -> str:
    """What Idefics3Processor writes for an image of `rows` x `cols` tiles, with one `<image>` where each tile's run of
    image tokens goes (the tokenizer splits text at these added tokens, so the runs expand after tokenizing)."""
    tile = f"{FAKE_TOKEN}{GLOBAL_TOKEN}{IMAGE_TOKEN}{FAKE_TOKEN}"
    if rows == cols == 0:
        return tile
    grid = "".join(
        "".join(f"{FAKE_TOKEN}<row_{r + 1}_col_{c + 1}>{IMAGE_TOKEN}" for c in range(cols)) + "\n" for r in range(rows)
    )
    return f"{grid}\n{tile}"
