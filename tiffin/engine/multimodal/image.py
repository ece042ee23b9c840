"""Images as a CLIP-style vision tower takes them: decoded within limits, then preprocessed as transformers' PIL image
processors do (`CLIPImageProcessorPil`, which `LlavaProcessor` uses), pixel for pixel: converted to RGB (transparency
composited on white), the shortest edge resized with PIL's bicubic, center-cropped, rescaled in float64 then cast to
float32, normalized in float32.

Decoding never allocates past `max_pixels`: a file's declared size is read from its header and refused before any
pixel is decoded (a decompression bomb of a few KB declaring 50,000² pixels costs nothing). Every refusal is a
ParamError naming the setting or the problem."""

import base64
import binascii
import io
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tiffin.engine.errors import ParamError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")  # what `decode_image` opens; GIF: its first frame
MAX_EXIF_BYTES = 65535  # a JPEG's APP1 segment holds at most this: no camera writes more
MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP", "image/gif": "GIF"}
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def decode_image(data: bytes, max_pixels: int, where: str = "image", declared: str | None = None):
    """The RGB PIL image `data` encodes (PNG, JPEG, WebP, or an animated file's first frame), fully decoded, turned
    upright by its EXIF orientation tag as transformers' `load_image` does (a phone's photo as its viewer shows it)
    and converted to RGB as every processor's first step does (`to_rgb`). ParamError naming `where` for an unsupported
    or corrupt file, one declaring more than `max_pixels` pixels, one of another format than the media type
    `declared` names (of MEDIA_TYPES; others are not checked), EXIF past MAX_EXIF_BYTES or that PIL cannot parse, or a
    palette PIL cannot convert; each before the pixels are decoded where its header tells."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    try:
        with warnings.catch_warnings():  # our limit decides, below
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=FORMATS)
    except UnidentifiedImageError:
        raise _refusal(where, f"{where}: not an image in a supported format ({', '.join(FORMATS)})") from None
    except Image.DecompressionBombError as e:  # past twice PIL's own limit: more than ours unless raised past it
        raise _refusal(where, f"{where}: more pixels than max_image_pixels={max_pixels} allows ({e})") from None
    except (OSError, ValueError) as e:
        raise _refusal(where, f"{where}: cannot be decoded: {e}") from None
    if MEDIA_TYPES.get(declared, image.format) != image.format:
        raise _refusal(where, f"{where}: the data URL declares {declared} but holds {image.format} data")
    check_pixels(image.size, max_pixels, where)
    try:
        image.load()  # an animated file stays on its first frame
    except (OSError, ValueError, SyntaxError, EOFError) as e:  # truncated or corrupt data
        raise _refusal(where, f"{where}: cannot be decoded ({image.format}): {e}") from None
    exif = len(image.info.get("exif") or b"") + len(image.info.get("Raw profile type exif") or "") // 2
    if exif > MAX_EXIF_BYTES:  # PIL parses EXIF in Python: a PNG's or WebP's of megabytes takes seconds
        raise _refusal(where, f"{where}: {exif} bytes of EXIF data, more than the {MAX_EXIF_BYTES} a JPEG may hold")
    try:
        ImageOps.exif_transpose(image, in_place=True)
    except Exception as e:  # noqa: BLE001 (PIL's EXIF parser raises struct.error, KeyError... on hostile data)
        raise _refusal(where, f"{where}: its EXIF data cannot be read: {type(e).__name__}: {e}") from None
    try:
        return to_rgb(image)
    except (OSError, ValueError) as e:  # a tRNS chunk longer than the palette, ...
        raise _refusal(where, f"{where}: cannot be converted to RGB ({image.mode}): {e}") from None


def check_pixels(size: tuple[int, int], max_pixels: int, where: str) -> None:
    width, height = size
    if width < 1 or height < 1:
        raise _refusal(where, f"{where}: an image of {width}x{height} pixels has no pixels")
    if width * height > max_pixels:
        raise _refusal(where, f"{where}: {width}x{height} pixels is more than max_image_pixels={max_pixels} allows")


def decode_data_url(url: str, max_pixels: int, max_bytes: int, where: str):
    """The image of a `data:image/...;base64,` URL (`decode_image`, checked against the media type it declares);
    ParamError naming `where` otherwise."""
    head, comma, payload = url.partition(",")
    if not comma or not head.startswith("data:") or not head.endswith(";base64"):
        raise _refusal(where, f"{where}: a data URL must be 'data:<media type>;base64,<data>'")
    if len(payload) * 3 // 4 > max_bytes:
        raise _refusal(where, f"{where}: the image's {len(payload) * 3 // 4} bytes exceed max_image_bytes={max_bytes}")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise _refusal(where, f"{where}: the data URL's payload is not valid base64") from None
    return decode_image(data, max_pixels, where, head.removeprefix("data:").removesuffix(";base64").lower())


def _refusal(where: str, message: str) -> ParamError:
    """A ParamError naming the request field `where` lies in (`messages[0].content[1]` -> messages)."""
    return ParamError(where.partition("[")[0].partition(".")[0], message)


@dataclass(frozen=True)
class ImageProcessor:
    """CLIPImageProcessor's settings (preprocessor_config.json's fields)."""

    shortest_edge: int
    crop_size: tuple[int, int]  # height, width
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = 3  # PIL's BICUBIC
    do_resize: bool = True
    do_center_crop: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True

    @classmethod
    def read(cls, path: str | Path, image_size: int) -> "ImageProcessor":
        """The checkpoint's preprocessor_config.json, else CLIP's defaults at the tower's `image_size`."""
        file = Path(path) / "preprocessor_config.json"
        raw = json.loads(file.read_text()) if file.exists() else {}
        size, crop = raw.get("size") or {}, raw.get("crop_size") or {}
        if isinstance(size, int):
            size = {"shortest_edge": size}
        size = {k: v for k, v in size.items() if v is not None}
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        if set(size) - {"shortest_edge"}:
            raise ValueError(f"{file}: image size {size} is not supported; tiffin resizes the shortest edge")
        keys = ("image_mean", "image_std", "rescale_factor", "resample", *(f for f in cls.__dataclass_fields__
                                                                           if f.startswith("do_")))  # fmt: skip
        return cls(
            shortest_edge=size.get("shortest_edge", image_size),
            crop_size=(crop.get("height", image_size), crop.get("width", image_size)),
            **{k: tuple(raw[k]) if isinstance(raw[k], list) else raw[k] for k in keys if k in raw},
        )

    def __call__(self, image) -> torch.Tensor:
        """`image` (a PIL image) as pixel values, float32 [3, height, width]."""
        from PIL import Image

        if self.do_convert_rgb:
            image = to_rgb(image)
        if self.do_resize:
            width, height = image.size
            short, long = min(width, height), max(width, height)
            new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
            size = (new_short, new_long) if width <= height else (new_long, new_short)
            image = image.resize(size, resample=Image.Resampling(self.resample))
        pixels = torch.from_numpy(np.array(image))
        pixels = (pixels[..., None] if pixels.ndim == 2 else pixels).permute(2, 0, 1)
        if self.do_center_crop:
            pixels = center_crop(pixels, *self.crop_size)
        return rescale_and_normalize(pixels, self)


def rescale_and_normalize(pixels: torch.Tensor, settings) -> torch.Tensor:
    """[..., C, H, W] uint8 `pixels` as float32, as transformers' PIL processors make them: rescaled in float64 then
    cast, normalized in float32. `settings`: a processor's `do_rescale`, `rescale_factor`, `do_normalize`,
    `image_mean` and `image_std`."""
    pixels = pixels.double() * settings.rescale_factor if settings.do_rescale else pixels.double()
    pixels = pixels.float()
    if settings.do_normalize:
        mean = torch.tensor(settings.image_mean, dtype=torch.float32)[:, None, None]
        std = torch.tensor(settings.image_std, dtype=torch.float32)[:, None, None]
        pixels = (pixels - mean) / std
    return pixels.contiguous()


def to_rgb(image):
    """RGB, transparency composited on white (transformers' `convert_to_rgb`)."""
    from PIL import Image

    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", image.size, (255, 255, 255, 255)), image).convert("RGB")
    return image.convert("RGB")


def center_crop(pixels: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The centered `height` x `width` window of [C, H, W] `pixels`, zero-padded (centered) where they are smaller."""
    h, w = pixels.shape[-2:]
    if h < height or w < width:
        pad_h, pad_w = max(height - h, 0), max(width - w, 0)
        top, left = -(-pad_h // 2), -(-pad_w // 2)
        padded = pixels.new_zeros((pixels.shape[0], h + pad_h, w + pad_w))
        padded[:, top : top + h, left : left + w] = pixels
        pixels, h, w = padded, h + pad_h, w + pad_w
    top, left = (h - height) // 2, (w - width) // 2
    return pixels[:, top : top + height, left : left + width]
