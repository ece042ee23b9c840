"""Image files built to hurt a decoder, for tests and `benchmarks/hostile_images.py`: decompression bombs (a header
declaring far more pixels than the file holds), truncated and corrupt files, wrong declared types, animations of
thousands of frames, EXIF of megabytes or that PIL cannot parse, palette tricks, text-chunk bombs, and the largest
image `max_image_pixels` allows (a zlib bomb of 48 KB). Each names what the API must answer: a 400 whose message
holds `words`, or a 200 (the file is a valid image, or its first frame is)."""

import struct
import zlib
from dataclasses import dataclass

from tiffin.testing.images import encoded, random_image

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MAX_PIXELS = 16_777_216  # EngineConfig.max_image_pixels' default: the bombs and the largest image are sized by it


@dataclass(frozen=True)
class HostileImage:
    name: str
    data: bytes
    media_type: str  # what the data URL declares
    words: tuple[str, ...] = ()  # in the 400's message; () for a 200

    @property
    def status(self) -> int:
        return 400 if self.words else 200


def chunk(kind: bytes, data: bytes) -> bytes:
    """A PNG chunk, its CRC right."""
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png(width: int, height: int, idat: bytes, depth: int = 8, color: int = 2, before_idat: bytes = b"") -> bytes:
    """A PNG of one IDAT chunk (`color`: 0 grayscale, 2 RGB, 3 palette)."""
    ihdr = chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, depth, color, 0, 0, 0))
    return PNG_MAGIC + ihdr + before_idat + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def with_chunk(data: bytes, extra: bytes, after_idat: bool = False) -> bytes:
    """PNG `data` with the `extra` chunk after its IHDR (or before its IEND)."""
    at = len(data) - 12 if after_idat else 33
    return data[:at] + extra + data[at:]


def exif_ifd(entries: list[tuple[int, int, int, int]], tail: bytes = b"") -> bytes:
    """Little-endian TIFF-structured EXIF: one IFD of (tag, type, count, value or offset) entries, then `tail`."""
    ifd = struct.pack("<H", len(entries)) + b"".join(struct.pack("<HHII", *e) for e in entries) + bytes(4)
    return b"II*\x00" + struct.pack("<I", 8) + ifd + tail


def hostile_images(frames: int = 3000) -> list[HostileImage]:
    """The hostile files, each a few bytes to a few MB (under the server's 10 MiB body once base64-encoded);
    `frames`: the animations' frame count."""
    small = random_image(1, (64, 64))
    png_ok, jpeg_ok = encoded(small, "PNG"), encoded(small, "JPEG")
    gif_ok, webp_ok = encoded(small.convert("P"), "GIF"), encoded(small, "WEBP", lossless=True)
    sof = jpeg_ok.index(b"\xff\xc0")
    gif_frame = gif_ok.index(b"\x2c")
    vp8l = webp_ok.index(b"VP8L") + 9  # the 14-bit width - 1 and height - 1 after the signature byte

    def webp_declaring(w: int, h: int) -> bytes:
        bits = struct.unpack("<I", webp_ok[vp8l : vp8l + 4])[0] & ~((1 << 28) - 1) | (w - 1) | (h - 1) << 14
        return webp_ok[:vp8l] + struct.pack("<I", bits) + webp_ok[vp8l + 4 :]

    bomb_rows = zlib.compress((b"\x00" + bytes(50_000 // 8)) * 100, 9)
    side = int(MAX_PIXELS**0.5)
    tiles = [random_image(i, (16, 16)) for i in range(frames)]
    pal_idat = zlib.compress(b"".join(b"\x00" + bytes(range(64)) for _ in range(64)))
    two_colors = chunk(b"PLTE", bytes([0, 0, 0, 255, 255, 255]))
    unreadable_exif = exif_ifd([(0x0112, 3, 1, 6), (0x80E3, 1, 9, 38)], bytes(9))  # 9 bytes where PIL wants an int
    ztxt = chunk(b"zTXt", b"Comment\x00\x00" + zlib.compress(b"a" * (8 << 20), 9))  # 8x PIL's MAX_TEXT_CHUNK
    refused = "max_image_pixels"
    return [
        HostileImage(
            "PNG 50000x50000, 1-bit (a few KB)", png(50_000, 50_000, bomb_rows, 1, 0), "image/png", (refused,)
        ),  # fmt: skip
        HostileImage("PNG declaring 5000x5000", png(5000, 5000, bomb_rows), "image/png", ("5000x5000 pixels", refused)),
        HostileImage(
            "JPEG declaring 65500x65500",
            jpeg_ok[: sof + 5] + struct.pack(">HH", 65500, 65500) + jpeg_ok[sof + 9 :],
            "image/jpeg",
            (refused,),
        ),  # fmt: skip
        HostileImage(
            "GIF screen 65535x65535",
            gif_ok[:6] + struct.pack("<HH", 65535, 65535) + gif_ok[10:],
            "image/gif",
            (refused,),
        ),  # fmt: skip
        HostileImage(
            "GIF frame 60000x60000 on a 64x64 screen",
            gif_ok[: gif_frame + 5] + struct.pack("<HH", 60000, 60000) + gif_ok[gif_frame + 9 :],
            "image/gif",
            (refused,),
        ),  # fmt: skip
        HostileImage("WebP declaring 16384x16384", webp_declaring(16384, 16384), "image/webp", (refused,)),
        HostileImage("WebP declaring 5000x5000", webp_declaring(5000, 5000), "image/webp", ("5000x5000", refused)),
        HostileImage("PNG truncated", png_ok[: len(png_ok) // 2], "image/png", ("cannot be decoded",)),
        HostileImage("JPEG truncated", jpeg_ok[: len(jpeg_ok) // 2], "image/jpeg", ("cannot be decoded",)),
        HostileImage("GIF truncated", gif_ok[: len(gif_ok) // 2], "image/gif", ("cannot be decoded",)),
        HostileImage("WebP truncated", webp_ok[: len(webp_ok) // 2], "image/webp", ("cannot be decoded",)),
        HostileImage(
            "PNG corrupt zlib stream",
            png(64, 64, b"\x78\x9c" + bytes(range(256)) * 8),
            "image/png",
            ("cannot be decoded",),
        ),  # fmt: skip
        HostileImage("PNG magic then noise", PNG_MAGIC + bytes(range(256)) * 4, "image/png", ("not an image",)),
        HostileImage("empty file", b"", "image/png", ("not an image",)),
        HostileImage(
            "SVG",
            b'<svg xmlns="http://www.w3.org/2000/svg" width="9" height="9"/>',
            "image/svg+xml",
            ("not an image in a supported format",),
        ),  # fmt: skip
        HostileImage("BMP", encoded(small, "BMP"), "image/bmp", ("not an image in a supported format",)),
        HostileImage("TIFF", encoded(small, "TIFF"), "image/tiff", ("not an image in a supported format",)),
        HostileImage("PNG declared image/jpeg", png_ok, "image/jpeg", ("declares image/jpeg but holds PNG",)),
        HostileImage("WebP declared image/gif", webp_ok, "image/gif", ("declares image/gif but holds WEBP",)),
        HostileImage("PNG zTXt bomb (8 MB of text)", with_chunk(png_ok, ztxt), "image/png", ("cannot be decoded",)),
        HostileImage("PNG zTXt bomb after IDAT", with_chunk(png_ok, ztxt, True), "image/png", ("cannot be decoded",)),
        HostileImage(
            "PNG eXIf of 65535 entries (768 KB)",
            with_chunk(
                png_ok,
                chunk(b"eXIf", exif_ifd([(0x0112, 3, 1, 6)] + [(0x9000 + i % 4096, 3, 1, 1) for i in range(65534)])),
            ),
            "image/png",
            ("bytes of EXIF data",),
        ),  # fmt: skip
        HostileImage(
            "PNG eXIf PIL cannot parse",
            with_chunk(png_ok, chunk(b"eXIf", unreadable_exif)),
            "image/png",
            ("EXIF data cannot be read",),
        ),  # fmt: skip
        HostileImage(
            f"GIF of {frames} frames",
            encoded(tiles[0].convert("P"), "GIF", save_all=True, append_images=[t.convert("P") for t in tiles[1:]]),
            "image/gif",
        ),  # fmt: skip
        HostileImage(
            f"APNG of {frames} frames", encoded(tiles[0], "PNG", save_all=True, append_images=tiles[1:]), "image/png"
        ),  # fmt: skip
        HostileImage(
            f"WebP of {frames} frames",
            encoded(tiles[0], "WEBP", save_all=True, append_images=tiles[1:], lossless=True),
            "image/webp",
        ),  # fmt: skip
        HostileImage("PNG palette of 2 entries, indices to 63", png(64, 64, pal_idat, 8, 3, two_colors), "image/png"),
        HostileImage(
            "PNG tRNS longer than its palette",
            png(64, 64, pal_idat, 8, 3, two_colors + chunk(b"tRNS", bytes(300))),
            "image/png",
            ("cannot be converted to RGB",),
        ),  # fmt: skip
        HostileImage("PNG palette image without PLTE", png(64, 64, pal_idat, 8, 3), "image/png"),
        HostileImage(
            f"PNG {side}x{side} of zeros (48 KB): the most pixels allowed",
            png(side, side, zlib.compress((b"\x00" + bytes(side * 3)) * side, 9)),
            "image/png",
        ),  # fmt: skip
    ]
