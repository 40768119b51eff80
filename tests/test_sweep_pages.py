"""Sweep pages and API (issue 26): the form and the API refuse a malformed search space or
metric with the engine's sentence; a sweep's page shows its best trial, what pruning
saved and its charts' data; bob reaches none of alice's sweeps and cannot start one on
her pool. No trial runs here: the trials' rows are filled in as the engine would
(tests/test_sweeps.py runs real ones)."""

import json
import os
from datetime import timedelta

import pytest
from browsing import login
from conftest import TEST_IMAGE
from django.test import Client
from django.utils import timezone

from console import pools as console_pools
from console.models import ApiToken
from jobs.clusters.services import ClusterSpec
from jobs.models import Image, Job, Replica, Sweep, Trial
from jobs.placement import scheduler
from jobs.pools import autoscaler, sweeps

pytestmark = pytest.mark.django_db
SHOTS = os.environ.get("SUANLI_SCREENSHOTS", "/tmp")

SPACE = "lr: log_uniform 1e-4 1e-1\nlayers: int 1 8\nopt: categorical adam sgd"


@pytest.fixture
def make_pool(catalog, priced, alice, storage_root):
    """A pool of one 1-GPU A100 cluster; no host is needed, since no trial is placed."""

    def make(owner=None, name="train"):
        shape = ClusterSpec(
            name="",
            nodes=1,
            gpu_model=catalog["a100-80gb"],
            gpus_per_node=1,
            image=Image.objects.get(reference=TEST_IMAGE),
        )
        pool = autoscaler.pool_create(
            owner=owner or alice, spec=autoscaler.PoolSpec(name=name, cluster=shape)
        )
        return console_pools.refresh(pool)

    return make


def client_of(user):
    client = Client()
    client.force_login(user)
    return client


def api_of(user):
    _, token = ApiToken.issue(user=user, name="script")
    client = Client(HTTP_AUTHORIZATION=f"Bearer {token}")

    def call(method, path, body=None):
        if method == "GET":
            response = client.get(f"/api/v1/{path}")
        else:
            response = client.post(
                f"/api/v1/{path}", data=json.dumps(body or {}), content_type="application/json"
            )
        return response.status_code, response.json()

    return call


def form_data(pool, **extra):
    data = {
        "name": "lr-search", "pool": pool.pk, "command": "python train.py", "env": "",
        "workdir": "/workspace", "space": SPACE, "metric": "val_loss", "direction": "minimize",
        "trials": 4, "parallel": 4, "pruner": "asha", "min_steps": 5,
    }  # fmt: skip
    data.update(extra)
    return data


def _fill(trial, *, state, curve, seconds, note=""):
    """What the engine would have written: the curve read, the state, the job's times."""
    now = timezone.now()
    values = [v for _s, v in curve]
    Trial.objects.filter(pk=trial.pk).update(
        state=state, curve=curve, last_step=curve[-1][0], last_value=values[-1],
        best_value=min(values), note=note,
    )  # fmt: skip
    Job.objects.filter(pk=trial.job_id).update(
        state=Job.State.SUCCEEDED if state == Trial.State.COMPLETE else Job.State.CANCELLED,
        started_at=now - timedelta(seconds=seconds),
        finished_at=now,
    )
    ran(trial.job_id, now - timedelta(seconds=seconds), now)  # what billing prices


def ran(job_id: int, started, finished) -> None:
    """Its attempt 1's container on its (pool's) cluster from `started` to `finished`: what
    billing prices as its cost (the pool's cluster placed on the paper host first)."""
    job = Job.objects.select_related("cluster").get(pk=job_id)
    if not job.cluster.node_set.exists():
        scheduler.place_pending()
    node = job.cluster.node_set.get()
    Replica.objects.create(
        job=job, attempt=1, rank=0, node=node, host=node.host,
        container_name=f"projection-test-{job.pk}-1-0", state=Replica.State.EXITED,
        started_at=started, finished_at=finished,
    )  # fmt: skip


@pytest.fixture
def filled_sweep(make_pool, alice, paper_host):
    """Four trials: two ran to step 40 (400 s each), two were pruned at steps 10 and 20
    (100 s and 200 s), one of those with a note of a malformed metric line."""
    pool = make_pool()
    spec = sweeps.SweepSpec(
        name="lr-search", command="python train.py", space=sweeps.parse_space(SPACE),
        metric="val_loss", trials=4, parallel=4, min_steps=5,
    )  # fmt: skip
    sweep = sweeps.sweep_create(owner=alice, pool=pool, spec=spec)
    t0, t1, t2, t3 = sweep.trial_set.order_by("number")
    assert all(t.job_id for t in (t0, t1, t2, t3))
    _fill(t0, state="complete", curve=[[10, 0.9], [20, 0.6], [30, 0.5], [40, 0.45]], seconds=400)
    _fill(t1, state="complete", curve=[[10, 0.8], [20, 0.5], [30, 0.35], [40, 0.3]], seconds=400)
    _fill(t2, state="pruned", curve=[[10, 1.2]], seconds=100)
    _fill(
        t3, state="pruned", curve=[[10, 1.0], [20, 0.95]], seconds=200,
        note="log line 7: not a JSON object after SUANLI_METRIC",
    )  # fmt: skip
    return sweep


# -- the form and the API refuse a malformed space or metric ----------------------------------

MALFORMED = [
    ({"space": "x: normal 1 2"}, "space", "the type must be one of"),
    ({"space": "x: uniform 2 1"}, "space", "low must be below high"),
    ({"space": "x: log_uniform 0 1"}, "space", "a log-uniform range must be above 0"),
    ({"space": '[{"name": "x", "type": "uniform", "low": 0'}, "space", "not valid JSON"),
    ({"space": "x: uniform 0 1\nX: int 1 2"}, "space", "Parameter X is named twice"),
    ({"metric": "val loss"}, "metric", "The metric is the name of a number"),
    ({"metric": "step"}, "metric", "The metric is the name of a number"),
    ({"trials": 2, "parallel": 3}, "parallel", "between 1 and the number of trials"),
]


@pytest.mark.parametrize(("change", "field", "says"), MALFORMED)
def test_the_form_shows_what_is_wrong_with_the_space_or_metric(
    make_pool, alice, change, field, says
):
    pool = make_pool()
    response = client_of(alice).post("/sweeps/new/", form_data(pool, **change))
    assert response.status_code == 200
    html = response.content.decode()
    assert f'id="field-{field}"' in html and says in html, html[:400]
    errors = response.context["form"].errors
    assert field in errors and says in " ".join(errors[field])
    assert not Sweep.objects.exists()


@pytest.mark.parametrize(("change", "field", "says"), MALFORMED)
def test_the_api_refuses_a_malformed_space_or_metric_with_its_sentence(
    make_pool, alice, change, field, says
):
    pool = make_pool()
    body = form_data(pool, **change)
    body.pop("env")
    status, answer = api_of(alice)("POST", "sweeps", body)
    assert status == 400, answer
    assert says in answer["error"] and says in " ".join(answer["fields"][field])
    assert not Sweep.objects.exists()


def test_the_api_takes_a_json_space_and_refuses_a_bad_one(make_pool, alice):
    pool = make_pool()
    api = api_of(alice)
    bad = [{"name": "lr", "type": "log_uniform", "low": -1, "high": 1}]
    status, answer = api(
        "POST", "sweeps", {"pool": pool.pk, "command": "true", "metric": "loss", "space": bad}
    )
    assert status == 400 and "a log-uniform range must be above 0" in answer["error"]
    space = [{"name": "lr", "type": "log_uniform", "low": 1e-4, "high": 0.1}]
    status, answer = api(
        "POST", "sweeps",
        {"pool": pool.pk, "command": "true", "metric": "loss", "space": space, "trials": 3},
    )  # fmt: skip
    assert status == 201, answer
    assert answer["space"] == space and answer["trials"] == 3 and answer["state"] == "running"
    assert len(answer["trial_list"]) == 1  # one at a time by default
    assert answer["trial_list"][0]["params"]["lr"] > 0


def test_the_form_starts_a_sweep_and_goes_to_its_page(make_pool, alice):
    pool = make_pool()
    response = client_of(alice).post("/sweeps/new/", form_data(pool, env="EPOCHS=3"))
    sweep = Sweep.objects.get()
    assert response.status_code == 302 and response["Location"] == f"/sweeps/{sweep.pk}/"
    assert sweep.env == {"EPOCHS": "3"} and sweep.trial_set.count() == 4
    assert sweep.space[0] == {"name": "lr", "type": "log_uniform", "low": 1e-4, "high": 0.1}


def test_the_form_documents_the_metric_line_and_says_when_there_is_no_pool(make_pool, alice, bob):
    page = client_of(bob).get("/sweeps/new/").content.decode()
    assert 'data-testid="no-pools"' in page and 'href="/pools/new/"' in page
    make_pool()
    page = client_of(alice).get("/sweeps/new/").content.decode()
    assert 'SUANLI_METRIC {"step": 100, "val_loss": 0.41}' in page
    for words in ("SUANLI_PARAM_LR", "SUANLI_PARAMS_FILE", "SIGTERM"):
        assert words in page


# -- the sweep's page ------------------------------------------------------------------------


def test_the_page_highlights_the_best_trial_and_says_what_pruning_saved(filled_sweep, alice):
    response = client_of(alice).get(f"/sweeps/{filled_sweep.pk}/")
    assert response.status_code == 200
    html = response.content.decode()
    best = filled_sweep.trial_set.get(number=1)  # val_loss 0.3, the lowest complete one
    rows = {r["t"].number: r for r in response.context["rows"]}
    assert rows[1]["best"] and not any(rows[n]["best"] for n in (0, 2, 3))
    assert f'<tr data-trial="{best.number}" class="best">' in html
    assert html.count('data-testid="best-badge"') == 1
    # 400 + 400 + 100 + 200 s used; the pruned ones would have run 400 s each to step 40.
    assert (
        "Pruning saved <strong>500 GPU-seconds</strong> (31 %) and <strong>¥1.08</strong> "
        "against running all 4 trials to step 40." in html
    ), html
    note = html.split('<tr data-trial="3">')[1].split("</tr>")[0]
    assert 'data-testid="trial-note">log line 7: not a JSON object after SUANLI_METRIC<' in note
    assert f'href="/jobs/{best.job_id}/"' in html
    assert 'hx-trigger="every 5s"' in html  # running: the live part polls


def test_the_chart_data_has_a_curve_per_trial_and_a_parcoords_axis_per_parameter(
    filled_sweep, alice
):
    client = client_of(alice)
    page = client.get(f"/sweeps/{filled_sweep.pk}/")
    data = page.context["charts"]
    assert client.get(f"/sweeps/{filled_sweep.pk}/data.json").json() == json.loads(json.dumps(data))
    curves = {c["number"]: c for c in data["curves"]}
    assert curves[1]["best"] and curves[1]["steps"] == [10, 20, 30, 40]
    assert curves[1]["values"] == [0.8, 0.5, 0.35, 0.3]
    assert curves[2]["state"] == "pruned" and curves[2]["steps"] == [10]
    dims = {d["label"]: d for d in data["parcoords"]["dimensions"]}
    assert list(dims) == ["lr (log10)", "layers", "opt", "val_loss"]
    assert dims["opt"]["ticktext"] == ["adam", "sgd"] and dims["opt"]["tickvals"] == [0, 1]
    assert set(dims["opt"]["values"]) <= {0, 1}
    assert dims["lr (log10)"]["range"] == [-4, -1]
    assert all(-4 <= v <= -1 for v in dims["lr (log10)"]["values"])
    assert dims["layers"]["range"] == [1, 8]
    assert dims["val_loss"]["values"] == [0.45, 0.3, 1.2, 0.95]
    assert data["parcoords"]["trials"] == [0, 1, 2, 3]
    assert 'id="sweep-data"' in page.content.decode()


def test_the_savings_say_plainly_when_nothing_completed_or_nothing_was_pruned(filled_sweep, alice):
    client = client_of(alice)
    Trial.objects.filter(sweep=filled_sweep, state="complete").update(state="running")
    html = client.get(f"/sweeps/{filled_sweep.pk}/live/").content.decode()
    assert 'data-kind="waiting"' in html and "No trial has run to its end yet" in html
    Trial.objects.filter(sweep=filled_sweep).update(state="complete")
    html = client.get(f"/sweeps/{filled_sweep.pk}/live/").content.decode()
    assert 'data-kind="none"' in html and "Nothing was pruned: the 4 trials ran" in html


def test_the_list_shows_trials_done_best_value_and_saved_gpu_seconds(filled_sweep, alice):
    html = client_of(alice).get("/sweeps/").content.decode()
    assert f'href="/sweeps/{filled_sweep.pk}/"' in html
    assert "4 / 4" in html and "0.3 <" in html and "500 GPU-s" in html


def test_cancelling_stops_the_running_trials(make_pool, alice):
    pool = make_pool()
    client_of(alice).post("/sweeps/new/", form_data(pool, trials=3, parallel=2))
    sweep = Sweep.objects.get()
    response = client_of(alice).post(f"/sweeps/{sweep.pk}/cancel/")
    assert response.status_code == 302
    sweep.refresh_from_db()
    assert sweep.state == "cancelled"
    assert not Job.objects.filter(trial__sweep=sweep, state="queued").exists()
    html = client_of(alice).get(f"/sweeps/{sweep.pk}/").content.decode()
    assert 'data-testid="cancel-sweep"' not in html and "every 5s" not in html


def test_the_api_shows_trials_best_and_savings(filled_sweep, alice):
    api = api_of(alice)
    status, listing = api("GET", "sweeps")
    assert status == 200 and listing["count"] == 1
    row = listing["sweeps"][0]
    assert (
        row["trials_done"] == 4 and row["best_value"] == 0.3 and row["pool"] == filled_sweep.pool_id
    )
    status, one = api("GET", f"sweeps/{filled_sweep.pk}")
    assert status == 200 and one["best_trial"] == 1
    assert [t["points"] for t in one["trial_list"]] == [4, 4, 1, 2]
    s = one["savings"]
    assert s["unit"] == "GPU" and s["pruned"] == 2 and s["full_steps"] == 40
    assert round(s["saved_unit_seconds"]) == 500 and s["saved_cost"] == "1.08"
    status, cancelled = api("POST", f"sweeps/{filled_sweep.pk}/cancel")
    assert status == 200 and cancelled["state"] == "cancelled"


# -- bob reaches none of it ------------------------------------------------------------------


def test_bob_gets_404_on_every_one_of_alices_sweep_urls(filled_sweep, bob):
    client = client_of(bob)
    for url in ("", "live/", "data.json"):
        assert client.get(f"/sweeps/{filled_sweep.pk}/{url}").status_code == 404
    assert client.post(f"/sweeps/{filled_sweep.pk}/cancel/").status_code == 404
    assert f"/sweeps/{filled_sweep.pk}/" not in client.get("/sweeps/").content.decode()
    api = api_of(bob)
    assert api("GET", f"sweeps/{filled_sweep.pk}")[0] == 404
    assert api("POST", f"sweeps/{filled_sweep.pk}/cancel")[0] == 404
    assert api("GET", "sweeps")[1]["count"] == 0
    filled_sweep.refresh_from_db()
    assert filled_sweep.state == "running"


def test_bob_cannot_start_a_sweep_on_alices_pool(filled_sweep, make_pool, bob):
    alices = filled_sweep.pool
    response = client_of(bob).post("/sweeps/new/", form_data(alices))
    assert response.status_code == 200  # bob has no pool: the form says so
    make_pool(owner=bob, name="bobs")
    response = client_of(bob).post("/sweeps/new/", form_data(alices))
    assert "pool" in response.context["form"].errors
    status, answer = api_of(bob)("POST", "sweeps", {**form_data(alices), "env": None})
    assert status == 404 and answer["error"] == "No such pool."
    assert Sweep.objects.filter(owner=bob).count() == 0


# -- how it looks ----------------------------------------------------------------------------


def test_screenshot_of_a_sweep_page(filled_sweep, live_server, page):
    login(page, live_server, "alice", "alice-pass-123")
    page.goto(f"{live_server.url}/sweeps/{filled_sweep.pk}/")
    page.wait_for_selector("#sweep-curves .main-svg")
    page.wait_for_selector("#sweep-parcoords .main-svg")
    assert page.locator("tr.best").count() == 1
    page.screenshot(path=f"{SHOTS}/sweep-page.png", full_page=True)
