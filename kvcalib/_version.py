"""The version, in one place: pyproject.toml reads it (tool.setuptools.dynamic), kvcalib re-exports it."""

__version__ = "0.3.0"
