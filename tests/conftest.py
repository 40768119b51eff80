"""Shared personas and real parts: the PostgreSQL, Redis and two Docker engines that
`make test` starts (.ci/services.sh). Nothing of ours is mocked."""

import os
import shutil
import uuid
from pathlib import Path

import docker
import pytest
from django.contrib.auth import get_user_model

from jobs.hosts import services as host_services
from jobs.models import GpuModel, Host
from jobs.placement.catalog import seed_catalog
from jobs.pools import sweeps

TEST_IMAGE = os.environ.get("SUANLI_TEST_IMAGE", "suanli/busybox:latest")


def procfile_line(process: str) -> str:
    """The Procfile's own command line for a process, so tests run what production runs."""
    from pathlib import Path

    for line in (Path(__file__).resolve().parent.parent / "Procfile").read_text().splitlines():
        name, _, command = line.partition(":")
        if name.strip() == process:
            return command.strip()
    raise LookupError(process)


def _engine_urls() -> list[str]:
    return [u for u in os.environ.get("SUANLI_TEST_ENGINES", "").split(",") if u]


def pytest_report_header(config):
    from django.db import connection

    lines = [
        f"database: {connection.vendor} {connection.settings_dict.get('HOST') or connection.settings_dict['NAME']}"
    ]
    for url in _engine_urls():
        try:
            client = docker.DockerClient(base_url=url, timeout=5)
            lines.append(f"docker engine: {url} (Docker {client.version()['Version']})")
            client.close()
        except Exception as exc:  # the header must never stop the run; the tests will say it
            lines.append(f"docker engine: {url} NOT ANSWERING: {exc}")
    return lines


@pytest.fixture(scope="session")
def engine_urls() -> list[str]:
    urls = _engine_urls()
    if len(urls) < 2:
        pytest.fail(
            "SUANLI_TEST_ENGINES must name two Docker engines; run the suite with `make test`, "
            "which starts them (.ci/services.sh)."
        )
    return urls


@pytest.fixture
def catalog(db):
    seed_catalog()
    return {m.slug: m for m in GpuModel.objects.all()}


@pytest.fixture
def operator(db):
    return get_user_model().objects.create_user(
        "olga", password="olga-pass-123", is_staff=True, is_superuser=True
    )


@pytest.fixture
def alice(db):
    return get_user_model().objects.create_user("alice", password="alice-pass-123")


@pytest.fixture
def bob(db):
    return get_user_model().objects.create_user("bob", password="bob-pass-123")


@pytest.fixture
def make_host(catalog, engine_urls):
    """Register a host through the real service and check it against its real engine."""

    def make(
        name="gpu-a-01", *, engine=0, zone="zone-a", model="a100-80gb", gpus=8, check=True, **extra
    ):
        url = engine_urls[engine] if isinstance(engine, int) else engine
        addrs = [a for a in os.environ.get("SUANLI_TEST_ENGINE_ADDRS", "").split(",") if a]
        host = Host(
            name=name,
            engine_url=url,
            address=addrs[engine]
            if isinstance(engine, int) and engine < len(addrs)
            else "127.0.0.1",
            zone=zone,
            gpu_model=catalog[model] if model else None,
            gpu_count=gpus,
            **extra,
        )
        host_services.host_save(host=host)
        return host_services.host_check(host_id=host.pk) if check else host

    return make


@pytest.fixture
def paper_host(catalog):
    """An active 8-GPU A100 host registered with no engine behind it: for pages, forms and
    permissions that never start a container."""
    host = Host(
        name="gpu-paper-01",
        engine_url="unix:///run/suanli-no-such-engine.sock",
        address="127.0.0.1",
        zone="zone-a",
        gpu_model=catalog["a100-80gb"],
        gpu_count=8,
        state=Host.State.ACTIVE,
    )
    return host_services.host_save(host=host)


@pytest.fixture(scope="session", autouse=True)
def _optuna_lets_go(django_db_setup, django_db_blocker):
    """Optuna's own connections to the test database (jobs/pools/sweeps.py) are closed before
    the database is dropped at the end of the run."""
    yield
    sweeps.close_storages()


@pytest.fixture(autouse=True)
def _fresh_redis(settings):
    """Every test starts with empty queues on the test Redis (a dedicated server)."""
    import django_rq

    try:
        django_rq.get_connection("default").flushdb()
    except Exception as exc:  # the suite needs Redis; say so plainly
        pytest.fail(
            f"Redis at {settings.REDIS_URL} does not answer ({exc}); run the suite with `make test`."
        )


@pytest.fixture
def storage_root(settings, tmp_path):
    """A storage root of the test's own on the researchers' filesystem (MooseFS under
    `make test`: the same files on the console and on every test host), removed after."""
    base = Path(os.environ.get("SUANLI_STORAGE_ROOT") or tmp_path)
    settings.SUANLI_STORAGE_ROOT = base / f"t-{tmp_path.name}-{uuid.uuid4().hex[:8]}"
    yield settings.SUANLI_STORAGE_ROOT
    shutil.rmtree(settings.SUANLI_STORAGE_ROOT, ignore_errors=True)


@pytest.fixture
def make_cluster(catalog, storage_root):
    """Request a cluster through the real service (it waits for placement)."""
    from jobs.clusters.services import ClusterSpec, cluster_create
    from jobs.models import Cluster, Image

    def make(owner, name="c1", *, nodes=1, gpus=1, model="a100-80gb", cpu=None, **extra):
        from jobs.models import InstanceType

        spec = ClusterSpec(
            name=name,
            nodes=nodes,
            gpu_model=None if cpu else catalog[model],
            gpus_per_node=0 if cpu else gpus,
            instance_type=InstanceType.objects.get(name=cpu) if cpu else None,
            image=Image.objects.get(reference=TEST_IMAGE),
            **extra,
        )
        return cluster_create(owner=owner, spec=spec)

    make.Cluster = Cluster
    return make


class Processes:
    """Procfile processes started for a test, on the test database; stopped after it."""

    def __init__(self, tmp_path):
        from django.db import connection

        s = connection.settings_dict
        self.env = dict(os.environ)
        self.env["DATABASE_URL"] = (
            f"postgres://{s['USER']}:{s['PASSWORD']}@{s['HOST']}:{s['PORT']}/{s['NAME']}"
        )
        self.env["SUANLI_STATIC_FINDERS"] = "1"
        self.tmp_path = tmp_path
        self.procs = []

    def start(self, name: str, *extra: str, env: dict | None = None):
        import subprocess
        import sys
        from pathlib import Path

        # As honcho runs it: the Procfile line through the shell, the venv first on PATH.
        line = " ".join([procfile_line(name), *extra])
        env = {**self.env, **(env or {})}
        env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
        log = open(self.tmp_path / f"{name}-{len(self.procs)}.log", "w")  # noqa: SIM115
        proc = subprocess.Popen(
            ["/bin/sh", "-c", f"exec {line}"],
            cwd=Path(__file__).resolve().parent.parent,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: see stop_all
        )
        self.procs.append((name, proc, log))
        return proc

    def stop_all(self):
        import signal

        for name, proc, log in self.procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except Exception:
                    proc.kill()
            # Whatever it forked (an RQ work horse orphaned by a kill -9 of its worker) must
            # not live on, consuming the next test's queue.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            log.close()
            print(f"--- {name} log:", (self.tmp_path / log.name.split("/")[-1]).read_text()[-2000:])


@pytest.fixture
def processes(transactional_db, tmp_path):
    procs = Processes(tmp_path)
    yield procs
    procs.stop_all()


@pytest.fixture
def rq_worker(processes):
    """A real `rqworker` process on the test database, as the Procfile runs it (without a
    fork per job, so the tests stay quick)."""
    import time

    proc = processes.start("worker", "--worker-class", "console.rqworker.SimpleWorker")
    time.sleep(0.5)
    return proc


@pytest.fixture
def work_queue():
    """Run what is queued on a real RQ queue, in this process, until it is empty."""
    import django_rq
    from rq import SimpleWorker

    def work(name="docker"):
        queue = django_rq.get_queue(name)
        SimpleWorker([queue], connection=queue.connection, serializer=queue.serializer).work(
            burst=True
        )

    return work


@pytest.fixture
def running_cluster(make_host, make_cluster, alice):
    """A placed cluster on the real engines: `nodes` nodes, one host per engine."""
    from jobs.placement import scheduler

    def make(nodes=1, *, gpus=1, owner=None, name=None, **extra):
        if not make_host.__dict__.get("made"):
            make_host("gpu-a-01", engine=0, zone="zone-a", gpus=2)
            make_host("gpu-b-01", engine=1, zone="zone-a", gpus=2)
            make_host.__dict__["made"] = True
        extra.setdefault("release_policy", "never")
        extra.setdefault("volumes", ())
        cluster = make_cluster(
            owner or alice,
            name or f"c{nodes}-{gpus}-{len(extra)}",
            nodes=nodes,
            gpus=gpus,
            **extra,
        )
        scheduler.place_pending()
        cluster.refresh_from_db()
        assert cluster.state == "running", cluster.state_reason
        return cluster

    return make


@pytest.fixture
def settle_until():
    """Drive the reconciler (the watch process's safety net) until the job ends."""
    import time

    from jobs.runs import repair

    def wait(job, states=("succeeded", "failed", "cancelled"), timeout=30):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job.refresh_from_db()
            if job.state in states:
                return job
            repair.reconcile()
            time.sleep(0.3)
        job.refresh_from_db()
        raise AssertionError(f"job {job.name} is {job.state} ({job.state_reason}) after {timeout}s")

    return wait


@pytest.fixture(autouse=True)
def _no_leftover_containers(request):
    """Tests that start containers leave none behind on the engines: no workspace after
    any test, no replica after those that ran a cluster's jobs."""
    yield
    labels = ["suanli.workspace"]
    if {"running_cluster", "make_pool"} & set(request.fixturenames):
        labels.append("suanli.job")
    for url in _engine_urls():
        client = docker.DockerClient(base_url=url, timeout=10)
        for label in labels:
            for c in client.containers.list(all=True, filters={"label": label}):
                c.remove(force=True)
        for image in client.images.list(name="suanli-keep/*"):  # stopped workspaces saved
            client.images.remove(image.id, force=True)
        client.close()


@pytest.fixture
def rate_card(catalog):
    """A rate card version through the real models: `rate_card({"a100-80gb": "3.60"})`."""
    from decimal import Decimal

    from django.utils import timezone

    from billing.models import Price, RateCard
    from jobs.models import InstanceType

    def make(gpu_prices=None, *, cpu_prices=None, effective_from=None, **fields):
        card = RateCard.objects.create(effective_from=effective_from or timezone.now(), **fields)
        for slug, per_hour in (gpu_prices or {}).items():
            Price.objects.create(card=card, gpu_model=catalog[slug], per_hour=Decimal(per_hour))
        for name, per_hour in (cpu_prices or {}).items():
            Price.objects.create(
                card=card,
                instance_type=InstanceType.objects.get(name=name),
                per_hour=Decimal(per_hour),
            )
        return card

    return make


@pytest.fixture
def fund():
    """Top an account up through the real ledger service."""
    import uuid
    from decimal import Decimal

    from billing import services as billing

    def top_up(user, amount):
        return billing.post_entry(
            account=billing.account_for(user),
            kind="topup",
            amount=Decimal(amount),
            key=f"test-topup:{uuid.uuid4()}",
            memo="test top-up",
        )

    return top_up


@pytest.fixture
def priced(catalog, alice, bob, fund):
    """The starting rate card in force, and money on alice's and bob's accounts."""
    from datetime import timedelta

    from django.utils import timezone

    from billing.catalog import seed_rate_card

    seed_rate_card(effective_from=timezone.now() - timedelta(hours=1))
    fund(alice, "1000")
    fund(bob, "1000")


@pytest.fixture(scope="module")
def browser():
    """Debian's Chromium through Playwright (its own download is not reachable here)."""
    from playwright.sync_api import sync_playwright

    # Playwright's sync API runs an event loop in this thread; the tests' ORM calls are
    # still plain synchronous calls between page steps.
    os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=os.environ.get("SUANLI_CHROMIUM", "/usr/bin/chromium"),
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
            ],
        )
        yield browser
        browser.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1366, "height": 800})
    page = context.new_page()
    yield page
    context.close()
