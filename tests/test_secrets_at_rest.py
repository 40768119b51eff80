"""Webhook signing secrets and engines' TLS material are encrypted in PostgreSQL: a dump of
the table gives none of them away, while the console still signs and connects with them.
Without a key the console refuses to start (unless DEBUG, where it derives one)."""

import importlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.core.exceptions import FieldError, ImproperlyConfigured
from django.db import connection
from django.urls import reverse
from pki import pem_pair
from standardwebhooks import Webhook

from jobs.base import crypto
from jobs.events import webhooks
from jobs.hosts import services as host_services
from jobs.hosts.forms import HostForm
from jobs.models import Host, WebhookEndpoint, WebhookEvent

pytestmark = pytest.mark.django_db
ROOT = Path(__file__).resolve().parent.parent


def _raw(table: str, column: str, pk: int) -> str:
    with connection.cursor() as cursor:
        cursor.execute(f'SELECT "{column}" FROM "{table}" WHERE id = %s', [pk])  # noqa: S608
        return cursor.fetchone()[0]


@pytest.fixture
def tls_host(catalog):
    ca, _ = pem_pair("ca")
    cert, key = pem_pair()
    host = Host(
        name="gpu-remote",
        engine_url="tcp://127.0.0.1:1",
        address="127.0.0.1",
        zone="zone-a",
        tls_ca=ca,
        tls_cert=cert,
        tls_key=key,
    )
    return host_services.host_save(host=host), (ca, cert, key)


def test_a_webhook_secret_is_not_in_its_column_but_still_signs(alice):
    secret = webhooks.new_secret()
    endpoint = WebhookEndpoint.objects.create(
        owner=alice, url="https://example.com/hook", events=["job.queued"], secret=secret
    )
    raw = _raw("jobs_webhookendpoint", "secret", endpoint.pk)
    assert raw.startswith("fernet:") and secret not in raw
    assert secret.removeprefix("whsec_") not in raw

    endpoint = WebhookEndpoint.objects.get(pk=endpoint.pk)
    assert endpoint.secret == secret
    event = WebhookEvent.objects.create(owner=alice, uid="msg_test", type="job.queued", body="{}")
    headers = webhooks.headers_for(endpoint, event, 1_700_000_000)
    assert headers["webhook-signature"] == webhooks.sign(secret, "msg_test", 1_700_000_000, "{}")


def test_a_rotated_secret_and_its_predecessor_are_both_encrypted(client, alice, settings):
    settings.SUANLI_WEBHOOK_ALLOW_NETS = ["127.0.0.0/8"]
    client.force_login(alice)
    client.post(
        reverse("webhooks"),
        {"url": "http://127.0.0.1:9/hook", "events": ["job.queued"], "enabled": "on"},
    )
    endpoint = WebhookEndpoint.objects.get(owner=alice)
    first = endpoint.secret
    client.post(reverse("webhook_rotate", args=[endpoint.pk]))
    endpoint.refresh_from_db()
    assert endpoint.previous_secret == first and endpoint.secret != first
    for column, plain in (("secret", endpoint.secret), ("previous_secret", first)):
        raw = _raw("jobs_webhookendpoint", column, endpoint.pk)
        assert raw.startswith("fernet:") and plain not in raw, column
    # Both still sign, as a receiver verifies them (Standard Webhooks).
    event = WebhookEvent.objects.create(owner=alice, uid="msg_rot", type="job.queued", body="{}")
    headers = webhooks.headers_for(endpoint, event, int(time.time()))
    for secret in (endpoint.secret, first):
        Webhook(secret).verify("{}", headers)


def test_tls_material_is_not_in_its_columns(tls_host):
    host, (ca, cert, key) = tls_host
    for column, plain in (("tls_key", key), ("tls_cert", cert), ("tls_ca", ca)):
        raw = _raw("jobs_host", column, host.pk)
        assert raw.startswith("fernet:") and "BEGIN" not in raw and plain not in raw, column
    with connection.cursor() as cursor:
        cursor.execute("SELECT * FROM jobs_host")
        assert "PRIVATE KEY" not in repr(cursor.fetchall()), "no column holds the key"
    host = Host.objects.get(pk=host.pk)
    assert (host.tls_ca, host.tls_cert, host.tls_key) == (ca, cert, key)


def test_the_host_form_keeps_the_stored_key_when_left_empty(tls_host):
    host, (ca, cert, key) = tls_host
    form = HostForm(
        {
            "name": host.name, "engine_url": host.engine_url, "address": "10.1.2.3",
            "zone": "zone-a", "gpu_model": "", "gpu_count": "0",
            "tls_ca": ca, "tls_cert": cert, "tls_key": "",
        },
        instance=Host.objects.get(pk=host.pk),
    )  # fmt: skip
    assert form.is_valid(), form.errors
    host_services.host_save(host=form.save(commit=False))
    assert Host.objects.get(pk=host.pk).tls_key == key
    assert "BEGIN" not in _raw("jobs_host", "tls_key", host.pk)


def test_empty_secrets_stay_empty_and_cannot_be_searched(alice, catalog):
    host = host_services.host_save(
        host=Host(name="gpu-local", engine_url="unix:///run/x.sock", address="127.0.0.1", zone="a")
    )
    assert _raw("jobs_host", "tls_key", host.pk) == ""
    with pytest.raises(FieldError):
        list(WebhookEndpoint.objects.filter(secret="whsec_x"))
    assert Host.objects.filter(tls_key__isnull=False).count() == 1


def test_the_migration_encrypts_rows_written_before_it(alice, tls_host):
    host, (ca, cert, key) = tls_host
    endpoint = WebhookEndpoint.objects.create(owner=alice, url="https://e.x/h", secret="whsec_AAAA")
    with connection.cursor() as cursor:  # as the rows were before encryption
        cursor.execute("UPDATE jobs_host SET tls_key = %s WHERE id = %s", [key, host.pk])
        cursor.execute(
            "UPDATE jobs_webhookendpoint SET secret = %s WHERE id = %s", ["whsec_AAAA", endpoint.pk]
        )
    assert Host.objects.get(pk=host.pk).tls_key == key, "plain rows are read meanwhile"
    migration = importlib.import_module("jobs.migrations.0010_encrypt_secrets")
    with connection.schema_editor() as editor:
        migration.encrypt_rows(None, editor)
        migration.encrypt_rows(None, editor)  # twice: nothing is encrypted twice
    assert crypto.is_encrypted(_raw("jobs_host", "tls_key", host.pk))
    assert crypto.is_encrypted(_raw("jobs_webhookendpoint", "secret", endpoint.pk))
    assert Host.objects.get(pk=host.pk).tls_key == key
    assert WebhookEndpoint.objects.get(pk=endpoint.pk).secret == "whsec_AAAA"
    with connection.schema_editor() as editor:
        migration.decrypt_rows(None, editor)
    assert _raw("jobs_host", "tls_key", host.pk) == key


def test_a_second_key_rotates_and_a_wrong_key_fails_loudly(alice, settings):
    from cryptography.fernet import Fernet

    endpoint = WebhookEndpoint.objects.create(owner=alice, url="https://e.x/h", secret="whsec_BBBB")
    old = list(settings.SUANLI_SECRETS_KEYS)
    settings.SUANLI_SECRETS_KEYS = [Fernet.generate_key().decode(), *old]
    assert WebhookEndpoint.objects.get(pk=endpoint.pk).secret == "whsec_BBBB"
    settings.SUANLI_SECRETS_KEYS = [Fernet.generate_key().decode()]
    with pytest.raises(ImproperlyConfigured, match="does not decrypt"):
        WebhookEndpoint.objects.get(pk=endpoint.pk)


def _settings_load(**env):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SUANLI_SECRETS_KEY")}
    clean.update(env)
    return subprocess.run(
        [sys.executable, "-c", "import django; django.setup(); from django.conf import settings; "
         "print(len(settings.SUANLI_SECRETS_KEYS))"],
        cwd=ROOT, env={**clean, "DJANGO_SETTINGS_MODULE": "console.settings"},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_without_a_key_the_console_refuses_to_start_unless_debug(tmp_path, settings):
    refused = _settings_load(DEBUG="0")
    assert refused.returncode != 0
    assert "SUANLI_SECRETS_KEY (or SUANLI_SECRETS_KEY_FILE) must be set" in refused.stderr
    assert _settings_load(DEBUG="1").stdout.strip() == "1", "DEBUG derives a key"
    key_file = tmp_path / "secrets.key"
    key_file.write_text(settings.SUANLI_SECRETS_KEYS[0] + "\n")
    assert _settings_load(DEBUG="0", SUANLI_SECRETS_KEY_FILE=str(key_file)).returncode == 0
    bad = _settings_load(DEBUG="0", SUANLI_SECRETS_KEY="not-a-fernet-key")
    assert bad.returncode != 0 and "Fernet keys" in bad.stderr
