"""The per-node agent: discovery, heartbeats and engine lifecycle (no Django)."""

from common import __version__

__all__ = ["__version__"]
