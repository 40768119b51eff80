"""The console's part of pools (issue 26): the money figures the autoscaler uses, written
on each pool's row from billing before each round (jobs does not read billing), and the
cron entry that runs the rounds (jobs/pools/autoscaler.py) and the sweeps' safety net (jobs/pools/sweeps.py).
"""

import logging

from django.core.exceptions import ValidationError
from django.db import transaction

from billing import caps
from billing import selectors as billing
from jobs.clusters import services
from jobs.models import Cluster, Job, Pool
from jobs.pools import autoscaler, sweeps

log = logging.getLogger("suanli.pools")


FIGURES = ("rate_per_hour", "spent", "balance", "gpu_room")  # what `refresh` writes


def refresh(pool: Pool, *, book=None) -> Pool:
    """One cluster's price now, what the pool has spent, and what its maker's caps leave
    (money, GPUs), onto the row."""
    figures = _figures(
        pool, book=book, spent=billing.charged_for_pool(pool.pk),
        balance=billing.balance_of(pool.owner),
    )  # fmt: skip
    # Written every time, not only when this object's figures differ: the object may hold
    # figures whose write a refused submit rolled back.
    Pool.objects.filter(pk=pool.pk).update(**figures)
    for field, value in figures.items():
        setattr(pool, field, value)
    return pool


def _figures(pool: Pool, *, book, spent, balance) -> dict:
    """The pool's FIGURES from what it was charged (`spent`) and its owner's balance."""
    # A team pool's clusters are charged to its maker's budget: the autoscaler sees no more
    # than what is left of it (billing.caps), so it holds back at the cap.
    left = caps.money_left(pool.owner_id, pool.created_by_id)
    if left is not None:
        balance = min(balance, left)
    # Likewise the GPUs its maker's GPU cap leaves: it adds no cluster past them.
    room = caps.gpu_room(pool.owner_id, pool.created_by_id)
    rate = billing.pool_rate(pool, book=book)
    return dict(zip(FIGURES, (rate, spent, balance, room), strict=True))


def tick() -> int:
    """Cron: every pool that is active or still holds clusters, one round each. The pools
    of a researcher's own (no team caps, which change as each round adds clusters) get
    their figures together (`refresh_many`) and their rounds together where nothing is to
    decide (`autoscaler.quiet_rounds`); the others one by one, as a submit does."""
    ids = set(Pool.objects.filter(state=Pool.State.ACTIVE).values_list("pk", flat=True))
    ids |= set(
        Cluster.objects.filter(pool__isnull=False, state__in=autoscaler.LIVE).values_list(
            "pool_id", flat=True
        )
    )
    book = billing.rate_book()
    pools = list(Pool.objects.filter(pk__in=ids).select_related("owner"))
    own = [p for p in pools if caps.own_account(p.owner_id, p.created_by_id)]
    alone = [p for p in pools if not caps.own_account(p.owner_id, p.created_by_id)]
    try:
        refresh_many(own, book=book)
        rounds = autoscaler.quiet_rounds([p.pk for p in own])
    except Exception:  # one pool's trouble must not stop the other pools' rounds
        log.exception("pools: no joint round, one round each")
        alone = pools
    else:
        for pk in rounds:
            try:
                autoscaler.pool_scale(pk)
            except Exception:
                log.exception("pool %s: no round", pk)
    for pool in alone:
        try:
            refresh(pool, book=book)
            autoscaler.pool_scale(pool.pk)
        except Exception:  # one pool's trouble must not stop the other pools' rounds
            log.exception("pool %s: no round", pool.pk)
    autoscaler.prune_samples()
    sweeps.tick()
    return len(ids)


def refresh_many(pools: list[Pool], *, book) -> None:
    """`refresh` of pools whose maker is their owner (no team caps to apply), with one
    query per figure for all of them, and one UPDATE of the rows whose figures changed."""
    if not pools:
        return
    spent = billing.charged_for_pools(p.pk for p in pools)
    balances = billing.balances_of({p.owner_id for p in pools})
    changed = []
    for pool in pools:
        figures = _figures(
            pool, book=book, spent=spent[pool.pk], balance=balances[pool.owner_id]
        )  # no query: no caps on one's own pools
        if any(getattr(pool, field) != value for field, value in figures.items()):
            for field, value in figures.items():
                setattr(pool, field, value)
            changed.append(pool)
    Pool.objects.bulk_update(changed, FIGURES)


def submit(*, pool: Pool, spec: services.JobSpec, by=None) -> Job:
    """A job onto the pool, with the money figures fresh (page, API, command line); refused
    in words when `by` (who submits; default the pool's maker) is past their own monthly
    budget in the team, or the pool needs a cluster its maker's caps refuse."""
    with transaction.atomic():
        refresh(pool)
        if why := caps.submitter_refusal(pool, by or pool.created_by):
            raise ValidationError(why)  # the submitter's own budget, in its own words
        if autoscaler.blocked(pool) is not None and (why := caps.pool_refusal(pool, by=by)):
            raise ValidationError(why)  # the maker's cap, in its own words
        return autoscaler.pool_submit(pool=pool, spec=spec)


def sweep_create(*, owner, pool: Pool, spec, created_by=None) -> object:
    """A sweep on the pool (page, API), with the money figures fresh; refused in words when
    the one who starts it (`created_by`; default the pool's maker) is past their own
    monthly budget in the team, or its trials would pass the caps of the pool's maker
    (billing.caps)."""
    refresh(pool)
    if why := caps.submitter_refusal(pool, created_by or pool.created_by):
        raise ValidationError(why)
    if why := caps.pool_refusal(pool, by=created_by):
        raise ValidationError(why)
    return sweeps.sweep_create(owner=owner, pool=pool, spec=spec, created_by=created_by)
