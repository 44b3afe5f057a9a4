"""MNIST / CIFAR-10 readers on files written here in the real formats (idx-ubyte, the
CIFAR-10 binary records), vision transforms against hand computations, determinism
under set_seed, and named errors for missing, truncated and malformed files."""
import os
import struct
import zlib

import numpy as np
import pytest

import dualmode as dm
from dualmode.dataset import Cifar10Dataset, MnistDataset, transforms, vision


def _mnist_arrays(n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 28, 28), dtype=np.uint8), \
        rng.integers(0, 10, n).astype(np.uint8)


def _write_idx(path, magic, arr):
    with open(path, "wb") as f:
        f.write(struct.pack(">I", magic) + struct.pack(">" + "I" * arr.ndim, *arr.shape))
        f.write(arr.tobytes())


@pytest.fixture
def mnist_dir(tmp_path):
    # written byte by byte here (not with vision.write_mnist) so the format is checked
    img, lab = _mnist_arrays(12)
    _write_idx(tmp_path / "train-images-idx3-ubyte", 2051, img)
    _write_idx(tmp_path / "train-labels-idx1-ubyte", 2049, lab)
    timg, tlab = _mnist_arrays(4, seed=1)
    _write_idx(tmp_path / "t10k-images-idx3-ubyte", 2051, timg)
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte", 2049, tlab)
    return tmp_path, (img, lab), (timg, tlab)


def test_mnist_reads_the_idx_files(mnist_dir):
    path, (img, lab), (timg, tlab) = mnist_dir
    rows = list(MnistDataset(str(path), usage="train", shuffle=False))
    assert len(rows) == 12
    got = np.stack([r[0].asnumpy() for r in rows])
    assert got.shape == (12, 28, 28, 1) and got.dtype == np.uint8
    np.testing.assert_array_equal(got[..., 0], img)
    np.testing.assert_array_equal([int(r[1].asnumpy()) for r in rows], lab)
    assert rows[0][1].dtype == np.uint32
    both = MnistDataset(str(path), shuffle=False)          # usage "all": train then test
    assert both.get_dataset_size() == 16
    test_only = [r[0].asnumpy()[..., 0] for r in MnistDataset(str(path), "test", shuffle=False)]
    np.testing.assert_array_equal(np.stack(test_only), timg)


def test_mnist_num_samples_shuffle_and_shards(mnist_dir):
    path, (img, lab), _ = mnist_dir
    assert MnistDataset(str(path), "train", num_samples=5, shuffle=False).get_dataset_size() == 5
    dm.set_seed(7)
    a = [int(r[1].asnumpy()) for r in MnistDataset(str(path), "train", shuffle=True)]
    dm.set_seed(7)
    b = [int(r[1].asnumpy()) for r in MnistDataset(str(path), "train", shuffle=True)]
    assert a == b and sorted(a) == sorted(lab.tolist())
    shards = [[r[0].asnumpy() for r in MnistDataset(str(path), "train", shuffle=False,
                                                    num_shards=4, shard_id=k)]
              for k in range(4)]
    assert [len(s) for s in shards] == [3, 3, 3, 3]
    seen = np.stack([x for s in shards for x in s])[..., 0]
    assert sorted(map(bytes, seen)) == sorted(map(bytes, img))


def test_mnist_batches_through_take(mnist_dir):
    path, (img, lab), _ = mnist_dir
    ds = MnistDataset(str(path), "train", shuffle=False).batch(5, drop_remainder=True)
    batches = list(ds)
    assert len(batches) == 2
    np.testing.assert_array_equal(batches[1][0].asnumpy()[..., 0], img[5:10])
    np.testing.assert_array_equal(batches[1][1].asnumpy(), lab[5:10])


def test_cifar10_reads_the_binary_records(tmp_path):
    rng = np.random.default_rng(2)
    img = rng.integers(0, 256, (10, 32, 32, 3), dtype=np.uint8)
    lab = rng.integers(0, 10, 10).astype(np.uint8)
    # the real layout: per record 1 label byte, then the R, G and B planes (32x32 each)
    for k in range(5):
        recs = [bytes([lab[i]]) + img[i].transpose(2, 0, 1).tobytes()
                for i in range(2 * k, 2 * k + 2)]
        (tmp_path / f"data_batch_{k + 1}.bin").write_bytes(b"".join(recs))
    rows = list(Cifar10Dataset(str(tmp_path), usage="train", shuffle=False))
    np.testing.assert_array_equal(np.stack([r[0].asnumpy() for r in rows]), img)
    np.testing.assert_array_equal([int(r[1].asnumpy()) for r in rows], lab)
    # the writer produces the same bytes
    out = tmp_path / "again"
    vision.write_cifar10(str(out), img, lab, "train")
    for k in range(5):
        assert (out / f"data_batch_{k + 1}.bin").read_bytes() == \
            (tmp_path / f"data_batch_{k + 1}.bin").read_bytes()


def test_reader_errors_name_the_file(tmp_path, mnist_dir):
    path, _, _ = mnist_dir
    with pytest.raises(ValueError, match=r"MnistDataset: usage='val' is not valid"):
        MnistDataset(str(path), usage="val")
    with pytest.raises(ValueError, match=r"MnistDataset: dataset_dir=.*nowhere.* is not a dir"):
        MnistDataset(str(path / "nowhere"))
    os.remove(path / "t10k-labels-idx1-ubyte")
    with pytest.raises(ValueError, match=r"MnistDataset: file .*t10k-labels-idx1-ubyte.* is "
                                         r"missing"):
        MnistDataset(str(path), usage="test")
    data = (path / "train-images-idx3-ubyte").read_bytes()
    (path / "train-images-idx3-ubyte").write_bytes(data[:-100])
    with pytest.raises(ValueError, match=r"MnistDataset: file .*train-images-idx3-ubyte.* is "
                                         r"truncated"):
        MnistDataset(str(path), usage="train")
    (path / "train-images-idx3-ubyte").write_bytes(b"\0\0\x08\x01" + data[4:])
    with pytest.raises(ValueError, match=r"train-images-idx3-ubyte.* has magic number 2049; "
                                         r"expected 2051"):
        MnistDataset(str(path), usage="train")
    cdir = tmp_path / "cifar"
    vision.write_cifar10(str(cdir), np.zeros((5, 32, 32, 3), np.uint8), np.zeros(5), "train")
    (cdir / "data_batch_3.bin").write_bytes(b"\0" * 100)
    with pytest.raises(ValueError, match=r"Cifar10Dataset: file .*data_batch_3.bin.* is "
                                         r"truncated"):
        Cifar10Dataset(str(cdir), usage="train")
    os.remove(cdir / "data_batch_3.bin")
    with pytest.raises(ValueError, match=r"Cifar10Dataset: file .*data_batch_3.bin.* is missing"):
        Cifar10Dataset(str(cdir), usage="train")


# ---------------------------------------------------------------------------
# transforms
# ---------------------------------------------------------------------------
def test_decode_png_round_trip_and_filters():
    img = np.random.default_rng(3).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    np.testing.assert_array_equal(vision.Decode()(np.frombuffer(vision.encode_png(img),
                                                                np.uint8)), img)
    grey = img[:, :, 0]
    np.testing.assert_array_equal(vision.Decode()(vision.encode_png(grey)),
                                  np.repeat(grey[:, :, None], 3, axis=2))
    # a PNG written with the Sub (1), Up (2), Average (3) and Paeth (4) filters
    h, w, c = img.shape
    x = img.reshape(h, w * c).astype(np.int32)
    rows = []
    for y in range(h):
        prev = x[y - 1] if y else np.zeros(w * c, np.int32)
        ftype = y % 5
        left = np.r_[np.zeros(c, np.int32), x[y, :-c]]
        upleft = np.r_[np.zeros(c, np.int32), prev[:-c]]
        if ftype == 0:
            pred = 0
        elif ftype == 1:
            pred = left
        elif ftype == 2:
            pred = prev
        elif ftype == 3:
            pred = (left + prev) >> 1
        else:
            pa, pb, pc = np.abs(prev - upleft), np.abs(left - upleft), np.abs(left + prev - 2 * upleft)
            pred = np.where((pa <= pb) & (pa <= pc), left, np.where(pb <= pc, prev, upleft))
        rows.append(bytes([ftype]) + ((x[y] - pred) & 0xFF).astype(np.uint8).tobytes())

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(
            ">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(b"".join(rows))) + chunk(b"IEND", b""))
    np.testing.assert_array_equal(vision.Decode()(png), img)
    with pytest.raises(ValueError, match=r"Decode: JPEG images are not supported"):
        vision.Decode()(b"\xff\xd8\xff\xe0" + b"\0" * 20)


def test_geometric_transforms():
    img = np.arange(4 * 6 * 3, dtype=np.uint8).reshape(4, 6, 3)
    np.testing.assert_array_equal(vision.CenterCrop(2)(img), img[1:3, 2:4])
    np.testing.assert_array_equal(vision.HWC2CHW()(img), img.transpose(2, 0, 1))
    np.testing.assert_array_equal(vision.Resize((8, 12), vision.Inter.NEAREST)(img),
                                  img.repeat(2, 0).repeat(2, 1))
    # bilinear with half-pixel centres: halving averages 2x2 blocks
    f = np.arange(16, dtype=np.float32).reshape(4, 4)
    np.testing.assert_allclose(vision.Resize((2, 2))(f),
                               f.reshape(2, 2, 2, 2).mean(axis=(1, 3)))
    assert vision.Resize(2)(img).shape == (2, 3, 3)       # shorter side, aspect kept
    flip = vision.RandomHorizontalFlip(1.0)(img)
    np.testing.assert_array_equal(flip, img[:, ::-1])
    np.testing.assert_array_equal(vision.RandomHorizontalFlip(0.0)(img), img)


def test_random_crop_with_padding_is_seeded():
    img = np.arange(1, 4 * 4 + 1, dtype=np.uint8).reshape(4, 4, 1)
    crop = vision.RandomCrop(4, padding=2)
    dm.set_seed(11)
    a = [crop(img) for _ in range(20)]
    dm.set_seed(11)
    b = [crop(img) for _ in range(20)]
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    padded = np.pad(img, ((2, 2), (2, 2), (0, 0)))
    for x in a:                                  # each a 4x4 window of the padded image
        assert any(np.array_equal(x, padded[i:i + 4, j:j + 4])
                   for i in range(5) for j in range(5))
    assert len({x.tobytes() for x in a}) > 1
    with pytest.raises(ValueError, match=r"RandomCrop: size=\(9, 9\) is larger than the "
                                         r"\(padded\) image 8x8"):
        vision.RandomCrop(9, padding=2)(img)


def test_rescale_normalize_typecast_in_a_pipeline(tmp_path):
    img, lab = _mnist_arrays(8, seed=4)
    vision.write_mnist(str(tmp_path), img, lab, "train")
    ds = MnistDataset(str(tmp_path), "train", shuffle=False)
    ds = ds.map([vision.Rescale(1.0 / 255, 0.0), vision.Normalize([0.1307], [0.3081]),
                 vision.HWC2CHW()], input_columns="image")
    ds = ds.map(transforms.TypeCast(dm.int32), input_columns="label").batch(4)
    x, y = next(iter(ds))
    want = ((img[:4].astype(np.float32) / 255 - 0.1307) / 0.3081)[:, None]
    np.testing.assert_allclose(x.asnumpy(), want, rtol=1e-6, atol=1e-6)
    assert x.dtype == np.float32 and y.dtype == np.int32
    np.testing.assert_array_equal(y.asnumpy(), lab[:4])


@pytest.mark.parametrize("make, match", [
    (lambda: vision.Normalize([0.5, 0.5], [0.2]), r"Normalize: mean .* and std .* must be"),
    (lambda: vision.Normalize([0.5], [0.0]), r"Normalize: std=\[0.0\] must be > 0"),
    (lambda: vision.RandomHorizontalFlip(1.5), r"RandomHorizontalFlip: prob=1.5"),
    (lambda: vision.RandomCrop(0), r"RandomCrop: size=0 is not valid"),
    (lambda: vision.RandomCrop(4, padding=-1), r"RandomCrop: padding=-1 is not valid"),
    (lambda: vision.Resize((2, 2), "cubic"), r"Resize: interpolation='cubic' is not supp"),
    (lambda: vision.Decode(to_pil=True), r"Decode: to_pil=True is not supported"),
])
def test_transform_arguments_are_checked(make, match):
    with pytest.raises(ValueError, match=match):
        make()
