"""The embedded broker under many producers and consumers: nothing lost, duplicated or corrupt."""

from __future__ import annotations

from pathlib import Path

from testbed import broker_stress as stress


def test_ten_thousand_messages_four_producers_three_consumers() -> None:
    figures = stress.run("syshaxfs", messages=10_000, producers=4, consumers=3)
    assert (figures.lost, figures.duplicated, figures.corrupt) == (0, 0, 0), figures
    assert figures.received == 10_000


def test_a_half_written_message_is_never_read(tmp_path: Path) -> None:
    """A message exists under its final name only once it is whole: a reader that lists the
    folder while a put is in progress finds nothing to take."""
    from kombu import Connection

    import controlplane.core.broker

    for sub in ("queue", "processed", "control"):
        (tmp_path / sub).mkdir()
    options = {
        "data_folder_in": str(tmp_path / "queue"),
        "data_folder_out": str(tmp_path / "queue"),
        "control_folder": str(tmp_path / "control"),
        "polling_interval": 0.01,
    }
    with Connection("syshaxfs://", transport_options=options) as conn:
        channel = conn.default_channel
        assert isinstance(channel, controlplane.core.broker.Channel)
        real_replace = controlplane.core.broker.os.replace
        seen_while_writing: list[list[str]] = []

        def replace_and_look(src: str, dst: str) -> None:
            seen_while_writing.append(sorted(p.name for p in (tmp_path / "queue").iterdir()))
            real_replace(src, dst)

        controlplane.core.broker.os.replace = replace_and_look  # type: ignore[assignment]
        try:
            queue = conn.SimpleQueue("q")
            queue.put({"n": 1})
        finally:
            controlplane.core.broker.os.replace = real_replace  # type: ignore[assignment]
        (before,) = seen_while_writing
        assert all(name.startswith(".") for name in before), before  # only the staging file
        assert queue.get(timeout=2).payload == {"n": 1}
        assert sorted(p.name for p in (tmp_path / "queue").iterdir()) == []
        queue.close()
