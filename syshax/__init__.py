"""Command-line entry point and Django-free components (engine simulator, load generator)."""

__version__ = "0.1.0"
