"""Researchers log in (or sign up) and see the fleet's real availability."""

import re

import pytest
from django.test import override_settings
from django.urls import reverse

from jobs.hosts import services as host_services
from jobs.models import Host

pytestmark = pytest.mark.django_db


def test_pages_need_a_login(client):
    response = client.get(reverse("dashboard"))
    assert response.status_code == 302 and response.url.startswith(reverse("login"))


def test_demo_style_login_lands_on_the_dashboard(client, alice):
    response = client.post(
        reverse("login"), {"username": "alice", "password": "alice-pass-123"}, follow=True
    )
    assert response.redirect_chain[-1][0] == reverse("dashboard")
    assert "Fleet availability" in response.content.decode()


def test_wrong_password_says_so(client, alice):
    response = client.post(reverse("login"), {"username": "alice", "password": "nope"})
    assert response.status_code == 200
    assert "Please enter a correct username and password" in response.content.decode()


def test_dashboard_counts_free_gpus_per_model_and_zone_from_active_hosts(
    client, alice, make_host, django_assert_max_num_queries
):
    make_host("gpu-a-01", engine=0, zone="zone-a", model="a100-80gb", gpus=8, check="reuse")
    make_host("gpu-a-02", engine=1, zone="zone-a", model="a100-80gb", gpus=4, check="reuse")
    make_host("gpu-b-01", engine=1, zone="zone-b", model="a100-80gb", gpus=2, check="reuse")
    make_host("gpu-b-t4", engine=0, zone="zone-b", model="t4-16gb", gpus=4, check="reuse")
    drained = make_host("gpu-b-02", engine=0, zone="zone-b", model="t4-16gb", gpus=4, check="reuse")
    host_services.host_set_draining(host=drained, draining=True)
    make_host(
        "gpu-dead",
        engine="unix:///run/suanli-no-such-engine.sock",
        zone="zone-c",
        model="h100-80gb",
        gpus=8,
    )

    client.force_login(alice)
    # +1: the disabled-webhook notice; +1: the person's language and time zone; +1: the
    # person's teams (the acting-for switcher and request.actor share it)
    with django_assert_max_num_queries(11):
        response = client.get(reverse("dashboard"))
    rows = {(r.gpu_model, r.zone): (r.free, r.hosts) for r in response.context["availability"]}
    assert rows == {
        ("T4 16 GB", "zone-b"): (4, 1),
        ("A100 80 GB", "zone-a"): (12, 2),
        ("A100 80 GB", "zone-b"): (2, 1),
    }
    body = response.content.decode()
    assert "emulated GPUs" in body and "H100" not in body.split("CPU-only instances")[0]
    assert response.context["free_total"] == 18


def test_empty_fleet_says_so(client, alice, catalog):
    client.force_login(alice)
    body = client.get(reverse("dashboard")).content.decode()
    assert "No GPU host takes new work right now." in body


def test_sign_up_creates_an_account_and_logs_in(client, db):
    response = client.post(
        reverse("signup"),
        {
            "username": "carol",
            "password1": "a-long-pass-phrase-9",
            "password2": "a-long-pass-phrase-9",
        },
        follow=True,
    )
    assert response.redirect_chain[-1][0] == reverse("dashboard")
    assert response.context["user"].username == "carol"


def test_sign_up_refuses_weak_or_mismatched_passwords(client, db):
    body = client.post(
        reverse("signup"), {"username": "carol", "password1": "123", "password2": "124"}
    ).content.decode()
    assert "The two password fields didn" in body


@override_settings(SUANLI_SIGNUP_ENABLED=False)
def test_sign_up_can_be_switched_off(client, db):
    assert client.get(reverse("signup")).status_code == 404
    assert "Sign up" not in client.get(reverse("login")).content.decode()


def test_static_vendor_files_are_served_locally(client, alice):
    client.force_login(alice)
    body = client.get(reverse("dashboard")).content.decode()
    assert "/static/vendor/htmx.min.js" in body
    # Every script and stylesheet comes from our own origin (a CDN's "cdn" is not looked for
    # in the whole page: a random CSRF token once held those letters).
    loaded = re.findall(r'<(?:script|link)\b[^>]*\b(?:src|href)="([^"]*)"', body)
    assert loaded and all(url.startswith("/") and not url.startswith("//") for url in loaded)
    from django.contrib.staticfiles import finders

    assert finders.find("vendor/plotly.min.js").endswith("static/vendor/plotly.min.js")
    assert finders.find("vendor/htmx.min.js")


def test_logout_is_a_post(client, alice):
    client.force_login(alice)
    response = client.post(reverse("logout"))
    assert response.status_code == 302
    assert client.get(reverse("dashboard")).status_code == 302


def test_down_host_shows_its_error_to_the_operator(client, operator, make_host):
    host = make_host("gpu-dead", engine="unix:///run/suanli-no-such-engine.sock")
    assert host.state == Host.State.DOWN
    client.force_login(operator)
    response = client.post(reverse("ops_host_check", args=[host.pk]), follow=True)
    assert "Host gpu-dead did not answer" in response.content.decode()
