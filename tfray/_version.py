"""The one place tfray's version is written (setup.py reads it from here)."""

__version__ = "0.1.0"
