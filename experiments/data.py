"""The paper's datasets read from their standard on-disk formats, plus offline ones.

Nothing is ever downloaded. ``cifar10``/``cifar100`` read the python-pickle
folders (``cifar-10-batches-py``, ``cifar-100-python``) under ``--data-root``,
``caltech101`` the ``101_ObjectCategories`` folder of per-class image folders.
``digits`` is real data that ships inside scikit-learn (1,797 handwritten
digits, 8x8, upscaled to 32x32x3) so the accuracy experiment runs offline;
``synthetic`` is class templates plus noise, for pure speed runs.

Images are held as uint8 ``(N, 3, H, W)``; :class:`Batches` turns them into
normalised float batches with the usual augmentation (random crop after
padding, horizontal flip), reproducibly from a seed, so the plain and the
pipedp run of an experiment see the very same batches.
"""

from __future__ import annotations

import io
import os
import pickle
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["DATASETS", "Dataset", "Batches", "load", "cifar", "caltech101", "digits", "save_digits", "synthetic"]

CIFAR_URL = "https://www.cs.toronto.edu/~kriz/cifar.html"
CALTECH_URL = "https://data.caltech.edu/records/mzrjq-6wc02"


@dataclass
class Dataset:
    """A train/test split of uint8 images ``(N, 3, H, W)`` with int64 labels."""

    name: str
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    classes: int
    flip: bool = True  # mirror images are the same class (not so for digits)

    @property
    def image_size(self) -> int:
        return int(self.train_x.shape[-1])

    def stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-channel mean and std of the training images, in [0, 1] units."""
        x = self.train_x.float().div_(255)
        return x.mean(dim=(0, 2, 3)), x.std(dim=(0, 2, 3)).clamp_min(1e-3)

    def subset(self, train: int | None = None, test: int | None = None) -> "Dataset":
        """The first ``train``/``test`` images of each split (``--quick`` runs)."""
        return Dataset(self.name, self.train_x[:train], self.train_y[:train], self.test_x[:test],
                       self.test_y[:test], self.classes, self.flip)


# -- CIFAR ------------------------------------------------------------------------------------------
class _ArraysOnly(pickle.Unpickler):
    """CIFAR batches hold numpy arrays, lists and bytes: refuse anything else (a pickle can run code)."""

    ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"),
               ("numpy._core.multiarray", "scalar")}

    def find_class(self, module: str, name: str):  # type: ignore[override]
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"unexpected object {module}.{name}")


def _read_batch(path: str, label_key: bytes) -> tuple[np.ndarray, np.ndarray]:
    try:
        with open(path, "rb") as f:
            d = _ArraysOnly(io.BytesIO(f.read()), encoding="bytes").load()
        data, labels = np.asarray(d[b"data"], dtype=np.uint8), np.asarray(d[label_key], dtype=np.int64)
    except (pickle.UnpicklingError, EOFError, KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        raise ValueError(
            f"{path} is not a CIFAR python batch ({type(e).__name__}: {e}); expected a pickled dict with "
            f"{b'data'!r} (N x 3072 uint8) and {label_key!r}: re-extract the 'python version' archive from {CIFAR_URL}"
        ) from None
    if data.ndim != 2 or data.shape[1] != 3072 or len(labels) != len(data):
        raise ValueError(f"{path}: data has shape {data.shape} and {len(labels)} labels; expected N x 3072 and N labels")
    return data.reshape(-1, 3, 32, 32), labels


def cifar(root: str, classes: int = 10) -> Dataset:
    """CIFAR-10 or CIFAR-100 from the python-pickle folder under ``root``."""
    if classes == 10:
        folder, train, test, key = "cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)], ["test_batch"], b"labels"
    elif classes == 100:
        folder, train, test, key = "cifar-100-python", ["train"], ["test"], b"fine_labels"
    else:
        raise ValueError(f"CIFAR has 10 or 100 classes, not {classes}")
    base = os.path.join(os.path.expanduser(root), folder)
    missing = [f for f in train + test if not os.path.isfile(os.path.join(base, f))]
    if missing:
        raise FileNotFoundError(
            f"CIFAR-{classes} not found: expected {base}/ with {', '.join(train + test)} "
            f"(missing {', '.join(missing)}). Download and extract the 'python version' from {CIFAR_URL} "
            f"into --data-root (nothing is downloaded here), or use --dataset digits or synthetic"
        )

    def read(names: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [_read_batch(os.path.join(base, n), key) for n in names]
        return torch.from_numpy(np.concatenate([p[0] for p in parts])), torch.from_numpy(np.concatenate([p[1] for p in parts]))

    (tx, ty), (vx, vy) = read(train), read(test)
    for split, y in (("train", ty), ("test", vy)):
        if len(y) and (int(y.min()) < 0 or int(y.max()) >= classes):
            raise ValueError(f"{base}: {split} labels span {int(y.min())}..{int(y.max())}, not 0..{classes - 1}")
    return Dataset(f"cifar{classes}", tx, ty, vx, vy, classes)


# -- Caltech-101 ----------------------------------------------------------------------------------
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp")


def _decode(path: str, size: int) -> np.ndarray:
    from PIL import Image

    try:
        with Image.open(path) as im:
            im = im.convert("RGB")
            w, h = im.size
            s = size / min(w, h)  # shorter side to ``size``, then the centre square
            im = im.resize((max(size, round(w * s)), max(size, round(h * s))), Image.BILINEAR)
            w, h = im.size
            left, top = (w - size) // 2, (h - size) // 2
            im = im.crop((left, top, left + size, top + size))
            return np.asarray(im, dtype=np.uint8).transpose(2, 0, 1).copy()
    except OSError as e:
        raise ValueError(f"cannot read image {path}: {e}; remove or replace the file") from None


def caltech101(root: str, size: int = 224, test_fraction: float = 0.2, seed: int = 0) -> Dataset:
    """Caltech-101 from ``root/101_ObjectCategories/<class>/*.jpg``, split per class (seeded).

    ``BACKGROUND_Google`` (clutter, not a category) is left out, as usual:
    101 classes. Each class keeps ``test_fraction`` of its images (at least one)
    for testing. Images become ``size`` x ``size`` (shorter side scaled, centre crop).
    """
    try:
        import PIL  # noqa: F401
    except ImportError:
        raise ImportError("reading Caltech-101 needs Pillow: pip install pillow (or pipedp[experiments])") from None
    base = os.path.join(os.path.expanduser(root), "101_ObjectCategories")
    if not os.path.isdir(base):
        raise FileNotFoundError(
            f"Caltech-101 not found: expected {base}/<category>/image_*.jpg (the 101_ObjectCategories folder "
            f"of the archive from {CALTECH_URL}, extracted into --data-root; nothing is downloaded here), "
            f"or use --dataset digits or synthetic"
        )
    names = sorted(d for d in os.listdir(base) if os.path.isdir(os.path.join(base, d)) and d != "BACKGROUND_Google")
    files = {n: sorted(f for f in os.listdir(os.path.join(base, n)) if f.lower().endswith(IMAGE_SUFFIXES)) for n in names}
    empty = [n for n in names if not files[n]]
    if len(names) < 2 or empty:
        raise ValueError(
            f"{base} must hold one folder of images per category (at least 2 categories, each with "
            f"{'/'.join(IMAGE_SUFFIXES)} files); found {len(names)} categories"
            + (f", empty: {', '.join(empty[:5])}" if empty else "")
        )
    rng = np.random.default_rng(seed)
    train, test = [], []
    for label, n in enumerate(names):
        order = rng.permutation(len(files[n]))
        k = max(1, round(len(order) * test_fraction)) if len(order) > 1 else 0
        test += [(os.path.join(base, n, files[n][i]), label) for i in order[:k]]
        train += [(os.path.join(base, n, files[n][i]), label) for i in order[k:]]

    def read(items: list[tuple[str, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            images = list(pool.map(lambda it: _decode(it[0], size), items))
        x = torch.from_numpy(np.stack(images)) if images else torch.empty(0, 3, size, size, dtype=torch.uint8)
        return x, torch.tensor([label for _, label in items], dtype=torch.int64)

    (tx, ty), (vx, vy) = read(train), read(test)
    return Dataset("caltech101", tx, ty, vx, vy, len(names))


# -- offline sets ----------------------------------------------------------------------------------
def _stratified(y: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    train, test = [], []
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        k = round(len(idx) * test_fraction)
        test.append(idx[:k])
        train.append(idx[k:])
    return rng.permutation(np.concatenate(train)), np.sort(np.concatenate(test))


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        path = os.environ.get("PIPEDP_DIGITS_NPZ")  # a host without scikit-learn (see save_digits)
        if path and os.path.isfile(path):
            with np.load(path, allow_pickle=False) as z:
                return z["images"], z["target"]
        raise ImportError(
            "the offline 'digits' set ships with scikit-learn: pip install scikit-learn (or pipedp[experiments]), "
            "set PIPEDP_DIGITS_NPZ to a file written by experiments.data.save_digits, or use --dataset synthetic"
        ) from None
    d = load_digits()
    return d.images, d.target


def save_digits(path: str) -> None:
    """Write the digits arrays to ``path`` (.npz) for a host without scikit-learn (PIPEDP_DIGITS_NPZ)."""
    images, target = _digits_arrays()
    with open(path, "wb") as f:
        np.savez_compressed(f, images=images, target=target)


def digits(size: int = 32, test_fraction: float = 0.2, seed: int = 0) -> Dataset:
    """scikit-learn's bundled handwritten digits (real, offline), upscaled to ``size`` x ``size`` x 3."""
    images, target = _digits_arrays()
    img = torch.from_numpy(images.astype(np.float32) / 16.0).unsqueeze(1)  # (N, 1, 8, 8) in [0, 1]
    img = F.interpolate(img, size=(size, size), mode="bilinear", align_corners=False)
    x = (img.clamp(0, 1) * 255).round().to(torch.uint8).expand(-1, 3, -1, -1).contiguous()
    y = np.asarray(target, dtype=np.int64)
    tr, te = _stratified(y, test_fraction, seed)
    yt = torch.from_numpy(y)
    return Dataset("digits", x[tr], yt[tr], x[te], yt[te], 10, flip=False)


def synthetic(train: int = 2048, test: int = 512, classes: int = 10, size: int = 32, seed: int = 0) -> Dataset:
    """Class templates plus noise: learnable, any size, no files (speed runs)."""
    g = torch.Generator().manual_seed(seed)
    templates = torch.rand(classes, 3, size, size, generator=g)

    def make(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.randint(0, classes, (n,), generator=g)
        x = (0.6 * templates[y] + 0.4 * torch.rand(n, 3, size, size, generator=g)) * 255
        return x.round().to(torch.uint8), y

    (tx, ty), (vx, vy) = make(train), make(test)
    return Dataset("synthetic", tx, ty, vx, vy, classes)


DATASETS = ("cifar10", "cifar100", "caltech101", "digits", "synthetic")


def load(name: str, root: str | None = None, *, image_size: int | None = None, seed: int = 0) -> Dataset:
    """A dataset by its ``--dataset`` name; ``root`` is ``--data-root`` for the on-disk ones."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}: choose one of {', '.join(DATASETS)}")
    if name in ("cifar10", "cifar100", "caltech101") and not root:
        raise ValueError(f"--dataset {name} reads files: pass --data-root DIR (the folder holding the extracted archive)")
    if name == "cifar10":
        return cifar(root, 10)  # type: ignore[arg-type]
    if name == "cifar100":
        return cifar(root, 100)  # type: ignore[arg-type]
    if name == "caltech101":
        return caltech101(root, size=image_size or 224, seed=seed)  # type: ignore[arg-type]
    if name == "digits":
        return digits(size=image_size or 32, seed=seed)
    return synthetic(size=image_size or 32, seed=seed)


class Batches:
    """Normalised float batches of one split: shuffled and augmented (training) or in order (test).

    Epoch ``e`` of a seed is always the same sequence of batches, whichever
    run asks for it, so two runs compared side by side train on identical data.
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int, *, mean: torch.Tensor, std: torch.Tensor,
                 train: bool, flip: bool = True, seed: int = 0) -> None:
        if batch_size < 1:
            raise ValueError(f"batch size must be positive, got {batch_size}")
        if train and len(x) < batch_size:
            raise ValueError(f"the training split has {len(x)} images, fewer than one batch of {batch_size}: "
                             f"lower --batch-size")
        self.x, self.y, self.batch_size, self.train, self.flip, self.seed = x, y, batch_size, train, flip, seed
        self.mean, self.std = mean.view(1, -1, 1, 1), std.view(1, -1, 1, 1)
        self.pad = max(1, x.shape[-1] // 8)  # 4 pixels at 32x32, as in the ResNet paper's CIFAR recipe

    def __len__(self) -> int:
        n = len(self.x)
        return n // self.batch_size if self.train else -(-n // self.batch_size)

    def epoch(self, e: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(self.seed * 100003 + e)
        order = torch.randperm(len(self.x), generator=g) if self.train else torch.arange(len(self.x))
        for k in range(len(self)):
            idx = order[k * self.batch_size : (k + 1) * self.batch_size]
            x = self.x[idx].float().div_(255)
            if self.train:
                x = self._augment(x, g)
            yield (x - self.mean) / self.std, self.y[idx]

    def _augment(self, x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        n, c, h, w = x.shape
        p = self.pad
        padded = F.pad(x, (p, p, p, p))
        dy, dx = torch.randint(0, 2 * p + 1, (n,), generator=g), torch.randint(0, 2 * p + 1, (n,), generator=g)
        rows = (dy[:, None] + torch.arange(h))[:, None, :, None]
        cols = (dx[:, None] + torch.arange(w))
        if self.flip:
            mirror = torch.rand(n, generator=g) < 0.5
            cols = torch.where(mirror[:, None], cols.flip(1), cols)
        return padded[torch.arange(n)[:, None, None, None], torch.arange(c)[None, :, None, None], rows, cols[:, None, None, :]]
