"""One writer of timelines and state reasons (jobs/events/timeline.py).

An engine can answer with an error of thousands of characters. Alice's spot cluster is
preempted for such a reason, then released for it with a job still queued: nothing fails,
her cluster page, her job page and the API keep each reason to what its field holds, and
the page still shows how the error began. Each timeline entry whose kind the table
(`webhooks.SENT_AS`) sends reaches her receiver exactly once; the others never do.

No Docker engine is needed: the host is a row and the real scheduler places the cluster."""

import json

import pytest
from django.test import Client
from django.urls import reverse

from console.models import ApiToken
from jobs.clusters import services
from jobs.clusters.services import JobSpec
from jobs.events import webhooks
from jobs.models import Cluster, ClusterEvent, Job, JobEvent, WebhookEndpoint
from jobs.placement import scheduler
from tests.test_webhooks import Receiver

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("priced")]

# What an engine says when it cannot make a container, padded to 5,000 characters.
HEAD = "500 Server Error for http+docker://localhost/v1.45/containers/create: "
ENGINE_ERROR = (HEAD + "failed to create task for container: " + "x" * 5000)[:4990] + " THE-END"


def _limit(model, field="message") -> int:
    return model._meta.get_field(field).max_length


@pytest.fixture
def receiver(settings):
    settings.SUANLI_WEBHOOK_ALLOW_NETS = ["127.0.0.0/8"]
    r = Receiver()
    yield r
    r.close()


@pytest.fixture
def placed(paper_host, make_cluster, alice):
    cluster = make_cluster(alice, "spotty", gpus=2, spot=True)
    scheduler.place_pending()
    cluster.refresh_from_db()
    assert cluster.state == Cluster.State.RUNNING
    return cluster


def _api(user):
    _, token = ApiToken.issue(user=user, name="script")
    client = Client(HTTP_AUTHORIZATION=f"Bearer {token}")
    return lambda path: client.get(f"/api/v1/{path}").json()


def test_an_engine_error_of_5000_characters_is_kept_to_each_fields_length(client, alice, placed):
    job = services.job_submit(cluster=placed, spec=JobSpec(name="train", command="echo hi"))
    assert services.cluster_preempt(cluster=placed, reason=ENGINE_ERROR)
    placed.refresh_from_db()  # back in the queue, saying why it was preempted
    assert placed.state == Cluster.State.PENDING
    assert len(placed.state_reason) == _limit(Cluster, "state_reason")
    assert placed.state_reason.startswith("preempted (" + HEAD)

    client.force_login(alice)
    page = client.get(reverse("cluster_detail", args=[placed.pk])).content.decode()
    assert HEAD in page and "THE-END" not in page  # in the status line and the timeline
    api = _api(alice)
    said = api(f"clusters/{placed.pk}")["state_reason"]
    assert said == placed.state_reason and "THE-END" not in said

    services.cluster_release(cluster=placed, reason=ENGINE_ERROR)
    job.refresh_from_db()
    assert job.state == Job.State.CANCELLED
    assert job.state_reason == ENGINE_ERROR[: _limit(Job, "state_reason")]
    for event in [*ClusterEvent.objects.filter(cluster=placed), *JobEvent.objects.filter(job=job)]:
        assert len(event.message) <= _limit(type(event)), event.kind
    cancelled = JobEvent.objects.get(job=job, kind="cancelled")
    assert cancelled.message == ENGINE_ERROR[: _limit(JobEvent)]
    page = client.get(reverse("job_detail", args=[job.pk])).content.decode()
    assert HEAD in page and "THE-END" not in page
    assert api(f"jobs/{job.pk}")["state_reason"] == job.state_reason


def test_each_entry_the_table_sends_is_delivered_once_and_no_other(
    alice, paper_host, make_cluster, receiver, work_queue
):
    WebhookEndpoint.objects.create(
        owner=alice, url=receiver.url, events=[t for t, _ in WebhookEndpoint.EVENTS],
        secret=webhooks.new_secret(),
    )  # fmt: skip
    cluster = make_cluster(alice, "hooked", gpus=1)
    scheduler.place_pending()  # "running": sent
    job = services.job_submit(cluster=cluster, spec=JobSpec(name="train", command="echo hi"))
    services.cluster_release(cluster=cluster)  # "releasing": not sent; "released": sent
    work_queue("webhooks")

    got = [json.loads(r["body"])["type"] for r in receiver.requests]
    assert got == ["cluster.running", "job.queued", "job.cancelled", "cluster.released"], got
    entries = [
        *(("cluster", e.kind) for e in ClusterEvent.objects.filter(cluster=cluster)),
        *(("job", e.kind) for e in JobEvent.objects.filter(job=job)),
    ]
    assert ("cluster", "releasing") in entries  # on the timeline, never a webhook
    expected = [webhooks.sent_as(*entry) for entry in entries]
    assert sorted(filter(None, expected)) == sorted(got)
    assert len(set(got)) == len(got)  # each once, though the sweep runs again
    webhooks.sweep()
    work_queue("webhooks")
    assert len(receiver.requests) == len(got)
