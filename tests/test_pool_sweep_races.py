"""Races and lost state in pools and sweeps (issue 26), each found by a review and fixed:
a dispatch between the idle check and the release, a budget with no price, a starting
cluster whose job ran elsewhere, a prune racing the job's end, Redis losing the log, a
sweep whose pool was closed."""

import threading
from datetime import timedelta

import optuna
import pytest
from django.core.exceptions import ValidationError
from django.db import connection
from django.utils import timezone
from test_pools import drive, hosts, live, make_pool  # noqa: F401 (fixtures)

from jobs.base import logstore
from jobs.clusters import services
from jobs.clusters.services import JobSpec
from jobs.models import Job, Pool, Sweep, Trial
from jobs.pools import autoscaler, sweeps
from jobs.runs import livelogs

pytestmark = pytest.mark.django_db


def _sweep(alice, pool, **kw):
    spec = dict(
        name="quad",
        command="sleep 60",
        space=sweeps.parse_space("x: uniform 0 6"),
        metric="loss",
        trials=3,
        parallel=1,
        pruner=Sweep.Pruner.ASHA,
        min_steps=1,
    )
    spec.update(kw)
    return sweeps.sweep_create(owner=alice, pool=pool, spec=sweeps.SweepSpec(**spec))


def _say(job_id, *lines):
    """Lines as the live log follower keeps them (rank 0, a timestamp)."""
    return logstore.append(
        logstore.connect(),
        livelogs._key(job_id),
        [f"0\t2025-01-01T00:00:00Z {line}" for line in lines],
        keep=livelogs.LINES_KEPT,
        ttl=livelogs.KEEP_S,
        counter_ttl=livelogs.COUNTER_S,
    )


# -- pools --------------------------------------------------------------------------------------


def test_idle_release_spares_a_job_moved_onto_the_cluster_meanwhile(make_pool, monkeypatch):  # noqa: F811
    """_shrink reads 'idle' without the cluster's lock; a dispatch that moves the pool's
    waiting job onto that cluster and commits before the release takes the lock must
    not have its job stopped: the release checks again under the lock."""
    pool = make_pool(min_clusters=0, max_clusters=1, idle_minutes=1)
    services.cluster_create(owner=pool.owner, spec=autoscaler.cluster_spec(pool, "train-1"))
    drive(pool, lambda: any(c.state == "running" for c in live(pool)))
    real = autoscaler._jobless
    moved = {}

    def read_then_a_dispatch(cluster):
        idle = real(cluster)
        if not moved:  # the unlocked read; then dispatch.dispatch commits a job onto it
            job = services.job_submit(
                cluster=cluster, spec=JobSpec(name="x", command="true"), pool=pool
            )
            Job.objects.filter(pk=job.pk).update(state=Job.State.RUNNING, attempt=1)
            moved["job"] = job.pk
        return idle

    monkeypatch.setattr(autoscaler, "_jobless", read_then_a_dispatch)
    autoscaler.pool_scale(pool.pk, now=timezone.now() + timedelta(minutes=2))
    job = Job.objects.get(pk=moved["job"])
    assert not job.cancel_requested, (job.state, job.state_reason)
    assert len(live(pool)) == 1


def test_a_budget_per_hour_holds_when_the_shape_has_no_price(make_pool):  # noqa: F811
    """A budget per hour and no price to check it against: no cluster is added (and
    blocked() says so)."""
    pool = make_pool(min_clusters=0, max_clusters=3)
    Pool.objects.filter(pk=pool.pk).update(budget_per_hour="1.00", rate_per_hour=None)
    pool.refresh_from_db()
    assert autoscaler.blocked(pool) is not None  # "a budget ... pays for 0"
    for i in range(3):
        try:
            autoscaler.pool_submit(pool=pool, spec=JobSpec(name=f"j{i}", command="sleep 30"))
        except ValidationError:
            pass  # what it should say: no cluster, and none may be added
    autoscaler.pool_scale(pool.pk)
    assert len(live(pool)) == 0, [e.message for e in pool.events.all()]


def test_a_starting_cluster_whose_job_ran_elsewhere_goes_at_once(make_pool):  # noqa: F811
    """A cluster added for a waiting job is still starting when a pool cluster that became
    free first takes the job: with nothing left waiting it is released at once, not
    placed and charged for idling until its idle minutes pass."""
    pool = make_pool(min_clusters=0, max_clusters=2, idle_minutes=10)
    services.cluster_create(owner=pool.owner, spec=autoscaler.cluster_spec(pool, "train-1"))
    drive(pool, lambda: any(c.state == "running" for c in live(pool)))
    a = live(pool)[0]
    busy = services.job_submit(cluster=a, spec=JobSpec(name="busy", command="true"), pool=pool)
    Job.objects.filter(pk=busy.pk).update(state=Job.State.RUNNING, attempt=1)
    x = autoscaler.pool_submit(pool=pool, spec=JobSpec(name="x", command="true"))
    autoscaler.pool_scale(pool.pk)
    added = [c for c in live(pool) if c.pk != a.pk]
    assert len(added) == 1 and added[0].state == "pending"
    # A's job ends; A's dispatch takes x (the pool's oldest waiting job).
    Job.objects.filter(pk=busy.pk).update(state=Job.State.SUCCEEDED, finished_at=timezone.now())
    Job.objects.filter(pk=x.pk).update(cluster=a, state=Job.State.RUNNING, attempt=1)
    autoscaler.pool_scale(pool.pk, now=timezone.now() + timedelta(seconds=30))
    assert added[0].pk not in [c.pk for c in live(pool)], "surplus starting cluster kept"


# -- sweeps -------------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)  # a racing thread, its own connection
def test_a_prune_racing_the_jobs_end_still_settles_the_trial(
    make_pool,  # noqa: F811
    alice,
    monkeypatch,
):
    """_report tells Optuna PRUNED (its own connection: committed at once), then the
    job's cancel finds it ended meanwhile: the trial is pruned all the same, and its
    job's end (and cron's safety net) leave it so, without an error."""
    pool = make_pool(min_clusters=0, max_clusters=1)
    sweep = _sweep(alice, pool)
    trial = Trial.objects.get(sweep=sweep)
    _say(trial.job_id, 'SUANLI_METRIC {"step": 1, "loss": 5}')
    monkeypatch.setattr(optuna.trial.Trial, "should_prune", lambda self: True)
    real_cancel = services.job_cancel

    def job_ends_meanwhile(*, job, by):
        # The job's last container exits (settle.finish in another process, committed).
        def finish():
            Job.objects.filter(pk=job.pk).update(
                state=Job.State.SUCCEEDED, finished_at=timezone.now()
            )
            connection.close()

        t = threading.Thread(target=finish)
        t.start()
        t.join()
        return real_cancel(job=job, by=by)

    monkeypatch.setattr(sweeps.services, "job_cancel", job_ends_meanwhile)
    sweeps.observe(trial.job_id)  # the race: "Job ... has ended; nothing to cancel"
    monkeypatch.undo()
    trial.refresh_from_db()
    assert trial.state == Trial.State.PRUNED
    study = sweeps.study_of(sweep)
    assert study.trials[trial.number].state == optuna.trial.TrialState.PRUNED
    sweeps.job_ended(trial.job_id)
    sweeps.tick()
    trial.refresh_from_db()
    assert trial.state == Trial.State.PRUNED
    # Our row behind Optuna's (a worker that died between the two): settled from Optuna.
    Trial.objects.filter(pk=trial.pk).update(state=Trial.State.RUNNING)
    sweeps.job_ended(trial.job_id)
    trial.refresh_from_db()
    assert trial.state == Trial.State.PRUNED


def test_metric_lines_after_redis_lost_the_log_are_read(make_pool, alice):  # noqa: F811
    """Redis restarted without its data numbers the log from 1 again (as the stored-log
    fallback does): the lines are read all the same (a step already reported is not)."""
    pool = make_pool(min_clusters=0, max_clusters=1)
    sweep = _sweep(alice, pool, pruner=Sweep.Pruner.NONE)
    trial = Trial.objects.get(sweep=sweep)
    _say(trial.job_id, *[f"noise {i}" for i in range(50)], 'SUANLI_METRIC {"step": 1, "loss": 5}')
    sweeps.observe(trial.job_id)
    trial.refresh_from_db()
    assert trial.log_seq == 51 and trial.last_step == 1
    conn = logstore.connect()
    key = livelogs._key(trial.job_id)
    conn.delete(key, f"{key}:seq", f"{key}:marks")  # Redis restarted without its data
    _say(trial.job_id, 'SUANLI_METRIC {"step": 2, "loss": 1}')
    sweeps.observe(trial.job_id)
    trial.refresh_from_db()
    assert trial.last_step == 2, (trial.log_seq, trial.last_step, trial.curve)


def test_a_sweep_on_a_closed_pool_finishes(make_pool, alice):  # noqa: F811
    """Closing the pool cancels the trial's waiting job; with no trial able to start
    again, the sweep finishes (it is not advanced for ever) and says why."""
    pool = make_pool(min_clusters=0, max_clusters=1)
    sweep = _sweep(alice, pool, trials=3)
    trial = Trial.objects.get(sweep=sweep)
    autoscaler.pool_close(pool=pool)
    assert Job.objects.get(pk=trial.job_id).state == Job.State.CANCELLED
    sweeps.job_ended(trial.job_id)
    sweeps.tick()
    sweep.refresh_from_db()
    assert sweep.state == Sweep.State.FINISHED, (sweep.state, sweep.note)
    assert "pool train is closed" in sweep.note
