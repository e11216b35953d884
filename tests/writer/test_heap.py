"""freeze_gc: the publisher freezes the process's heap at its first publish and unfreezes it at close."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from ckptstream import Publisher, Stream
from ckptstream.writer import heap
from ckptstream.writer.heap import HeapFreeze
from tests.helpers import assert_same_tensors, random_state


@pytest.fixture(autouse=True)
def unfrozen_heap():
    gc.unfreeze()  # (a library may freeze objects at import)
    yield
    holders = heap._holders
    heap._holders, heap._frozen_count = 0, None
    gc.unfreeze()
    assert holders == 0, "a hold was not given back"


def frozen(obj: object) -> bool:
    """Whether ``obj`` (tracked by the collector) is frozen: left out of every generation."""
    return not any(o is obj for o in gc.get_objects())


def test_freezes_the_heap_alive_at_the_first_publish_until_close(stream_url):
    alive_before = [object()]  # a tracked object of the trainer's, alive at the first publish
    state = random_state(0)
    with Publisher(stream_url, freeze_gc=True) as publisher:
        assert gc.get_freeze_count() == 0  # nothing before the first publish
        publisher.publish(state).result()
        count = gc.get_freeze_count()
        assert count > 0 and frozen(alive_before)
        created_after = [object()]
        publisher.publish(state).result()
        assert gc.get_freeze_count() <= count  # frozen once (frozen objects that die leave the count)
        assert not frozen(created_after)  # what came later is collected as usual
    assert gc.get_freeze_count() == 0 and not frozen(alive_before)
    assert_same_tensors(dict(Stream(stream_url).iter_tensors(1)), state)


def test_garbage_is_collected_before_the_freeze(stream_url):
    class Node:
        pass

    cycle = Node()
    cycle.self = cycle  # garbage only a collection reclaims
    dead = weakref.ref(cycle)
    del cycle
    gc.disable()  # (so that nothing but the publisher's collection reclaims it)
    try:
        with Publisher(stream_url, freeze_gc=True) as publisher:
            publisher.publish(random_state(3)).result()
            assert dead() is None  # collected, not frozen for good
    finally:
        gc.enable()


def test_by_default_only_the_device_encoder_freezes(tmp_path):
    state = random_state(1)
    with Publisher(str(tmp_path / "host")) as publisher:  # CPU tensors: the host path
        publisher.publish(state).result()
        assert gc.get_freeze_count() == 0
    with Publisher(str(tmp_path / "device"), device_delta=True) as publisher:  # the device encoder's CPU run
        publisher.publish(state).result()
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
    with Publisher(str(tmp_path / "off"), device_delta=True, freeze_gc=False) as publisher:
        publisher.publish(state).result()
        assert gc.get_freeze_count() == 0


def test_a_failed_publish_still_gives_the_hold_back(stream_url):
    with Publisher(stream_url, freeze_gc=True) as publisher:
        with pytest.raises(ValueError):
            publisher.publish({"bad name\n": torch.zeros(3)})
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0 and heap._holders == 0


def test_the_last_holder_unfreezes(tmp_path):
    first, second = HeapFreeze(), HeapFreeze()
    first.hold()
    count = gc.get_freeze_count()
    second.hold()
    assert 0 < gc.get_freeze_count() <= count  # one freeze for the process
    first.release()
    first.release()  # idempotent
    assert gc.get_freeze_count() > 0 and heap._holders == 1
    second.release()
    assert gc.get_freeze_count() == 0


def test_a_freeze_made_since_is_left_to_its_owner(stream_url):
    with Publisher(stream_url, freeze_gc=True) as publisher:
        publisher.publish(random_state(2)).result()
        theirs = [object()]
        gc.freeze()  # the trainer's own (or an in-process vLLM's), after the publisher's
    assert frozen(theirs)  # not undone by the publisher's close


def test_objects_frozen_before_are_frozen_until_close(stream_url):
    own = [object()]
    gc.freeze()  # a library's at import (seen on the GPU host)
    with Publisher(stream_url, freeze_gc=True) as publisher:
        created_after = [object()]
        publisher.publish(random_state(2)).result()
        assert frozen(created_after)  # frozen all the same
    assert not frozen(created_after) and not frozen(own)
