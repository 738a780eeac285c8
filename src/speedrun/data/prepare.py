"""`speedrun data prepare` (issue 9), its first piece: one source image as the bytes a shard holds.

ImageNet's files are not all what their names say: a few are CMYK JPEGs, some grayscale, one is a PNG named
.JPEG, and phone photos carry an EXIF orientation that a decoder ignores unless asked. Every prepared image is the
same thing: upright, 8-bit RGB, its longer side at most `max_side_px` (FFCV's `max_resolution`; the aspect ratio
kept, never enlarged), encoded as baseline JPEG at `quality` (FFCV's `jpeg_quality`). Files are hostile: read
under the image folder reader's limits (data/folder.py: formats, header size, progressive scans) before a pixel
is decoded; a file that cannot be used is one ValueError naming it (the command decides: skip or stop).
"""

from __future__ import annotations

import io
from dataclasses import dataclass

from PIL import Image, ImageOps

from speedrun.data import folder


@dataclass(frozen=True)
class Prepared:
    """A prepared image and what was done to it (the command counts these in its report)."""
    jpeg: bytes
    width_px: int
    height_px: int
    source_format: str  # "JPEG" or "PNG": what the bytes were, whatever the file's name
    source_mode: str  # Pillow's mode before conversion: "RGB", "L", "CMYK", "P", "RGBA", ...
    rotated: bool  # an EXIF orientation other than 1 was applied
    resized: bool


def prepare_image(path: str, max_side_px: int, quality: int) -> Prepared:
    """The file at `path` as a Prepared image (see the module). Raises ValueError naming the file."""
    if not 16 <= max_side_px <= 8192:
        raise ValueError(f"max side must be 16 to 8192 px, got {max_side_px}; ImageNet recipes use 256 to 512")
    if not 1 <= quality <= 100:
        raise ValueError(f"JPEG quality must be 1 to 100, got {quality}; 90 keeps ImageNet's accuracy (FFCV)")
    try:
        with folder._opened(path) as im:  # JPEG or PNG by content, the file checked
            folder._check_header(path, im, max_side_px)
            source_format, source_mode = im.format, im.mode
            # JPEG only: decode at 1/2, 1/4 or 1/8 scale while the longer side stays >= max_side_px.
            if max(im.size) > max_side_px:
                scale = max_side_px / max(im.size)
                im.draft("RGB", (max(1, round(im.width * scale)), max(1, round(im.height * scale))))
            orientation = im.getexif().get(0x0112, 1)  # EXIF Orientation
            upright = ImageOps.exif_transpose(im)
            rgb = upright.convert("RGB") if upright.mode != "RGB" else upright  # L, CMYK, P, RGBA, LA ...
            resized = max(rgb.size) > max_side_px
            if resized:  # exif_transpose returned a copy: thumbnail (in place) leaves the file's image alone
                rgb.thumbnail((max_side_px, max_side_px), Image.Resampling.LANCZOS)
            buf = io.BytesIO()
            rgb.save(buf, format="JPEG", quality=quality)
            return Prepared(buf.getvalue(), rgb.width, rgb.height, source_format, source_mode,
                            orientation not in (1, None), resized)
    except folder._Refused as e:  # whatever failed inside the block (a file that does not decode to its end too)
        raise ValueError(str(e)) from None
