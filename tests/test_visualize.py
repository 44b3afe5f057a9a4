"""dm.parallel.visualize: the device-to-slice table (every device, any rank, replicas and
partial sums marked) checked against device_slices, and the PNG's header."""
import io
import re

import numpy as np
import pytest

import dualmode as dm
from dualmode import Tensor
from dualmode.parallel import DeviceLocalLayout, Layout, TensorLayout, visualize
from dualmode.parallel.visualize import layout_rows

PNG = b"\x89PNG\r\n\x1a\n"


def _rows(text):
    """rank -> list of 'a:b' ranges, from the printed table."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(\d+)\s+\S.*?((?:\s+\d+:\d+)+)", line)
        if m:
            out[int(m.group(1))] = m.group(2).split()
    return out


@pytest.mark.parametrize("spec, shape", [
    (Layout((2, 2, 2), ("dp", "sp", "mp"))("mp", ("sp", "dp")), (8, 8)),
    (Layout((2, 4), ("dp", "mp"))("dp", "None", "mp"), (4, 6, 8)),
    (Layout((2, 2, 2), ("a", "b", "c"))("a", "None", "b", "c"), (2, 3, 4, 6)),
    (Layout((8,), ("tp",))("tp",), (16,)),
])
def test_table_lists_every_device_and_its_slices(spec, shape):
    buf = io.StringIO()
    text = visualize(spec, shape=shape, file=buf)
    assert buf.getvalue().rstrip("\n") == text
    rows = _rows(text)
    slices = spec.device_slices(shape)
    assert sorted(rows) == list(range(len(slices)))
    for rank, sl in enumerate(slices):
        assert rows[rank] == [f"{s.start}:{s.stop}" for s in sl]


def test_spec_example_rank_1_and_rank_4():
    text = visualize(Layout((2, 2, 2), ("dp", "sp", "mp"))("mp", ("sp", "dp")), shape=(8, 8),
                     file=io.StringIO())
    rows = _rows(text)
    assert rows[1] == ["4:8", "0:2"] and rows[4] == ["0:4", "2:4"]
    assert "dp=0, sp=0, mp=1" in text


def test_replicas_and_partial_sums_are_marked():
    rep = TensorLayout((2, 4), ((0,), ()), (8, 8))            # repeated over axis 1
    text = visualize(rep, file=io.StringIO())
    assert "replica of rank 0" in text and "replica of rank 4" in text
    rows = layout_rows(rep)
    assert [r["replica_of"] for r in rows] == [None, 0, 0, 0, None, 4, 4, 4]
    part = TensorLayout((2, 4), ((0,), ()), (8, 8), partial=(1,))
    text = visualize(part, file=io.StringIO())
    assert "partial sums" in text and "summand, with rank 0" in text


def test_tensor_of_a_sharded_program_and_plain_tensor(sim_devices):
    sim_devices(4)
    x = Tensor(np.arange(32, dtype=np.float32).reshape(8, 4))
    y = dm.ops.ReLU().shard(((4, 1),))(x)
    text = visualize(y, file=io.StringIO())
    assert _rows(text) == {r: [f"{2 * r}:{2 * r + 2}", "0:4"] for r in range(4)}
    text = visualize(x, file=io.StringIO())                      # plain: whole everywhere
    assert all(v == ["0:8", "0:4"] for v in _rows(text).values()) and len(_rows(text)) == 4


def test_device_local_values_listed_per_device():
    text = visualize(DeviceLocalLayout(2, (3, 4)), file=io.StringIO())
    assert "its own value" in text and "no global view" in text
    with pytest.raises(ValueError, match=r"visualize: per-device values \(DeviceLocalLayout\) "
                                         r"have no global tensor to draw"):
        visualize(DeviceLocalLayout(2, (3, 4)), path="never.png", file=io.StringIO())


@pytest.mark.parametrize("spec, shape", [
    (Layout((2, 4), ("dp", "mp"))("dp", "mp"), (8, 8)),
    (Layout((2, 4), ("dp", "mp"))("dp", "None", "mp"), (4, 6, 8)),
    (Layout((8,), ("tp",))("tp",), (16,)),
])
def test_png_is_written(tmp_path, spec, shape):
    pytest.importorskip("matplotlib")
    path = tmp_path / "layout.png"
    visualize(spec, shape=shape, path=str(path), file=io.StringIO())
    data = path.read_bytes()
    assert data[:8] == PNG and len(data) > 1000


def test_png_of_replicated_and_partial_layouts(tmp_path):
    pytest.importorskip("matplotlib")
    for k, lay in enumerate([TensorLayout((2, 4), ((0,), ()), (8, 8)),
                             TensorLayout((2, 4), ((0,), ()), (8, 8), partial=(1,))]):
        path = tmp_path / f"l{k}.png"
        visualize(lay, path=str(path), file=io.StringIO())
        assert path.read_bytes()[:8] == PNG


def test_bad_arguments_are_named(tmp_path):
    spec = Layout((2, 4), ("dp", "mp"))("dp", "mp")
    with pytest.raises(ValueError, match=r"visualize: a Layout spec .* needs shape=\.\.\."):
        visualize(spec)
    with pytest.raises(TypeError, match=r"visualize: tensor_or_layout is a list; expected a "
                                        r"Tensor, a TensorLayout"):
        visualize([1, 2])
    with pytest.raises(ValueError, match=r"visualize: shape=\(4, 4\) but the layout is of "
                                         r"shape \(8, 8\)"):
        visualize(spec.bind((8, 8)), shape=(4, 4))
    four = Layout((2, 2, 2), ("a", "b", "c"))("a", "None", "b", "c")
    out = io.StringIO()
    with pytest.raises(ValueError, match=r"visualize: path= draws tensors of rank 1, 2 or 3; "
                                         r"this one has rank 4"):
        visualize(four, shape=(2, 3, 4, 6), path=str(tmp_path / "x.png"), file=out)
    assert out.getvalue() == "" and not (tmp_path / "x.png").exists()
