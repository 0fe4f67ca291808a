"""Standalone mode's deployments: a file in the shape of the control plane's answer.

``--deployments-file PATH`` lists what a standalone router routes to: the
``{"deployments": [...]}`` document ``GET routing/deployments`` serves (JSON or YAML), read by
the same parser (``common.routing.parse_deployments``) a managed router reads that answer
with, so a field the control plane adds is one a file may carry, and a document saved from
the control plane is a valid file.

An entry may leave out its ``id``: it is derived from the entry's ``name`` (decision record
68), so adding, dropping or reordering other entries never moves a replica's id. The id keys
the replica's flow-control queues and the replicas a request has already tried, so ids of
routable entries must be distinct; a repeat is refused naming both entries.
"""

from __future__ import annotations

import hashlib
from typing import Any

from common.routing import ROUTABLE_STATES, DeploymentSpec, parse_deployments
from router.policy.documents import read_document


def derived_id(name: str) -> int:
    """The id of an entry that gives none: 48 bits of its name's SHA-256, the same in every
    process and every run (so each ``--workers`` worker agrees), and exact in JSON."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:6], "big")


def _with_ids(document: Any) -> tuple[Any, set[int]]:
    """``document`` with an id on every entry that names itself but gives no id, and the
    indexes of those entries. Anything malformed is left for the parser to name."""
    if not isinstance(document, dict) or not isinstance(document.get("deployments"), list):
        return document, set()
    entries: list[Any] = []
    derived: set[int] = set()
    for index, entry in enumerate(document["deployments"]):
        if isinstance(entry, dict) and "id" not in entry and isinstance(entry.get("name"), str):
            entry = {**entry, "id": derived_id(entry["name"])}
            derived.add(index)
        entries.append(entry)
    return {**document, "deployments": entries}, derived


def _check_distinct(entries: list[dict[str, Any]], derived: set[int]) -> None:
    """Raise a ValueError naming the first routable entry whose id another one has."""
    first: dict[int, int] = {}
    for index, entry in enumerate(entries):
        if entry.get("state", "running") not in ROUTABLE_STATES:
            continue
        ident = entry["id"]
        if ident not in first:
            first[ident] = index
            continue
        other = first[ident]
        if index in derived and other in derived:
            raise ValueError(
                f"deployments[{index}].name {entry['name']!r} repeats deployments[{other}]'s: "
                "names must be distinct where no id is given"
            )
        raise ValueError(
            f"deployments[{index}].id {ident} repeats deployments[{other}]'s: ids must be distinct"
        )


def parse_deployments_file(document: Any) -> list[DeploymentSpec]:
    """The routable deployments of a deployments file's content; a ValueError naming the
    entry and the field that is wrong."""
    document, derived = _with_ids(document)
    specs = parse_deployments(document)
    _check_distinct(document["deployments"], derived)
    return specs


def load_deployments_file(path: str) -> list[DeploymentSpec]:
    """The routable deployments listed in the file at ``path``; OSError when it cannot be
    read, ValueError (naming the field) when it is not a valid deployments document."""
    return parse_deployments_file(read_document(path))
