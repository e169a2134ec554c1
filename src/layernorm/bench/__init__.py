"""The tools on top of the library: ``python -m layernorm info`` and ``bench``.

This package is the top layer: it imports layernorm's public API (and, for the
roofline, the Numba backend), and nothing in the library imports it, so
``import layernorm`` never loads it. The modules, each with one job:

``cli``       the argument parser and ``main``, the entry point of ``python -m layernorm``
``machine``   versions, backends, threads, CPU and GPU of this machine (``info``)
``timing``    the one timer: calibrated samples in interleaved rounds, medians
``settings``  what one ``bench`` run measures, validated from the command line
``impls``     the implementations compared: copies, ours, and the peer libraries
``run``       the grid of cases, each timed and summarized (bandwidth, % copy, speed-up)
``report``    the printed tables, the JSON file and the plot
``noise``     was the machine quiet? the conditions of a run and a verdict on its numbers
``roofline``  ``bench --roofline``: where the LayerNorm kernel's time goes
``dask``      ``bench --dask``: Dask throughput against the NumPy path
"""
