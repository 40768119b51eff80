"""A finished job with a long history: its page sends each chart series decimated to what
a chart can show (the lowest and highest of each time bucket, so a one-second dip stays
visible), the diagnosis still reads every second, and zooming in fetches a time range at
full resolution from the job's metrics.json (the owner's only)."""

import json
import re
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from jobs.clusters import services
from jobs.clusters.services import JobSpec
from jobs.models import Job
from monitoring.models import Sample

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 1, 5, 10, 0, tzinfo=UTC)
SECONDS = 20_000
DIP_AT = 12_345  # the one second GPU 1 dropped to 3 %


def _finished_job(cluster, host, gpu_util) -> Job:
    """A job that ran SECONDS seconds from T0 on one node of two GPUs, with one stored
    sample a second; `gpu_util(i)` is second i's two GPUs' utilisation."""
    job = services.job_submit(cluster=cluster, spec=JobSpec(name="long", command="true"))
    Job.objects.filter(pk=job.pk).update(
        state=Job.State.SUCCEEDED,
        started_at=T0,
        finished_at=T0 + timedelta(seconds=SECONDS - 1),
    )
    job.refresh_from_db()
    Sample.objects.bulk_create(
        (
            Sample(
                at=T0 + timedelta(seconds=i), cluster=cluster, job=job, host=host,
                node_index=0, gpu_util=gpu_util(i), gpu_mem_mib=[40_000.0, 40_000.0],
                gpu_source="derived", cpu_pct=400.0, mem_bytes=2**34, net_rx_bps=1e6,
                net_tx_bps=1e6, disk_read_bps=0.0, disk_write_bps=0.0, read_iops=10.0,
                write_iops=0.0,
            )
            for i in range(SECONDS)
        ),
        batch_size=5_000,
    )  # fmt: skip
    return job


@pytest.fixture
def long_job(make_cluster, paper_host, alice):
    cluster = make_cluster(alice, "long", gpus=2)
    return _finished_job(cluster, paper_host, lambda i: [90.0, 3.0 if i == DIP_AT else 90.0])


@pytest.fixture
def owner(alice):
    client = Client()
    client.force_login(alice)
    return client


def _history(page: str) -> list[dict]:
    found = re.search(
        r'<script id="metrics-history" type="application/json">(.*?)</script>', page, re.S
    )
    return json.loads(found[1])


def _zoom(client, job, **query):
    return client.get(reverse("job_metrics", args=[job.pk]), query)


def test_the_page_keeps_a_one_second_dip_in_at_most_2000_points_a_series(long_job, owner):
    response = owner.get(reverse("job_detail", args=[long_job.pk]))
    assert response.status_code == 200
    page = response.content.decode()
    assert len(response.content) < 1_000_000  # was 5.8 MB with every second embedded
    history = _history(page)
    # One node: each sample is one point of every series (each GPU's, CPU, network, ...).
    assert 1_000 <= len(history) <= 2_100
    assert [s["t"] for s in history] == sorted(s["t"] for s in history)
    gpu1 = [s["gpu"][1] for s in history]
    assert min(gpu1) == 3.0  # the dip that lasted one second
    assert min(s["gpu"][0] for s in history) == 90.0  # and not smeared onto GPU 0
    # The whole run is on the chart, start to end.
    assert history[0]["t"] == int(T0.timestamp())
    assert history[-1]["t"] == int(T0.timestamp()) + SECONDS - 1
    assert "drag across a chart to zoom in" in page
    assert f'data-zoom="{reverse("job_metrics", args=[long_job.pk])}"' in page


def test_zooming_in_brings_every_second_of_the_range(long_job, owner):
    start = T0 + timedelta(seconds=DIP_AT - 50)
    end = T0 + timedelta(seconds=DIP_AT + 50)
    response = _zoom(owner, long_job, **{"from": start.isoformat(), "to": end.isoformat()})
    assert response.status_code == 200
    data = response.json()
    assert data["resolution"] == "second" and data["step"] == 0
    seconds = [s["t"] for s in data["samples"]]
    assert seconds == list(range(int(start.timestamp()), int(end.timestamp()) + 1))
    dip = next(s for s in data["samples"] if s["t"] == int(T0.timestamp()) + DIP_AT)
    assert dip["gpu"] == [90.0, 3.0]
    assert {s["job"] for s in data["samples"]} == {long_job.pk}
    # A time with an offset, or none (UTC), reads the same.
    naive = _zoom(owner, long_job, **{"from": "2026-01-05T13:25:45", "to": "2026-01-05T13:25:49"})
    assert [s["t"] for s in naive.json()["samples"]] == list(
        range(int((T0 + timedelta(seconds=DIP_AT)).timestamp()), int(T0.timestamp()) + DIP_AT + 5)
    )


def test_a_wide_zoom_is_decimated_like_the_page(long_job, owner):
    response = _zoom(owner, long_job, **{"from": T0.isoformat()})  # to the end
    data = response.json()
    assert data["step"] > 0
    assert len(data["samples"]) <= 2_100
    assert min(s["gpu"][1] for s in data["samples"]) == 3.0
    outside = _zoom(
        owner, long_job, **{"from": "2026-02-01T00:00:00Z", "to": "2026-02-02T00:00:00Z"}
    )
    assert outside.status_code == 200 and outside.json()["samples"] == []


def test_another_tenant_gets_404_and_a_bad_range_400(long_job, owner, bob):
    stranger = Client()
    stranger.force_login(bob)
    assert _zoom(stranger, long_job, **{"from": T0.isoformat()}).status_code == 404
    assert Client().get(reverse("job_metrics", args=[long_job.pk])).status_code == 302

    bad = _zoom(owner, long_job, **{"from": "yesterday"})
    assert bad.status_code == 400
    assert "`from` must be an ISO 8601 time" in bad.json()["error"]
    assert _zoom(owner, long_job, to="2026-13-45T99:00:00").status_code == 400
    backwards = _zoom(
        owner, long_job, **{"from": "2026-01-05T12:00:00Z", "to": "2026-01-05T11:00:00Z"}
    )
    assert backwards.status_code == 400
    assert backwards.json() == {"error": "`from` must be before `to`."}


def test_the_diagnosis_still_reads_every_second(make_cluster, paper_host, alice, owner):
    """Busy 3 s, idle 2 s: a period the decimated chart cannot show, the diagnosis finds."""
    cluster = make_cluster(alice, "loader", gpus=2)
    job = _finished_job(cluster, paper_host, lambda i: [95.0, 95.0] if i % 5 < 3 else [5.0, 5.0])
    page = owner.get(reverse("job_detail", args=[job.pk])).content.decode()
    assert "Data-loading bottleneck" in page
    assert "every ~5 s" in page
    assert len(_history(page)) <= 2_100


def test_a_finished_jobs_picture_is_kept_and_a_late_sample_still_shows(long_job, owner):
    """The second visit reads the kept chart and diagnosis (no bucket query, the same
    page); a sample the monitor stores late is on the next visit (the kept picture is keyed
    by what the job's samples are)."""
    late = Sample.objects.filter(job=long_job).latest("at")
    late.delete()  # not stored yet
    url = reverse("job_detail", args=[long_job.pk])
    first = _history(owner.get(url).content.decode())
    assert first[-1]["t"] == int(late.at.timestamp()) - 1
    with CaptureQueriesContext(connection) as again:
        second = owner.get(url)
    assert _history(second.content.decode()) == first
    assert not [q for q in again.captured_queries if "WITH s AS" in q["sql"]]
    late.pk = None
    late.save()  # stored now
    third = _history(owner.get(url).content.decode())
    assert third[-1]["t"] == int(late.at.timestamp())


def test_a_job_not_started_yet_has_a_page_with_no_samples(make_cluster, alice, owner):
    cluster = make_cluster(alice, "waiting", gpus=2)
    job = services.job_submit(cluster=cluster, spec=JobSpec(name="later", command="true"))
    response = owner.get(reverse("job_detail", args=[job.pk]))
    assert response.status_code == 200
    assert _history(response.content.decode()) == []
    assert owner.get(reverse("job_metrics", args=[job.pk])).json()["samples"] == []
