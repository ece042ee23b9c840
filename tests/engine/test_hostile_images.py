"""Every file of `tiffin.testing.hostile_images` through the API's image decoding (`decode_data_url`, what chat,
Responses and Messages images go through): a ParamError naming the problem, or, for a valid image, an RGB image of
the first frame only. A file declaring more pixels than `max_image_pixels` is refused before any pixel is decoded,
so decoding never allocates past the setting; of an animation of 200 frames only the first is decoded.
`benchmarks/hostile_images.py` sends the same files to a served Bento."""

import base64
import io

import pytest

from tiffin.engine.errors import ParamError
from tiffin.engine.multimodal.image import decode_data_url
from tiffin.testing.hostile_images import MAX_PIXELS, hostile_images

PIL = pytest.importorskip("PIL.Image")
CASES = hostile_images(frames=200)
WHERE = "messages[0].content[1]"


def data_url(case) -> str:
    return f"data:{case.media_type};base64,{base64.b64encode(case.data).decode()}"


@pytest.fixture
def decoded_frames(monkeypatch) -> list:
    """The frames PIL decodes pixels of: each `load_prepare` (PNG, JPEG, GIF: once per frame decoded) and each WebP
    frame libwebp decodes (`_get_next`; its `load_prepare` then copies the decoded frame)."""
    from PIL import ImageFile, WebPImagePlugin

    seen, prepare, get_next = [], ImageFile.ImageFile.load_prepare, WebPImagePlugin.WebPImageFile._get_next

    def counted_prepare(image):
        if not isinstance(image, WebPImagePlugin.WebPImageFile):
            seen.append(image.size)
        return prepare(image)

    monkeypatch.setattr(ImageFile.ImageFile, "load_prepare", counted_prepare)
    monkeypatch.setattr(WebPImagePlugin.WebPImageFile, "_get_next", lambda im: seen.append(im.size) or get_next(im))
    return seen


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hostile_image_is_refused_by_name_or_decoded_within_bounds(case, decoded_frames):
    if case.status == 400:
        with pytest.raises(ParamError) as e:
            decode_data_url(data_url(case), MAX_PIXELS, 20 << 20, WHERE)
        message = str(e.value)
        assert e.value.param == "messages" and message.startswith(f"{WHERE}: ")
        assert all(w in message for w in case.words), message
        if "max_image_pixels" in case.words:
            assert not decoded_frames  # refused from the header
        return
    image = decode_data_url(data_url(case), MAX_PIXELS, 20 << 20, WHERE)
    first = PIL.open(io.BytesIO(case.data))
    assert image.mode == "RGB" and image.size == first.size and image.width * image.height <= MAX_PIXELS
    assert decoded_frames == [first.size]  # one frame decoded: the first
    assert image.tobytes() == first.convert("RGB").tobytes() or first.mode in ("P", "RGBA")  # else: on white
