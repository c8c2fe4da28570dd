"""Image files decoded straight into uint8 tensors, and uint8 batches made into the model's input on the device.

JPEG, PNG, WebP and GIF go through TorchCodec's image decoders where it is installed (accel-train[images]; it needs
torch >= 2.11), else through torchvision.io's, which torchvision 0.29 deprecates for TorchCodec's: both libjpeg-turbo
and libpng into a tensor, without PIL's image object and its copy. Other formats, and both missing, go through PIL.
The pixels are the same either way (libjpeg-turbo at its default settings). A damaged file is one line naming it;
so is one whose header declares more pixels than data.max_image_pixels (a decompression bomb), refused before any
decoder runs.
With data.decode=scaled an ImageFolder's JPEGs are read as EncodedJpeg (bytes and header size) and decoded by the
transform at a DCT scale of 1/2, 1/4 or 1/8 through simplejpeg (decoded_at), where the crop needs no more pixels.
Samples stay uint8 through their transforms, the collation and the copy to the device (a quarter of the bytes of
float32); `ImagesToModelInput` scales and normalises whole batches there.
"""

from __future__ import annotations

import functools
import io
import re
import threading
import warnings
from dataclasses import dataclass

import torch

from accel_train.config import MAX_IMAGE_PIXELS
from accel_train.data.channels import to_channels
from accel_train.errors import UnreadableFileError

# The first bytes of the formats decoded into tensors: JPEG, PNG, GIF, and WebP (RIFF....WEBP)
_DECODED_TO_TENSORS = (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"GIF87a", b"GIF89a")
# What to do about an unreadable image, by what read it: a dataset's file, the shard writer's, a shard's sample
_WHAT_TO_DO = {"imagefolder": "delete or replace that file", "shard": "delete or replace that file",
               "shards": "replace that image in the source and write the shards again",
               "hf": "replace that image in the dataset", "predict": "leave that file out of input=",
               "shard index": "replace that image in the tar, or remove the tar"}
_PNG = b"\x89PNG\r\n\x1a\n"
# PIL's pixel limit is one setting of the process: a header read that lifts it holds this lock (the others wait)
_PIL_LIMIT = threading.Lock()
_DECODER_ERROR = re.compile(r"^\w+, \S+:\d+, ")  # "decode_jpeg, .../decode_jpeg.cpp:171, " before the message


def read_image(path: str, reader: str = "imagefolder", max_pixels: int | None = MAX_IMAGE_PIXELS) -> torch.Tensor:
    """The image file at `path` as uint8 (3, H, W) RGB; one line naming it where it cannot be read or declares more
    than `max_pixels` (from a DataLoader worker too). The line starts with `reader`, what the user asked to read it
    (a dataset, or predict)."""
    return decode_image_bytes(_file_bytes(path, reader), path, reader, max_pixels)


def _file_bytes(path: str, reader: str) -> bytes:
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError as err:
        raise unreadable_image(path, reader, err.strerror or str(err)) from None


def decode_image_bytes(data: bytes, name: str, reader: str = "imagefolder",
                       max_pixels: int | None = MAX_IMAGE_PIXELS) -> torch.Tensor:
    """Encoded image bytes as uint8 (3, H, W) RGB, once their header's size is held to `max_pixels`
    (data.max_image_pixels); `name` says where they came from in the line of a damaged or too large one."""
    decode = _tensor_decoder()
    if decode is None or not (data.startswith(_DECODED_TO_TENSORS) or data[:4] == b"RIFF" and data[8:12] == b"WEBP"):
        return _decoded_by_pil(data, name, reader, max_pixels)
    size = declared_size(data)
    if size is not None:  # else no header reader knows the bytes, and the decoder says what is wrong with them
        check_pixels(size, name, reader, max_pixels)
    try:
        image = decode(data)
    except RuntimeError as err:
        raise unreadable_image(name, reader, _DECODER_ERROR.sub("", str(err).splitlines()[0])) from None
    if image.ndim == 4:  # an animated GIF or WebP: its first frame, as PIL's convert("RGB") gives it
        image = image[0]
    if image.dtype != torch.uint8:  # a 16-bit PNG
        from torchvision.transforms.v2 import functional

        image = functional.to_dtype(image, torch.uint8, scale=True)
    return image


@functools.cache
def _tensor_decoder():
    """bytes -> uint8 (C, H, W) RGB: TorchCodec's decode_image, else torchvision.io's, else None (PIL decodes)."""
    try:
        from torchcodec.decoders import decode_image

        return functools.partial(decode_image, mode="RGB")
    except Exception:  # not installed, or built for another torch: its library does not load
        pass
    try:
        from torchvision.io import ImageReadMode, decode_image
    except ImportError:  # a torchvision that has removed them
        return None
    # torchvision 0.29 warns at every call; TorchCodec's decoders replace them where installed (accel-train[images])
    warnings.filterwarnings("ignore", message="The image decoding and encoding capabilities of TorchVision are "
                            "deprecated", category=DeprecationWarning)
    return lambda data: decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)


def _decoded_by_pil(data: bytes, name: str, reader: str, max_pixels: int | None) -> torch.Tensor:
    """BMP, TIFF, PPM and the rest: PIL's decoder, then its pixels as a tensor (torchvision.io reads none of them)."""
    from torchvision.transforms.v2 import functional

    with open_image(data, name, reader, max_pixels) as image:
        return functional.pil_to_tensor(decoded(image, name, reader))


def decoded(image, name, reader: str, mode: str | None = "RGB"):
    """A PIL image (open_image's) decoded, in `mode` (RGB, as torchvision's loader gives it; None: its own); one line
    where it is damaged."""
    from PIL import Image

    try:
        if mode is None:
            image.load()
            return image
        return image.convert(mode)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        raise unreadable_image(name, reader, str(err)) from None


def declared_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) as an encoded image's header declares them, read before anything decodes; None where no
    header reader knows the bytes."""
    if data.startswith(_PNG) and data[12:16] == b"IHDR":
        # PNG's first chunk by its standard, read here: PIL's header read (26 us) costs more than libpng's whole
        # decode of a 28 px PNG (17 us)
        return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    simplejpeg = scaling_decoder()
    if simplejpeg is not None and data.startswith(b"\xff\xd8\xff"):
        try:
            height, width, _, _ = simplejpeg.decode_jpeg_header(data)
            return width, height
        except ValueError:
            pass  # PIL's reader may know it
    try:
        with _opened_by_pil(data) as image:
            return image.size
    except (OSError, SyntaxError, ValueError):
        return None


def open_image(data: bytes, name: str, reader: str, max_pixels: int | None):
    """PIL's image of encoded `data`, its header read (nothing decoded yet) and its size held to `max_pixels`
    (None: no limit, for a read of the size alone); one line naming it where PIL cannot read it, or it is larger."""
    try:
        image = _opened_by_pil(data)
    except (OSError, SyntaxError, ValueError) as err:
        raise unreadable_image(name, reader, str(err)) from None
    check_pixels(image.size, name, reader, max_pixels)
    return image


def _opened_by_pil(data: bytes):
    """PIL's image of `data`, only its header read. PIL's own pixel check is lifted for that read: it refuses at
    twice its limit before it says the size, and data.max_image_pixels may be above it; check_pixels holds the size
    to the key instead, before anything decodes. (PIL's limit is the process's: code of one's own that opens an
    image through PIL in another thread at that moment is not held to it.)"""
    from PIL import Image

    with _PIL_LIMIT:
        limit, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None
        try:
            return Image.open(io.BytesIO(data))
        finally:
            Image.MAX_IMAGE_PIXELS = limit


def check_pixels(size: tuple[int, int], name, reader: str, max_pixels: int | None) -> None:
    """One line naming the image, where `size` (width, height: what its header declares) has more pixels than
    `max_pixels` (data.max_image_pixels; None: no limit). Refused just above the limit, where PIL only warns (up to
    twice it): a warning from a DataLoader worker scrolls by while the memory goes."""
    width, height = size
    if max_pixels is not None and width * height > max_pixels:
        what = _WHAT_TO_DO.get(reader, "give image files only")
        memory = f" ({3 * width * height / 1e9:.1f} GB decoded as RGB)" if 3 * width * height >= 1e8 else ""
        raise UnreadableFileError(
            f"{reader}: {name} declares {width:,} x {height:,} pixels{memory}, more than data.max_image_pixels="
            f"{max_pixels}: not decoded (a decompression bomb?); {what}, or raise data.max_image_pixels if it is meant "
            "to be that large")


# libjpeg-turbo's DCT scales that decode faster than full size: its SIMD code has 1/2, 1/4 and 1/8, not 7/8 or 3/4
# (those decode slower than full size, measured)
DCT_FACTORS = (8, 4, 2)
_SCALABLE_COLOURS = ("YCbCr", "Gray")  # simplejpeg decodes these to RGB; CMYK and YCCK go to the full-size decoder
_EXIF_ORIENTATION = 0x0112


@dataclass(frozen=True)
class EncodedJpeg:
    """A JPEG file's bytes and its size from the header, read ahead of decoding (data.decode=scaled): the transform
    draws its crop from the size, then decodes at the scale the crop needs (decoded_at)."""

    data: bytes
    name: str  # where the bytes came from, for the line of a damaged file
    reader: str
    height: int
    width: int


def read_encoded(path: str, reader: str = "imagefolder",
                 max_pixels: int | None = MAX_IMAGE_PIXELS) -> EncodedJpeg | torch.Tensor:
    """ImageFolder's loader with data.decode=scaled: a JPEG that can be decoded at a DCT scale as EncodedJpeg (its
    bytes and header size, decoded by the transform); any other file decoded at full size as read_image does. Either
    way its header's size is held to `max_pixels` first."""
    data = _file_bytes(path, reader)
    size = _scalable_jpeg_size(data)
    if size is None:
        return decode_image_bytes(data, path, reader, max_pixels)
    height, width = size
    check_pixels((width, height), path, reader, max_pixels)
    return EncodedJpeg(data, path, reader, height, width)


def _scalable_jpeg_size(data: bytes) -> tuple[int, int] | None:
    """(height, width) of a JPEG that simplejpeg decodes at a scale into the pixels the full-size decoder gives, else
    None: not a JPEG, simplejpeg missing, CMYK, a header it cannot read (the full-size decoder then says what is
    wrong, as with data.decode=full), or an EXIF orientation (TorchCodec turns the image, simplejpeg does not)."""
    simplejpeg = scaling_decoder()
    if simplejpeg is None or not data.startswith(b"\xff\xd8\xff"):
        return None
    try:
        height, width, colours, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return None
    if colours not in _SCALABLE_COLOURS or exif_orientation(data) not in (None, 1):
        return None
    return height, width


def exif_orientation(data: bytes) -> int | None:
    """A JPEG's EXIF orientation tag (1: as stored), None where it has none: its APP1 segment's first IFD, read
    from the markers before the image data."""
    at = 2
    while at + 4 <= len(data) and data[at] == 0xFF:
        marker, length = data[at + 1], int.from_bytes(data[at + 2:at + 4], "big")
        if marker in (0xDA, 0xD9):  # the image data starts, or the file ends: no EXIF before them
            return None
        if marker == 0xE1 and data[at + 4:at + 10] == b"Exif\0\0":
            tiff = data[at + 10:at + 2 + length]
            order = "little" if tiff[:2] == b"II" else "big"
            ifd = int.from_bytes(tiff[4:8], order)
            for entry in range(int.from_bytes(tiff[ifd:ifd + 2], order)):
                field = tiff[ifd + 2 + 12 * entry:ifd + 14 + 12 * entry]
                if int.from_bytes(field[:2], order) == _EXIF_ORIENTATION:
                    return int.from_bytes(field[8:10], order)
            return None
        at += 2 + length
    return None


def decoded_at(jpeg: EncodedJpeg, factor: int) -> torch.Tensor:
    """The JPEG as uint8 (3, H, W) RGB at 1/factor of its size (libjpeg's DCT scaling: ceil(side / factor) pixels,
    each about the mean of factor x factor pixels of the full size, fewer in the last row and column where a side
    is not a multiple). At factor 1, the full-size decoder's pixels: libjpeg-turbo at its default settings, as
    TorchCodec's and torchvision.io's (a test holds each to PIL's), and faster than theirs on small photographs."""
    decode = scaling_decoder().decode_jpeg
    try:  # min_factor with the sizes of 1/factor: that scale, not a nearer one (7/8, 3/4: slower than full size)
        pixels = decode(jpeg.data) if factor == 1 else decode(
            jpeg.data, min_factor=factor, min_height=-(-jpeg.height // factor), min_width=-(-jpeg.width // factor))
    except ValueError as err:
        raise unreadable_image(jpeg.name, jpeg.reader, str(err).splitlines()[0]) from None
    return torch.from_numpy(pixels).permute(2, 0, 1)


@functools.cache
def scaling_decoder():
    """simplejpeg (libjpeg-turbo in a wheel, with its DCT scaling), or None where it is missing (every JPEG then
    decoded at full size)."""
    try:
        import simplejpeg
    except ImportError:
        return None
    return simplejpeg


def shrunk(pixels: torch.Tensor, short_side: int | None) -> torch.Tensor:
    """uint8 (C, H, W) pixels resized (antialiased) to a short side of `short_side` where theirs is longer: as
    `accel-train shard ... shrink_to=` stores them, by the evaluation transform's own resize (so at shrink_to equal
    to its size, evaluation sees the pixels of the source)."""
    if not short_side or min(pixels.shape[-2:]) <= short_side:
        return pixels
    from torchvision.transforms.v2 import functional

    return functional.resize(pixels, short_side, antialias=True)


def unreadable_image(name: str, reader: str, why: str) -> UnreadableFileError:
    """The one line for an image that cannot be read, starting with `reader` (what the user asked to read it) and
    ending with what to do about it there."""
    what = _WHAT_TO_DO.get(reader, "give image files only")  # predict's inputs, a user's own files
    return UnreadableFileError(f"{reader}: cannot read {name} as an image ({why}); {what}")


def decoder_name() -> str:
    """Which decoder image files go through here: TorchCodec, torchvision.io or PIL."""
    decode = _tensor_decoder()
    if decode is None:
        return "PIL"
    module = getattr(getattr(decode, "func", decode), "__module__", "")
    return "TorchCodec" if module.startswith("torchcodec") else "torchvision.io"


class Crops:
    """A batch of uint8 (C, H, W) images of different sizes (training's random crops of raw pixels, resized on the
    device by ImagesToModelInput), held as one flat tensor and the images' shapes: one copy to the device, pinned as
    one. The shapes stay on the host, where cutting the batch apart needs them (reading them from the device would
    wait for it). Accelerate's send_to_device and the DataLoader's pinning call `to` and `pin_memory`."""

    def __init__(self, pixels: torch.Tensor, shapes: torch.Tensor) -> None:
        self.pixels, self.shapes = pixels, shapes

    @classmethod
    def collate(cls, samples: list) -> list:
        """collate_fn: samples (image, label, ...) -> [Crops of the images, the rest as default_collate makes them]."""
        from torch.utils.data import default_collate

        images, *rest = zip(*samples)
        shapes = torch.tensor([image.shape for image in images])
        return [cls(torch.cat([image.reshape(-1) for image in images]), shapes), *map(default_collate, rest)]

    def to(self, device, non_blocking: bool = False) -> Crops:
        return Crops(self.pixels.to(device, non_blocking=non_blocking), self.shapes)

    def pin_memory(self) -> Crops:
        return Crops(self.pixels.pin_memory(), self.shapes)

    @property
    def device(self) -> torch.device:
        return self.pixels.device

    def __len__(self) -> int:
        return len(self.shapes)

    def images(self) -> list[torch.Tensor]:
        """Each image, a view of the flat tensor."""
        shapes = self.shapes.tolist()
        return [flat.view(shape) for flat, shape in zip(self.pixels.split([c * h * w for c, h, w in shapes]), shapes)]


class ImagesToModelInput:
    """uint8 image batches -> the float batch the model sees, scaled and normalised where the batch is: on the
    training device, after Accelerate's copy. The same operations in the same order as torchvision's
    ToDtype(float32, scale=True) + Normalize on the host, so the same inputs bit for bit; written out rather than
    called because Normalize copies its mean and std to the device at every call. Float images (made on the host,
    where random erasing runs) pass as they are.

    Crops (random crops of raw pixels, cut on the host) are first resized to `size` here, each by the resize that
    RandomResizedCrop makes on the host (antialiased, on uint8), so the host only copies pixels."""

    def __init__(self, mean, std, size: int | None = None, interpolation: str = "bilinear") -> None:
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)
        self.size, self.interpolation = size, interpolation
        self.on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, batch):
        """A batch as the loader gives it: (images, labels, ...) with the images made into the model's input."""
        images, *rest = batch
        made = self.images(images)
        if made is images:
            return batch
        return [made, *rest] if isinstance(batch, list) else (made, *rest)

    def images(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 images, (C, H, W) or (N, C, H, W), or Crops, as normalised float32, with a channel for each value of
        the mean (data.channels: converted just before normalising)."""
        if isinstance(images, Crops):
            images = resized_crops(images, self.size, self.interpolation)
        if images.dtype != torch.uint8:
            return images
        mean, std = self.normalization_on(images.device)
        if images.shape[-3] != mean.shape[-3]:
            scaled = to_channels(images.to(torch.float32).mul_(1.0 / 255), mean.shape[-3])
            return torch.sub(scaled, mean, out=float_batch_like(scaled)).div_(std)
        return float_batch_like(images).copy_(images).mul_(1.0 / 255).sub_(mean).div_(std)

    def normalization_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The mean and std on `device`, (C, 1, 1) each."""
        if device not in self.on_device:  # copied once a device, not at every batch; from pinned memory,
            pinned = device.type == "cuda"  # as a pageable copy would wait for the device's queued work
            self.on_device[device] = tuple((value.pin_memory() if pinned else value).to(
                device, non_blocking=pinned) for value in (self.mean, self.std))
        return self.on_device[device]


def float_batch_like(images: torch.Tensor) -> torch.Tensor:
    """An empty float32 tensor of `images`' shape where they are; in a DataLoader worker (the finish of a CPU run),
    in shared memory, as default_collate makes a worker's batches: the batch then reaches the main process without
    the copy into shared memory that sending it would make (64 images of 224 px: 38 MB, as long as the finish)."""
    from torch.utils.data import get_worker_info

    if images.device.type != "cpu" or get_worker_info() is None:
        return torch.empty(images.shape, dtype=torch.float32, device=images.device)
    storage = torch.UntypedStorage._new_shared(images.numel() * 4)  # default_collate's own way in a worker
    return torch.empty(0, dtype=torch.float32).set_(storage).view(images.shape)


def resized_crops(crops: Crops, size: int, interpolation: str = "bilinear") -> torch.Tensor:
    """Each crop resized to (size, size), stacked: uint8 (N, C, size, size) where the crops are. A crop at a time,
    as torchvision resizes one image (no batched resize takes inputs of different sizes); flipping (on the host)
    and this resize commute bit for bit."""
    from torchvision.transforms.v2 import InterpolationMode, functional

    mode = InterpolationMode(interpolation)
    return torch.stack([functional.resize(crop, [size, size], interpolation=mode, antialias=True)
                        for crop in crops.images()])


def model_input(finish: ImagesToModelInput | None, batch):
    """A loaded batch as the model takes it: through the data's `finish` where it has one."""
    return finish(batch) if finish is not None else batch
