"""Dask arrays: lazy map over row blocks, stats, backward, memory-mapped input, a cluster."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import layernorm as ln
from tests import reference

from .conftest import random_rows

dask = pytest.importorskip("dask")
da = pytest.importorskip("dask.array")
_dask = pytest.importorskip("layernorm._adapters.dask")


def _chunk_bytes(a):
    return max(int(np.prod([max(c) for c in a.chunks])) * a.dtype.itemsize, 0)


CASES = {
    # name: (shape, chunks, kwargs, normalized axes)
    "last": ((40, 24), (7, 10), {}, (1,)),
    "trailing-two": ((9, 4, 12), (2, 3, 5), {"normalized_shape": (4, 12)}, (1, 2)),
    "channels-first": ((6, 5, 3, 4), (4, 2, 3, 2), {"axis": 1}, (1,)),
    "split-axes": ((5, 6, 7), (2, 6, 3), {"axis": (0, 2)}, (0, 2)),
}


# Every layout in float32, every dtype on the plain layout (each pair compiles kernels).
@pytest.mark.parametrize(("case", "dtype"), [(c, "float32") for c in CASES]
                         + [("last", "bfloat16"), ("last", "float64")])
def test_forward_and_stats_equal_numpy_path(case, dtype):
    shape, chunks, kw, axes = CASES[case]
    rng = np.random.default_rng(1)
    xn = random_rows(rng, shape, dtype, loc=2.0)
    pshape = tuple(shape[a] for a in axes)
    w = random_rows(rng, pshape, "float32")
    b = random_rows(rng, pshape, dtype)
    x = da.from_array(xn, chunks=chunks)
    y, mean, rstd = ln.layer_norm(x, weight=w, bias=b, return_stats=True, **kw)
    assert all(isinstance(a, da.Array) for a in (y, mean, rstd))
    for a in axes:  # normalized axes are one block: every block holds whole rows
        assert len(y.chunks[a]) == 1 and len(mean.chunks[a]) == 1
    ey, emean, erstd = ln.layer_norm(xn, weight=w, bias=b, return_stats=True, **kw)
    got_y, got_mean, got_rstd = dask.compute(y, mean, rstd, scheduler="threads")
    assert got_y.dtype == ey.dtype and got_mean.shape == emean.shape
    # Rows are independent and computed by the same kernels: bitwise equal.
    np.testing.assert_array_equal(got_y, ey)
    np.testing.assert_array_equal(got_mean, emean)
    np.testing.assert_array_equal(got_rstd, erstd)
    r = ln.rms_norm(x, weight=w, **kw)
    np.testing.assert_array_equal(r.compute(), ln.rms_norm(xn, weight=w, **kw))
    ry, rrstd = ln.rms_norm(x, eps=1e-6, return_stats=True, **kw)
    np.testing.assert_array_equal(rrstd.compute(), ln.rms_norm(xn, eps=1e-6, return_stats=True,
                                                               **kw)[1])
    np.testing.assert_array_equal(ry.compute(), ln.rms_norm(xn, eps=1e-6, **kw))


def test_result_is_lazy_until_computed():
    calls = []

    def make(block_info=None):
        calls.append(block_info[None]["chunk-location"])
        start = block_info[None]["array-location"][0][0]
        rows = block_info[None]["chunk-shape"][0]
        return np.add.outer(np.arange(start, start + rows) * 0.5, np.linspace(-1, 3, 16))

    x = da.map_blocks(make, chunks=((5, 5, 3), (16,)), dtype=np.float64,
                      meta=np.empty((0, 0)))
    y, mean, rstd = ln.layer_norm(x, return_stats=True)
    grads = ln.layer_norm_backward(x, x, mean, rstd)
    assert all(isinstance(g, da.Array) for g in grads)
    assert calls == []
    xn = x.compute()
    calls.clear()
    np.testing.assert_array_equal(y.compute(), ln.layer_norm(xn))
    assert sorted(calls) == [(0, 0), (1, 0), (2, 0)]


def test_rechunking_keeps_block_sizes_and_warns_when_blocks_get_huge(monkeypatch):
    x = da.ones((4000, 300), chunks=(1000, 100), dtype=np.float32) * np.linspace(1, 2, 300)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = ln.layer_norm(x)
    assert y.chunks[1] == (300,)
    assert _chunk_bytes(y) <= _chunk_bytes(x)  # rows were re-split, not left to grow 3x
    monkeypatch.setattr(_dask, "BLOCK_WARN_BYTES", 1000)
    with pytest.warns(_dask.LargeBlockWarning, match=r"normalized axes \(1,\).*MiB"):
        ln.layer_norm(x)
    assert issubclass(_dask.LargeBlockWarning, UserWarning)
    # Already one block along the normalized axis: no rechunk, no warning.
    one = x.rechunk({1: -1})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ln.layer_norm(one).chunks == one.chunks


def _ordered_partials(gy, x, mean, rstd, w, row_chunks):
    """Per-block parameter gradients summed in block order, in the accumulation dtype."""
    acc = np.float64 if x.dtype == np.float64 else np.float32
    wa = np.ones(x.shape[1], acc) if w is None else w.astype(acc)
    gw = gb = None
    start = 0
    for rows in row_chunks:
        s = slice(start, start + rows)
        _, pw, pb = ln.layer_norm_backward(gy[s], x[s], mean[s], rstd[s], wa)
        gw = pw if gw is None else gw + pw
        gb = pb if gb is None else gb + pb
        start += rows
    return gw, gb


@pytest.mark.parametrize(("dtype", "with_weight"), [
    ("float32", False), ("float32", True), ("bfloat16", True), ("float64", False)])
def test_backward_grad_x_exact_and_param_grads_summed_in_block_order(dtype, with_weight):
    rng = np.random.default_rng(2)
    xn = random_rows(rng, (70, 33), dtype, loc=1.0)
    gyn = random_rows(rng, (70, 33), dtype)
    w = random_rows(rng, (33,), dtype) if with_weight else None
    x = da.from_array(xn, chunks=(16, 11))
    gy = da.from_array(gyn, chunks=(9, 33))
    _, mean, rstd = ln.layer_norm(x, weight=w, return_stats=True)
    gx, gw, gb = ln.layer_norm_backward(gy, x, mean, rstd, w)
    got = dask.compute(gx, gw, gb, scheduler="threads")
    again = dask.compute(gx, gw, gb, scheduler="sync")
    for a, b in zip(got, again, strict=True):
        np.testing.assert_array_equal(a, b)  # deterministic whatever the scheduler
    _, emean, erstd = ln.layer_norm(xn, weight=w, return_stats=True)
    egx, _, _ = ln.layer_norm_backward(gyn, xn, emean, erstd, w)
    np.testing.assert_array_equal(got[0], egx)
    like = (w if w is not None else xn).dtype
    assert got[1].dtype == got[2].dtype == like and got[1].shape == (33,)
    ow, ob = _ordered_partials(gyn, xn, emean, erstd, w, gx.chunks[0])
    np.testing.assert_array_equal(got[1], ow.astype(like))
    np.testing.assert_array_equal(got[2], ob.astype(like))
    _, rw, rb = reference.layer_norm_backward(gyn, xn, (1,), w)
    tol = {"bfloat16": 0.05, "float32": 1e-4, "float64": 1e-10}[dtype]
    np.testing.assert_allclose(got[1].astype(np.float64), rw.astype(np.float64), atol=tol * 10,
                               rtol=tol)
    np.testing.assert_allclose(got[2].astype(np.float64), rb.astype(np.float64), atol=tol * 10,
                               rtol=tol)


def test_rms_backward_channels_first_and_numpy_stats():
    rng = np.random.default_rng(3)
    xn = random_rows(rng, (6, 8, 5), "float32")
    gyn = random_rows(rng, (6, 8, 5), "float32")
    w = random_rows(rng, (8,), "float32")
    x = da.from_array(xn, chunks=(2, 3, 5))
    _, rstd = ln.rms_norm(xn, weight=w, axis=1, return_stats=True)
    gx, gw = ln.rms_norm_backward(gyn, x, rstd, w, axis=1)  # NumPy grad_y and rstd are fine
    egx, _ = ln.rms_norm_backward(gyn, xn, rstd, w, axis=1)
    np.testing.assert_array_equal(gx.compute(), egx)
    _, rgw = reference.rms_norm_backward(gyn, xn, (1,), w)
    np.testing.assert_allclose(gw.compute(), rgw, rtol=1e-4, atol=1e-4)
    assert gw.compute().shape == (8,)


@pytest.mark.parametrize(("shape", "kw"), [((7, 0), {}), ((5, 0, 3), {"axis": (1, 2)})],
                         ids=["last", "two-axes"])
def test_backward_with_a_normalized_size_of_zero_matches_numpy(shape, kw):
    rng = np.random.default_rng(6)
    xn = random_rows(rng, shape, "float32")
    gyn = random_rows(rng, shape, "float32")
    pshape = tuple(shape[a] for a in kw.get("axis", (1,)))
    w = random_rows(rng, pshape, "float32")
    chunks = (2, *shape[1:])  # several row blocks: partials of size 0 are added
    x, gy = da.from_array(xn, chunks=chunks), da.from_array(gyn, chunks=chunks)
    _, mean, rstd = ln.layer_norm(xn, weight=w, return_stats=True, **kw)
    got = dask.compute(*ln.layer_norm_backward(gy, x, mean, rstd, w, **kw))
    expected = ln.layer_norm_backward(gyn, xn, mean, rstd, w, **kw)
    _, rstd = ln.rms_norm(xn, weight=w, return_stats=True, **kw)
    got += dask.compute(*ln.rms_norm_backward(gy, x, rstd, w, **kw))
    expected += ln.rms_norm_backward(gyn, xn, rstd, w, **kw)
    for a, b in zip(got, expected, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    assert got[1].shape == pshape


def test_dask_and_numpy_weights_and_dask_only_errors():
    rng = np.random.default_rng(4)
    xn = random_rows(rng, (12, 10), "float32")
    wn = random_rows(rng, (10,), "float32")
    x = da.from_array(xn, chunks=(5, 4))
    w = da.from_array(wn, chunks=3)
    np.testing.assert_array_equal(ln.layer_norm(x, weight=w).compute(),
                                  ln.layer_norm(xn, weight=wn))
    # NumPy parameters are fine with a Dask x (other libraries: test_contract.py).
    np.testing.assert_array_equal(ln.layer_norm(x, weight=wn).compute(),
                                  ln.layer_norm(xn, weight=wn))
    with pytest.raises(TypeError, match="out="):
        ln.layer_norm(x, out=np.empty((12, 10), np.float32))
    with pytest.raises(ValueError, match="backend"):
        ln.layer_norm(x, backend="cupy")
    # Unknown row counts are fine (test_unknown_row_counts_*); unknown row lengths not.
    unknown = x[:, x[0] > 0]
    with pytest.raises(ValueError, match=r"unknown chunk sizes along the normalized axes \[1\]"):
        ln.layer_norm(unknown)


def _masked_rows(rng, shape, chunks):
    """A Dask array of the rows of a NumPy array that a boolean mask keeps (row counts
    unknown until computed: NaN chunk sizes), and those rows as a NumPy array."""
    xn = random_rows(rng, shape, "float32", loc=3.0)
    keep = rng.random(shape[0]) < 0.6
    x = da.from_array(xn, chunks=chunks)[da.from_array(keep, chunks=chunks[0])]
    assert np.isnan(x.shape[0]), "the mask should leave the row count unknown"
    return x, xn[keep]


def test_unknown_row_counts_forward_equals_numpy_path():
    """Rows are independent, so a Dask x whose row counts are unknown (after boolean
    indexing) runs block by block as any other: every forward gives NumPy's bits on the
    kept rows, and the results keep x's unknown row chunks."""
    rng = np.random.default_rng(11)
    x, xn = _masked_rows(rng, (90, 40), (25, 16))
    r, rn = (x * -0.5 + 1.0).astype(np.float32), (xn * -0.5 + 1.0).astype(np.float32)
    w = (1.0 + rng.standard_normal(40)).astype(np.float32)
    b = rng.standard_normal(40).astype(np.float32)
    y, mean, rstd = ln.layer_norm(x, weight=w, bias=b, return_stats=True)
    assert np.isnan(y.shape[0]) and len(y.chunks[0]) == len(x.chunks[0])
    for got, want in zip((y, mean, rstd), ln.layer_norm(xn, weight=w, bias=b,
                                                       return_stats=True), strict=True):
        np.testing.assert_array_equal(got.compute(), want)
    np.testing.assert_array_equal(ln.rms_norm(x, weight=w).compute(), ln.rms_norm(xn, weight=w))
    for got, want in zip(ln.layer_norm(x, weight=w, quantize="int8"),
                         ln.layer_norm(xn, weight=w, quantize="int8"), strict=True):
        np.testing.assert_array_equal(got.compute(), want)
    q = ln.layer_norm(x, quantize="int8", scale=0.05)[0].compute()
    np.testing.assert_array_equal(q, ln.layer_norm(xn, quantize="int8", scale=0.05)[0])
    for got, want in zip(ln.add_rms_norm(x, r, weight=w, weight_offset=1.0),
                         ln.add_rms_norm(xn, rn, weight=w, weight_offset=1.0), strict=True):
        np.testing.assert_array_equal(got.compute(), want)


def test_unknown_row_counts_backward_equals_known_chunks():
    """The backward with unknown row counts: grad_x is NumPy's; the parameter gradients
    are the per-block partials summed in block order, the bits of the same call once the
    chunk sizes are known."""
    rng = np.random.default_rng(12)
    x, xn = _masked_rows(rng, (80, 24), (20, 24))
    w = (1.0 + rng.standard_normal(24)).astype(np.float32)
    gy = (x * 0.5 + 1.0).astype(np.float32)
    _, mean, rstd = ln.layer_norm(x, weight=w, return_stats=True)
    grads = [g.compute() for g in ln.layer_norm_backward(gy, x, mean, rstd, weight=w,
                                                         grad_residual=x)]
    xk, gyk = x.compute_chunk_sizes(), gy.compute_chunk_sizes()
    _, mk, rk = ln.layer_norm(xk, weight=w, return_stats=True)
    known = [g.compute() for g in ln.layer_norm_backward(gyk, xk, mk, rk, weight=w,
                                                         grad_residual=xk)]
    for got, want in zip(grads, known, strict=True):
        np.testing.assert_array_equal(got, want)
    gyn = (xn * 0.5 + 1.0).astype(np.float32)
    want_x = ln.layer_norm_backward(gyn, xn, *ln.layer_norm(xn, weight=w, return_stats=True)[1:],
                                    weight=w, grad_residual=xn)[0]
    np.testing.assert_array_equal(grads[0], want_x)
    ref = reference.layer_norm_backward(gyn, xn, (1,), w)
    np.testing.assert_allclose(grads[1], ref[1], rtol=1e-4, atol=1e-4)
    rms = [g.compute() for g in ln.rms_norm_backward(gy, x, ln.rms_norm(x, return_stats=True)[1],
                                                     weight=w)]
    rms_known = [g.compute() for g in ln.rms_norm_backward(
        gyk, xk, ln.rms_norm(xk, return_stats=True)[1], weight=w)]
    for got, want in zip(rms, rms_known, strict=True):
        np.testing.assert_array_equal(got, want)


def test_unknown_row_counts_errors_name_the_argument():
    """What cannot line up with unknown row counts is refused when the call is made: a
    normalized axis of unknown size, a companion of known shape or other chunks, an
    array scale; shape errors of the known axes say how the unknown sizes appear."""
    rng = np.random.default_rng(13)
    x, xn = _masked_rows(rng, (60, 16), (20, 16))
    with pytest.raises(ValueError, match=r"normalized axes \[0\]"):
        ln.layer_norm(x, axis=0)
    with pytest.raises(ValueError, match=r"normalized axes \[0\]"):
        ln.layer_norm(x, normalized_shape=(5, 16))
    _, mean, rstd = ln.layer_norm(x, return_stats=True)
    with pytest.raises(ValueError, match="grad_y must be a Dask array"):
        ln.layer_norm_backward(np.ones((len(xn), 16), np.float32), x, mean, rstd)
    doubled = da.concatenate([x, x])
    with pytest.raises(ValueError, match="residual has 6 chunks of unknown size along axis 0 "
                                         "where x has 3"):
        ln.add_layer_norm(x, doubled)
    with pytest.raises(ValueError, match=r"residual must have shape .*got shape \(1, 8\).*"
                                         r"appear as 1"):
        ln.add_layer_norm(x, x[:, :8])
    with pytest.raises(ValueError, match="scale= as an array needs x's row counts"):
        ln.layer_norm(x, quantize="int8", scale=np.full((1, 1), 0.1, np.float32))


def test_dask_scale_is_used_lazily_and_checked_per_block():
    """A static scale= may be a Dask array (every array argument comes from x's library):
    rechunked to x's row blocks, the same codes as NumPy's, returned as passed; its
    values are checked in each block when the result is computed (not eagerly: that
    would run the scale's graph), its shape when the call is made."""
    rng = np.random.default_rng(6)
    xn = random_rows(rng, (9, 16), "float32")
    x = da.from_array(xn, chunks=(4, 16))
    per_row = (0.01 + rng.random((9, 1))).astype(np.float32)
    for sn in (per_row, np.full((1, 1), 0.02, np.float32), np.asarray(0.03, np.float32)):
        sd = da.from_array(sn, chunks=(5, 1) if sn.ndim else ())
        y, s = ln.layer_norm(x, quantize="int8", scale=sd)
        assert s is sd
        np.testing.assert_array_equal(y.compute(),
                                      ln.layer_norm(xn, quantize="int8", scale=sn)[0])
        y = ln.add_rms_norm(x, x, quantize="float8_e4m3fn", scale=sd)[0]
        want = ln.add_rms_norm(xn, xn, quantize="float8_e4m3fn", scale=sn)[0]
        np.testing.assert_array_equal(y.compute().view(np.uint8), want.view(np.uint8))
    bad = per_row.copy()
    bad[6] = -1.0
    seen = []
    lazy = da.from_array(bad, chunks=(5, 1)).map_blocks(
        lambda b: (seen.append(b.size), b)[1], meta=np.empty((0, 0), np.float32))
    y, _ = ln.layer_norm(x, quantize="int8", scale=lazy)
    assert not seen, "the scale was computed when the call was made"
    with pytest.raises(ValueError, match="scale must be positive and finite"):
        y.compute()
    with pytest.raises(ValueError, match=r"scale must be broadcastable .*\(9, 1\).*\(9, 2\)"):
        ln.layer_norm(x, quantize="int8", scale=da.ones((9, 2), chunks=3))
    unknown = da.from_array(per_row, chunks=(5, 1))
    with pytest.raises(ValueError, match="scale has unknown chunk sizes"):
        ln.layer_norm(x, quantize="int8", scale=unknown[unknown[:, 0] > 0])


def test_array_api_backend_per_block():
    rng = np.random.default_rng(5)
    xn = random_rows(rng, (12, 10), "float64")
    x = da.from_array(xn, chunks=(5, 10))
    got = ln.layer_norm(x, backend="array_api").compute()
    np.testing.assert_allclose(got, ln.layer_norm(xn), rtol=0, atol=1e-13)


class _TaskResults:
    """Records the size of every in-memory ndarray a local scheduler task produced."""

    def __enter__(self):
        from dask.callbacks import Callback

        self.nbytes = []

        def posttask(key, result, dsk, state, worker_id):
            items = result if isinstance(result, tuple) else (result,)
            for item in items:
                # np.memmap slices are views of the file, not memory.
                if isinstance(item, np.ndarray) and not isinstance(item, np.memmap):
                    self.nbytes.append(item.nbytes)

        self._cb = Callback(posttask=posttask)
        self._cb.__enter__()
        return self

    def __exit__(self, *exc):
        self._cb.__exit__(*exc)


def test_memory_mapped_npy_normalized_chunk_by_chunk(tmp_path):
    rng = np.random.default_rng(6)
    data = random_rows(rng, (600, 48), "float32", loc=100.0)
    np.save(tmp_path / "x.npy", data)
    src = np.load(tmp_path / "x.npy", mmap_mode="r")
    x = da.from_array(src, chunks=(50, 48))
    w = np.linspace(0.5, 1.5, 48, dtype=np.float32)
    y = ln.layer_norm(x, weight=w)
    target = np.lib.format.open_memmap(tmp_path / "y.npy", mode="w+", dtype=np.float32,
                                       shape=src.shape)
    with _TaskResults() as seen:
        da.store(y, target, scheduler="threads")
    target.flush()
    del target
    expected = ln.layer_norm(data, weight=w)
    np.testing.assert_array_equal(np.load(tmp_path / "y.npy"), expected)
    # No task ever held more than one chunk: the array went through block by block.
    assert seen.nbytes and max(seen.nbytes) <= 50 * 48 * 4
    da.to_npy_stack(tmp_path / "stack", y, axis=0)
    np.testing.assert_array_equal(da.from_npy_stack(tmp_path / "stack").compute(), expected)


def _npy_rows(path, block_info=None):
    """Read one block of rows of a .npy file (on whichever worker runs the task)."""
    (start, stop), *_ = block_info[None]["array-location"]
    return np.array(np.load(path, mmap_mode="r")[start:stop])


def test_npy_loaded_per_block_keeps_the_graph_free_of_data(tmp_path):
    # da.from_array(memmap) pickles the whole memmap into the graph (fine for the local
    # threaded scheduler, which never pickles); for a cluster, each task reads its rows.
    cloudpickle = pytest.importorskip("cloudpickle")
    rng = np.random.default_rng(9)
    data = random_rows(rng, (300, 40), "float32", loc=-20.0)
    path = tmp_path / "x.npy"
    np.save(path, data)
    shape = np.load(path, mmap_mode="r").shape  # reads the header only
    x = da.map_blocks(_npy_rows, str(path), chunks=((60,) * 5, (shape[1],)),
                      dtype=np.float32, meta=np.empty((0, 0), np.float32))
    y, _, rstd = ln.layer_norm(x, return_stats=True)
    graph = dict(y.__dask_graph__())
    assert len(cloudpickle.dumps(graph)) < data.nbytes // 10
    np.testing.assert_array_equal(y.compute(), ln.layer_norm(data))
    np.testing.assert_array_equal(rstd.compute(), ln.layer_norm(data, return_stats=True)[2])


def test_distributed_cluster_returns_only_the_results():
    distributed = pytest.importorskip("distributed")
    cloudpickle = pytest.importorskip("cloudpickle")
    from distributed.protocol import dask_deserialize

    rng = da.random.default_rng(7)  # the data is generated on the workers
    x = rng.standard_normal((2000, 96), chunks=(250, 48)).astype(np.float32) + 10.0
    gy = rng.standard_normal((2000, 96), chunks=(500, 96)).astype(np.float32)
    w = np.linspace(0.5, 1.5, 96, dtype=np.float32)
    b = np.linspace(-1.0, 1.0, 96, dtype=np.float32)
    y, mean, rstd = ln.layer_norm(x, weight=w, bias=b, return_stats=True)
    gx, gw, gb = ln.layer_norm_backward(gy, x, mean, rstd, w)
    # The graph carries no data but the small weights: x (768 KB) is made on the workers.
    graph = {}
    for arr in (y, gx, gw, gb):
        graph.update(dict(arr.__dask_graph__()))
    assert len(cloudpickle.dumps(graph)) < 100_000

    received = []
    original = dask_deserialize.dispatch(np.ndarray)

    def spy(header, frames):
        arr = original(header, frames)
        received.append(arr.shape)
        return arr

    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=None) as cluster, \
            distributed.Client(cluster):
        dask_deserialize.register(np.ndarray)(spy)
        try:
            got_y, got_gx, got_gw, got_gb = dask.compute(y, gx, gw, gb)
        finally:
            dask_deserialize.register(np.ndarray)(original)
        workers = len(cluster.workers)
    assert workers == 2
    # What reached the client: exactly the four results, each once (no stats, no blocks of x).
    assert sorted(received) == sorted([(2000, 96), (2000, 96), (96,), (96,)])

    # Same graph on the local synchronous scheduler (never touching the cluster).
    xn, gyn = dask.compute(x, gy, scheduler="sync")
    ey, emean, erstd = ln.layer_norm(xn, weight=w, bias=b, return_stats=True)
    np.testing.assert_array_equal(got_y, ey)
    egx, _, _ = ln.layer_norm_backward(gyn, xn, emean, erstd, w)
    np.testing.assert_array_equal(got_gx, egx)
    local_gw, local_gb = dask.compute(gw, gb, scheduler="sync")
    np.testing.assert_array_equal(got_gw, local_gw)  # same block order, same bits
    np.testing.assert_array_equal(got_gb, local_gb)
    _, rw, rb = reference.layer_norm_backward(gyn, xn, (1,), w)
    np.testing.assert_allclose(got_gw, rw, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(got_gb, rb, rtol=1e-4, atol=1e-3)


