"""Images as Qwen2-VL takes them: resized so that each edge is a multiple of a patch times the merge size and the
pixel count lies within [min_pixels, max_pixels] (`smart_resize`), then rescaled and normalized
(`image.rescale_and_normalize`) and cut into flat patches, as transformers' `Qwen2VLImageProcessorPil` makes them,
pixel for pixel.

Invariant: an image's pixel values are `[rows, cols, merge, merge, channels * temporal_patch * patch * patch]`, where
(rows, cols) is its grid of image tokens (one per merge x merge square of patches): flattened to 2-D, the rows of
transformers' `pixel_values`, each patch repeated `temporal_patch` times over time as a still image is. The shape
alone gives the image's token count and its M-RoPE grid (`multimodal.mrope`)."""

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tiffin.engine.multimodal.image import CLIP_MEAN, CLIP_STD, rescale_and_normalize, to_rgb

MAX_ASPECT = 200  # transformers refuses longer/shorter edge ratios past it


@dataclass(frozen=True)
class PatchProcessor:
    """Qwen2VLImageProcessor's settings (preprocessor_config.json's fields)."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = 3  # PIL's BICUBIC
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True

    @classmethod
    def read(cls, path: str | Path) -> "PatchProcessor":
        """The checkpoint's preprocessor_config.json (`size` or the older `min_pixels` / `max_pixels`), else
        Qwen2-VL's defaults."""
        path = Path(path)
        raw = json.loads(f.read_text()) if (f := path / "preprocessor_config.json").exists() else {}
        if raw.get("do_convert_rgb") is False:
            raise ValueError(f"{path}: do_convert_rgb false is not supported; tiffin converts images to RGB")
        size = raw.get("size") or {}
        bounds = {"min_pixels": size.get("shortest_edge", raw.get("min_pixels")),
                  "max_pixels": size.get("longest_edge", raw.get("max_pixels"))}  # fmt: skip
        keys = ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std", "rescale_factor",
                "resample", "do_resize", "do_rescale", "do_normalize")  # fmt: skip
        given = {k: raw[k] for k in keys if raw.get(k) is not None} | {k: v for k, v in bounds.items() if v}
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in given.items()})

    @property
    def factor(self) -> int:
        """What each resized edge is a multiple of: one image token's pixels."""
        return self.patch_size * self.merge_size

    def __call__(self, image) -> torch.Tensor:
        """`image` (a PIL image) as its patches (the module's invariant), float32; ValueError for an aspect ratio
        past MAX_ASPECT."""
        from PIL import Image

        image = to_rgb(image)
        if self.do_resize:
            height, width = smart_resize(image.height, image.width, self.factor, self.min_pixels, self.max_pixels)
            image = image.resize((width, height), resample=Image.Resampling(self.resample))
        pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1)
        return self.patchify(rescale_and_normalize(pixels, self))

    def patchify(self, pixels: torch.Tensor) -> torch.Tensor:
        """[C, H, W] -> the module's invariant layout (each edge a multiple of `factor`)."""
        c, h, w = pixels.shape
        p, m = self.patch_size, self.merge_size
        rows, cols = h // self.factor, w // self.factor
        x = pixels.view(c, rows, m, p, cols, m, p).permute(1, 4, 2, 5, 0, 3, 6)  # rows, cols, mh, mw, c, ph, pw
        x = x[:, :, :, :, :, None].expand(-1, -1, -1, -1, -1, self.temporal_patch_size, -1, -1)
        return x.reshape(rows, cols, m, m, -1).contiguous()

    def largest(self) -> torch.Tensor:
        """The pixel values of the image of the most tokens this processor makes (the memory profile's)."""
        side = math.isqrt(self.max_pixels // self.factor**2) * self.factor
        m, dim = self.merge_size, 3 * self.temporal_patch_size * self.patch_size**2
        return torch.zeros(side // self.factor, side // self.factor, m, m, dim)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Each edge rounded to a multiple of `factor`, then both scaled (at the image's aspect) into
    [min_pixels, max_pixels], as transformers' `smart_resize` does; ValueError past MAX_ASPECT."""
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ValueError(f"an image of {width}x{height} pixels: an aspect ratio past {MAX_ASPECT} is not supported")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w
