# ruff: noqa: F811 (make_pool, imported from test_projections, is the tests' argument)
"""Issue 44 review, item 11: the projections of a sweep and of a pool, and the budgets'
watch of a sweep, read the database a fixed number of times however many trials or jobs
they have (the pool and sweep pages poll them live; the watch runs every accrual tick)."""

from __future__ import annotations

from decimal import Decimal

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from test_projections import (  # noqa: F401 (make_pool: the fixture)
    _fill,
    _said,
    make_pool,  # noqa: F401 (the fixture)
)

from billing import budgets, projections
from jobs.models import Sweep
from jobs.pools import sweeps

pytestmark = pytest.mark.django_db


def _queries(fn) -> int:
    with CaptureQueriesContext(connection) as seen:
        fn()
    return len(seen.captured_queries)


def _sweep(pool, alice, name, parallel):
    spec = sweeps.SweepSpec(
        name=name, command="python train.py", space=sweeps.parse_space("x: uniform 0 1"),
        metric="val_loss", trials=12, parallel=parallel, min_steps=5, budget=Decimal("500"),
    )  # fmt: skip
    sweep = sweeps.sweep_create(owner=alice, pool=pool, spec=spec)
    trials = list(sweep.trial_set.order_by("number"))
    assert len(trials) == parallel
    for i, t in enumerate(trials[:-1]):  # the last one still running (its job waits)
        _fill(t, state="pruned" if i % 2 else "complete", steps=40 if i % 2 == 0 else 20,
              seconds=400)  # fmt: skip
    return Sweep.objects.select_related("pool").get(pk=sweep.pk)


def test_a_sweeps_projection_and_budget_watch_read_as_often_for_2_trials_as_for_8(make_pool, alice):
    few = _sweep(make_pool("a"), alice, "few", 2)
    many = _sweep(make_pool("b"), alice, "many", 8)
    for judge in (
        lambda s: projections.sweep_projection(s),
        lambda s: projections.sweep_figures(s),
        lambda s: budgets.check_sweep(s),
    ):
        small = _queries(lambda judge=judge: judge(few))
        assert _queries(lambda judge=judge: judge(many)) == small, judge
    assert projections.sweep_projection(many)["trial_cost"] is not None


def test_a_pools_projection_reads_as_often_for_1_job_as_for_5(make_pool, alice):
    few = _sweep(make_pool("a"), alice, "few", 2)
    many = _sweep(make_pool("b"), alice, "many", 6)
    small = _queries(lambda: projections.pool_projection(few.pool))
    assert _queries(lambda: projections.pool_projection(many.pool)) == small
    # Its waiting job (the trial not placed) is named, not priced.
    said = projections.pool_projection(many.pool)["words"]
    assert _said(said, "en") == "No job is running in it; 1 queued jobs not counted"
