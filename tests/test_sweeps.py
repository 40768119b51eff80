"""Sweeps (issue 26): Optuna trials of one command on a pool, on the real engines and the
Procfile's processes, each trial reporting its metric by SUANLI_METRIC lines in its log;
successive halving stops the bad ones early and their cluster takes the next trial."""

import json
import time

import pytest
from django.core.exceptions import ValidationError
from django.test import Client
from django.urls import reverse
from test_pools import hosts, make_pool  # noqa: F401 (fixtures)
from waiting import until

from billing.models import LedgerEntry
from jobs.models import Cluster, Job, Sweep, Trial
from jobs.pools import sweeps

STEPS = 12
# The objective: x from the trial's parameters; one step a second, the value falling
# towards (x - 3)^2 over its steps. busybox's sh has no floats: awk does the sums.
OBJECTIVE = (
    'cat "$SUANLI_PARAMS_FILE"; i=1; while [ $i -le ' + str(STEPS) + " ]; do "
    'awk -v x="$SUANLI_PARAM_X" -v s=$i \'BEGIN { printf "SUANLI_METRIC {\\"step\\": %d, '
    '\\"loss\\": %.6f}\\n", s, (x - 3) * (x - 3) + 8 / s }\'; sleep 1; i=$((i + 1)); done'
)


# -- the search space and the metric line, as written -----------------------------------------


def test_the_search_space_reads_lines_and_json():
    space = sweeps.parse_space(
        "x: uniform -5 10\nlr: log-uniform 1e-5 1e-1\nlayers: int 1 8\nopt: categorical adam sgd 3"
    )
    assert space == [
        {"name": "x", "type": "uniform", "low": -5.0, "high": 10.0},
        {"name": "lr", "type": "log_uniform", "low": 1e-5, "high": 0.1},
        {"name": "layers", "type": "int", "low": 1, "high": 8},
        {"name": "opt", "type": "categorical", "choices": ["adam", "sgd", 3]},
    ]
    assert sweeps.parse_space(json.dumps(space)) == space
    assert sweeps.parse_space(sweeps.space_text(space)) == space


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "at least one parameter"),
        ("x uniform 1 2", "write it as 'name: type low high'"),
        ("x: normal 1 2", "the type must be one of uniform, log_uniform, int, categorical"),
        ("x: uniform 2 1", "low must be below high"),
        ("x: uniform 1 nan", "must be a finite number"),
        ("x: uniform one 2", "x's low must be a number, not one"),
        ("x: log_uniform 0 1", "a log-uniform range must be above 0"),
        ("x: int 1.5 3", "an integer range needs whole numbers"),
        ("x: uniform 1", "uniform needs a low and a high"),
        ("x: categorical", "categorical needs 1 to 50 choices"),
        ("x: uniform 0 1\nX: int 1 2", "Parameter X is named twice"),
        ("1x: uniform 0 1", "the name must be letters, digits and _"),
        ('[{"name": "x", "type": "uniform", "low": 0', "not valid JSON"),
        ('[{"name": "x", "type": "uniform", "low": 0, "high": 1e999}]', "finite"),
        ('{"x": 1}', "The search space in JSON is a list"),
    ],
)
def test_a_malformed_search_space_says_what_is_wrong(text, says):
    with pytest.raises(ValidationError) as caught:
        sweeps.parse_space(text)
    assert says in " ".join(caught.value.messages)


def test_metric_lines():
    parse = sweeps.parse_metric_line
    assert parse('SUANLI_METRIC {"step": 100, "val_loss": 0.41}', "val_loss") == (100, 0.41)
    assert parse('epoch 3 SUANLI_METRIC {"val_loss": 1, "step": 0}', "val_loss") == (0, 1.0)
    assert parse("plain output", "val_loss") is None
    assert parse('SUANLI_METRIC {"step": 1, "acc": 0.9}', "val_loss") is None  # another metric
    for line, says in [
        ("SUANLI_METRIC {step: 1}", "not a JSON object"),
        ("SUANLI_METRIC [1, 2]", "not a JSON object"),
        ('SUANLI_METRIC {"step": -1, "val_loss": 1}', '"step" must be a whole number'),
        ('SUANLI_METRIC {"step": 1.5, "val_loss": 1}', '"step" must be a whole number'),
        ('SUANLI_METRIC {"step": 1, "val_loss": NaN}', "not a JSON object"),
        ('SUANLI_METRIC {"step": 1, "val_loss": "low"}', "must be a finite number"),
        ('SUANLI_METRIC {"step": 1, "val_loss": 1e999}', "must be a finite number"),
        ("SUANLI_METRIC " + "[" * 1_999, "not a JSON object"),
        ("SUANLI_METRIC " + "[" * 100_000, "the line is too long"),
    ]:
        with pytest.raises(sweeps.MetricLineError, match=says):
            parse(line, "val_loss")
    with pytest.raises(ValidationError):
        sweeps.validate_metric("step")
    with pytest.raises(ValidationError):
        sweeps.validate_metric("val loss; rm -rf /")


# -- a real sweep -----------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_successive_halving_stops_bad_trials_and_finds_x_near_3(
    make_pool,  # noqa: F811
    processes,
    alice,
    storage_root,
):
    env = {
        "SUANLI_STORAGE_ROOT": str(storage_root),
        "SUANLI_POOL_INTERVAL": "1",
        "SUANLI_PLACEMENT_INTERVAL": "1",
        "SUANLI_ACCRUAL_INTERVAL": "2",
        "SUANLI_RECONCILE_INTERVAL": "5",
        "SUANLI_HOST_CHECK_INTERVAL": "600",
    }
    processes.start("worker", "--worker-class", "console.rqworker.SimpleWorker", env=env)
    processes.start("watch", env=env)
    processes.start("logs", env=env)
    processes.start("cron", env=env)
    pool = make_pool(min_clusters=0, max_clusters=2, idle_minutes=30)
    sweep = sweeps.sweep_create(
        owner=alice,
        pool=pool,
        spec=sweeps.SweepSpec(
            name="quad",
            command=OBJECTIVE,
            space=sweeps.parse_space("x: uniform 0 6"),
            metric="loss",
            trials=8,
            parallel=2,
            pruner=Sweep.Pruner.ASHA,
            min_steps=2,
        ),
    )
    deadline = time.monotonic() + 180
    while Sweep.objects.get(pk=sweep.pk).state == Sweep.State.RUNNING:
        assert time.monotonic() < deadline, list(
            Trial.objects.filter(sweep=sweep).values_list("number", "state", "last_step", "note")
        )
        running = Job.objects.filter(pool=pool, state__in=Job.ACTIVE).count()
        assert running <= 2  # 2 at a time
        time.sleep(0.5)
    sweep.refresh_from_db()
    trials = list(sweep.trial_set.select_related("job"))
    assert len(trials) == 8
    states = [t.state for t in trials]
    assert "failed" not in states, (
        [(t.number, t.note, t.job.state_reason) for t in trials],
        trials[0].job.replicas.first().log[-1500:],
    )
    pruned = [t for t in trials if t.state == Trial.State.PRUNED]
    complete = [t for t in trials if t.state == Trial.State.COMPLETE]
    assert pruned and complete
    for t in pruned:  # ended before their full steps, by SIGTERM (the last one pruned may
        assert t.last_step < STEPS  # still be in its grace period as the sweep finishes)
        job = until(
            lambda t=t: (j := Job.objects.get(pk=t.job_id)).state in Job.ENDED and j,
            what=f"trial {t.number}'s job ended",
        )
        assert job.state == "cancelled" and "pruner at step" in job.state_reason
    for t in complete:
        assert t.last_step == STEPS and t.job.state == "succeeded"
        assert t.curve[0] == [1, pytest.approx((t.params["x"] - 3) ** 2 + 8, abs=1e-5)]
    # Each trial got its parameters in its environment and its JSON file.
    first = trials[0].job.replicas.get()
    assert json.dumps({"x": trials[0].params["x"]}) in first.log
    best = sweeps.figures(sweep).best
    assert abs(best.params["x"] - 3) < 1, [(t.params, t.state, t.last_value) for t in trials]
    # Pruning saved time: what ran is less than every trial's full length.
    figures = sweeps.figures(sweep)
    for t in trials:  # shown with -s: the sweep as it went
        print(
            t.number, t.state, f"x={t.params['x']:.3f}", t.last_step, t.last_value, t.job.cluster_id
        )
    print("used", figures.used_unit_seconds, "full", figures.full_unit_seconds)
    assert figures.used_unit_seconds < figures.full_unit_seconds
    assert figures.full_steps == STEPS
    # ...and the sweep's page says by how much.
    client = Client()
    client.force_login(alice)
    page = client.get(reverse("sweep_detail", args=[sweep.pk])).content.decode()
    saved = f"{figures.saved_unit_seconds:,.0f} GPU-seconds</strong> ({figures.saved_share * 100:.0f} %)"
    assert f"Pruning saved <strong>{saved}" in page, page
    assert f"against running all 8 trials to step {STEPS}" in page
    # Only the pool's two clusters ran all eight trials: no placement per trial.
    clusters = list(Cluster.objects.filter(pool=pool))
    assert len(clusters) == 2
    assert {t.job.cluster_id for t in trials} == {c.pk for c in clusters}
    # ...and they are charged like any cluster.
    until(  # an accrual round after the last trial (the cron's, every 2 s)
        lambda: all(LedgerEntry.objects.filter(cluster=c, kind="usage").exists() for c in clusters),
        what="both clusters charged",
    )
    for cluster in clusters:
        usage = LedgerEntry.objects.filter(cluster=cluster, kind="usage")
        assert usage.exists()
        assert sum(e.amount for e in usage) < 0
