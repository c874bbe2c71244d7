"""Sphinx configuration: MyST markdown pages, the API reference from the docstrings (autodoc).

Built with warnings as errors (``make docs``; CI runs it): a broken link, reference or docstring fails the build.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

project = "pipedp"
author = "the pipedp developers"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]  # napoleon: the Args: sections
source_suffix = {".md": "markdown"}
myst_heading_anchors = 3  # [text](page.md#a-heading) links resolve, and a missing anchor is a warning
root_doc = "index"
exclude_patterns = ["_build", "README.md"]  # README.md: how to write these pages
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": False}
nitpicky = False  # torch's and the standard library's types have no inventory offline (no intersphinx)
html_theme = "alabaster"
html_title = "pipedp"
