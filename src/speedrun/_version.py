"""The package's version: one place, imported by the package and by what records it (results, saved models)."""

__version__ = "0.1.0"
