"""The ``syshax`` distribution: the shared layer (``syshax.common``), the engine simulator, the
load generator, the KV connector and, on top, the command line (docs/architecture.md)."""

from syshax.common import __version__

__all__ = ["__version__"]
