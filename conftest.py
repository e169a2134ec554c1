"""Root pytest configuration: parallel kernels whenever a call is large enough, and no
doctest collection of modules whose library is missing.

``--doctest-modules`` imports every module under ``src/layernorm``; the torch glue and the
drop-in torch modules import torch at module level, which is only right when torch is
installed.
"""

import os
from importlib.util import find_spec

# Tests compare the serial and parallel kernels bit for bit: the choice measured per call
# (layernorm._backends._numba.schedule) would make which one runs depend on timing.
os.environ.setdefault("LAYERNORM_PARALLEL", "always")

collect_ignore: list[str] = []
if find_spec("torch") is None:
    collect_ignore += ["src/layernorm/torch.py", "src/layernorm/_adapters/torch.py"]
if find_spec("dask") is None:
    collect_ignore += ["src/layernorm/_adapters/dask.py", "src/layernorm/bench/dask.py"]
