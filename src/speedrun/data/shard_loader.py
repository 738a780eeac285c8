"""The input path for datasets that do not fit in memory: prepared shards (data/shards.py) decoded by
DataLoader worker processes, random-resized crop and flip on the device.

The division of work is FFCV's lesson ("ImageNet in 18 minutes" and FFCV both found the input path, not the GPU,
to be the limit): the CPU does only what must be done per file, decoding, and every batched operation runs where
the model runs.

- Order. Step s takes positions [s*B, (s+1)*B) of a stream that concatenates the epochs' permutations, each a
  pure function of (seed, epoch), as the on-device loader does (data/loader.py). So every image is seen exactly
  once per epoch, every batch is full (static shapes), and a resumed run restarts at its step with no state but
  the step. Under torchrun each process keeps its share of every global batch (dist.share), so K processes see
  exactly the images, and the augmentations, of one.
- Workers (CPU). Each sample is one positioned read from its shard, a Pillow decode at reduced scale (JPEG's
  DCT scaling, `draft`) and a resize to a fixed `decode_px` square. The square is a stretch: a crop box is
  expressed in fractions of the image's width and height, which the stretch leaves unchanged, so the device crop
  undoes it using the original size the worker returns. Fixed-size samples batch without padding, and changing
  the training resolution (progressive resizing) changes nothing in the workers.
- Device. Crop boxes for the whole global batch are drawn in the main process from a generator seeded by
  (seed, step); the crop, the resize to `res` px, the flip and the standardization are one affine_grid +
  grid_sample (bilinear) on the batch. Pinned host memory and non-blocking copies, one batch ahead.

Known cost of the choice: a `decode_px` square stores a non-square image with fewer pixels along its longer side
(a 4:3 photo at 256 px loses a quarter of its width), and a crop much larger than `res` is resampled bilinearly
without antialiasing. Both matter little at ImageNet's 160-224 px from 256 px; say decode_px=320 to keep more.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, UnidentifiedImageError

from speedrun.data.loader import Normalization, steps_for
from speedrun.data.shards import Shards, check_listed, repair_advice
from speedrun.data.workers import dataloader_worker_init, started

MAX_DECODE_SIDE_PX = 8192  # a shard's JPEG is prepared at <= 8192 px (data/prepare.py); larger is not ours
RRC_TRIES = 10  # torchvision's RandomResizedCrop draws up to 10 boxes before it falls back to a central crop


def _generator(seed: int, stream: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + stream) % (2**63))


def epoch_order(seed: int, epoch: int, n: int) -> torch.Tensor:
    """Epoch `epoch`'s permutation of the n samples: a pure function of (seed, epoch)."""
    return torch.randperm(n, generator=_generator(seed, epoch))


def stream_indices(seed: int, n: int, batch_size: int, step: int) -> torch.Tensor:
    """The sample indices of global batch `step`, (batch_size,) int64: stream positions step*B ... step*B + B - 1,
    where position p is epoch p // n's permutation at p % n."""
    positions = torch.arange(step * batch_size, (step + 1) * batch_size)
    epochs = positions // n
    out = torch.empty(batch_size, dtype=torch.int64)
    for e in epochs.unique().tolist():  # one epoch, or two at a boundary (more only when batch_size > n)
        where = epochs == e
        out[where] = epoch_order(seed, e, n)[positions[where] % n]
    return out


def _opened(jpeg: bytes) -> Image.Image:
    """The JPEG's header read and checked (format, size): nothing is decoded yet. A shard is a file from elsewhere."""
    im = Image.open(io.BytesIO(jpeg), formats=("JPEG",))
    w, h = im.size
    if not (1 <= w <= MAX_DECODE_SIDE_PX and 1 <= h <= MAX_DECODE_SIDE_PX):
        im.close()
        raise ValueError(f"{w}x{h} px is beyond the {MAX_DECODE_SIDE_PX}-px limit")
    return im


def _unusable(where: str, e: Exception, root: str | None) -> ValueError:
    # Pillow names its in-memory file in this one ("<_io.BytesIO object at 0x...>"): no help to anyone.
    why = "not a JPEG" if isinstance(e, UnidentifiedImageError) else " ".join(str(e).split())[:200]
    advice = repair_advice(root) if root is not None else "run speedrun data prepare again"
    return ValueError(f"{where} is not a usable JPEG ({why}); {advice}")


_DECODE_ERRORS = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)


def header_size(jpeg: bytes, where: str, root: str | None = None) -> tuple[int, int]:
    """(width, height) from the JPEG's header, checked as decode() checks it; the GPU path's workers call this
    so that nvJPEG never sees a file the CPU path would refuse. root: the prepared folder, whose repair the
    error names."""
    try:
        with _opened(jpeg) as im:
            return im.size
    except _DECODE_ERRORS as e:
        raise _unusable(where, e, root) from None


def decode(jpeg: bytes, decode_px: int, where: str, root: str | None = None) -> tuple[np.ndarray, int, int]:
    """JPEG bytes -> (decode_px, decode_px, 3) uint8 and the image's own (width, height). The header is checked
    before any pixel is decoded (format, size), and a failure names the sample and how to repair `root`."""
    try:
        with _opened(jpeg) as im:
            w, h = im.size
            im.draft("RGB", (decode_px, decode_px))  # DCT scaling: decode at 1/2, 1/4, 1/8 while >= decode_px
            rgb = im.convert("RGB") if im.mode != "RGB" else im
            # Pillow's bilinear resize filters over the whole footprint when shrinking (antialiased).
            out = rgb.resize((decode_px, decode_px), Image.Resampling.BILINEAR)
            return np.asarray(out, dtype=np.uint8), w, h
    except _DECODE_ERRORS as e:
        raise _unusable(where, e, root) from None


class ShardImages(torch.utils.data.Dataset):
    """Samples of one prepared split, decoded to `decode_px` squares. Fetched a batch at a time (DataLoader calls
    __getitems__ with a batch sampler's list): (images (b, 3, D, D) uint8, labels (b,) int64, sizes (b, 2) int64
    as (width, height)). raw: the images are left encoded, a list of b 1-D uint8 tensors (their headers checked),
    for a decoder on the device."""

    def __init__(self, root: str, split: str, decode_px: int, raw: bool = False):
        self.root, self.split, self.decode_px, self.raw = root, split, decode_px, raw
        self._shards: Shards | None = None
        check_listed(root, split)  # a split file the folder's manifest does not list is no split of it
        with Shards(root, split) as shards:  # checked here, in the main process: errors are one line, early
            self.labels = torch.from_numpy(shards.index[:, 3].copy())

    def __len__(self) -> int:
        return len(self.labels)

    def _open(self) -> Shards:
        if self._shards is None:  # in each worker process: file descriptors are not shared across fork
            self._shards = Shards(self.root, self.split)
        return self._shards

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor | list[torch.Tensor], torch.Tensor,
                                                          torch.Tensor]:
        shards, d = self._open(), self.decode_px
        if self.raw:
            blobs, sizes = [], torch.empty(len(indices), 2, dtype=torch.int64)
            for k, i in enumerate(indices):
                data = shards.read(i)
                sizes[k] = torch.tensor(header_size(data, f"sample {i} of {self.split} in {self.root}",
                                                    self.root))
                blobs.append(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            return blobs, self.labels[indices], sizes
        images = np.empty((len(indices), d, d, 3), dtype=np.uint8)
        sizes = np.empty((len(indices), 2), dtype=np.int64)
        for k, i in enumerate(indices):
            images[k], sizes[k, 0], sizes[k, 1] = decode(shards.read(i), d, f"sample {i} of "
                                                         f"{self.split} in {self.root}", self.root)
        # (b, D, D, 3) -> (b, 3, D, D) as a view: the device copy makes it contiguous in whichever layout it needs
        return torch.from_numpy(images).permute(0, 3, 1, 2), self.labels[indices], torch.from_numpy(sizes)

    def __getitem__(self, i: int):
        images, labels, sizes = self.__getitems__([i])
        return images[0], labels[0], sizes[0]

    def __getstate__(self):  # what a worker process receives: no open files
        return {**self.__dict__, "_shards": None}


def _identity(batch):
    return batch


def device_decoder(choice: str, device: torch.device) -> tuple[Callable | None, str | None]:
    """The batched JPEG decode on the device that `choice` asks for ("auto", "pillow" or "nvjpeg"), or None for
    Pillow in the CPU workers; with a note when "auto" on a CUDA device falls back to Pillow.

    nvjpeg is TorchCodec's decode_jpeg on a list of JPEGs (one nvJPEG batch call; TorchCodec >= 0.16, the `[gpu]`
    extra), not torchvision's decoders: they are deprecated since torchvision 0.29, and the core must not need
    torchvision."""
    if choice not in ("auto", "pillow", "nvjpeg"):
        raise ValueError(f"decoder must be auto, pillow or nvjpeg, got {choice!r}")
    if choice == "pillow" or (choice == "auto" and device.type != "cuda"):
        return None, None
    if device.type != "cuda":
        raise ValueError(f"decoder=nvjpeg needs a CUDA device, not {device.type}; use decoder=pillow (or auto)")
    try:
        from torchcodec.decoders import decode_jpeg
    except Exception as e:  # noqa: BLE001 -- ImportError, or OSError/RuntimeError from its CUDA libraries
        why = f"TorchCodec is not usable here ({type(e).__name__}: {' '.join(str(e).split())[:120]})"
        if choice == "nvjpeg":
            raise ValueError(f"decoder=nvjpeg: {why}; pip install 'speedrun[gpu]', or use decoder=pillow") from None
        return None, (f"GPU JPEG decoding needs TorchCodec: {why}; pip install 'speedrun[gpu]' for it. Decoding "
                      "with Pillow in the CPU workers instead")

    def decode_on_device(blobs: list[torch.Tensor]) -> list[torch.Tensor]:
        return decode_jpeg(blobs, mode="RGB", device=device)  # list of (3, H, W) uint8 on the device

    return decode_on_device, None


def random_resized_boxes(sizes: torch.Tensor, gen: torch.Generator, scale: tuple[float, float] = (0.08, 1.0),
                         ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> torch.Tensor:
    """Inception-style crop boxes (Szegedy et al. 2015, as torchvision's RandomResizedCrop and FFCV): area a
    uniform fraction of the image in `scale`, aspect ratio log-uniform in `ratio`, position uniform; of RRC_TRIES
    draws the first that fits, else the largest central box within `ratio`.

    sizes: (B, 2) (width, height) px. Returns (B, 4) boxes (x0, y0, w, h) as fractions of width and height."""
    b = len(sizes)
    width, height = sizes[:, 0:1].double(), sizes[:, 1:2].double()  # (B, 1)
    area = width * height * torch.empty(b, RRC_TRIES, dtype=torch.float64).uniform_(*scale, generator=gen)
    log_r = torch.empty(b, RRC_TRIES, dtype=torch.float64).uniform_(math.log(ratio[0]), math.log(ratio[1]),
                                                                    generator=gen)
    w = torch.sqrt(area * log_r.exp()).round()
    h = torch.sqrt(area / log_r.exp()).round()
    fits = (w >= 1) & (h >= 1) & (w <= width) & (h <= height)  # (B, TRIES)
    first = torch.where(fits.any(1), fits.double().argmax(1), -1)
    u = torch.rand(b, 2, generator=gen, dtype=torch.float64)  # drawn for every sample: the stream stays aligned
    rows = torch.arange(b)
    pick_w, pick_h = w[rows, first.clamp_min(0)], h[rows, first.clamp_min(0)]
    x0 = torch.floor(u[:, 0] * (width[:, 0] - pick_w + 1))
    y0 = torch.floor(u[:, 1] * (height[:, 0] - pick_h + 1))
    # Fallback: the whole image, cut to the nearest allowed aspect ratio, centred.
    own = width[:, 0] / height[:, 0]
    fw = torch.where(own > ratio[1], (height[:, 0] * ratio[1]).round(), width[:, 0])
    fh = torch.where(own < ratio[0], (width[:, 0] / ratio[0]).round(), height[:, 0])
    fallback = first < 0
    pick_w, pick_h = torch.where(fallback, fw, pick_w), torch.where(fallback, fh, pick_h)
    x0 = torch.where(fallback, ((width[:, 0] - fw) / 2).floor(), x0)
    y0 = torch.where(fallback, ((height[:, 0] - fh) / 2).floor(), y0)
    return torch.stack([x0 / width[:, 0], y0 / height[:, 0], pick_w / width[:, 0], pick_h / height[:, 0]], 1).float()


def center_boxes(sizes: torch.Tensor, crop_ratio: float) -> torch.Tensor:
    """Evaluation crops (FFCV's CenterCrop decoder, ratio 224/256): the central square of side crop_ratio x the
    shorter side. (B, 4) fractions, as random_resized_boxes."""
    width, height = sizes[:, 0].double(), sizes[:, 1].double()
    side = crop_ratio * torch.minimum(width, height)
    return torch.stack([(width - side) / 2 / width, (height - side) / 2 / height, side / width, side / height],
                       1).float()


def crop_resize(images: torch.Tensor, boxes: torch.Tensor, flips: torch.Tensor | None, res: int,
                normalization: Normalization) -> torch.Tensor:
    """uint8 (B, 3, D, D) on the device -> (B, 3, res, res) as `normalization` says: each box cut out, resized
    bilinearly to res x res, mirrored where `flips`. boxes: (B, 4) fractions (x0, y0, w, h); flips: (B,) bool."""
    boxes = boxes.to(images.device)
    x0, y0, w, h = boxes.unbind(1)
    # affine_grid maps output coordinates in [-1, 1] to input ones: x_in = sx * x_out + tx (align_corners=False,
    # so -1 and 1 are the outer edges of the border pixels, and a box's edges map exactly to the output's).
    sx = w if flips is None else torch.where(flips.to(images.device), -w, w)
    tx, ty = 2 * x0 + w - 1, 2 * y0 + h - 1
    zeros = torch.zeros_like(w)
    theta = torch.stack([torch.stack([sx, zeros, tx], 1), torch.stack([zeros, h, ty], 1)], 1)  # (B, 2, 3)
    grid = F.affine_grid(theta, [len(images), 3, res, res], align_corners=False)
    x = F.grid_sample(images.float(), grid, mode="bilinear", padding_mode="border", align_corners=False)
    mean, std = normalization.mean.to(x.device), normalization.std.to(x.device)
    x = ((x / 255 - mean.view(1, -1, 1, 1)) / std.view(1, -1, 1, 1)).to(normalization.dtype)
    return x.contiguous(memory_format=torch.channels_last) if normalization.channels_last else x


class _Steps(torch.utils.data.Sampler):
    """Yields this process's part of each global batch, steps `start` ... `stop - 1`, as lists of indices."""

    def __init__(self, n: int, batch_size: int, seed: int, start: int, stop: int, share: slice | None):
        self.n, self.batch_size, self.seed, self.start, self.stop, self.share = n, batch_size, seed, start, stop, share

    def __len__(self) -> int:
        return max(0, self.stop - self.start)

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.start, self.stop):
            indices = stream_indices(self.seed, self.n, self.batch_size, step)
            yield (indices if self.share is None else indices[self.share]).tolist()


@dataclass(frozen=True)
class CropAndFlip:
    """The training augmentation, drawn per global batch and applied on the device: a random-resized crop whose
    area is a uniform fraction of the image in crop_area_frac (min, max) (random_resized_boxes), and, when flip,
    a horizontal mirror of each image with probability 1/2."""

    flip: bool = True
    crop_area_frac: tuple[float, float] = (0.08, 1.0)


@dataclass(frozen=True)
class Decoding:
    """How the JPEGs become pixels. workers: DataLoader worker processes (0: decode in the loading process), each
    holding prefetch_batches batches in flight. Pillow decodes each image to a decode_px square in the workers; with
    device_decode (device_decoder()) the workers only read and check each JPEG and the device decodes the batch."""

    decode_px: int = 256
    workers: int = 0
    prefetch_batches: int = 2
    device_decode: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None

    def __post_init__(self) -> None:
        if not 8 <= self.decode_px <= 1024:
            raise ValueError(f"decode_px must be in [8, 1024], got {self.decode_px}")
        if not 0 <= self.workers <= 256:
            raise ValueError(f"workers must be in [0, 256], got {self.workers}")


class ShardLoader:
    """Training batches (inputs, targets) on `device` from prepared shards, `steps` of them for `epochs`.

    res_at(step) -> px: the training resolution of each step (progressive resizing); it may change at any step.
    normalization: the inputs' standardization, dtype and layout. share: this process's slice of every global batch
    (dist.share), or None for one process.
    """

    def __init__(self, root: str, split: str, *, batch_size: int, epochs: float, device: torch.device,
                 res_at: Callable[[int], int], normalization: Normalization,
                 augmentation: CropAndFlip = CropAndFlip(), decoding: Decoding = Decoding(), seed: int = 0,
                 share: slice | None = None):
        self.decoding = decoding
        self.dataset = ShardImages(root, split, decoding.decode_px, raw=decoding.device_decode is not None)
        if len(self.dataset) == 0:
            raise ValueError(f"the {split} split in {root} has no images; run speedrun data "
                             "prepare on a folder with images")
        self.batch_size, self.device, self.res_at = batch_size, device, res_at
        self.normalization = normalization
        self.augmentation, self.seed, self.share = augmentation, seed, share
        self.steps = steps_for(epochs, len(self.dataset), batch_size)

    @property
    def num_examples(self) -> int:
        return len(self.dataset)

    def epoch_at(self, step: int) -> float:
        return step * self.batch_size / self.num_examples

    def indices(self, step: int) -> torch.Tensor:
        """The sample indices this process trains on at `step` (for tests and the exactly-once check)."""
        indices = stream_indices(self.seed, self.num_examples, self.batch_size, step)
        return indices if self.share is None else indices[self.share]

    def _augment(self, step: int, sizes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Crop boxes and flips of this process's part of global batch `step`: drawn for the whole global batch
        from (seed, step) and cut to the share, so they do not depend on the number of processes. The sizes of
        the other processes' images are not known here, so every process draws with its own images' sizes in
        its own rows: the draws per row are the same numbers, the boxes are each image's own."""
        gen = _generator(self.seed, 1_000_000_000 + step)  # apart from the epochs' permutation streams
        b = len(sizes)
        share = self.share or slice(0, b)
        full = torch.ones(self.batch_size, 2, dtype=torch.int64)
        full[share] = sizes
        boxes = random_resized_boxes(full, gen, self.augmentation.crop_area_frac)[share]
        flips = (torch.rand(self.batch_size, generator=gen) < 0.5)[share] if self.augmentation.flip else None
        return boxes, flips

    def batches(self, start_step: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The batches of steps start_step ... steps - 1; each a pure function of (seed, step)."""
        sampler = _Steps(self.num_examples, self.batch_size, self.seed, start_step, self.steps, self.share)
        pin = self.device.type == "cuda"
        workers = self.decoding.workers
        loader = torch.utils.data.DataLoader(
            self.dataset, batch_sampler=sampler, num_workers=workers, collate_fn=_identity, pin_memory=pin,
            prefetch_factor=self.decoding.prefetch_batches if workers else None, persistent_workers=False,
            worker_init_fn=dataloader_worker_init())  # stop signals are the parent's (workers.py)
        pending: list[tuple[int, tuple]] = []
        step = start_step
        for images, labels, sizes in started(loader):
            # Copy this batch while the previous one trains (non-blocking from pinned memory). Encoded images stay
            # on the host: the decoder takes host bytes and writes its output on the device.
            if self.decoding.device_decode is None:
                images = images.to(self.device, non_blocking=pin)
            pending.append((step, (images, labels.to(self.device, non_blocking=pin), sizes)))
            step += 1
            if len(pending) > 1:
                yield self._finish(*pending.pop(0))
        while pending:
            yield self._finish(*pending.pop(0))

    def _finish(self, step: int, batch: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels, sizes = batch
        boxes, flips = self._augment(step, sizes)
        res = self.res_at(step)
        device_decode = self.decoding.device_decode
        if device_decode is None:
            return crop_resize(images, boxes, flips, res, self.normalization), labels
        # Decoded at their own sizes: each image is cropped from itself (the same boxes as the Pillow path).
        decoded = device_decode(images)  # b x (3, H, W) uint8
        out = [crop_resize(img[None], boxes[k:k + 1], None if flips is None else flips[k:k + 1], res,
                           self.normalization) for k, img in enumerate(decoded)]
        x = torch.cat(out)
        return (x.contiguous(memory_format=torch.channels_last) if self.normalization.channels_last else x), labels


def eval_batches(dataset: ShardImages, *, batch_size: int, res: int, crop_ratio: float, device: torch.device,
                 mean: torch.Tensor, std: torch.Tensor, dtype: torch.dtype, channels_last: bool, workers: int,
                 part: slice | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The evaluation split in file order, centre-cropped at `res` px: (inputs, labels) on `device`. part: the
    positions this process evaluates (dist: a contiguous slice each; the counts are summed)."""
    positions = list(range(len(dataset)))[part or slice(None)]
    batches = [positions[i:i + batch_size] for i in range(0, len(positions), batch_size)]
    pin = device.type == "cuda"
    normalization = Normalization(mean, std, dtype, channels_last)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=batches, num_workers=workers,
                                         collate_fn=_identity, pin_memory=pin, worker_init_fn=dataloader_worker_init())
    for images, labels, sizes in started(loader):
        images = images.to(device, non_blocking=pin)
        yield (crop_resize(images, center_boxes(sizes, crop_ratio), None, res, normalization),
               labels.to(device, non_blocking=pin))
