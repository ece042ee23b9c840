"""Images for tests and benchmarks, all seeded: `random_image` (smooth gradients plus noise, any PIL mode) and
`varied_images`, 50 images of the shapes, modes and files users send (1x1 to 4000x300 and 300x4000, every PIL mode
a PNG, JPEG, GIF or WebP decodes to and a few more, transparency of every kind, JPEGs carrying EXIF orientations 1
to 8, CMYK, animated GIF and WebP)."""

import io
from dataclasses import dataclass

import numpy as np

BANDS = {"RGB": 3, "RGBA": 4, "L": 1, "LA": 2}  # what `random_image` draws; other modes are converted from RGB(A)
EXIF_ORIENTATION = 0x0112


def random_image(seed: int, size: tuple[int, int], mode: str = "RGB"):
    """A `size` (width, height) PIL image in `mode`: gradients plus noise, closer to a photo than white noise, so that
    resampling does real work. Modes past BANDS are converted from RGBA ("PA", "RGBa", "La") or RGB."""
    from PIL import Image

    base = mode if mode in BANDS else "RGBA" if mode in ("PA", "RGBa", "La") else "RGB"
    rng = np.random.default_rng(seed)
    w, h = size
    pixels = rng.integers(0, 256, (h, w, BANDS[base]), dtype=np.uint8)
    pixels = (pixels // 4 + (np.arange(w)[None, :, None] * 3 + np.arange(h)[:, None, None]) % 192).astype(np.uint8)
    image = Image.fromarray(pixels[..., 0] if base == "L" else pixels, base)
    return image if mode == base else image.convert(mode)


@dataclass(frozen=True)
class VariedImage:
    """One of `varied_images`: `image` as a user's Python code holds it, or `data`, the file an API request carries
    (then `image` is None), with the EXIF orientation tag it carries (0: none)."""

    name: str
    image: object = None
    data: bytes | None = None
    orientation: int = 0


def encoded(image, fmt: str, **save) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **save)
    return out.getvalue()


def with_orientation(image, fmt: str, orientation: int) -> bytes:
    """`image` saved as `fmt` with an EXIF orientation tag."""
    exif = image.getexif()
    exif[EXIF_ORIENTATION] = orientation
    return encoded(image, fmt, exif=exif.tobytes())


# (width, height, mode) of the images handed over as PIL images
IN_MEMORY = [
    (1, 1, "RGB"), (1, 3, "RGB"), (3, 3, "RGB"), (7, 5, "RGB"), (14, 14, "RGB"), (27, 29, "RGB"),
    (56, 56, "RGB"), (57, 91, "RGB"), (64, 48, "RGB"), (100, 1, "RGB"), (1, 100, "RGB"), (128, 127, "RGB"),
    (200, 131, "RGB"), (300, 5, "RGB"), (5, 300, "RGB"), (333, 777, "RGB"), (640, 480, "RGB"), (1000, 10, "RGB"),
    (4000, 300, "RGB"), (300, 4000, "RGB"), (1, 1, "RGBA"), (77, 60, "RGBA"), (1300, 97, "RGBA"), (2, 2, "L"),
    (33, 90, "L"), (801, 601, "L"), (90, 33, "LA"), (64, 64, "P"), (45, 45, "PA"), (31, 17, "1"),
    (40, 30, "CMYK"), (29, 41, "I;16"), (60, 20, "YCbCr"),
]  # fmt: skip


def varied_images(seed: int = 0) -> list[VariedImage]:
    """The 50 images, the same for the same `seed`: 34 PIL images (IN_MEMORY and a fully transparent RGBA one) and
    16 files: JPEGs with EXIF orientations 1 to 8 (RGB, grayscale, CMYK), a PNG with an EXIF orientation, a
    palette PNG with a transparent index and one with per-entry alpha (tRNS), a two-frame GIF with transparent
    pixels, a lossless RGBA WebP and a two-frame lossy WebP."""
    out = [VariedImage(f"{m} {w}x{h}", random_image(seed + i, (w, h), m)) for i, (w, h, m) in enumerate(IN_MEMORY)]
    clear = random_image(seed, (50, 70), "RGBA")
    clear.putalpha(0)
    out.append(VariedImage("RGBA 50x70 transparent", clear))
    img = lambda i, size, mode="RGB": random_image(seed + 100 + i, size, mode)  # noqa: E731
    sizes = [(40, 24), (24, 40), (97, 61), (640, 360), (9, 4), (3, 1), (301, 4000), (1, 2)]
    for orientation, size in enumerate(sizes, 1):
        data = with_orientation(img(orientation, size), "JPEG", orientation)
        out.append(VariedImage(f"JPEG {size[0]}x{size[1]} EXIF {orientation}", data=data, orientation=orientation))
    for i, (fmt, (w, h), mode, orientation) in enumerate(
        [("JPEG", (50, 20), "L", 6), ("JPEG", (30, 50), "CMYK", 5), ("PNG", (35, 18), "RGB", 8)]
    ):
        data = with_orientation(img(9 + i, (w, h), mode), fmt, orientation)
        out.append(VariedImage(f"{fmt} {mode} {w}x{h} EXIF {orientation}", data=data, orientation=orientation))
    palette = img(12, (70, 40)).convert("P")
    out.append(VariedImage("PNG P 70x40 transparent index", data=encoded(palette, "PNG", transparency=3)))
    alpha = bytes(range(0, 256, 4)) * 4  # a tRNS entry per palette entry
    out.append(VariedImage("PNG P 70x40 tRNS", data=encoded(palette, "PNG", transparency=alpha)))
    frames = [img(13 + i, (61, 83), "RGBA") for i in range(2)]
    for frame in frames:  # GIF's transparency is all or nothing
        frame.putalpha(frame.getchannel("A").point(lambda a: 255 * (a > 99)))
    gif = encoded(frames[0], "GIF", save_all=True, append_images=frames[1:])
    out.append(VariedImage("GIF 61x83 two frames", data=gif))
    out.append(VariedImage("WebP RGBA 66x44 lossless", data=encoded(img(15, (66, 44), "RGBA"), "WEBP", lossless=True)))
    frames = [img(16 + i, (48, 80)) for i in range(2)]
    out.append(VariedImage("WebP 48x80 two frames", data=encoded(frames[0], "WEBP", save_all=True,
                                                                  append_images=frames[1:])))  # fmt: skip
    return out
