"""Waiting on the real parts: poll a condition until it holds, no longer than needed."""

import time


def until(check, timeout: float = 30, what: str = "condition", every: float = 0.2):
    """`check()`'s first truthy value, polled every `every` s; fails after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"not within {timeout} s: {what}")
