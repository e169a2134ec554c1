"""Accuracy kept while fast: error against a float64 reference on hard rows.

Rows of ``1e4 + randn`` in float32 have a large common offset: a naive
``E[x^2] - E[x]^2`` loses every significant digit there, and even two-pass float32
code loses about 1e-3. The targets: max |y - y_float64| <= 1e-5.
"""

# asv reads params and param_names as plain class-level lists.
# ruff: noqa: RUF012

from __future__ import annotations

import numpy as np

from .common import EPS, OPS, _converter, float64_reference, get_array, get_params

BACKENDS = ["numba", "array_api", "torch", "jax", "torch_native"]


class Accuracy:
    """max |y - y_float64| and max relative error on ``1e4 + randn`` float32 rows."""

    params = [OPS, BACKENDS]
    param_names = ["op", "backend"]

    def setup(self, op: str, backend: str) -> None:
        import layernorm as ln

        x = get_array("512x768", "float32", offset=1e4)
        w, b = get_params(768, "float32")
        conv, ready = _converter(backend, "float32")
        xb, wb, bb = conv(x), conv(w), conv(b)
        if backend == "torch_native":
            import torch.nn.functional as F

            if op == "layer_norm":
                y = F.layer_norm(xb, (768,), wb, bb, EPS)
            else:
                y = F.rms_norm(xb, (768,), wb, EPS)
        else:
            kwargs = {"backend": "array_api"} if backend == "array_api" else {}
            if op == "layer_norm":
                y = ready(ln.layer_norm(xb, weight=wb, bias=bb, eps=EPS, **kwargs))
            else:
                y = ready(ln.rms_norm(xb, weight=wb, eps=EPS, **kwargs))
        y = np.asarray(y.numpy() if hasattr(y, "numpy") else y, dtype=np.float64)
        ref = float64_reference(op, x, w, b)
        self.abs_err = float(np.max(np.abs(y - ref)))
        self.rel_err = self.abs_err / float(np.max(np.abs(ref)))

    def track_max_abs_error(self, op: str, backend: str) -> float:
        return self.abs_err

    track_max_abs_error.unit = "abs error"

    def track_max_rel_error(self, op: str, backend: str) -> float:
        return self.rel_err

    track_max_rel_error.unit = "rel error"
