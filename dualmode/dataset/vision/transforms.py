"""Vision transforms for ``Dataset.map`` (MindSpore's ``dataset.vision``): each takes
one image (HWC, or CHW after HWC2CHW) as a numpy array and returns the new one. The
random ones draw from the generator of ``dualmode.set_seed`` (``context.rng()``), so a
seed gives the same augmented epochs."""
from __future__ import annotations

import numpy as np

from ... import context
from ._png import decode_png

__all__ = ["Decode", "Resize", "RandomCrop", "RandomHorizontalFlip", "CenterCrop",
           "Rescale", "Normalize", "HWC2CHW", "Inter"]


class Inter:
    """Interpolation modes of Resize."""
    NEAREST = "nearest"
    LINEAR = "linear"
    BILINEAR = "linear"


def _size(owner, size):
    given = size
    if isinstance(size, (int, np.integer)) and not isinstance(size, bool):
        size = (int(size), int(size))
    if not isinstance(size, (tuple, list)) or len(size) != 2 or any(
            isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 1
            for s in size):
        raise ValueError(f"{owner}: size={given!r} is not valid; expected an int >= 1 or "
                         f"(height, width)")
    return int(size[0]), int(size[1])


def _image(owner, img):
    img = np.asarray(img)
    if img.ndim not in (2, 3):
        raise ValueError(f"{owner}: the image has shape {img.shape}; expected HW or HWC")
    return img


class Decode:
    """PNG bytes (a 1-D uint8 array or bytes) -> HWC uint8 RGB (``to_pil`` is refused:
    dualmode has no imaging library). JPEG is not supported: it raises saying so."""

    def __init__(self, to_pil=False):
        if to_pil:
            raise ValueError("Decode: to_pil=True is not supported (no imaging library); "
                             "images are numpy arrays")

    def __call__(self, data):
        buf = bytes(np.asarray(data, np.uint8).reshape(-1)) if not isinstance(
            data, (bytes, bytearray)) else bytes(data)
        if buf[:2] == b"\xff\xd8":
            raise ValueError("Decode: JPEG images are not supported; supported: 8-bit PNG "
                             "(store images as PNG, or use the raw MNIST/CIFAR readers)")
        img = decode_png(buf, "Decode")
        if img.shape[2] == 1:
            img = np.repeat(img, 3, axis=2)
        elif img.shape[2] == 2:
            img = np.repeat(img[:, :, :1], 3, axis=2)
        return np.ascontiguousarray(img[:, :, :3])


class Resize:
    """Resize HW(C) to `size` ((h, w), or an int for the shorter side keeping the aspect
    ratio), bilinear (half-pixel centres, as OpenCV) or nearest."""

    def __init__(self, size, interpolation=Inter.LINEAR):
        if isinstance(size, (int, np.integer)) and not isinstance(size, bool):
            if size < 1:
                raise ValueError(f"Resize: size={size!r} is not valid; expected an int >= 1 "
                                 f"or (height, width)")
            self.size = int(size)
        else:
            self.size = _size("Resize", size)
        if interpolation not in (Inter.LINEAR, Inter.NEAREST):
            raise ValueError(f"Resize: interpolation={interpolation!r} is not supported; "
                             f"expected Inter.LINEAR or Inter.NEAREST")
        self.interpolation = interpolation

    def _target(self, h, w):
        if isinstance(self.size, tuple):
            return self.size
        s = self.size
        return (s, max(1, round(w * s / h))) if h <= w else (max(1, round(h * s / w)), s)

    def __call__(self, img):
        img = _image("Resize", img)
        h, w = img.shape[:2]
        oh, ow = self._target(h, w)
        if self.interpolation == Inter.NEAREST:
            rows = np.minimum((np.arange(oh) * h / oh).astype(int), h - 1)
            cols = np.minimum((np.arange(ow) * w / ow).astype(int), w - 1)
            return img[rows][:, cols]

        def axis(n_in, n_out):
            pos = np.clip((np.arange(n_out) + 0.5) * n_in / n_out - 0.5, 0, n_in - 1)
            lo = np.floor(pos).astype(int)
            hi = np.minimum(lo + 1, n_in - 1)
            return lo, hi, (pos - lo).astype(np.float32)
        r0, r1, fr = axis(h, oh)
        c0, c1, fc = axis(w, ow)
        x = img.astype(np.float32)
        shape_r = (-1, 1) + (1,) * (img.ndim - 2)
        shape_c = (1, -1) + (1,) * (img.ndim - 2)
        top = x[r0][:, c0] * (1 - fc.reshape(shape_c)) + x[r0][:, c1] * fc.reshape(shape_c)
        bot = x[r1][:, c0] * (1 - fc.reshape(shape_c)) + x[r1][:, c1] * fc.reshape(shape_c)
        out = top * (1 - fr.reshape(shape_r)) + bot * fr.reshape(shape_r)
        if img.dtype == np.uint8:
            return np.clip(np.rint(out), 0, 255).astype(np.uint8)
        return out.astype(img.dtype)


def _pad4(owner, padding):
    given = padding
    if padding is None:
        return (0, 0, 0, 0)
    if isinstance(padding, (int, np.integer)) and not isinstance(padding, bool):
        padding = (int(padding),) * 4
    elif isinstance(padding, (tuple, list)) and len(padding) == 2:
        padding = (padding[0], padding[1], padding[0], padding[1])
    if not isinstance(padding, (tuple, list)) or len(padding) != 4 or any(
            isinstance(p, bool) or not isinstance(p, (int, np.integer)) or p < 0
            for p in padding):
        raise ValueError(f"{owner}: padding={given!r} is not valid; expected an int >= 0, "
                         f"(left/right, top/bottom) or (left, top, right, bottom)")
    return tuple(int(p) for p in padding)


class RandomCrop:
    """Crop a random `size` window, after padding the image by `padding` (int, 2 or 4
    values: left, top, right, bottom) with `fill_value` (MindSpore's "constant" mode)."""

    def __init__(self, size, padding=None, pad_if_needed=False, fill_value=0,
                 padding_mode="constant"):
        self.size = _size("RandomCrop", size)
        self.padding = _pad4("RandomCrop", padding)
        if padding_mode not in ("constant", "edge", "reflect", "symmetric"):
            raise ValueError(f"RandomCrop: padding_mode={padding_mode!r} is not valid; "
                             f"expected 'constant', 'edge', 'reflect' or 'symmetric'")
        self.pad_if_needed, self.fill_value, self.padding_mode = \
            bool(pad_if_needed), fill_value, padding_mode

    def __call__(self, img):
        img = _image("RandomCrop", img)
        left, top, right, bottom = self.padding
        h, w = img.shape[:2]
        th, tw = self.size
        if self.pad_if_needed:
            bottom += max(th - (h + top + bottom), 0)
            right += max(tw - (w + left + right), 0)
        widths = ((top, bottom), (left, right)) + ((0, 0),) * (img.ndim - 2)
        if any(self.padding) or self.pad_if_needed:
            kw = {"constant_values": self.fill_value} if self.padding_mode == "constant" else {}
            img = np.pad(img, widths, mode=self.padding_mode, **kw)
        h, w = img.shape[:2]
        if th > h or tw > w:
            raise ValueError(f"RandomCrop: size={self.size} is larger than the (padded) "
                             f"image {h}x{w}; use padding or pad_if_needed=True")
        g = context.rng()
        i = int(g.integers(0, h - th + 1))
        j = int(g.integers(0, w - tw + 1))
        return img[i:i + th, j:j + tw]


class RandomHorizontalFlip:
    """Mirror the image left-right with probability `prob`."""

    def __init__(self, prob=0.5):
        if isinstance(prob, bool) or not isinstance(prob, (int, float)) or not 0 <= prob <= 1:
            raise ValueError(f"RandomHorizontalFlip: prob={prob!r} must be a float in [0, 1]")
        self.prob = float(prob)

    def __call__(self, img):
        img = _image("RandomHorizontalFlip", img)
        return img[:, ::-1] if context.rng().random() < self.prob else img


class CenterCrop:
    """Crop the central `size` window (padded with zeros when the image is smaller)."""

    def __init__(self, size):
        self.size = _size("CenterCrop", size)

    def __call__(self, img):
        img = _image("CenterCrop", img)
        th, tw = self.size
        h, w = img.shape[:2]
        if th > h or tw > w:
            ph, pw = max(th - h, 0), max(tw - w, 0)
            img = np.pad(img, ((ph // 2, ph - ph // 2), (pw // 2, pw - pw // 2))
                         + ((0, 0),) * (img.ndim - 2))
            h, w = img.shape[:2]
        i, j = int(round((h - th) / 2.0)), int(round((w - tw) / 2.0))
        return img[i:i + th, j:j + tw]


class Rescale:
    """``image * rescale + shift`` as float32."""

    def __init__(self, rescale, shift):
        for key, v in (("rescale", rescale), ("shift", shift)):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"Rescale: {key}={v!r} must be a number")
        self.rescale, self.shift = float(rescale), float(shift)

    def __call__(self, img):
        return np.asarray(img, np.float32) * np.float32(self.rescale) + np.float32(self.shift)


class Normalize:
    """``(image - mean) / std`` per channel (HWC; ``is_hwc=False`` for CHW), float32."""

    def __init__(self, mean, std, is_hwc=True):
        self.mean = np.asarray(mean, np.float32).reshape(-1)
        self.std = np.asarray(std, np.float32).reshape(-1)
        if self.mean.shape != self.std.shape or not self.mean.size:
            raise ValueError(f"Normalize: mean {self.mean.tolist()} and std {self.std.tolist()} "
                             f"must be non-empty and of the same length (one per channel)")
        if np.any(self.std <= 0):
            raise ValueError(f"Normalize: std={self.std.tolist()} must be > 0")
        self.is_hwc = bool(is_hwc)

    def __call__(self, img):
        img = np.asarray(img, np.float32)
        c = img.shape[-1] if self.is_hwc else img.shape[0]
        if img.ndim == 2:
            c = 1
        if self.mean.size not in (1, c):
            raise ValueError(f"Normalize: mean has {self.mean.size} values but the image "
                             f"{img.shape} has {c} channels")
        shape = (-1,) if self.is_hwc or img.ndim == 2 else (-1, 1, 1)
        return (img - self.mean.reshape(shape)) / self.std.reshape(shape)


class HWC2CHW:
    """HWC -> CHW (HW -> 1HW)."""

    def __call__(self, img):
        img = _image("HWC2CHW", img)
        if img.ndim == 2:
            return img[None]
        return np.ascontiguousarray(img.transpose(2, 0, 1))
