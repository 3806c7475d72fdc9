"""Sphinx configuration of the jaxccl documentation (MyST markdown, API reference from the docstrings).

Build: ``python -m sphinx -W --keep-going -b html docs docs/_build/html``.
"""

import jaxccl

jaxccl.emulate(8)  # the API pages import modules that may start JAX

project = "jaxccl"
author = "jaxccl contributors"
copyright = "jaxccl contributors"
version = release = jaxccl.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

autodoc_default_options = {"members": True, "member-order": "bysource"}
autodoc_typehints = "description"
autodoc_class_signature = "separated"
autosummary_generate = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

html_theme = "alabaster"
html_title = f"jaxccl {release}"
