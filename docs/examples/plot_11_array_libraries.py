"""
One call, many array libraries
==============================

The same ``ln.layer_norm(x, weight=w, bias=b)`` works on NumPy, PyTorch, JAX, Dask and
CuPy arrays, and returns an array of the library it was given.
:func:`layernorm.backend_name` says which backend computes it. Each section below runs
only if its library is installed (and, for CuPy, if a GPU is present).
"""

# %%
import importlib.util

import numpy as np

import layernorm as ln

rng = np.random.default_rng(0)
N, D = 1024, 768
x_np = rng.standard_normal((N, D), dtype=np.float32)
w_np = rng.uniform(0.5, 1.5, D).astype(np.float32)
b_np = rng.standard_normal(D).astype(np.float32)


def available(name):
    return importlib.util.find_spec(name) is not None


def to_numpy(y):
    """Back to NumPy, to compare with the NumPy result."""
    if hasattr(y, "compute"):  # Dask
        y = y.compute()
    if hasattr(y, "get"):  # CuPy
        y = y.get()
    if hasattr(y, "detach"):  # torch
        y = y.detach().cpu().numpy()
    return np.asarray(y)


def report(library, x, y, reference):
    diff = np.abs(to_numpy(y) - reference).max()
    print(
        f"{library:7s} backend={ln.backend_name(x):10s} -> {type(y).__module__}."
        f"{type(y).__name__}, dtype {y.dtype}, max |y - NumPy's y| = {diff:.1e}"
    )


# %%
# NumPy: the Numba CPU kernels
# ----------------------------
y_np = ln.layer_norm(x_np, weight=w_np, bias=b_np)
report("NumPy", x_np, y_np, y_np)

# %%
# PyTorch: zero-copy through DLPack, a tensor back
# ------------------------------------------------
# CPU tensors reach the same Numba kernels without a copy; the result is a tensor and
# autograd works through it.
if available("torch"):
    import torch

    x_t = torch.from_numpy(x_np).requires_grad_()
    w_t, b_t = torch.from_numpy(w_np), torch.from_numpy(b_np)
    y_t = ln.layer_norm(x_t, weight=w_t, bias=b_t)
    report("torch", x_t, y_t, y_np)
    y_t.square().sum().backward()
    ref = torch.nn.functional.layer_norm(x_t, (D,), w_t, b_t)
    print(
        "        same as torch.nn.functional.layer_norm within",
        f"{(y_t - ref).abs().max().item():.1e}; x.grad shape {tuple(x_t.grad.shape)}",
    )
else:
    print("PyTorch is not installed; skipped.")

# %%
# JAX: the generic array-API implementation
# -----------------------------------------
# JAX arrays have no native kernels here; the library computes with JAX's own
# operations, so the call works under ``jax.jit`` and ``jax.grad`` too.
if available("jax"):
    import jax
    import jax.numpy as jnp

    x_j, w_j, b_j = jnp.asarray(x_np), jnp.asarray(w_np), jnp.asarray(b_np)
    y_j = ln.layer_norm(x_j, weight=w_j, bias=b_j)
    report("JAX", x_j, y_j, y_np)

    jitted = jax.jit(lambda x: ln.layer_norm(x, weight=w_j, bias=b_j))
    print(f"        under jax.jit: max difference {float(jnp.abs(jitted(x_j) - y_j).max()):.1e}")
    grad = jax.grad(lambda x: jnp.sum(ln.layer_norm(x, weight=w_j, bias=b_j) ** 2))(x_j)
    print("        jax.grad shape", grad.shape)
else:
    print("JAX is not installed; skipped.")

# %%
# Dask: block by block
# --------------------
# A Dask array is normalized lazily, block by block. A row must be seen whole, so the
# normalized axis is rechunked into one block (here it was split in two), and the other
# axes are re-split so that blocks stay about as large as before. NumPy ``weight`` and
# ``bias`` are fine with a Dask ``x``.
if available("dask"):
    import dask.array as da

    x_d = da.from_array(x_np, chunks=(256, D // 2))
    y_d = ln.layer_norm(x_d, weight=w_np, bias=b_np)
    print("        input chunks: ", x_d.chunksize, " result chunks:", y_d.chunksize)
    report("Dask", x_d, y_d, y_np)
    print("        bitwise equal to NumPy:", np.array_equal(y_d.compute(), y_np))
    assert np.array_equal(y_d.compute(), y_np)
else:
    print("Dask is not installed; skipped.")

# %%
# CuPy: CUDA kernels on the array's device
# ----------------------------------------
gpu = False
if available("cupy"):
    import cupy

    try:
        gpu = cupy.cuda.runtime.getDeviceCount() > 0
    except cupy.cuda.runtime.CUDARuntimeError:
        gpu = False
if gpu:
    x_c, w_c, b_c = cupy.asarray(x_np), cupy.asarray(w_np), cupy.asarray(b_np)
    y_c = ln.layer_norm(x_c, weight=w_c, bias=b_c)
    report("CuPy", x_c, y_c, y_np)
else:
    print("CuPy with a CUDA GPU is not available here; skipped.")

# %%
# Mixing libraries is an error that names them
# --------------------------------------------
if available("torch"):
    try:
        ln.layer_norm(x_t, weight=w_np)
    except TypeError as err:
        print("TypeError:", err)
