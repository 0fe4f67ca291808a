"""The files a standalone router reads (policy, tenants, deployments): JSON, or YAML by a
``.yaml``/``.yml`` name."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def read_document(path: str) -> Any:
    """A file's content; OSError when it cannot be read, ValueError when it does not parse
    (YAML's own error too, so that a watcher catching ValueError keeps watching)."""
    text = Path(path).read_text()
    if path.endswith((".yaml", ".yml")):
        import yaml

        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"not valid YAML: {exc}") from None
    import json

    return json.loads(text)
