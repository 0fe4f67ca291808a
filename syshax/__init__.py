"""The ``syshax`` command line: ``syshax up``, ``web``, ``agent``, ``router``, ``sim`` and the rest
(``syshax/cli.py``), each verb loading its process's own package (docs/architecture.md)."""

from common import __version__

__all__ = ["__version__"]
