"""The console's part of GPU subscriptions (jobs/pools/subscriptions.py): the balance check
they rent with (billing sits above jobs), and the task that runs the check, from the cron
tick (console/cron.py) and queued when GPUs come back (jobs.runs.exits.free_gpus)."""

from functools import partial

from console.forms import check_funds
from jobs.pools import subscriptions


def funds_of(owner):
    """The balance check of a new cluster of `owner`'s (console.forms.check_funds): a
    researcher, or a team member's Actor (the team's balance, the member's caps)."""
    return partial(check_funds, owner)


def tick() -> dict:
    """Expire what is past its time and fire what fits now."""
    return subscriptions.check(funds_of=funds_of)
