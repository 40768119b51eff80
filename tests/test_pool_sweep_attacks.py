"""Pools and sweeps (issue 26) as an attacker uses them: a researcher with the form, the API
and a shell in their own trials. Each test states what must hold (several were first
written as proofs of flaws found in review, and pass since their fixes).
No trial runs here: the metric lines are handed to `sweeps.observe` as the log would."""

import json

import pytest
from conftest import TEST_IMAGE
from django.core.exceptions import ValidationError
from django.test import Client
from test_pools import hosts  # noqa: F401 (fixture: the pool form's fit check needs hosts)

from billing.models import Account
from console import pools as console_pools
from console.forms import PoolForm, check_funds
from console.models import ApiToken
from jobs.clusters.services import ClusterSpec, JobSpec
from jobs.models import Cluster, Image, Pool, Sweep, Trial
from jobs.pools import autoscaler, sweeps

pytestmark = pytest.mark.django_db


@pytest.fixture
def make_pool(catalog, priced, alice, storage_root):
    """A pool of 1-GPU A100 clusters; no host is needed (nothing is placed)."""

    def make(owner=None, name="train", **fields):
        shape = ClusterSpec(
            name="",
            nodes=1,
            gpu_model=catalog["a100-80gb"],
            gpus_per_node=1,
            image=Image.objects.get(reference=TEST_IMAGE),
        )
        spec = autoscaler.PoolSpec(name=name, cluster=shape, **fields)
        return console_pools.refresh(autoscaler.pool_create(owner=owner or alice, spec=spec))

    return make


def client_of(user):
    client = Client(raise_request_exception=False)
    client.force_login(user)
    return client


def api_of(user):
    _, token = ApiToken.issue(user=user, name="script")
    client = Client(HTTP_AUTHORIZATION=f"Bearer {token}", raise_request_exception=False)

    def post(path, body):
        r = client.post(f"/api/v1/{path}", data=json.dumps(body), content_type="application/json")
        return r.status_code, r.content.decode()

    return post


def start_sweep(owner, pool, *, name="s", space="x: uniform 0 1", metric="loss"):
    spec = sweeps.SweepSpec(
        name=name, command="true", space=sweeps.parse_space(space), metric=metric,
        trials=2, parallel=1, pruner=Sweep.Pruner.NONE,
    )  # fmt: skip
    return sweeps.sweep_create(owner=owner, pool=pool, spec=spec)


def metric_lines(monkeypatch, by_job: dict):
    """What the live log keeps: numbered `rank\\tts text` lines, per job id."""
    monkeypatch.setattr(
        sweeps.livelogs,
        "lines",
        lambda job: [
            (i, f"0\t2026-01-01T00:00:00Z {text}") for i, text in enumerate(by_job[job.pk], 1)
        ],
    )


# -- the search space: what the form and the API take ------------------------------------------


def test_a_bound_too_large_for_a_float_is_refused_with_a_sentence():
    space = json.dumps([{"name": "x", "type": "uniform", "low": 0, "high": 10**400}])
    with pytest.raises(ValidationError):
        sweeps.parse_space(space)


def test_the_api_answers_400_not_500_to_a_huge_bound(make_pool, alice):
    pool = make_pool()
    space = [{"name": "x", "type": "int", "low": 0, "high": 10**400}]
    status, _ = api_of(alice)(
        "sweeps", {"pool": pool.pk, "command": "true", "metric": "loss", "space": space}
    )
    assert status == 400
    assert not Sweep.objects.exists()


def test_a_parameter_name_is_one_word_without_a_trailing_newline():
    space = json.dumps([{"name": "x\n", "type": "uniform", "low": 0, "high": 1}])
    with pytest.raises(ValidationError):
        sweeps.parse_space(space)  # else the trial's env has a name SUANLI_PARAM_X\n


def test_a_choice_with_a_nul_character_is_refused_by_the_form(make_pool, alice):
    pool = make_pool()
    space = json.dumps([{"name": "opt", "type": "categorical", "choices": ["a\u0000b", "c"]}])
    response = client_of(alice).post(
        "/sweeps/new/",
        {
            "name": "s", "pool": pool.pk, "command": "true", "env": "", "workdir": "/workspace",
            "space": space, "metric": "loss", "direction": "minimize", "trials": 2,
            "parallel": 1, "pruner": "none", "min_steps": 1,
        },
    )  # fmt: skip
    assert response.status_code == 200  # the form again, with the sentence
    assert not Sweep.objects.exists()


def test_markup_in_a_choice_and_in_the_name_is_text_on_every_page(make_pool, alice):
    pool = make_pool()
    evil = "<img src=x onerror=alert(1)>"
    space = json.dumps([{"name": "opt", "type": "categorical", "choices": [evil]}])
    sweep = start_sweep(alice, pool, name=evil, space=space)
    client = client_of(alice)
    for url in (f"/sweeps/{sweep.pk}/", f"/sweeps/{sweep.pk}/live/", "/sweeps/"):
        html = client.get(url).content.decode()
        assert evil not in html, url
        assert "&lt;img src=x onerror=alert(1)&gt;" in html, url
    data = client.get(f"/sweeps/{sweep.pk}/data.json").json()
    # The JSON is data (JsonResponse, application/json); the chart draws it as Plotly text.
    assert data["parcoords"]["dimensions"][0]["ticktext"] == [evil]


# -- the metric line: a trial's own output -----------------------------------------------------


def test_a_step_beyond_32_bits_is_a_note_not_a_crash(make_pool, alice, monkeypatch):
    sweep = start_sweep(alice, make_pool())
    trial = sweep.trial_set.get()
    metric_lines(monkeypatch, {trial.job_id: ['SUANLI_METRIC {"step": 3000000000, "loss": 1}']})
    sweeps.observe(trial.job_id)  # raises sqlalchemy's DataError (integer out of range)
    trial.refresh_from_db()
    assert trial.log_seq == 1  # read, not read again and again


def test_one_researchers_poison_line_does_not_stop_anothers_sweep(
    make_pool, alice, bob, monkeypatch
):
    alices = start_sweep(alice, make_pool()).trial_set.get()
    bobs = start_sweep(bob, make_pool(owner=bob, name="bobs")).trial_set.get()
    metric_lines(
        monkeypatch,
        {
            alices.job_id: ['SUANLI_METRIC {"step": 3000000000, "loss": 1}'],
            bobs.job_id: ['SUANLI_METRIC {"step": 1, "loss": 0.5}'],
        },
    )
    try:
        sweeps.tick()
    finally:
        bobs.refresh_from_db()
    assert bobs.curve == [[1, 0.5]]


# -- money: a pool's clusters pass the balance check as a cluster does ---------------------------


def test_a_pool_adds_no_cluster_the_balance_does_not_pay_for(make_pool, alice, catalog):
    pool = make_pool(max_clusters=5)
    Account.objects.filter(user=alice).update(balance=0)
    funds = check_funds(
        alice, gpu_model=catalog["a100-80gb"], instance_type=None, units=1, spot=False
    )
    assert funds.short  # the cluster form and POST /clusters refuse alice now
    for n in range(5):
        try:
            console_pools.submit(pool=pool, spec=JobSpec(name=f"j{n}", command="true"))
        except ValidationError as refused:
            assert "does not cover 10 minutes of another cluster" in refused.messages[0]
    autoscaler.pool_scale(pool.pk)
    assert Cluster.objects.filter(pool=pool).count() == 0


@pytest.mark.parametrize("budget", ["1e30", "NaN", "Infinity", "-1", "0", "123456789012345678"])
def test_the_api_answers_400_to_a_budget_out_of_range(make_pool, alice, budget):
    make_pool()  # the rate card and the money
    status, body = api_of(alice)(
        "pools",
        {"name": "p2", "gpu_model": "a100-80gb", "gpus_per_node": 1, "budget_total": budget},
    )
    assert status in (400, 422), body
    assert not Pool.objects.filter(name="p2").exists()


def test_a_sweep_cannot_run_on_another_researchers_pool_by_form_or_api(make_pool, alice, bob):
    pool = make_pool()
    response = client_of(bob).post(
        "/sweeps/new/",
        {
            "name": "s", "pool": pool.pk, "command": "true", "env": "", "workdir": "/workspace",
            "space": "x: uniform 0 1", "metric": "loss", "direction": "minimize", "trials": 1,
            "parallel": 1, "pruner": "none", "min_steps": 1,
        },
    )  # fmt: skip
    assert response.status_code == 200 and "pool" in response.context["form"].errors
    status, _ = api_of(bob)(
        "sweeps", {"pool": pool.pk, "command": "true", "metric": "loss", "space": "x: uniform 0 1"}
    )
    assert status == 404
    assert not Sweep.objects.exists() and not Trial.objects.exists()
    # Nor through the engine itself.
    with pytest.raises(ValidationError):
        start_sweep(bob, pool)


@pytest.mark.usefixtures("hosts")
def test_the_pool_form_checks_the_balance_for_its_whole_minimum(make_pool, alice, catalog):
    """Fixed (console/forms.py PoolForm): min_clusters start at once, so the balance must
    cover them all, as for that many clusters made one by one; it checked one only."""
    make_pool(name="seed")  # the rate card
    funds = check_funds(
        alice, gpu_model=catalog["a100-80gb"], instance_type=None, units=1, spot=False
    )
    # Enough for one cluster's minutes, not for three.
    Account.objects.filter(user=alice).update(balance=funds.needed * 2)
    image = Image.objects.get(reference=TEST_IMAGE)

    def form(low):
        return PoolForm(
            {
                "name": f"p{low}", "resource": "gpu:a100-80gb", "nodes": 1, "gpus_per_node": 1,
                "image": str(image.pk), "network": "standard", "zone": "", "volumes": "",
                "min_clusters": low, "max_clusters": 3, "idle_minutes": 10,
                "budget_per_hour": "", "budget_total": "",
            },
            owner=alice,
        )  # fmt: skip

    assert form(1).is_valid(), form(1).errors
    refused = form(3)
    assert not refused.is_valid()
    assert "minimum of 3 clusters" in " ".join(refused.errors["min_clusters"])
    assert refused.funds_short


def test_a_flood_of_metric_lines_is_not_a_flood_of_database_writes(make_pool, alice, monkeypatch):
    sweep = start_sweep(alice, make_pool())
    trial = sweep.trial_set.get()
    lines = [f'SUANLI_METRIC {{"step": {s}, "loss": 1}}' for s in range(1, 2001)]
    metric_lines(monkeypatch, {trial.job_id: lines})
    writes = []
    real = sweeps.optuna.storages.RDBStorage.set_trial_intermediate_value

    def counted(self, *args, **kwargs):
        writes.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(sweeps.optuna.storages.RDBStorage, "set_trial_intermediate_value", counted)
    sweeps.observe(trial.job_id)
    trial.refresh_from_db()
    assert trial.last_step == 2000
    # One round of reading: a bounded number of writes (each opens a connection: NullPool).
    assert len(writes) <= 50, len(writes)
