"""pyperm.datasets: digits, and MNIST/CIFAR-10 readers on tiny files written here (nothing is downloaded)."""

from __future__ import annotations

import gzip
import pickle
import struct

import numpy as np
import pytest

from pyperm.datasets import (
    DatasetError,
    load_cifar10,
    load_cifar100,
    load_dataset,
    load_digits,
    load_mnist,
    read_idx,
    to_batches,
)


def _idx(array: np.ndarray) -> bytes:
    codes = {np.dtype(np.uint8): 0x08, np.dtype(">i4"): 0x0C}
    header = bytes([0, 0, codes[array.dtype], array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.tobytes()


def _write_mnist(root, gz: bool, n_train: int = 6, n_test: int = 4, seed: int = 0):
    rng = np.random.default_rng(seed)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": rng.integers(0, 10, n_train, dtype=np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, n_test, dtype=np.uint8),
    }
    for name, array in arrays.items():
        raw = _idx(array)
        if gz:
            (root / (name + ".gz")).write_bytes(gzip.compress(raw))
        else:
            (root / name).write_bytes(raw)
    return arrays


def _write_cifar(root, batches=(1, 2), n: int = 3, seed: int = 0):
    rng = np.random.default_rng(seed)
    written = {}
    for name in [f"data_batch_{i}" for i in batches] + ["test_batch"]:
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, 10, n)]
        with open(root / name, "wb") as f:
            pickle.dump({b"batch_label": name.encode(), b"labels": labels, b"data": data}, f)
        written[name] = (data, labels)
    return written


def test_digits_split_and_scale():
    ds = load_digits()
    assert ds.x_train.shape == (1400, 1, 8, 8) and ds.x_test.shape == (397, 1, 8, 8)
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int64
    assert 0.0 <= ds.x_train.min() and ds.x_train.max() == 1.0
    assert set(np.unique(ds.y_test)) == set(range(10))
    again = load_digits()
    assert np.array_equal(ds.x_train, again.x_train)
    assert not np.array_equal(ds.y_train, load_digits(seed=1).y_train)
    assert np.array_equal(load_digits(np.int64(1)).y_train, load_digits(seed=1).y_train)  # numpy ints are ints


def test_bad_sizes_and_seeds_name_the_argument():
    ds = load_digits()
    with pytest.raises(ValueError, match="seed must be at least 0"):
        load_digits(-1)
    with pytest.raises(TypeError, match="seed must be an int"):
        load_digits(0.5)
    with pytest.raises(ValueError, match="train must be at least 1"):
        ds.subset(train=0)
    with pytest.raises(ValueError, match="test must be at least 1"):
        ds.subset(test=-3)  # a negative slice would silently drop samples from the end
    assert len(ds.subset(train=10).y_train) == 10 and len(ds.subset().y_test) == 397
    pytest.importorskip("torch")
    with pytest.raises(ValueError, match="batch_size must be at least 1"):
        to_batches(ds.x_test, ds.y_test, 0)
    assert [len(y) for _, y in to_batches(ds.x_test, ds.y_test, np.int64(200))] == [200, 197]


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_idx_files(tmp_path, gz):
    arrays = _write_mnist(tmp_path, gz)
    ds = load_mnist(tmp_path)
    assert ds.x_train.shape == (6, 1, 28, 28) and ds.x_test.shape == (4, 1, 28, 28)
    np.testing.assert_allclose(ds.x_train[:, 0] * 255.0, arrays["train-images-idx3-ubyte"], atol=1e-4)
    assert np.array_equal(ds.y_test, arrays["t10k-labels-idx1-ubyte"])
    assert load_dataset(f"mnist:{tmp_path}").x_test.shape == (4, 1, 28, 28)


def test_idx_reader_dtypes_and_errors(tmp_path):
    ints = np.arange(6, dtype=">i4").reshape(2, 3)
    (tmp_path / "ints").write_bytes(_idx(ints))
    assert np.array_equal(read_idx(tmp_path / "ints"), ints)
    (tmp_path / "bad").write_bytes(b"\x01\x02\x03\x04")
    with pytest.raises(DatasetError, match="bad: not an idx file"):
        read_idx(tmp_path / "bad")
    (tmp_path / "short").write_bytes(_idx(ints)[:-4])
    with pytest.raises(DatasetError, match=r"short: idx header says shape \(2, 3\)"):
        read_idx(tmp_path / "short")


def test_mnist_errors_name_the_file(tmp_path):
    _write_mnist(tmp_path, gz=False)
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(_idx(np.zeros(3, dtype=np.uint8)))
    with pytest.raises(DatasetError, match=r"t10k-labels-idx1-ubyte: \(3,\) labels for 4 images"):
        load_mnist(tmp_path)
    (tmp_path / "train-images-idx3-ubyte").unlink()
    with pytest.raises(DatasetError, match="no train-images-idx3-ubyte"):
        load_mnist(tmp_path)


def test_cifar10_batches(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    written = _write_cifar(folder, batches=range(1, 6))
    ds = load_cifar10(tmp_path)  # the parent of cifar-10-batches-py works too
    assert ds.x_train.shape == (15, 3, 32, 32) and ds.x_test.shape == (3, 3, 32, 32)
    data, labels = written["test_batch"]
    np.testing.assert_allclose(ds.x_test.reshape(3, -1) * 255.0, data, atol=1e-4)
    assert ds.y_test.tolist() == labels


def test_cifar10_errors(tmp_path, caplog):
    with pytest.raises(DatasetError, match="no data_batch_1"):
        load_cifar10(tmp_path)
    _write_cifar(tmp_path, batches=(1,))
    assert load_cifar10(tmp_path).x_train.shape == (3, 3, 32, 32)
    assert "only 1 of the 5" in caplog.text
    (tmp_path / "test_batch").write_bytes(b"garbage")
    with pytest.raises(DatasetError, match="test_batch: not a readable CIFAR-10 batch"):
        load_cifar10(tmp_path)


def test_cifar10_pickle_cannot_run_code(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("should not run",))

    _write_cifar(tmp_path, batches=(1,))
    with open(tmp_path / "test_batch", "wb") as f:
        pickle.dump({b"data": Evil(), b"labels": []}, f)
    with pytest.raises(DatasetError, match="builtins.print is not allowed"):
        load_cifar10(tmp_path)


def write_cifar100(root, n_train: int = 4, n_test: int = 3, seed: int = 0, labels_high: int = 100):
    """CIFAR-100's python pickles (``train``, ``test`` with ``fine_labels``), tiny."""
    rng = np.random.default_rng(seed)
    written = {}
    for name, n in (("train", n_train), ("test", n_test)):
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        fine = [int(v) for v in rng.integers(0, labels_high, n)]
        with open(root / name, "wb") as f:
            pickle.dump({b"data": data, b"fine_labels": fine, b"coarse_labels": [0] * n}, f)
        written[name] = (data, fine)
    return written


def test_cifar100_pickles(tmp_path):
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    written = write_cifar100(folder)
    ds = load_dataset(f"cifar100:{tmp_path}")  # the parent of cifar-100-python works too
    assert ds.name == "cifar100" and ds.num_classes == 100
    assert ds.x_train.shape == (4, 3, 32, 32) and ds.x_test.shape == (3, 3, 32, 32)
    data, fine = written["test"]
    np.testing.assert_allclose(ds.x_test.reshape(3, -1) * 255.0, data, atol=1e-4)
    assert ds.y_test.tolist() == fine


def test_cifar100_errors_name_the_file(tmp_path):
    with pytest.raises(DatasetError, match="nowhere: not a directory"):
        load_cifar100(tmp_path / "nowhere")
    with pytest.raises(DatasetError, match="train: no such file"):
        load_cifar100(tmp_path)
    write_cifar100(tmp_path, labels_high=1)
    with open(tmp_path / "test", "wb") as f:
        pickle.dump({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 1]}, f)  # CIFAR-10's key
    with pytest.raises(DatasetError, match="test: key 'data' or 'fine_labels' is missing"):
        load_cifar100(tmp_path)
    with open(tmp_path / "test", "wb") as f:
        pickle.dump({b"data": np.zeros((1, 3072), np.uint8), b"fine_labels": [100]}, f)
    with pytest.raises(DatasetError, match=r"test: fine labels must lie in 0..99"):
        load_cifar100(tmp_path)


def test_missing_mnist_dir_and_malformed_idx_name_the_path(tmp_path):
    with pytest.raises(ValueError, match="absent: not a directory"):
        load_dataset(f"mnist:{tmp_path / 'absent'}")
    _write_mnist(tmp_path, gz=True)
    (tmp_path / "t10k-images-idx3-ubyte.gz").write_bytes(b"not gzip at all")
    with pytest.raises(ValueError, match="t10k-images-idx3-ubyte.gz: cannot be read"):
        load_dataset(f"mnist:{tmp_path}")
    with pytest.raises(TypeError, match="data must be a str"):
        load_dataset(3)


def test_unknown_dataset_names():
    with pytest.raises(DatasetError, match="unknown dataset 'imagenet'"):
        load_dataset("imagenet")
    with pytest.raises(DatasetError, match="mnist needs the directory"):
        load_dataset("mnist")
