"""A backing service's outage as a long-running process lives through it.

Every process of the Procfile outlives a Redis or PostgreSQL restart on its own: it logs
the first failure once (not a traceback a second), waits 1, 2, 4 ... `cap` seconds between
tries, and logs once when the service answers again. `Outage` keeps that bookkeeping for
one loop; the loop decides what to retry. The errors that mean "the service is away" (as
opposed to a bug, which must still surface) are named here for the callers to catch.

Layer: base (beside queue and sql); uses no other part (the long-running commands use it).
"""

import logging
import time

import redis.exceptions
from django import db

# Refused, reset, timed out, still loading its data, or the password not yet set up.
REDIS_DOWN = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
# A lost connection, a server shutting down or starting up (psycopg's OperationalError
# and the InterfaceError of a connection closed under us both derive from db.Error).
DB_DOWN = (db.OperationalError, db.InterfaceError)


class Outage:
    """One loop's view of one service: `failed()` on an error, `ok()` after a success."""

    def __init__(self, what: str, log: logging.Logger, *, cap: float = 10.0):
        self.what = what
        self.log = log
        self.cap = cap
        self.since: float | None = None
        self.delay = 0.0

    @property
    def down(self) -> bool:
        return self.since is not None

    def failed(self, exc: BaseException) -> float:
        """Note a failure; the seconds to wait before the next try."""
        if self.since is None:
            self.since = time.monotonic()
            self.delay = 1.0
            self.log.warning(
                "%s is unreachable (%s: %s); retrying with backoff up to %.0f s",
                self.what,
                type(exc).__name__,
                str(exc).strip() or "no message",
                self.cap,
            )
        else:
            self.delay = min(self.delay * 2, self.cap)
        return self.delay

    def ok(self) -> bool:
        """Note a success; True when it ends an outage (the caller may need to set up again)."""
        if self.since is None:
            return False
        self.log.warning("%s answers again after %.0f s", self.what, time.monotonic() - self.since)
        self.since = None
        self.delay = 0.0
        return True


def close_db_connections() -> None:
    """Drop this thread's database connections, dead or alive: the next query dials afresh."""
    for conn in db.connections.all(initialized_only=True):
        try:
            conn.close()
        except db.Error:  # closing a connection the server already dropped
            pass
