"""Sphinx configuration of pyperm's documentation site.

Build (from the repository root, after ``pip install ".[docs]"``)::

    sphinx-build -W -b html docs docs/_build/html

``-D plot_gallery=0`` skips running the gallery scripts (a quick check of the pages).
The API reference is written at build time from each public module's ``__all__``
(``_ext/apireference.py``), so it lists exactly what the package exports.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pyperm

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))

# The gallery runs small torch jobs on a 2-core machine; threads that spin between
# operations only slow them down there (see the guide's performance notes).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

project = "pyperm"
author = "the pyperm developers"
copyright = "the pyperm developers"
release = pyperm.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.mathjax",
    "numpydoc",
    "sphinx_gallery.gen_gallery",
    "apireference",
    "clihelp",
]

# guide/_*.rst: sections included into a page (.. include::), not pages of their own.
exclude_patterns = ["_build", "_templates", "examples/README.rst", "**/GALLERY_HEADER.rst", "guide/_*.rst"]
templates_path = ["_templates"]
root_doc = "index"
default_role = "code"
pygments_style = "sphinx"
# numpydoc renders a docstring's References as citations; a list of references that the text
# does not cite by number is fine in a docstring, so "not referenced" is not a defect.
suppress_warnings = ["ref.citation"]

# --------------------------------------------------------------------------- autodoc
autosummary_generate = True
autosummary_imported_members = True
autodoc_typehints = "none"  # numpydoc's Parameters sections say the types, in words
autodoc_member_order = "bysource"

# --------------------------------------------------------------------------- numpydoc
# Class pages list their methods and properties through the class template, not numpydoc's
# auto-generated member tables (which would duplicate them and warn on every dataclass field).
numpydoc_show_class_members = False
numpydoc_show_inherited_class_members = False
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False
numpydoc_validation_checks: set[str] = set()

# --------------------------------------------------------------------------- gallery
sphinx_gallery_conf = {
    "examples_dirs": ["examples"],
    "gallery_dirs": ["auto_examples"],
    "filename_pattern": r"/plot_",
    "within_subsection_order": "gallery_order.ExampleOrder",
    "download_all_examples": False,
    "remove_config_comments": True,
    "show_memory": False,
    "min_reported_time": 1,
    # The execution-times page needs jQuery, which Sphinx no longer ships (a JavaScript error).
    "write_computation_times": False,
    "image_scrapers": ("matplotlib",),
    "matplotlib_animations": False,
    "reference_url": {"pyperm": None},
    "abort_on_example_error": False,
    "only_warn_on_example_error": False,
}

# --------------------------------------------------------------------------- HTML
html_theme = "pydata_sphinx_theme"
html_title = f"pyperm {release}"
html_static_path = ["_static"]
html_css_files = ["pyperm.css"]
html_show_sourcelink = False
html_theme_options = {
    "navbar_align": "left",
    "show_toc_level": 2,
    "navigation_with_keys": False,
    "secondary_sidebar_items": ["page-toc"],
    "footer_start": ["copyright"],
    "footer_end": ["sphinx-version"],
}
html_sidebars = {"index": [], "auto_examples/index": []}
html_context = {"default_mode": "light"}
