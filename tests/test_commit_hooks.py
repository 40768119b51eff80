"""The rollback tests' commit hooks (tests/commit_hooks.py) run as after a real COMMIT."""

import pytest
from django.db import transaction

pytestmark = pytest.mark.django_db


def test_hooks_run_at_once_outside_atomic():
    ran = []
    transaction.on_commit(lambda: ran.append(1))
    assert ran == [1]


def test_hooks_run_at_outer_exit_not_inner():
    ran = []
    with transaction.atomic():
        transaction.on_commit(lambda: ran.append(1))
        with transaction.atomic():
            transaction.on_commit(lambda: ran.append(2))
        assert ran == []
    assert ran == [1, 2]


def test_hooks_dropped_with_rolled_back_block():
    ran = []
    with pytest.raises(ZeroDivisionError):
        with transaction.atomic():
            transaction.on_commit(lambda: ran.append(1))
            raise ZeroDivisionError
    assert ran == []
    with transaction.atomic():
        transaction.on_commit(lambda: ran.append(2))
        try:
            with transaction.atomic():
                transaction.on_commit(lambda: ran.append(3))
                raise ZeroDivisionError
        except ZeroDivisionError:
            pass
    assert ran == [2]


def test_hook_adding_hook():
    ran = []

    def first():
        ran.append(1)
        with transaction.atomic():
            transaction.on_commit(lambda: ran.append(2))

    with transaction.atomic():
        transaction.on_commit(first)
    assert ran == [1, 2]


@pytest.mark.django_db(transaction=True)
def test_transactional_untouched():
    ran = []
    with transaction.atomic():
        transaction.on_commit(lambda: ran.append(1))
        assert ran == []
    assert ran == [1]


def test_django_rq_queues_what_a_rollback_test_commits():
    import django_rq

    queue = django_rq.get_queue("default")
    job = queue.enqueue("commit_hooks._only_test_blocks", None)
    assert job is not None and queue.count == 1, "outside a block: at once, as in autocommit"
    queue.empty()
    with transaction.atomic():
        queue.enqueue("commit_hooks._only_test_blocks", None)
        assert queue.count == 0, "not before the commit"
    assert queue.count == 1
