"""docs/architecture.md draws each of import-linter's layers contracts in pyproject.toml.

A picture is the fenced block after a ``<!-- layers: <contract name> -->`` comment. Each of its
lines that starts with module names (``a | b``, then two spaces before any description) is one
layer, top to bottom; the other lines (connectors, notes) are drawing.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"

MARKER = re.compile(r"<!-- layers: (?P<name>.+?) -->\n```[^\n]*\n(?P<body>.*?)\n```", re.S)
LAYER_LINE = re.compile(r"[a-z_][\w.]*(?: \| [a-z_][\w.]*)*")

Layers = list[frozenset[str]]


def _layer(text: str) -> frozenset[str]:
    """One layer's modules; their order inside a layer means nothing."""
    return frozenset(part.strip(" ()") for part in re.split(r"[|:]", text))


def contract_layers() -> dict[str, Layers]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts = config["tool"]["importlinter"]["contracts"]
    return {
        c["name"]: [_layer(layer) for layer in c["layers"]]
        for c in contracts
        if c["type"] == "layers"
    }


def picture_layers(body: str) -> Layers:
    layers = []
    for line in body.splitlines():
        head = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        if LAYER_LINE.fullmatch(head):
            layers.append(_layer(head))
    return layers


def documented_layers(text: str) -> dict[str, list[Layers]]:
    pictures: dict[str, list[Layers]] = {}
    for match in MARKER.finditer(text):
        pictures.setdefault(match["name"], []).append(picture_layers(match["body"]))
    return pictures


CONTRACTS = contract_layers()


def test_every_layers_contract_is_drawn_once_and_every_picture_is_a_contract() -> None:
    drawn = documented_layers(DOC.read_text())
    assert sorted(drawn) == sorted(CONTRACTS)
    assert {name: len(pictures) for name, pictures in drawn.items() if len(pictures) > 1} == {}


@pytest.mark.parametrize("name", sorted(CONTRACTS))
def test_the_picture_shows_the_contracts_layers_in_order(name: str) -> None:
    (picture,) = documented_layers(DOC.read_text()).get(name, [[]])
    assert picture == CONTRACTS[name]


def test_a_picture_missing_a_layer_or_out_of_order_differs() -> None:
    """The check itself: a picture without ``flow``, or with two layers swapped, differs."""
    body = "   cli      the root\n      |\n   api | policy\n   flow\n   engines  transport"
    drawn = picture_layers(body)
    assert drawn == [{"cli"}, {"policy", "api"}, {"flow"}, {"engines"}]
    assert picture_layers(body.replace("   flow\n", "")) != drawn
    assert picture_layers("   api | policy\n   cli\n   flow\n   engines") != drawn
