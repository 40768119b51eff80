"""GPU subscriptions cannot fill the table (issue 41's attack review): a subscribe-then-cancel
loop once added rows without end, since only waiting ones were counted. At most
SUANLI_GPU_SUBSCRIPTIONS_PER_DAY are made in 24 hours, cancelled ones included."""

import json
from datetime import timedelta

import pytest
import time_machine
from django.urls import reverse
from django.utils import timezone
from test_gpu_subscriptions import _api

from jobs.models import GpuSubscription

pytestmark = pytest.mark.django_db

WORDS = "You made 3 GPU subscriptions in the last 24 hours, the most allowed: wait a while"
NEW = {"gpu_model": "a100-80gb", "gpus_per_node": 8}


def test_a_subscribe_then_cancel_loop_stops_at_so_many_a_day(
    client, make_paper_host, alice, bob, settings
):
    settings.SUANLI_GPU_SUBSCRIPTIONS_PER_DAY = 3
    make_paper_host()
    api = _api(alice)
    for _ in range(3):
        status, made = api("POST", "gpu-subscriptions", NEW)
        assert status == 201, made
        assert api("DELETE", f"gpu-subscriptions/{made['id']}")[0] == 204
    status, refused = api("POST", "gpu-subscriptions", NEW)
    assert status == 400 and WORDS in json.dumps(refused), refused
    client.force_login(alice)  # the page says the same words
    page = client.post(reverse("gpu_subscriptions"), {**NEW, "nodes": "1"}).content.decode()
    assert WORDS in page.replace("&#x27;", "'")
    assert GpuSubscription.objects.filter(owner=alice).count() == 3
    assert _api(bob)("POST", "gpu-subscriptions", NEW)[0] == 201  # her limit is her own
    with time_machine.travel(timezone.now() + timedelta(hours=24, minutes=1)):
        assert api("POST", "gpu-subscriptions", NEW)[0] == 201  # a day later: again
