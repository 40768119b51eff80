"""`make run` keeps SQLite as its zero-setup database: a burst of API submits to the real
web process is answered, never with "database is locked" (a 500)."""

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from browsing import free_port as _free_port

ROOT = Path(__file__).resolve().parent.parent

SEED = """
from datetime import timedelta
from decimal import Decimal
from django.contrib.auth import get_user_model
from django.utils import timezone
from billing import services as billing
from billing.catalog import seed_rate_card
from console.models import ApiToken
from jobs.hosts import services as host_services
from jobs.clusters import services
from jobs.placement.catalog import seed_catalog
from jobs.models import GpuModel, Host
seed_catalog()
seed_rate_card(effective_from=timezone.now() - timedelta(hours=1))
host_services.host_save(host=Host(
    name="gpu-paper-01", engine_url="unix:///run/suanli-no-such-engine.sock",
    address="127.0.0.1", zone="zone-a", gpu_model=GpuModel.objects.get(slug="a100-80gb"),
    gpu_count=8, state=Host.State.ACTIVE, images=["suanli/busybox:latest"],
))
user = get_user_model().objects.create_user("burst", password="burst-pass-123")
billing.post_entry(account=billing.account_for(user), kind="topup", amount=Decimal("1000"),
                   key="seed", memo="seed")
print(ApiToken.issue(user=user, name="burst")[1])
"""


def _call(url, token, body=None):
    request = urllib.request.Request(  # noqa: S310 (our test URL)
        url,
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        method="POST" if body is not None else "GET",
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:  # noqa: S310
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_twenty_concurrent_api_submits_on_sqlite_get_no_5xx(processes, tmp_path):
    url = f"sqlite:///{tmp_path / 'burst.sqlite3'}"
    env = {**processes.env, "DATABASE_URL": url}
    manage = [sys.executable, "manage.py"]
    subprocess.run([*manage, "migrate", "--no-input", "-v0"], cwd=ROOT, env=env, check=True)
    seeded = subprocess.run(
        [*manage, "shell", "-c", SEED],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    token = seeded.stdout.strip().splitlines()[-1]
    port = _free_port()
    processes.start("web", env={"DATABASE_URL": url, "PORT": str(port)})
    base = f"http://127.0.0.1:{port}"
    for _ in range(100):  # the web process takes a moment to listen
        try:
            urllib.request.urlopen(f"{base}/healthz", timeout=2)  # noqa: S310
            break
        except OSError:
            time.sleep(0.2)
    status, body = _call(
        f"{base}/api/v1/clusters",
        token,
        {"name": "burst", "gpu_model": "a100-80gb", "nodes": 1, "gpus_per_node": 1,
         "image": "suanli/busybox:latest", "volumes": [], "release_policy": "never"},
    )  # fmt: skip
    assert status == 201, body
    cluster = json.loads(body)["id"]

    def submit(i):
        return _call(
            f"{base}/api/v1/jobs", token, {"cluster": cluster, "name": f"j{i}", "command": "true"}
        )

    with ThreadPoolExecutor(max_workers=20) as pool:
        answers = list(pool.map(submit, range(20)))
    errors = [(status, body[:300]) for status, body in answers if status >= 500]
    assert not errors, errors
    assert [status for status, _ in answers] == [201] * 20
    status, body = _call(f"{base}/api/v1/jobs?cluster={cluster}", token)
    assert status == 200 and json.loads(body)["count"] == 20
