"""Signed job-status webhooks to a real HTTP receiver on loopback (allowed by the setting
the tests switch on), retried, never lost, and never a way into our own network."""

import json
import socket
import threading
import time
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.db import transaction
from django.urls import reverse
from django.utils import timezone
from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError

from jobs.clusters import services
from jobs.clusters.services import JobSpec
from jobs.events import webhooks
from jobs.models import WebhookDelivery, WebhookEndpoint, WebhookEvent
from jobs.runs import dispatch

pytestmark = pytest.mark.django_db


class Receiver:
    """A real HTTP server: records each request; answers with the next status queued."""

    def __init__(self, port=0):
        self.requests = []
        self.statuses = []
        self.hang = False
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                outer.requests.append({"headers": dict(self.headers), "body": body.decode()})
                if outer.hang:
                    time.sleep(5)
                status = outer.statuses.pop(0) if outer.statuses else 200
                self.send_response(status)
                if status in (301, 302):
                    self.send_header("Location", "http://127.0.0.1:9/elsewhere")
                self.end_headers()
                self.wfile.write(b'{"ok": true}')

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/hooks/suanli"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver(settings):
    settings.SUANLI_WEBHOOK_ALLOW_NETS = ["127.0.0.0/8"]
    r = Receiver()
    yield r
    r.close()


def _endpoint(owner, url, events=None):
    return WebhookEndpoint.objects.create(
        owner=owner, url=url, events=events or [t for t, _ in WebhookEndpoint.EVENTS],
        secret=webhooks.new_secret(),
    )  # fmt: skip


def _verified(endpoint, request):
    headers = {k.lower(): v for k, v in request["headers"].items()}
    return Webhook(endpoint.secret).verify(request["body"], headers)


def test_a_job_reports_queued_started_succeeded_signed_per_the_standard(
    running_cluster, receiver, alice, work_queue, settle_until
):
    endpoint = _endpoint(alice, receiver.url)
    cluster = running_cluster(1)
    job = services.job_submit(cluster=cluster, spec=JobSpec(name="hook", command="echo hi"))
    dispatch.dispatch(cluster.pk)
    settle_until(job)
    work_queue("webhooks")
    types = [json.loads(r["body"])["type"] for r in receiver.requests]
    assert types == ["cluster.running", "job.queued", "job.started", "job.succeeded"], types
    for request in receiver.requests:
        _verified(endpoint, request)  # raises if the signature is wrong
        assert request["headers"]["webhook-id"].startswith("msg_")
    done = _verified(endpoint, receiver.requests[3])
    assert done["data"]["job"] == {
        **done["data"]["job"],
        "id": job.pk,
        "state": "succeeded",
        "exit_code": 0,
    }
    assert done["data"]["job"]["url"].endswith(f"/jobs/{job.pk}/")
    tampered = dict(receiver.requests[3], body=receiver.requests[3]["body"].replace("0", "1"))
    with pytest.raises(WebhookVerificationError):
        _verified(endpoint, tampered)


def test_a_receiver_down_at_first_gets_the_event_on_a_retry_with_the_same_id(
    settings, alice, work_queue
):
    settings.SUANLI_WEBHOOK_ALLOW_NETS = ["127.0.0.0/8"]
    settings.SUANLI_WEBHOOK_RETRY_DELAYS = [0, 1, 1, 1]
    with socket.socket() as s:  # a port nobody listens on yet
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = _endpoint(alice, f"http://127.0.0.1:{port}/in")
    with transaction.atomic():
        event = webhooks.emit(owner_id=alice.pk, event_type="job.failed", data={"job": {"id": 1}})
    work_queue("webhooks")
    delivery = WebhookDelivery.objects.get(event=event)
    assert delivery.state == "pending" and delivery.attempts == 1
    assert "refused" in delivery.tries.get().error
    receiver = Receiver(port)  # the receiver comes up
    receiver.statuses = [503]  # ... and is not ready for one more attempt
    try:
        for _ in range(2):
            time.sleep(1.1)
            webhooks.sweep()  # what the cron sweep does; the RQ worker delivers
            work_queue("webhooks")
        delivery.refresh_from_db()
        assert delivery.state == "succeeded" and delivery.attempts == 3
        ids = {r["headers"]["webhook-id"] for r in receiver.requests}
        assert ids == {event.uid} and len(receiver.requests) == 2
        assert [a.status_code for a in delivery.tries.order_by("at")] == [None, 503, 200]
        endpoint.refresh_from_db()
        assert endpoint.failing_since is None and endpoint.last_success_at is not None
    finally:
        receiver.close()


def test_410_gone_disables_the_endpoint(receiver, alice, work_queue):
    endpoint = _endpoint(alice, receiver.url)
    receiver.statuses = [410]
    with transaction.atomic():
        webhooks.emit(owner_id=alice.pk, event_type="job.failed", data={})
    work_queue("webhooks")
    endpoint.refresh_from_db()
    assert not endpoint.enabled and "410" in endpoint.disabled_reason
    with transaction.atomic():
        assert webhooks.emit(owner_id=alice.pk, event_type="job.failed", data={}) is None
    assert len(receiver.requests) == 1


def test_an_endpoint_failing_for_five_days_is_disabled_and_the_dashboard_says_so(
    receiver, alice, work_queue, client
):
    endpoint = _endpoint(alice, receiver.url)
    WebhookEndpoint.objects.filter(pk=endpoint.pk).update(
        failing_since=timezone.now() - timedelta(days=5, minutes=1)
    )
    receiver.statuses = [500]
    with transaction.atomic():
        event = webhooks.emit(owner_id=alice.pk, event_type="job.failed", data={})
    work_queue("webhooks")
    endpoint.refresh_from_db()
    assert not endpoint.enabled and "failing since" in endpoint.disabled_reason
    assert WebhookDelivery.objects.get(event=event).state == "dead"
    client.force_login(alice)
    page = client.get(reverse("dashboard")).content.decode()
    assert "was disabled" in page and endpoint.url in page


def test_hanging_and_redirecting_receivers_are_failures_and_retried(
    receiver, alice, work_queue, settings
):
    settings.SUANLI_WEBHOOK_TIMEOUT_S = 1
    _endpoint(alice, receiver.url)
    receiver.hang = True
    with transaction.atomic():
        event = webhooks.emit(owner_id=alice.pk, event_type="job.failed", data={})
    work_queue("webhooks")
    delivery = WebhookDelivery.objects.get(event=event)
    assert delivery.state == "pending" and "timed out" in delivery.tries.get().error
    receiver.hang = False
    receiver.statuses = [302]
    WebhookDelivery.objects.filter(pk=delivery.pk).update(next_attempt_at=timezone.now())
    webhooks.deliver(delivery.pk)
    delivery.refresh_from_db()
    assert delivery.last_status == 302 and delivery.state == "pending"  # not followed, not done
    assert len(receiver.requests) == 2


def test_an_event_is_written_with_its_change_or_not_at_all(running_cluster, receiver, alice):
    _endpoint(alice, receiver.url)
    cluster = running_cluster(1)
    before = WebhookEvent.objects.count()
    with pytest.raises(RuntimeError), transaction.atomic():
        services.job_submit(cluster=cluster, spec=JobSpec(name="rolled-back", command="true"))
        raise RuntimeError("the request fails after the submit")
    assert WebhookEvent.objects.count() == before  # no event for a job that never was
    assert not cluster.jobs.filter(name="rolled-back").exists()


def test_private_targets_are_refused_before_any_connection(client, alice, settings):
    settings.SUANLI_WEBHOOK_ALLOW_NETS = []
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    client.force_login(alice)
    for url in (
        f"http://127.0.0.1:{port}/", f"http://localhost:{port}/", "http://169.254.169.254/latest/",
        "http://10.1.2.3/", f"http://[::ffff:127.0.0.1]:{port}/", f"http://2130706433:{port}/",
        "ftp://example.com/", "file:///etc/passwd",
    ):  # fmt: skip
        response = client.post(
            reverse("webhooks"), {"url": url, "events": ["job.failed"], "enabled": "on"}
        )
        assert response.status_code == 200, url
        assert "errorlist" in response.content.decode(), url
    assert not WebhookEndpoint.objects.exists()
    # An endpoint stored before an operator tightened the rules is refused at delivery.
    endpoint = _endpoint(alice, f"http://127.0.0.1:{port}/")
    with transaction.atomic():
        event = webhooks.emit(owner_id=alice.pk, event_type="job.failed", data={})
    webhooks.deliver(WebhookDelivery.objects.get(event=event).pk)
    assert "refused" in WebhookDelivery.objects.get(event=event).tries.get().error
    with pytest.raises(BlockingIOError):
        listener.accept()  # nobody ever connected
    listener.close()
    assert endpoint.pk


def test_the_secret_is_shown_once_rotation_signs_with_both(receiver, client, alice, work_queue):
    client.force_login(alice)
    response = client.post(
        reverse("webhooks"),
        {"url": receiver.url, "events": ["job.failed"], "enabled": "on"},
        follow=True,
    )
    endpoint = WebhookEndpoint.objects.get(owner=alice)
    assert endpoint.secret in response.content.decode()
    again = client.get(reverse("webhook_detail", args=[endpoint.pk])).content.decode()
    assert endpoint.secret not in again  # shown once
    old = endpoint.secret
    client.post(reverse("webhook_rotate", args=[endpoint.pk]))
    endpoint.refresh_from_db()
    assert endpoint.secret != old and endpoint.previous_secret == old
    client.post(reverse("webhook_test", args=[endpoint.pk]))
    work_queue("webhooks")
    request = receiver.requests[-1]
    assert len(request["headers"]["webhook-signature"].split()) == 2
    assert _verified(endpoint, request)["type"] == "webhook.test"
    assert Webhook(old).verify(
        request["body"], {k.lower(): v for k, v in request["headers"].items()}
    )
    page = client.get(reverse("webhook_detail", args=[endpoint.pk])).content.decode()
    assert "webhook.test" in page and "200" in page
    delivery = WebhookDelivery.objects.get(endpoint=endpoint)
    client.post(reverse("webhook_redeliver", args=[delivery.pk]))
    work_queue("webhooks")
    assert receiver.requests[-1]["headers"]["webhook-id"] == request["headers"]["webhook-id"]


def test_another_researcher_sees_and_touches_nothing(receiver, client, alice, bob):
    endpoint = _endpoint(alice, receiver.url)
    with transaction.atomic():
        event = webhooks.emit(owner_id=alice.pk, event_type="job.failed", data={})
    delivery = WebhookDelivery.objects.get(event=event)
    client.force_login(bob)
    assert client.get(reverse("webhook_detail", args=[endpoint.pk])).status_code == 404
    for name, arg in (
        ("webhook_test", endpoint.pk), ("webhook_rotate", endpoint.pk),
        ("webhook_delete", endpoint.pk), ("webhook_redeliver", delivery.pk),
    ):  # fmt: skip
        assert client.post(reverse(name, args=[arg])).status_code == 404
    assert receiver.url not in client.get(reverse("webhooks")).content.decode()
    # Secrets are encrypted at rest (jobs/base/crypto.py): compare them read back, not in SQL.
    assert WebhookEndpoint.objects.get(pk=endpoint.pk).secret == endpoint.secret


def test_balance_low_is_sent_once_per_low_spell_and_release_is_reported(
    running_cluster, receiver, alice, rate_card, fund, work_queue
):
    from billing import services as billing

    rate_card({"a100-80gb": "3.60"}, effective_from=timezone.now() - timedelta(hours=1))
    fund(alice, "1.00")  # 3.60 an hour: about 17 minutes left
    endpoint = _endpoint(alice, receiver.url, events=["balance.low", "cluster.released"])
    cluster = running_cluster(1)
    assert billing.notify_low_balances() == 1
    assert billing.notify_low_balances() == 0  # once per low spell
    services.cluster_release(cluster=cluster)
    work_queue("webhooks")
    low, released = (_verified(endpoint, r) for r in receiver.requests)
    assert low["type"] == "balance.low" and low["data"]["balance"] == "1.0000"
    assert low["data"]["burn_per_hour"] == "3.6000" and low["data"]["url"].endswith("/billing/")
    assert released["type"] == "cluster.released"
    assert released["data"]["cluster"]["id"] == cluster.pk
    assert released["data"]["cluster"]["state"] == "released"
    fund(alice, "100")  # money in: the next low spell is told again
    assert billing.Account.objects.get(user=alice).low_notified_at is None
