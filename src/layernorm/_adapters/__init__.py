"""Adapters: libraries whose arrays the kernels do not take as they are.

* :mod:`.torch`: tensors -> zero-copy NumPy/CuPy views -> the engine -> tensors, with an
  autograd Function around the native routes.
* :mod:`.dask`: lazy blockwise graphs whose tasks run the engine on each block.

Each adapter imports its library at module import; :mod:`layernorm._api` imports an
adapter only when an array of its library arrives.
"""
