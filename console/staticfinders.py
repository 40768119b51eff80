"""Serve plotly.js from the `plotly` package itself (never a CDN, never a copy in git)."""

from pathlib import Path

import plotly
from django.contrib.staticfiles.finders import BaseFinder
from django.core.files.storage import FileSystemStorage

_DIR = Path(plotly.__file__).parent / "package_data"
_NAME = "plotly.min.js"
_URL_PATH = f"vendor/{_NAME}"


class PlotlyFinder(BaseFinder):
    def check(self, **kwargs):
        return []

    def find(self, path, find_all=False, **kwargs):
        if path != _URL_PATH:
            return [] if find_all else None
        found = str(_DIR / _NAME)
        return [found] if find_all else found

    def list(self, ignore_patterns):
        storage = FileSystemStorage(location=str(_DIR))
        storage.prefix = "vendor"
        yield _NAME, storage
