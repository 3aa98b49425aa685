"""Image classification data for the command line and the reproductions; nothing is ever downloaded.

- ``digits``: scikit-learn's 8x8 handwritten digits (1797 images, shipped with scikit-learn);
- ``mnist:DIR``: the MNIST idx files (``train-images-idx3-ubyte`` and friends, gzipped or not)
  in a directory the user has;
- ``cifar10:DIR``: the CIFAR-10 python pickle batches (``data_batch_1`` .. ``data_batch_5``,
  ``test_batch``) in ``DIR`` or ``DIR/cifar-10-batches-py``;
- ``cifar100:DIR``: the CIFAR-100 python pickles (``train``, ``test``, fine labels) in ``DIR``
  or ``DIR/cifar-100-python``.

Images come back as float32 arrays of shape (N, C, H, W) scaled to [0, 1], labels as int64;
numpy only, so the module imports without torch (:func:`to_batches` imports it when called).
"""

from __future__ import annotations

import gzip
import importlib.util
import logging
import pickle
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pyperm._checks import check_int, check_positive_int

__all__ = [
    "Dataset",
    "DatasetError",
    "load_cifar10",
    "load_cifar100",
    "load_dataset",
    "load_digits",
    "load_mnist",
    "read_idx",
    "to_batches",
]

logger = logging.getLogger(__name__)

DIGITS_TEST = 397  # of the 1797 digits: the test split, the rest is training data


class DatasetError(ValueError):
    """A dataset that cannot be found or read; the message names the file."""


@dataclass(frozen=True)
class Dataset:
    """A train/test split of images and labels.

    Attributes
    ----------
    name : str
        ``"digits"``, ``"mnist"``, ``"cifar10"`` or ``"cifar100"``.
    x_train, x_test : (N, C, H, W) ndarray of float32
        Images scaled to [0, 1].
    y_train, y_test : (N,) ndarray of int64
        Class labels.
    num_classes : int
        Number of classes.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int = 10

    @property
    def input_shape(self) -> tuple[int, ...]:
        """The shape of one image, (C, H, W)."""
        return tuple(self.x_train.shape[1:])

    def normalized(self, mean: list[float], std: list[float]) -> Dataset:
        """``(x - mean) / std`` per channel (one value for all channels, or one per channel).

        Raises
        ------
        DatasetError
            Wrong number of values, or a non-positive ``std``.
        """
        channels = self.x_train.shape[1]
        for name, values in (("mean", mean), ("std", std)):
            if len(values) not in (1, channels):
                raise DatasetError(
                    f"--{name} needs 1 or {channels} values for {self.name} ({channels} channels), got {len(values)}"
                )
        if min(std) <= 0:
            raise DatasetError(f"--std values must be positive, got {list(std)}")
        m = np.asarray(mean, dtype=np.float32).reshape(1, -1, 1, 1)
        s = np.asarray(std, dtype=np.float32).reshape(1, -1, 1, 1)
        return Dataset(
            self.name, (self.x_train - m) / s, self.y_train, (self.x_test - m) / s, self.y_test, self.num_classes
        )

    def subset(self, train: int | None = None, test: int | None = None) -> Dataset:
        """The first ``train`` training and ``test`` test samples (all when None)."""
        train = check_int(train, "train", 1, allow_none=True)
        test = check_int(test, "test", 1, allow_none=True)
        return Dataset(
            self.name,
            self.x_train[:train],
            self.y_train[:train],
            self.x_test[:test],
            self.y_test[:test],
            self.num_classes,
        )


# ------------------------------------------------------------------------------ digits


def _digits_table() -> tuple[np.ndarray, np.ndarray]:
    """The digits as scikit-learn ships them: (1797, 64) pixel values 0..16 and labels.

    The gzipped CSV inside scikit-learn is read directly when it is there: importing
    ``sklearn.datasets`` takes seconds on a loaded machine, reading the file a tenth of one.
    """
    spec = importlib.util.find_spec("sklearn")
    if spec is None:
        raise DatasetError("the digits data ships with scikit-learn: pip install scikit-learn")
    path = None if spec.origin is None else Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
    if path is not None and path.exists():
        table = np.loadtxt(path, delimiter=",")
        return table[:, :-1], table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits as sk_load_digits

    data = sk_load_digits()
    return np.asarray(data.data, dtype=np.float64), np.asarray(data.target, dtype=np.int64)


def load_digits(seed: int = 0) -> Dataset:
    """scikit-learn's digits as (N, 1, 8, 8) images in [0, 1]: 1400 training and 397 test images.

    Parameters
    ----------
    seed : int, default 0
        Seeds the shuffle before the split (numpy's ``default_rng``).
    """
    seed = check_int(seed, "seed", 0)
    images, labels = _digits_table()
    order = np.random.default_rng(seed).permutation(len(labels))
    x = (images[order] / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    y = labels[order]
    cut = len(y) - DIGITS_TEST
    return Dataset("digits", x[:cut], y[:cut], x[cut:], y[cut:])


# ------------------------------------------------------------------------------ MNIST

# The idx format's type codes (third byte of the magic number) and their big-endian dtypes.
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | Path) -> np.ndarray:
    """Read one idx file (the MNIST format), gzipped or not.

    Parameters
    ----------
    path : str or pathlib.Path
        The file; a name ending in ``.gz`` is decompressed.

    Returns
    -------
    ndarray
        The array with the file's shape and dtype (native byte order).

    Raises
    ------
    DatasetError
        The file is missing, truncated, or not in the idx format.
    """
    path = Path(path)
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise DatasetError(f"{path}: cannot be read ({type(exc).__name__}: {exc})") from exc
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise DatasetError(f"{path}: not an idx file (bad magic number)")
    ndim = raw[3]
    if ndim == 0 or len(raw) < 4 + 4 * ndim:
        raise DatasetError(f"{path}: not an idx file (bad number of dimensions {ndim})")
    shape = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    expected = int(np.prod(shape)) * dtype.itemsize
    body = raw[4 + 4 * ndim :]
    if len(body) != expected:
        raise DatasetError(f"{path}: idx header says shape {shape} ({expected} bytes), the file has {len(body)} bytes")
    return np.frombuffer(body, dtype=dtype).reshape(shape).astype(dtype.newbyteorder("="))


def _find(root: Path, stem: str) -> Path:
    """``root/stem`` with the names MNIST copies come under (``.gz``, or ``-`` written ``.``)."""
    names = [stem, stem.replace("-idx", ".idx")]
    for name in names:
        for candidate in (root / name, root / (name + ".gz")):
            if candidate.exists():
                return candidate
    raise DatasetError(f"{root}: no {stem} (or {stem}.gz) found")


def load_mnist(root: str | Path) -> Dataset:
    """MNIST from the four idx files in ``root`` (or ``root/MNIST/raw``, torchvision's layout).

    Parameters
    ----------
    root : str or pathlib.Path
        The directory with ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
        ``t10k-images-idx3-ubyte`` and ``t10k-labels-idx1-ubyte``, each possibly ``.gz``.

    Returns
    -------
    Dataset
        (N, 1, 28, 28) images in [0, 1].

    Raises
    ------
    DatasetError
        A file is missing or malformed, or images and labels disagree in number.
    """
    root = Path(root)
    if not root.is_dir():
        raise DatasetError(f"{root}: not a directory")
    if (root / "MNIST" / "raw").is_dir():
        root = root / "MNIST" / "raw"
    parts = []
    for split in ("train", "t10k"):
        images_path = _find(root, f"{split}-images-idx3-ubyte")
        labels_path = _find(root, f"{split}-labels-idx1-ubyte")
        images, labels = read_idx(images_path), read_idx(labels_path)
        if images.ndim != 3:
            raise DatasetError(f"{images_path}: expected (N, rows, cols) images, got shape {images.shape}")
        if labels.ndim != 1 or len(labels) != len(images):
            raise DatasetError(f"{labels_path}: {labels.shape} labels for {len(images)} images in {images_path.name}")
        parts.append(((images.astype(np.float32) / 255.0)[:, None], labels.astype(np.int64)))
    (x_train, y_train), (x_test, y_test) = parts
    return Dataset("mnist", x_train, y_train, x_test, y_test)


# ------------------------------------------------------------------------------ CIFAR-10


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles plain containers and numpy arrays only: a batch file cannot run code."""

    _ALLOWED = frozenset(
        {
            ("numpy.core.multiarray", "_reconstruct"),
            ("numpy._core.multiarray", "_reconstruct"),
            ("numpy", "ndarray"),
            ("numpy", "dtype"),
            ("numpy.core.multiarray", "scalar"),
            ("numpy._core.multiarray", "scalar"),
            ("_codecs", "encode"),
        }
    )

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a CIFAR batch")


def _read_cifar_batch(path: Path, label_key: str = "labels", kind: str = "CIFAR-10") -> tuple[np.ndarray, np.ndarray]:
    """Images and labels of one python pickle of CIFAR-10 (``labels``) or CIFAR-100 (``fine_labels``)."""
    if not path.exists():
        raise DatasetError(f"{path}: no such file (expected the {kind} python batches)")
    try:
        with path.open("rb") as f:
            batch = _ArrayUnpickler(f, encoding="bytes").load()
    except Exception as exc:  # pickle raises many types for a corrupt file
        raise DatasetError(f"{path}: not a readable {kind} batch ({type(exc).__name__}: {exc})") from exc
    if not isinstance(batch, dict):
        raise DatasetError(f"{path}: holds a {type(batch).__name__}, not a {kind} batch dict")
    data = batch.get(b"data", batch.get("data"))
    labels = batch.get(label_key.encode(), batch.get(label_key))
    if data is None or labels is None:
        raise DatasetError(f"{path}: key 'data' or {label_key!r} is missing")
    data = np.asarray(data)
    try:
        labels = np.asarray(labels, dtype=np.int64)
    except (TypeError, ValueError) as exc:
        raise DatasetError(f"{path}: key {label_key!r} is not a list of integers") from exc
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(labels) != len(data):
        raise DatasetError(f"{path}: key 'data' has shape {data.shape} for {len(labels)} labels, expected (N, 3072)")
    return (data.reshape(-1, 3, 32, 32).astype(np.float32) / 255.0), labels


def load_cifar10(root: str | Path) -> Dataset:
    """CIFAR-10 from its python batches in ``root`` or ``root/cifar-10-batches-py``.

    Parameters
    ----------
    root : str or pathlib.Path
        The directory with ``data_batch_1`` .. ``data_batch_5`` and ``test_batch``.
        Training batches that are absent are skipped (with a logged warning) so a
        partial copy works; at least one is needed.

    Returns
    -------
    Dataset
        (N, 3, 32, 32) images in [0, 1], not normalised.

    Raises
    ------
    DatasetError
        No training batch, no test batch, or a malformed batch (named).
    """
    root = Path(root)
    if (root / "cifar-10-batches-py").is_dir():
        root = root / "cifar-10-batches-py"
    if not root.is_dir():
        raise DatasetError(f"{root}: not a directory")
    present = [root / f"data_batch_{i}" for i in range(1, 6) if (root / f"data_batch_{i}").exists()]
    if not present:
        raise DatasetError(f"{root}: no data_batch_1 .. data_batch_5 found (expected the CIFAR-10 python batches)")
    if len(present) < 5:
        logger.warning("%s: only %d of the 5 CIFAR-10 training batches found", root, len(present))
    train = [_read_cifar_batch(p) for p in present]
    x_test, y_test = _read_cifar_batch(root / "test_batch")
    return Dataset(
        "cifar10", np.concatenate([x for x, _ in train]), np.concatenate([y for _, y in train]), x_test, y_test
    )


def load_cifar100(root: str | Path) -> Dataset:
    """CIFAR-100 (fine labels, 100 classes) from its python pickles in ``root`` or ``root/cifar-100-python``.

    Parameters
    ----------
    root : str or pathlib.Path
        The directory with the ``train`` and ``test`` pickles.

    Returns
    -------
    Dataset
        (N, 3, 32, 32) images in [0, 1], not normalised; ``num_classes`` 100.

    Raises
    ------
    DatasetError
        A missing directory or file, or a malformed pickle (named), or a label outside 0..99.
    """
    root = Path(root)
    if (root / "cifar-100-python").is_dir():
        root = root / "cifar-100-python"
    if not root.is_dir():
        raise DatasetError(f"{root}: not a directory")
    parts = [_read_cifar_batch(root / split, "fine_labels", "CIFAR-100") for split in ("train", "test")]
    for split, (_, labels) in zip(("train", "test"), parts):
        if len(labels) and (labels.min() < 0 or labels.max() >= 100):
            raise DatasetError(f"{root / split}: fine labels must lie in 0..99, got {labels.min()}..{labels.max()}")
    (x_train, y_train), (x_test, y_test) = parts
    return Dataset("cifar100", x_train, y_train, x_test, y_test, num_classes=100)


# ------------------------------------------------------------------------------ dispatch


def load_dataset(spec: str, seed: int = 0) -> Dataset:
    """A dataset named by ``digits``, ``mnist:DIR``, ``cifar10:DIR`` or ``cifar100:DIR`` (the ``--data`` option).

    Raises
    ------
    DatasetError
        An unknown name, a missing directory, or a malformed file.
    TypeError
        ``spec`` is not a str.
    """
    if not isinstance(spec, str):
        raise TypeError(f"data must be a str such as 'digits' or 'mnist:DIR', got {type(spec).__name__}")
    name, _, root = spec.partition(":")
    if name == "digits":
        if root:
            raise DatasetError(f"--data digits takes no directory, got {spec!r}")
        return load_digits(seed)
    loaders = {"mnist": load_mnist, "cifar10": load_cifar10, "cifar100": load_cifar100}
    if name in loaders:
        if not root:
            raise DatasetError(f"--data {name} needs the directory of its files: {name}:DIR")
        return loaders[name](root)
    raise DatasetError(f"unknown dataset {spec!r}: expected digits, mnist:DIR, cifar10:DIR or cifar100:DIR")


def to_batches(x: np.ndarray, y: np.ndarray, batch_size: int, *, device: Any = "cpu") -> list[tuple[Any, Any]]:
    """Consecutive ``(inputs, targets)`` torch batches of ``batch_size`` samples (the last one shorter).

    A list, so it can be iterated many times (the barrier reads the data once per point).
    """
    import torch

    batch_size = check_positive_int(batch_size, "batch_size")
    xt = torch.from_numpy(np.ascontiguousarray(x)).to(device)
    yt = torch.from_numpy(np.ascontiguousarray(y)).to(device)
    return [(xt[i : i + batch_size], yt[i : i + batch_size]) for i in range(0, len(yt), batch_size)]
