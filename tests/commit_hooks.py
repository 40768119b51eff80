"""transaction.on_commit hooks in rollback tests (plain `django_db`), as production runs them.

Under `django_db` without `transaction=True` the test runs inside a transaction that is rolled
back at its end and never commits, so every `transaction.on_commit` hook (RQ tasks queued
through django_rq's COMMIT_MODE "on_db_commit" and jobs.base.queue, webhooks, timeline
follow-ups) would silently never run. `run_commit_hooks` is autouse for every test (imported by
tests/conftest.py; a test module need not import it): a hook runs at once when no atomic block of the code is open, or when the
code's own outermost block ends, as after a real COMMIT; a block that is rolled back (or a
savepoint) drops its hooks, as Django does. The test's own wrapping blocks do not count.
django_rq's own "am I in a transaction?" (COMMIT_MODE "on_db_commit") sees them the same way:
outside the code's blocks `enqueue` queues at once and returns the job, as in production.
Under `transaction=True` nothing changes (no wrapping blocks, the real commits run them).
"""

import logging

import pytest
from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.transaction import Atomic
from django_rq.queues import DjangoRQ


def _only_test_blocks(conn) -> bool:
    return bool(conn.atomic_blocks) and all(
        getattr(block, "_from_testcase", False) for block in conn.atomic_blocks
    )


def _run_hooks(conn) -> None:
    while conn.run_on_commit and _only_test_blocks(conn) and not conn.needs_rollback:
        _sids, func, robust = conn.run_on_commit.pop(0)
        if robust:
            try:
                func()
            except Exception:  # as Django: a robust hook's error is logged, not raised
                logging.getLogger("django.db.backends.base").exception("on_commit hook")
        else:
            func()


@pytest.fixture(autouse=True)
def run_commit_hooks():
    original_on_commit = BaseDatabaseWrapper.on_commit
    original_exit = Atomic.__exit__

    def on_commit(self, func, robust=False):
        original_on_commit(self, func, robust)
        if self.in_atomic_block and _only_test_blocks(self):
            _run_hooks(self)

    def exit_(self, exc_type, exc_value, traceback):
        result = original_exit(self, exc_type, exc_value, traceback)
        conn = connections[self.using or "default"]
        if not getattr(self, "_from_testcase", False) and _only_test_blocks(conn):
            _run_hooks(conn)
        return result

    original_enqueue_call = DjangoRQ.enqueue_call

    def enqueue_call(self, *args, **kwargs):
        if self._commit_mode == "on_db_commit" and _only_test_blocks(connections["default"]):
            return self.original_enqueue_call(*args, **kwargs)  # autocommit, as in production
        return original_enqueue_call(self, *args, **kwargs)

    BaseDatabaseWrapper.on_commit = on_commit
    Atomic.__exit__ = exit_
    DjangoRQ.enqueue_call = enqueue_call
    try:
        yield
    finally:
        BaseDatabaseWrapper.on_commit = original_on_commit
        Atomic.__exit__ = original_exit
        DjangoRQ.enqueue_call = original_enqueue_call
