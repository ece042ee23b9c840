"""The encoder step: each image a step's prefill reaches run through the vision tower once, its embeddings cached by
content hash (LRU, bounded in bytes), the rows the step's tokens need gathered for the model to put in place of
their placeholder embeddings.

Chunked prefill: the simplest correct rule. A chunk that reaches any of an image's placeholders has the whole
image encoded (or found in the cache) and takes the slice its tokens cover, so the scheduler may split a
placeholder run anywhere; the next chunk finds the embeddings cached (or, evicted meanwhile, encodes the image
again, which gives the same rows). A prefix-cache hit that covers an image's placeholders needs no encoding."""

from collections import OrderedDict

import numpy as np
import torch

from tiffin.engine.core.scheduler import SchedulerOutput
from tiffin.engine.models.llava import MultiModalEmbeddings
from tiffin.engine.multimodal.inputs import ImageInput


class EncoderCache:
    """Image embeddings by content hash, least recently used evicted first, at most `max_bytes` held."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.bytes = max_bytes, 0
        self.entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.hits = self.misses = 0

    def get(self, key: bytes) -> torch.Tensor | None:
        found = self.entries.get(key)
        if found is not None:
            self.entries.move_to_end(key)
        self.hits += found is not None
        self.misses += found is None
        return found

    def put(self, key: bytes, embeddings: torch.Tensor) -> None:
        """Keep `embeddings`, evicting the oldest past the budget; one larger than the whole budget is not kept."""
        if embeddings.nbytes > self.max_bytes or key in self.entries:
            return
        self.entries[key] = embeddings
        self.bytes += embeddings.nbytes
        while self.bytes > self.max_bytes:
            self.bytes -= self.entries.popitem(last=False)[1].nbytes


class EncoderRunner:
    def __init__(self, model: torch.nn.Module, max_bytes: int, device: torch.device):
        self.model, self.device, self.max_bytes = model, device, max_bytes
        self.reset()

    def reset(self) -> None:
        """An empty cache and no image counted (after the memory profile's images)."""
        self.cache = EncoderCache(self.max_bytes)
        self.num_encoded = 0  # images run through the tower

    def add_profile_images(
        self, scheduler_output: SchedulerOutput, tokens_per_image: int, pixels: torch.Tensor, most: int | None = None
    ):
        """Give the memory profile's synthetic sequences as many distinct images as their scheduled tokens hold
        placeholders of (at least one), at most `most` in all (a dual encoder's step holds one per sequence), so
        that its step also runs the tower on the most images a step may encode."""
        count = 0
        for seq, n in zip(scheduler_output.seqs, scheduler_output.num_scheduled_tokens):
            offsets = range(0, max(n - tokens_per_image, 0) + 1, tokens_per_image)
            offsets = offsets if most is None else offsets[: most - count]
            length = min(tokens_per_image, n)  # a step shorter than one image still encodes one
            seq.images = tuple(ImageInput(o, length, (count + i).to_bytes(8), pixels) for i, o in enumerate(offsets))
            count += len(offsets)

    def step_embeddings(self, scheduler_output: SchedulerOutput, starts: np.ndarray) -> MultiModalEmbeddings | None:
        """The step's image rows and the batch rows they replace (None: no scheduled token is a placeholder).
        `starts`: each sequence's first row in the batch."""
        pieces = []  # (batch row, image, first row of the image's embeddings, end)
        for seq, row, n in zip(scheduler_output.seqs, starts, scheduler_output.num_scheduled_tokens):
            first = seq.num_computed_tokens
            for image in seq.images:
                lo, hi = max(image.offset, first), min(image.offset + image.length, first + n)
                if lo < hi:
                    pieces.append((int(row) + lo - first, image, lo - image.offset, hi - image.offset))
        if not pieces:
            return None
        embeddings = self.encode([image for _, image, _, _ in pieces])
        indices = torch.cat([torch.arange(row, row + hi - lo) for row, _, lo, hi in pieces])
        rows = torch.cat([embeddings[image.hash][lo:hi] for _, image, lo, hi in pieces])
        return MultiModalEmbeddings(indices.to(self.device), rows)

    def encode(self, images: list[ImageInput]) -> dict[bytes, torch.Tensor]:
        """Each image's embeddings by hash: from the cache, else from one tower forward per pixel shape."""
        found = {image.hash: self.cache.get(image.hash) for image in images}
        missing = {image.hash: image for image in images if found[image.hash] is None}
        by_shape: dict[tuple, list[ImageInput]] = {}
        for image in missing.values():
            by_shape.setdefault(tuple(image.pixel_values.shape), []).append(image)
        for group in by_shape.values():
            pixels = torch.stack([image.pixel_values for image in group]).to(self.device)
            for image, rows in zip(group, self.model.embed_images(pixels)):
                found[image.hash] = rows = rows.clone()  # not a view: the cache counts the bytes it holds
                self.cache.put(image.hash, rows)
            self.num_encoded += len(group)
        return found


def prefills_images(scheduler_output: SchedulerOutput) -> bool:
    """Whether any scheduled token of the step is an image placeholder."""
    return any(
        seq.num_computed_tokens < image.offset + image.length and image.offset < seq.num_computed_tokens + n
        for seq, n in zip(scheduler_output.seqs, scheduler_output.num_scheduled_tokens)
        for image in seq.images
    )
