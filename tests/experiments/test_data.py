"""Datasets from their real on-disk formats (fixture folders made here), offline sets, batches."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch

from experiments import data as D


def _cifar_batch(path, n: int, classes: int, key: bytes, seed: int) -> None:
    rng = np.random.default_rng(seed)
    d = {b"batch_label": b"x", key: rng.integers(0, classes, n).tolist(),
         b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), b"filenames": [b"f"] * n}
    with open(path, "wb") as f:
        pickle.dump(d, f)


def make_cifar10(root, n: int = 6) -> None:
    base = root / "cifar-10-batches-py"
    base.mkdir(parents=True)
    for i, name in enumerate([f"data_batch_{k}" for k in range(1, 6)] + ["test_batch"]):
        _cifar_batch(base / name, n, 10, b"labels", i)


def make_caltech(root, classes=("ant", "bee", "cat"), per_class: int = 5) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    base = root / "101_ObjectCategories"
    for c in (*classes, "BACKGROUND_Google"):
        (base / c).mkdir(parents=True)
        for k in range(per_class):
            h, w = rng.integers(20, 60, 2)
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(base / c / f"image_{k:04d}.jpg")


def test_cifar10_reads_the_python_pickles(tmp_path):
    make_cifar10(tmp_path)
    ds = D.load("cifar10", str(tmp_path))
    assert ds.train_x.shape == (30, 3, 32, 32) and ds.train_x.dtype == torch.uint8 and ds.test_x.shape[0] == 6
    with open(tmp_path / "cifar-10-batches-py" / "data_batch_1", "rb") as f:
        raw = pickle.load(f, encoding="bytes")
    assert torch.equal(ds.train_x[:6].reshape(6, -1), torch.from_numpy(raw[b"data"]))  # (N, 3, 32, 32): R, G, B planes
    assert ds.train_y[:6].tolist() == raw[b"labels"] and ds.classes == 10


def test_cifar100_uses_the_fine_labels(tmp_path):
    base = tmp_path / "cifar-100-python"
    base.mkdir()
    _cifar_batch(base / "train", 8, 100, b"fine_labels", 0)
    _cifar_batch(base / "test", 4, 100, b"fine_labels", 1)
    ds = D.load("cifar100", str(tmp_path))
    assert ds.classes == 100 and ds.train_x.shape[0] == 8 and ds.test_y.shape == (4,)


def test_missing_or_malformed_cifar_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="cifar-10-batches-py.*data_batch_1.*nothing is downloaded"):
        D.load("cifar10", str(tmp_path))
    with pytest.raises(ValueError, match="pass --data-root"):
        D.load("cifar10", None)
    make_cifar10(tmp_path)
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match="data_batch_3 is not a CIFAR python batch"):
        D.load("cifar10", str(tmp_path))


def test_a_pickle_that_would_run_code_is_refused(tmp_path):
    make_cifar10(tmp_path)

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    with open(tmp_path / "cifar-10-batches-py" / "test_batch", "wb") as f:
        pickle.dump({b"data": Evil(), b"labels": []}, f)
    with pytest.raises(ValueError, match="unexpected object"):
        D.load("cifar10", str(tmp_path))


def test_caltech_reads_category_folders_and_splits_each_class(tmp_path):
    pytest.importorskip("PIL")
    make_caltech(tmp_path)
    ds = D.load("caltech101", str(tmp_path), image_size=24)
    assert ds.classes == 3  # BACKGROUND_Google is not a category
    assert ds.train_x.shape == (12, 3, 24, 24) and ds.test_x.shape == (3, 3, 24, 24)
    assert sorted(ds.test_y.tolist()) == [0, 1, 2] and sorted(set(ds.train_y.tolist())) == [0, 1, 2]


def test_missing_or_broken_caltech_is_a_clear_error(tmp_path):
    pytest.importorskip("PIL")
    with pytest.raises(FileNotFoundError, match="101_ObjectCategories/<category>"):
        D.load("caltech101", str(tmp_path))
    make_caltech(tmp_path)
    (tmp_path / "101_ObjectCategories" / "ant" / "image_0001.jpg").write_bytes(b"broken")
    with pytest.raises(ValueError, match="cannot read image .*image_0001.jpg"):
        D.load("caltech101", str(tmp_path), image_size=16)
    for f in (tmp_path / "101_ObjectCategories" / "bee").iterdir():
        f.unlink()
    with pytest.raises(ValueError, match="empty: bee"):
        D.load("caltech101", str(tmp_path), image_size=16)


def test_digits_is_real_offline_data_split_per_class():
    pytest.importorskip("sklearn")
    ds = D.load("digits")
    assert ds.train_x.shape[1:] == (3, 32, 32) and len(ds.train_x) + len(ds.test_x) == 1797
    assert abs(len(ds.test_x) - 0.2 * 1797) < 10 and not ds.flip
    assert set(ds.test_y.tolist()) == set(range(10))
    assert ds.train_x.float().std() > 20  # strokes, not a blank image


def test_unknown_dataset_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown dataset 'mnist'.*digits"):
        D.load("mnist")


def test_batches_are_reproducible_normalised_and_augmented():
    ds = D.synthetic(train=40, test=10, size=16)
    mean, std = ds.stats()
    train = D.Batches(ds.train_x, ds.train_y, 8, mean=mean, std=std, train=True, seed=3)
    a, b = list(train.epoch(1)), list(train.epoch(1))
    assert len(a) == len(train) == 5
    assert all(torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b))
    assert not torch.equal(a[0][0], next(train.epoch(2))[0])  # another epoch, another order
    x = torch.cat([t for t, _ in a])
    assert abs(float(x.mean())) < 0.5 and x.shape == (40, 3, 16, 16)
    test = D.Batches(ds.test_x, ds.test_y, 4, mean=mean, std=std, train=False)
    got = list(test.epoch())
    assert [len(y) for _, y in got] == [4, 4, 2]  # every test image, in order, unaugmented
    assert torch.allclose(got[0][0], (ds.test_x[:4].float() / 255 - mean.view(1, -1, 1, 1)) / std.view(1, -1, 1, 1))


def test_augmentation_is_a_shifted_and_possibly_mirrored_crop():
    x = torch.arange(2 * 1 * 8 * 8, dtype=torch.uint8).view(2, 1, 8, 8)
    batches = D.Batches(x, torch.zeros(2, dtype=torch.long), 2, mean=torch.zeros(1), std=torch.ones(1) / 255,
                        train=True, flip=True, seed=0)
    out, _ = next(batches.epoch(0))
    for img in out:
        src = x[int(img.max()) // 64, 0].float()  # which source image (values identify it)
        padded = torch.nn.functional.pad(src, (1, 1, 1, 1))
        crops = [padded[i:i + 8, j:j + 8] for i in range(3) for j in range(3)]
        assert any(torch.allclose(img[0], c, atol=1e-3) or torch.allclose(img[0], c.flip(1), atol=1e-3) for c in crops)


def test_a_batch_larger_than_the_split_is_a_clear_error():
    ds = D.synthetic(train=4, test=2, size=8)
    with pytest.raises(ValueError, match="fewer than one batch of 8"):
        D.Batches(ds.train_x, ds.train_y, 8, mean=torch.zeros(3), std=torch.ones(3), train=True)


def test_digits_from_a_saved_file_on_a_host_without_scikit_learn(tmp_path, monkeypatch):
    pytest.importorskip("sklearn")
    D.save_digits(str(tmp_path / "digits.npz"))
    want = D.digits()
    monkeypatch.setitem(__import__("sys").modules, "sklearn.datasets", None)  # import fails as if not installed
    with pytest.raises(ImportError, match="PIPEDP_DIGITS_NPZ"):
        D.digits()
    monkeypatch.setenv("PIPEDP_DIGITS_NPZ", str(tmp_path / "digits.npz"))
    got = D.digits()
    assert torch.equal(got.train_x, want.train_x) and torch.equal(got.test_y, want.test_y)
