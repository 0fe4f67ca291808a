"""The garbage-collector pause timer the gateway and the fleet load generator register."""

from __future__ import annotations

import gc

from common.gc_pauses import CollectionTimes


def test_a_collection_is_timed_and_a_long_one_kept() -> None:
    every, none = CollectionTimes(keep_over=0.0), CollectionTimes()
    gc.callbacks.extend([every, none])
    try:
        gc.collect()
    finally:
        gc.callbacks.remove(every)
        gc.callbacks.remove(none)
    assert every.longest > 0 and none.longest > 0
    assert [generation for _, _, generation in every.long][-1] == 2
    assert none.long == []
    assert none.take_longest() > 0 and none.take_longest() == 0.0
