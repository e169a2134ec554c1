"""Fast, numerically stable LayerNorm and RMSNorm for NumPy, CuPy, torch, Dask and any
array-API array.

Importing this package is cheap: it imports NumPy only. Numba, CuPy, torch and Dask
are imported (and kernels compiled) on first use.
"""

from ._adapters.dask import LargeBlockWarning
from ._api import (
    add_layer_norm,
    add_rms_norm,
    layer_norm,
    layer_norm_backward,
    rms_norm,
    rms_norm_backward,
)
from ._dispatch import backend_name
from .layer import IncompatibleKeys, LayerNorm, RMSNorm, StateDictKeyError

__version__ = "0.1.0"

__all__ = [
    "IncompatibleKeys",
    "LargeBlockWarning",
    "LayerNorm",
    "RMSNorm",
    "StateDictKeyError",
    "__version__",
    "add_layer_norm",
    "add_rms_norm",
    "backend_name",
    "layer_norm",
    "layer_norm_backward",
    "rms_norm",
    "rms_norm_backward",
]
