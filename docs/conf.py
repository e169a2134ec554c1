"""Sphinx configuration for the layernorm documentation.

Build (from the repository root; warnings are errors, references are checked)::

    python -m sphinx -W --keep-going -n -b html docs docs/_build/html

Every example in ``docs/examples/`` is executed at every build (sphinx-gallery with
``abort_on_example_error=True`` and ``run_stale_examples=True``), so every printed
number and every figure comes from the code as it is now.

Intersphinx (links into the NumPy, CuPy, PyTorch and Dask docs) needs the network to
fetch their inventories, which CI does not have. It is therefore OFF by default and the
build never tries to fetch anything; set ``LAYERNORM_DOCS_INTERSPHINX=1`` to turn it on
when building with network access. While it is off, references to those projects
render as plain code instead of links (see ``nitpick_ignore_regex`` below).
"""

from __future__ import annotations

import os

import layernorm

# Figures are rendered without a display, in CI and on headless machines alike.
os.environ.setdefault("MPLBACKEND", "Agg")

project = "layernorm"
author = "layernorm developers"
copyright = "layernorm developers"
release = layernorm.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "numpydoc",
    "sphinx_gallery.gen_gallery",
]

# Libraries without an inventory in the mapping below: their names never resolve.
nitpick_ignore_regex = [(r"py:.*", r"(jax|array_api_compat|array_api_strict|ml_dtypes)(\..*)?")]

INTERSPHINX = os.environ.get("LAYERNORM_DOCS_INTERSPHINX", "") not in ("", "0")
if INTERSPHINX:
    extensions.append("sphinx.ext.intersphinx")
    intersphinx_mapping = {
        "python": ("https://docs.python.org/3", None),
        "numpy": ("https://numpy.org/doc/stable/", None),
        "cupy": ("https://docs.cupy.dev/en/stable/", None),
        "torch": ("https://docs.pytorch.org/docs/stable/", None),
        "dask": ("https://docs.dask.org/en/stable/", None),
    }
    intersphinx_timeout = 10
else:
    # Without inventories these targets cannot resolve either; nitpicky mode still checks
    # every reference to layernorm itself (a typo there fails the build).
    nitpick_ignore_regex.append((r"py:.*", r"(numpy|np|cupy|torch|dask)(\..*)?"))

nitpicky = True
templates_path: list[str] = []
exclude_patterns = [
    "_build",
    "**.ipynb_checkpoints",
    "examples",  # the gallery's sources; sphinx-gallery renders them into auto_examples/
    "sg_execution_times.rst",  # left over by builds with write_computation_times=True
    "auto_examples/sg_execution_times.rst",
]
root_doc = "index"
source_suffix = {".rst": "restructuredtext"}

# -- autodoc / numpydoc ---------------------------------------------------------------
autodoc_typehints = "none"  # the numpydoc "Parameters" section is the documentation
autodoc_member_order = "bysource"
numpydoc_show_class_members = False  # methods are documented with :members: instead
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False
# Docstring checks that fail the build (-W): undocumented or unknown parameters, and a
# missing "Returns" section on functions that return something.
numpydoc_validation_checks = {"PR01", "PR02", "RT01"}
numpydoc_validation_exclude = {
    r"\.__call__$",
    r"\.reset_parameters$",
    r"\.state_dict$",
    r"\.load_state_dict$",
    r"\.extra_repr$",
}

# -- sphinx-gallery -------------------------------------------------------------------
sphinx_gallery_conf = {
    "examples_dirs": "examples",
    "gallery_dirs": "auto_examples",
    # Every script is executed, and every build re-executes it (no stale outputs).
    "filename_pattern": r"/plot_",
    "run_stale_examples": True,
    "abort_on_example_error": True,
    "within_subsection_order": "FileNameSortKey",
    "doc_module": ("layernorm",),
    "backreferences_dir": "gen_modules/backreferences",
    "image_scrapers": ("matplotlib",),
    "remove_config_comments": True,
    "min_reported_time": 1,
    "show_memory": False,
    "download_all_examples": False,
    # The timing pages load jQuery/DataTables from a CDN: nothing here may need the network.
    "write_computation_times": False,
}

# -- HTML -----------------------------------------------------------------------------
html_theme = "pydata_sphinx_theme"
html_title = f"layernorm {release}"
html_static_path: list[str] = []
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "header_links_before_dropdown": 6,
    # No icon links or version switcher: everything the pages load is served locally.
    "icon_links": [],
}
# Single pages have nothing to put in a section navigation; the right-hand "On this page"
# table of contents is enough.
html_sidebars = {
    page: []
    for page in ("index", "getting_started", "user_guide", "api", "benchmarks", "changelog")
}
html_show_sourcelink = False
html_copy_source = False
