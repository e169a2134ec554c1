"""This machine: versions, backends, threads, CPU and GPU (``python -m layernorm info``).

Nothing optional is imported: versions come from package metadata and availability
from import specs, so reporting on torch or CuPy never loads them.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
from typing import Any

#: Distributions reported by ``info``: (distribution name, import name, required?).
PACKAGES = (
    ("layernorm", "layernorm", True),
    ("numpy", "numpy", True),
    ("numba", "numba", True),
    ("llvmlite", "llvmlite", True),
    ("array-api-compat", "array_api_compat", True),
    ("ml_dtypes", "ml_dtypes", True),
    ("torch", "torch", False),
    ("cupy", "cupy", False),
    ("dask", "dask", False),
    ("distributed", "distributed", False),
    ("jax", "jax", False),
    ("array-api-strict", "array_api_strict", False),
    ("onnxruntime", "onnxruntime", False),
)

#: CuPy is published under several distribution names (one per CUDA major version).
_CUPY_DISTRIBUTIONS = ("cupy", "cupy-cuda13x", "cupy-cuda12x", "cupy-cuda11x")


def installed(module: str) -> bool:
    """Whether ``module`` can be imported, found without importing it.

    Examples
    --------
    >>> installed("numpy")
    True
    >>> installed("surely_not_a_module_name")
    False
    """
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def distribution_version(dist: str, module: str) -> str | None:
    """Installed version of a distribution, read from its metadata (no import).

    Examples
    --------
    >>> distribution_version("numpy", "numpy") is not None
    True
    """
    names = _CUPY_DISTRIBUTIONS if dist == "cupy" else (dist,)
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "installed (version unknown)" if installed(module) else None


def versions() -> dict[str, str | None]:
    """Versions of Python and of every package ``info`` reports (None: not installed)."""
    out: dict[str, str | None] = {
        "python": f"{platform.python_version()} ({platform.python_implementation()})"
    }
    for dist, module, _ in PACKAGES:
        out[dist] = distribution_version(dist, module)
    return out


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read().strip()
    except OSError:
        return None


def cpu_info() -> dict[str, Any]:
    """CPU model, logical cores, usable cores and cache sizes (Linux sysfs where present)."""
    model = None
    text = _read("/proc/cpuinfo") or ""
    for line in text.splitlines():
        if line.lower().startswith(("model name", "hardware", "cpu model")):
            model = line.split(":", 1)[1].strip()
            break
    info: dict[str, Any] = {
        "model": model or platform.processor() or platform.machine(),
        "machine": platform.machine(),
        "logical_cores": os.cpu_count(),
    }
    if hasattr(os, "sched_getaffinity"):
        info["usable_cores"] = len(os.sched_getaffinity(0))
    caches = []
    base = "/sys/devices/system/cpu/cpu0/cache"
    if os.path.isdir(base):
        for entry in sorted(os.listdir(base)):
            if not entry.startswith("index"):
                continue
            level = _read(f"{base}/{entry}/level")
            kind = _read(f"{base}/{entry}/type")
            size = _read(f"{base}/{entry}/size")
            shared = _read(f"{base}/{entry}/shared_cpu_list")
            if level and size:
                caches.append({"level": int(level), "type": kind, "size": size,
                               "shared_cpu_list": shared})
    info["caches"] = caches
    return info


def threading_info(probe: bool = True) -> dict[str, Any]:
    """Numba's thread count and threading layer.

    Numba only knows its threading layer once a parallel kernel has run, so with
    ``probe`` a call large enough to take the parallel path is made first.
    """
    import numba

    info: dict[str, Any] = {
        "numba_num_threads": numba.config.NUMBA_NUM_THREADS,
        "numba_threads_in_use": numba.get_num_threads(),
        "configured_layer": numba.config.THREADING_LAYER,
        "layer": None,
    }
    if probe:
        try:
            import numpy as np

            from .. import layer_norm
            from .._backends._numba import PARALLEL_MIN_ELEMENTS

            rows = max(2, PARALLEL_MIN_ELEMENTS // 64)
            x = np.random.default_rng(0).standard_normal((rows, 64), dtype=np.float32)
            layer_norm(x)
        except Exception as exc:  # pragma: no cover - reported, never fatal
            info["probe_error"] = f"{type(exc).__name__}: {exc}"
    try:
        info["layer"] = numba.threading_layer()
    except ValueError:
        info["layer"] = None
    return info


def backends_info() -> dict[str, str]:
    """Which backends can run here, in words (nothing optional is imported)."""
    out: dict[str, str] = {}
    out["numba"] = ("available: NumPy arrays on the CPU" if installed("numba")
                    else "missing: numba is not installed")
    out["array_api"] = ("available: any other array-API array (JAX, array_api_strict, ...)"
                        if installed("array_api_compat") else "missing: array-api-compat")
    if not installed("cupy"):
        out["cupy"] = "not installed (CuPy arrays and torch CUDA tensors need it)"
    elif not installed("layernorm._backends._cupy"):
        out["cupy"] = "CuPy installed; the CuPy backend is not in this build"
    else:
        out["cupy"] = "CuPy installed: CuPy arrays on the GPU (if one is usable, see gpu)"
    for lib, what in (("torch", "torch tensors via DLPack"),
                      ("dask", "Dask arrays via map_blocks")):
        glue = installed(f"layernorm._adapters.{lib}")
        if not installed(lib):
            out[lib] = f"{lib} not installed"
        elif not glue:
            out[lib] = f"{lib} installed; its glue is not in this build"
        else:
            out[lib] = f"available: {what}"
    return out


def gpu_info() -> list[dict[str, Any]] | str:
    """GPUs seen through CuPy, when CuPy is installed; never raises."""
    if not installed("cupy"):
        return "none found (cupy not installed)"
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
        gpus = []
        for i in range(count):
            props = cupy.cuda.runtime.getDeviceProperties(i)
            name = props["name"]
            gpus.append({
                "id": i,
                "name": name.decode() if isinstance(name, bytes) else str(name),
                "memory_GiB": round(props["totalGlobalMem"] / 2**30, 1),
                "compute_capability": f"{props['major']}.{props['minor']}",
            })
        return gpus or "none found (CuPy sees no device)"
    except Exception as exc:
        return f"none usable ({type(exc).__name__}: {exc})"


def collect_info(probe: bool = True) -> dict[str, Any]:
    """Everything ``python -m layernorm info`` prints, as a dict."""
    return {
        "versions": versions(),
        "platform": platform.platform(),
        "backends": backends_info(),
        "threads": threading_info(probe),
        "cpu": cpu_info(),
        "gpu": gpu_info(),
    }


def format_info(info: dict[str, Any]) -> str:
    """Human-readable text for :func:`collect_info`'s dict."""
    lines = [f"layernorm {info['versions'].get('layernorm')}  ({info['platform']})", "",
             "versions:"]
    required = {dist for dist, _, req in PACKAGES if req}
    for name, ver in info["versions"].items():
        shown = ver if ver is not None else "not installed"
        tag = "" if name in required or name == "python" else "  (optional)"
        lines.append(f"  {name:<18} {shown}{tag}")
    lines += ["", "backends:"]
    lines += [f"  {name:<10} {what}" for name, what in info["backends"].items()]
    t = info["threads"]
    lines += ["", "threads:",
              f"  numba threads      {t['numba_threads_in_use']} in use, "
              f"{t['numba_num_threads']} available (NUMBA_NUM_THREADS)",
              f"  threading layer    {t['layer'] or 'unknown'} "
              f"(configured: {t['configured_layer']})"]
    if "probe_error" in t:
        lines.append(f"  probe failed:      {t['probe_error']}")
    c = info["cpu"]
    cores = f"{c['logical_cores']} logical"
    if "usable_cores" in c:
        cores += f", {c['usable_cores']} usable by this process"
    lines += ["", "cpu:", f"  model              {c['model']} ({c['machine']})",
              f"  cores              {cores}"]
    for cache in c["caches"]:
        label = f"L{cache['level']} {cache['type'] or ''}".strip()
        lines.append(f"  {label:<18} {cache['size']} (shared by cpus {cache['shared_cpu_list']})")
    lines += ["", "gpu:"]
    if isinstance(info["gpu"], str):
        lines.append(f"  {info['gpu']}")
    else:
        for g in info["gpu"]:
            lines.append(f"  [{g['id']}] {g['name']}, {g['memory_GiB']} GiB, "
                         f"compute capability {g['compute_capability']}")
    return "\n".join(lines)


def load_info() -> dict[str, Any]:
    """The 1-minute load average against the logical cores (None where the platform has
    no load average): more runnable processes than cores means timings are shared.

    Examples
    --------
    >>> sorted(load_info())
    ['load_avg_1m', 'logical_cores']
    """
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {"load_avg_1m": load, "logical_cores": os.cpu_count()}


def summary_line() -> str:
    """One line on the machine and the libraries compared, for the top of a report;
    a second line warns when other processes keep the machine busy."""
    cpu = cpu_info()
    ver = versions()
    libs = ", ".join(f"{name} {ver[name]}" for name in
                     ("layernorm", "numpy", "numba", "torch", "jax", "onnxruntime", "dask")
                     if ver.get(name))
    line = f"{cpu['model']}, {cpu['logical_cores']} logical cores; {libs}"
    if hasattr(os, "getloadavg") and cpu["logical_cores"]:
        load = os.getloadavg()[0]
        if load > 0.5 * cpu["logical_cores"]:
            line += (f"\nwarning: the machine is busy (load average {load:.1f} on "
                     f"{cpu['logical_cores']} cores): other processes will add noise, "
                     "most of all at more than one thread")
    return line
