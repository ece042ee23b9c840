"""Pixel values from tiffin's preprocessing equal transformers' PIL image processors exactly (`torch.equal`) on the 50
images of `tiffin.testing.images.varied_images` (1x1 to 4000x300 and 300x4000, every mode from 1-bit to CMYK and
16-bit grayscale, transparency of every kind, EXIF-oriented JPEGs and PNGs, animated GIF and WebP), for every family
tiffin serves: LLaVA's `CLIPImageProcessorPil`, Idefics3 / SmolVLM's `Idefics3ImageProcessorPil`, Qwen2-VL /
Qwen2.5-VL's `Qwen2VLImageProcessorPil` (both use it), each at the tiny test checkpoints' settings and at the hub
checkpoints' (llava-1.5's 336 px, Qwen2-VL's up to 12.8 M pixels, and SmolVLM's 512 px tiles of a 2048 px edge on 6
images of extreme shapes: `runs`).

A PIL image goes to both processors as it is. A file goes through the API's decoding (`decode_image`): transformers'
processors ignore EXIF orientation, but its `load_image` (what its pipelines do with a file or URL) turns the image
upright, as tiffin's decoding does, so a file carrying an orientation is compared with `load_image`'s image, and the
other files with PIL's first frame. Reading each side's settings from the same saved preprocessor_config.json also
checks tiffin's config reading."""

import base64
import io

import pytest
import torch

from tiffin.engine.multimodal.image import ImageProcessor, decode_image
from tiffin.engine.multimodal.patches import PatchProcessor
from tiffin.engine.multimodal.tiles import TileProcessor
from tiffin.testing import tiny_idefics3, tiny_qwen2_vl
from tiffin.testing.images import varied_images

PIL = pytest.importorskip("PIL.Image")
IMAGES = varied_images()
MAX_PIXELS = 1 << 24  # the API's default max_image_pixels
SETTINGS = {  # family -> setting -> transformers' processor arguments
    "clip": {"tiny": {"size": 56}, "hub": {"size": 336}},
    "tiles": {
        "tiny": {"size": {"longest_edge": tiny_idefics3.LONGEST_EDGE}, "tile": tiny_idefics3.TILE},
        "hub": {"size": {"longest_edge": 2048}, "tile": 512},
    },
    "patches": {
        "tiny": {"size": {"shortest_edge": tiny_qwen2_vl.MIN_PIXELS, "longest_edge": tiny_qwen2_vl.MAX_PIXELS},
                 "patch_size": tiny_qwen2_vl.PATCH, "merge_size": tiny_qwen2_vl.MERGE},
        "hub": {"size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 16384}, "patch_size": 14,
                "merge_size": 2},
    },
}  # fmt: skip
HUB_TILES = {"RGB 1x1", "RGB 4000x300", "RGB 300x4000", "RGB 1000x10", "RGBA 1300x97", "JPEG 301x4000 EXIF 7"}


def both_processors(family: str, setting: dict, path) -> tuple:
    """(tiffin's, transformers') processors of `family`, tiffin's read from what transformers' saved at `path`."""
    from transformers import CLIPImageProcessorPil, Idefics3ImageProcessorPil, Qwen2VLImageProcessorPil

    if family == "clip":
        theirs = CLIPImageProcessorPil(size={"shortest_edge": setting["size"]}, crop_size=setting["size"])
    elif family == "tiles":
        theirs = Idefics3ImageProcessorPil(size=setting["size"], max_image_size={"longest_edge": setting["tile"]})
    else:
        theirs = Qwen2VLImageProcessorPil(**setting)
    theirs.save_pretrained(path)
    if family == "clip":
        return ImageProcessor.read(path, setting["size"]), theirs
    return (TileProcessor.read(path, setting["tile"]) if family == "tiles" else PatchProcessor.read(path)), theirs


@pytest.fixture(scope="module")
def processors(tmp_path_factory) -> dict:
    return {
        (family, name): both_processors(family, setting, tmp_path_factory.mktemp(f"{family}-{name}"))
        for family, settings in SETTINGS.items()
        for name, setting in settings.items()
    }


def inputs(case) -> tuple:
    """The image each side preprocesses: tiffin's as the API decodes a file, transformers' as `load_image` does
    (an EXIF-oriented file) or PIL's first frame."""
    from transformers.image_utils import load_image

    if case.image is not None:
        return case.image, case.image
    ours = decode_image(case.data, MAX_PIXELS)
    if case.orientation:
        return ours, load_image(base64.b64encode(case.data).decode())
    theirs = PIL.open(io.BytesIO(case.data))
    theirs.load()
    return ours, theirs


def preprocessed(family: str, processor, image, theirs: bool) -> tuple:
    """(pixel values as transformers lays them out, the grid they came in) or the ValueError refusing `image`."""
    try:
        if not theirs:
            out = processor(image)
            if family == "tiles":
                return out[0], out[1:]
            return (out.reshape(-1, out.shape[-1]), out.shape[:2]) if family == "patches" else (out, ())
        if family == "tiles":
            out = processor(image, return_tensors="pt", return_row_col_info=True)
            return out["pixel_values"][0], (out["rows"][0][0], out["cols"][0][0])
        out = processor(image, return_tensors="pt")
        if family == "patches":
            _, rows, cols = out["image_grid_thw"][0].tolist()
            return out["pixel_values"], (rows // processor.merge_size, cols // processor.merge_size)
        return out["pixel_values"][0], ()
    except ValueError:  # an aspect ratio past 200 (Qwen2-VL)
        return "refused", ()


def test_the_images_are_the_fifty_the_issue_names():
    sizes = [(c.image or PIL.open(io.BytesIO(c.data))).size for c in IMAGES]
    modes = {c.image.mode for c in IMAGES if c.image is not None}
    assert len(IMAGES) == len({c.name for c in IMAGES}) == 50
    assert {(1, 1), (4000, 300), (300, 4000)} <= set(sizes)
    assert {"L", "LA", "RGBA", "P", "PA", "1", "CMYK", "I;16"} <= modes
    assert {c.orientation for c in IMAGES} == set(range(9))


def runs() -> list:
    """Every image through every family and setting, but SmolVLM's hub settings on HUB_TILES only: they resize every
    image to a 2048 px edge (16 tiles and a global one), a second or more per image on 2 cores."""
    return [
        pytest.param(case, family, setting, id=f"{case.name}-{family}-{setting}")
        for case in IMAGES
        for family in SETTINGS
        for setting in SETTINGS[family]
        if (family, setting) != ("tiles", "hub") or case.name in HUB_TILES
    ]


@pytest.mark.parametrize("case, family, setting", runs())
def test_pixel_values_equal_transformers_pil_processors(processors, family, setting, case):
    ours, theirs = processors[family, setting]
    our_image, their_image = inputs(case)
    got, grid = preprocessed(family, ours, our_image, theirs=False)
    want, want_grid = preprocessed(family, theirs, their_image, theirs=True)
    assert grid == want_grid
    if isinstance(want, str):
        assert got == want  # both refuse
    else:
        assert got.dtype == want.dtype == torch.float32 and torch.equal(got, want)


@pytest.mark.parametrize("case", [c for c in IMAGES if c.orientation > 1], ids=lambda c: c.name)
def test_exif_orientation_turns_the_decoded_image_upright(case):
    """Decoding applies the orientation (from 5 on, width and height swap) and drops the tag: the pixels differ from
    the file's raw PIL image, which transformers' processors would take as it is."""
    raw = PIL.open(io.BytesIO(case.data))
    upright = decode_image(case.data, MAX_PIXELS)
    w, h = raw.size
    assert upright.size == ((h, w) if case.orientation >= 5 else (w, h))
    assert min(w, h) == 1 or upright.tobytes() != raw.tobytes()
    assert upright.getexif().get(0x0112) is None
