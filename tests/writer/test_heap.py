"""freeze_gc: the publisher freezes the process's heap at its first publish and unfreezes it at close."""

from __future__ import annotations

import gc

import pytest

from ckptstream import Publisher, Stream
from ckptstream.writer.heap import HeapFreeze
from tests.helpers import assert_same_tensors, random_state


@pytest.fixture(autouse=True)
def unfrozen_heap():
    assert gc.get_freeze_count() == 0, "the test process starts with a frozen heap"
    yield
    gc.unfreeze()


def test_freezes_the_heap_alive_at_the_first_publish_until_close(stream_url):
    alive_before = [object()]  # a tracked object of the trainer's, alive at the first publish
    state = random_state(0)
    with Publisher(stream_url, freeze_gc=True) as publisher:
        assert gc.get_freeze_count() == 0  # nothing before the first publish
        publisher.publish(state).result()
        frozen = gc.get_freeze_count()
        assert frozen > 0
        assert not any(o is alive_before for o in gc.get_objects())  # left out of the collector's passes
        created_after = [object()]
        publisher.publish(state).result()
        assert gc.get_freeze_count() <= frozen  # frozen once (frozen objects that die leave the count)
        assert any(o is created_after for o in gc.get_objects())  # what came later is collected as usual
    assert gc.get_freeze_count() == 0
    assert_same_tensors(dict(Stream(stream_url).iter_tensors(1)), state)


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


def test_the_last_holder_unfreezes(tmp_path):
    first, second = HeapFreeze(), HeapFreeze()
    first.hold()
    frozen = gc.get_freeze_count()
    second.hold()
    assert gc.get_freeze_count() <= frozen  # one freeze for the process
    first.release()
    first.release()  # idempotent
    assert gc.get_freeze_count() > 0 and second.holding
    second.release()
    assert gc.get_freeze_count() == 0


def test_a_process_that_froze_objects_before_keeps_them_frozen(stream_url):
    own = [object()]
    gc.freeze()  # the process's own policy (or a library's at import)
    with Publisher(stream_url, freeze_gc=True) as publisher:
        created_after = [object()]
        publisher.publish(random_state(2)).result()
        assert not any(o is created_after for o in gc.get_objects())  # frozen all the same
    # not unfrozen at close: the process had chosen to freeze
    assert not any(o is own or o is created_after for o in gc.get_objects())
