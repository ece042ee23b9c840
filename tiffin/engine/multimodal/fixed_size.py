"""Images resized to one fixed size, as transformers' `SiglipImageProcessorPil` makes them, pixel for pixel: RGB
(transparency composited on white), resized to `size` with PIL (the aspect ratio not kept, nothing cropped),
rescaled in float64 then cast to float32, normalized in float32 (`image.rescale_and_normalize`)."""

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tiffin.engine.multimodal.image import rescale_and_normalize, to_rgb

SIGLIP_MEAN = SIGLIP_STD = (0.5, 0.5, 0.5)


@dataclass(frozen=True)
class FixedSizeProcessor:
    """SiglipImageProcessor's settings (preprocessor_config.json's fields)."""

    size: tuple[int, int]  # height, width
    image_mean: tuple[float, ...] = SIGLIP_MEAN
    image_std: tuple[float, ...] = SIGLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = 3  # PIL's BICUBIC
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True

    @classmethod
    def read(cls, path: str | Path, image_size: int) -> "FixedSizeProcessor":
        """The checkpoint's preprocessor_config.json, else SigLIP's defaults at the tower's `image_size`. Images
        are always made RGB: the tower takes three channels (a `do_convert_rgb` of null or false would hand it
        an RGBA or grayscale image's other count)."""
        file = Path(path) / "preprocessor_config.json"
        raw = json.loads(file.read_text()) if file.exists() else {}
        size = raw.get("size") or {}
        size = {"height": size, "width": size} if isinstance(size, int) else size
        if set(size) - {"height", "width"}:
            raise ValueError(
                f"{file}: image size {size} is not supported; tiffin resizes SigLIP images to height x width"
            )
        keys = ("image_mean", "image_std", "rescale_factor", "resample", "do_resize", "do_rescale", "do_normalize")
        return cls(
            size=(size.get("height", image_size), size.get("width", image_size)),
            **{k: tuple(raw[k]) if isinstance(raw[k], list) else raw[k] for k in keys if raw.get(k) is not None},
        )

    @property
    def crop_size(self) -> tuple[int, int]:
        """The pixel values' height and width (every image's)."""
        return self.size

    def __call__(self, image) -> torch.Tensor:
        """`image` (a PIL image) as pixel values, float32 [3, height, width]."""
        from PIL import Image

        image = to_rgb(image)
        if self.do_resize:
            height, width = self.size
            image = image.resize((width, height), resample=Image.Resampling(self.resample))
        pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1)
        return rescale_and_normalize(pixels, self)
