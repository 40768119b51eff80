"""Guessing passwords or API tokens is throttled per address (django-axes): the tenth
failure locks the address for the cool-off, the right password and a valid token are
refused too, the page says why and what to do, and an operator can unlock it."""

import json
import os
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import requests
import time_machine
from axes.models import AccessAttempt
from browsing import free_port
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from playwright.sync_api import expect
from waiting import until

from console.models import ApiToken

pytestmark = pytest.mark.django_db

LOCKED = "Too many failed log-ins from your address"
ROOT = Path(__file__).resolve().parent.parent


def _login(client, username, password, url=None):
    return client.post(url or reverse("login"), {"username": username, "password": password})


def _fail_until_locked(client, settings, url=None, username="alice"):
    for attempt in range(1, settings.AXES_FAILURE_LIMIT):
        response = _login(client, username, f"wrong-{attempt}", url)
        assert response.status_code == 200, attempt
    return _login(client, username, "wrong-last", url)


def test_the_tenth_wrong_password_locks_and_the_right_one_is_refused(client, alice, settings):
    assert settings.AXES_FAILURE_LIMIT == 10
    response = _fail_until_locked(client, settings)
    body = response.content.decode()
    assert response.status_code == 429
    assert LOCKED in body and "Try again in 15 minutes or ask an operator" in body
    assert 'id="id_username"' in body, "the login page, with the lock as its error"

    response = _login(client, "alice", "alice-pass-123")
    assert response.status_code == 429 and LOCKED in response.content.decode()
    assert client.get(reverse("dashboard")).status_code == 302, "not logged in"
    # The address is locked, not only the account it guessed at.
    assert _login(Client(), "bob", "bob-pass-123").status_code == 429


def test_another_address_is_not_locked(client, alice, settings):
    _fail_until_locked(client, settings)
    elsewhere = Client(REMOTE_ADDR="192.0.2.7")
    response = _login(elsewhere, "alice", "alice-pass-123")
    assert response.status_code == 302 and response.url == reverse("dashboard")


def test_an_ipv6_guesser_moving_through_its_64_stays_locked(alice, settings):
    """One subscriber holds a /64: each guess from a new address of it counts all the same;
    the next /64 is someone else."""
    for n in range(1, settings.AXES_FAILURE_LIMIT + 1):
        guess = _login(Client(REMOTE_ADDR=f"2001:db8:1:2::{n:x}"), "alice", f"wrong-{n}")
    assert guess.status_code == 429
    right = _login(Client(REMOTE_ADDR="2001:db8:1:2:ffff::1"), "alice", "alice-pass-123")
    assert right.status_code == 429 and LOCKED in right.content.decode()
    neighbour = _login(Client(REMOTE_ADDR="2001:db8:1:3::1"), "alice", "alice-pass-123")
    assert neighbour.status_code == 302


def test_the_lock_ends_after_the_cool_off(client, alice, settings):
    _fail_until_locked(client, settings)
    with time_machine.travel(timezone.now() + timedelta(minutes=14), tick=False):
        assert _login(client, "alice", "alice-pass-123").status_code == 429
    # Each refused try restarted the cool-off: 15 minutes after the last one it is over.
    with time_machine.travel(timezone.now() + timedelta(minutes=14 + 16), tick=False):
        assert _login(client, "alice", "alice-pass-123").status_code == 302


def test_an_operator_unlocks_the_address_in_the_admin(client, alice, operator, settings):
    _fail_until_locked(client, settings)
    attempt = AccessAttempt.objects.get()
    assert attempt.ip_address == "127.0.0.1" and attempt.failures_since_start == 10

    desk = Client(REMOTE_ADDR="192.0.2.9")
    desk.force_login(operator)
    changelist = reverse("admin:axes_accessattempt_changelist")
    assert "127.0.0.1" in desk.get(changelist).content.decode()
    response = desk.post(
        changelist,
        {"action": "delete_selected", "_selected_action": [attempt.pk], "post": "yes"},
    )
    assert response.status_code == 302 and not AccessAttempt.objects.exists()

    response = _login(client, "alice", "alice-pass-123")
    assert response.status_code == 302 and response.url == reverse("dashboard")


def test_the_admin_login_is_throttled_too(client, operator, settings):
    url = reverse("admin:login")
    response = _fail_until_locked(client, settings, url=url, username="olga")
    body = response.content.decode()
    assert response.status_code == 429 and LOCKED in body and "ask an operator" in body
    assert "Suanli operations" in body, "the admin's own login page"
    response = _login(client, "olga", "olga-pass-123", url)
    assert response.status_code == 429 and LOCKED in response.content.decode()
    assert client.get(reverse("admin:index")).status_code == 302, "not logged in"


def test_password_and_token_failures_count_together(client, alice, settings):
    api = Client(HTTP_AUTHORIZATION="Bearer sk_suanli_guess")
    for _ in range(settings.AXES_FAILURE_LIMIT - 1):
        assert api.get("/api/v1/balance").status_code == 401
    assert _login(client, "alice", "wrong").status_code == 429


def _api(token, **extra):
    client = Client(HTTP_AUTHORIZATION=f"Bearer {token}", **extra)

    def call(path="balance"):
        response = client.get(f"/api/v1/{path}")
        return response.status_code, response.json(), response

    return call


def test_bad_api_tokens_lock_the_address_for_good_tokens_too(alice, settings):
    _, good = ApiToken.issue(user=alice, name="ci")
    assert _api(good)()[0] == 200
    for guess in range(1, settings.AXES_FAILURE_LIMIT):
        status, body, _ = _api(f"sk_suanli_guess{guess}")()
        assert status == 401 and "not valid" in body["error"], guess
    status, body, response = _api("sk_suanli_guess-last")()
    assert status == 429 and "Too many failed API tokens" in body["error"]
    assert response["Retry-After"] == str(15 * 60)

    status, body, _ = _api(good)()
    assert status == 429 and "ask an operator" in body["error"], "a valid token is refused too"
    assert _api(good, REMOTE_ADDR="192.0.2.8")()[0] == 200, "only the guessing address"
    assert _login(Client(), "alice", "alice-pass-123").status_code == 429
    assert "sk_suanli_guess" not in json.dumps(list(AccessAttempt.objects.values()), default=str)


def test_a_request_without_a_token_is_not_a_guess(alice, settings):
    anonymous = Client()
    for _ in range(settings.AXES_FAILURE_LIMIT + 2):
        assert anonymous.get("/api/v1/balance").status_code == 401
    assert not AccessAttempt.objects.exists()


def _web(processes, **env) -> str:
    """The web process as the Procfile runs it (uvicorn, its proxy options included)."""
    port = free_port()
    processes.start("web", env={"PORT": str(port), **env})
    url = f"http://127.0.0.1:{port}"

    def answers():
        try:
            return requests.get(f"{url}/healthz", timeout=2).status_code == 200
        except requests.ConnectionError:
            return False

    until(answers, timeout=20, what="the web process listens")
    return url


def _log_in_over_http(session, url, password, forwarded_for):
    """The login form as a browser posts it (its CSRF token), with an X-Forwarded-For."""
    page = session.get(f"{url}/login/", timeout=10)
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text).group(1)
    return session.post(
        f"{url}/login/",
        data={"username": "alice", "password": password, "csrfmiddlewaretoken": token},
        headers={"X-Forwarded-For": forwarded_for, "Referer": f"{url}/login/"},
        allow_redirects=False,
        timeout=10,
    )


def test_a_client_on_the_consoles_machine_rotating_x_forwarded_for_is_locked_out(
    processes, alice, settings
):
    """Nobody is a trusted proxy by default: the header of a client on 127.0.0.1 is not
    its address, so ten wrong passwords lock 127.0.0.1 whatever each one claimed."""
    url = _web(processes, SUANLI_TRUSTED_PROXIES="")
    session = requests.Session()
    answers = [
        _log_in_over_http(session, url, f"wrong-{n}", f"198.51.100.{n}").status_code
        for n in range(settings.AXES_FAILURE_LIMIT)
    ]
    assert answers == [200] * (settings.AXES_FAILURE_LIMIT - 1) + [429]
    response = _log_in_over_http(session, url, "alice-pass-123", "198.51.100.200")
    assert response.status_code == 429 and LOCKED in response.text
    assert list(AccessAttempt.objects.values_list("ip_address", flat=True)) == ["127.0.0.1"]


def test_a_named_proxys_x_forwarded_for_is_believed_and_its_forged_part_is_not(
    processes, alice, settings
):
    """SUANLI_TRUSTED_PROXIES names the proxy (here on 127.0.0.1): the client is the entry
    that proxy appended (the rightmost untrusted one); what the client wrote before it is
    never believed, so rotating it does not unlock."""
    url = _web(processes, SUANLI_TRUSTED_PROXIES="127.0.0.1,::1")
    session = requests.Session()
    for n in range(settings.AXES_FAILURE_LIMIT):
        _log_in_over_http(session, url, "wrong", f"198.51.100.{n}, 203.0.113.5")
    assert AccessAttempt.objects.get().ip_address == "203.0.113.5"
    forged = _log_in_over_http(session, url, "alice-pass-123", "198.51.100.99, 203.0.113.5")
    assert forged.status_code == 429
    other = _log_in_over_http(requests.Session(), url, "alice-pass-123", "203.0.113.6")
    assert other.status_code == 302 and other.headers["Location"] == "/"


def test_a_proxy_left_unnamed_or_every_client_trusted_is_refused_at_start():
    """SUANLI_BEHIND_PROXY alone (which believed anyone's header) and "*" stop the start."""
    base = {k: v for k, v in os.environ.items() if k != "SUANLI_BEHIND_PROXY"}
    for extra in ({"SUANLI_BEHIND_PROXY": "1"}, {"SUANLI_TRUSTED_PROXIES": "*"}):
        result = subprocess.run(
            [sys.executable, "manage.py", "check"], cwd=ROOT, env={**base, **extra},
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert result.returncode != 0, extra
        assert "SUANLI_TRUSTED_PROXIES" in result.stderr, result.stderr


@pytest.mark.browser
def test_a_person_logs_in_and_is_then_told_about_the_lock(page, live_server, alice, settings):
    page.goto(f"{live_server.url}/login/")
    page.fill("#id_username", "alice")
    page.fill("#id_password", "alice-pass-123")
    page.click("button[type=submit]")
    page.wait_for_url(f"{live_server.url}/")
    page.context.clear_cookies()
    for _ in range(settings.AXES_FAILURE_LIMIT):
        page.goto(f"{live_server.url}/login/")
        page.fill("#id_username", "alice")
        page.fill("#id_password", "not-it")
        page.click("button[type=submit]")
    expect(page.locator(".errorlist")).to_contain_text(LOCKED)
    expect(page.locator(".errorlist")).to_contain_text("or ask an operator to unlock it")


@pytest.mark.django_db(transaction=True)  # the ASGI stack's threads, their own connections
def test_the_lock_page_is_served_by_the_asgi_stack_too(alice, settings):
    """Production runs ASGI (uvicorn), where axes' middleware takes its async path."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from django.test import AsyncClient

    async def attempts():
        client = AsyncClient()
        passwords = [f"wrong-{n}" for n in range(settings.AXES_FAILURE_LIMIT)]
        return [
            await client.post(reverse("login"), {"username": "alice", "password": password})
            for password in [*passwords, "alice-pass-123"]
        ]

    # A thread of its own: Playwright's sync API may hold this one's event loop.
    with ThreadPoolExecutor(1) as pool:
        responses = pool.submit(asyncio.run, attempts()).result()
    assert [r.status_code for r in responses[:-2]] == [200] * (settings.AXES_FAILURE_LIMIT - 1)
    for response in responses[-2:]:
        assert response.status_code == 429 and LOCKED in response.content.decode()
