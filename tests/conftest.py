"""Shared personas and real parts: the PostgreSQL, Redis and two Docker engines that
`make test` starts (.ci/services.sh). Nothing of ours is mocked.

Tiers. Every test is marked, at collection, with what it needs (`pytest -m`):
    unit     nothing: no database, no Redis, no engine
    db       PostgreSQL (and the test Redis): `db`, `transactional_db`, `live_server`, `django_db`
    engine   the two Docker engines and the rest of the full services (registry, MooseFS):
             `engine_urls` in its fixtures (so `make_host`, `running_cluster`...), or an
             explicit `pytest.mark.engine` where it reaches them another way
    procs    Procfile processes of its own: `processes`, `rq_worker`
    browser  Chromium: `browser`, `page`
    e2e      explicit: real PyTorch across the engines (`make e2e`)
`make test-fast` runs `not engine and not procs and not browser and not e2e` on PostgreSQL
and Redis alone; `make test` runs everything. The autouse fixtures below do only what a
test's tiers need.
"""

import os
import shutil
import uuid
from pathlib import Path

import docker
import pytest
from commit_hooks import run_commit_hooks  # noqa: F401 (autouse: rollback tests run on_commit hooks)
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


# -- tiers ---------------------------------------------------------------------------------

TIERS = ("unit", "db", "engine", "procs", "browser", "e2e")
# What puts a test in a tier: a fixture in its closure (item.fixturenames is the whole of it,
# so a fixture that requests `make_host` puts its tests in the engine tier too).
TIER_FIXTURES = {
    "db": {
        "db",
        "transactional_db",
        "django_db_reset_sequences",
        "django_db_serialized_rollback",
        "live_server",
    },
    "engine": {"engine_urls"},
    "procs": {"processes", "rq_worker"},
    "browser": {"browser", "page"},
}


def tiers_of(item) -> set[str]:
    """The tiers a collected test needs: those of its fixtures and its explicit markers."""
    used = set(getattr(item, "fixturenames", ()))
    found = {tier for tier, names in TIER_FIXTURES.items() if used & names}
    if item.get_closest_marker("django_db"):
        found.add("db")
    found |= {tier for tier in TIERS if tier != "unit" and item.get_closest_marker(tier)}
    return found or {"unit"}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects on the markers
def pytest_collection_modifyitems(config, items):
    for item in items:
        for tier in sorted(tiers_of(item)):
            if not any(m.name == tier for m in item.iter_markers()):
                item.add_marker(tier)


def _in_tier(request, tier: str) -> bool:
    return request.node.get_closest_marker(tier) is not None


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


# The outcome of one real, full host check per engine (and address and extra fields) in this
# session, for `make_host(check="reuse")`: the fields `host_services.host_check` writes.
_PROVEN: dict[tuple, dict] = {}
_PROOF_FIELDS = (
    "swarm_state",
    "swarm_cluster",
    "swarm_manager",
    "docker_version",
    "images",
    "storage_driver",
    "operating_system",
    "cpu_count",
    "memory_bytes",
    "root_disk_enforced",
    "emulated_gpu",
    "last_error",
    "last_error_text",
)


@pytest.fixture
def make_host(catalog, engine_urls):
    """Register a host through the real service on a real engine (the engine tier), and:
    check=True     check it: the real, full host check (the canary, swarm and network proofs);
    check="reuse"  the first time per engine (address, extra fields) in the session, the same
                   real check; after that the host gets that proven outcome (the engine's
                   facts, active or draining, checked now) without a canary. For tests that
                   need a real engine behind the host but are not about its check (the check
                   itself is proved by test_host_proofs.py and test_hosts.py);
    check=False    leave it unchecked, as host_save stores it."""

    def make(
        name="gpu-a-01", *, engine=0, zone="zone-a", model="a100-80gb", gpus=8, check=True, **extra
    ):
        url = engine_urls[engine] if isinstance(engine, int) else engine
        if not check:  # what its check would record: the test engines have the test image
            extra.setdefault("images", [TEST_IMAGE])
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
        if not check:
            return host
        key = (host.engine_url, host.address, tuple(sorted((k, repr(v)) for k, v in extra.items())))
        if check == "reuse" and key in _PROVEN:
            return _as_proven(host, _PROVEN[key])
        host = host_services.host_check(host_id=host.pk)
        if host.state in (Host.State.ACTIVE, Host.State.DRAINING):
            _PROVEN[key] = {field: getattr(host, field) for field in _PROOF_FIELDS}
        return host

    return make


def _as_proven(host: Host, proven: dict) -> Host:
    """What a good check writes (host_services.host_check), from an earlier one's outcome."""
    from django.utils import timezone

    now = timezone.now()
    Host.objects.filter(pk=host.pk).update(
        **proven,
        state=Host.State.DRAINING if host.drain_requested else Host.State.ACTIVE,
        last_checked=now,
        last_seen=now,
        unhealthy_since=None,
    )
    host_services.request_placement()  # as a check that makes a host active does
    host.refresh_from_db()
    return host


PAPER_ENGINE = "unix:///run/suanli-no-such-engine.sock"


@pytest.fixture
def make_paper_host(catalog):
    """Register hosts with no engine behind them (the db tier): active by default, for pages,
    forms, permissions, placement decisions and bills, anything that never starts a
    container. `make_paper_host("gpu-paper-02", zone="zone-b", gpus=2)`; they have the test
    image (`images=[...]` says which catalog images instead)."""

    def make(
        name="gpu-paper-01",
        *,
        zone="zone-a",
        model="a100-80gb",
        gpus=8,
        state=Host.State.ACTIVE,
        **extra,
    ):
        extra.setdefault("engine_url", PAPER_ENGINE)
        extra.setdefault("address", "127.0.0.1")
        # The catalog images its check would have recorded: the test image, as the test
        # engines have it; no other unless the test says so.
        extra.setdefault("images", [TEST_IMAGE])
        host = Host(
            name=name,
            zone=zone,
            gpu_model=catalog[model] if model else None,
            gpu_count=gpus,
            state=state,
            **extra,
        )
        return host_services.host_save(host=host)

    return make


@pytest.fixture
def paper_host(make_paper_host):
    """An active 8-GPU A100 host registered with no engine behind it: for pages, forms and
    permissions that never start a container."""
    return make_paper_host()


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup):
    """pytest-django's test database (made by the first test that needs it, never for a run of
    unit tests), emptied after each transactional test by DELETE rather than TRUNCATE, and
    Optuna's own connections to it (jobs/pools/sweeps.py) closed before it is dropped at the
    end of the run."""
    from django.db.backends.postgresql.operations import DatabaseOperations

    truncate = DatabaseOperations.sql_flush
    # What `migrate` made from the models and the flush's post_migrate signal would make again
    # (~0.1 s): kept, so that signal finds every row in place. No test writes either table.
    kept = {"django_content_type", "auth_permission"}

    def sql_flush(self, style, tables, *, reset_sequences=False, allow_cascade=False):
        """Django's flush after a transactional test: the same empty tables, but a DELETE of
        each (its foreign keys checked at commit: Django makes them all deferrable) takes
        ~0.03 s where one TRUNCATE of the ~55 tables takes ~0.3 s, a new file per table and
        index each time."""
        if reset_sequences or allow_cascade or not tables:
            return truncate(
                self, style, tables, reset_sequences=reset_sequences, allow_cascade=allow_cascade
            )
        return ["SET CONSTRAINTS ALL DEFERRED"] + [
            f"DELETE FROM {self.quote_name(table)}"  # noqa: S608 (Django's own table names)
            for table in tables
            if table not in kept
        ]

    DatabaseOperations.sql_flush = sql_flush
    yield
    DatabaseOperations.sql_flush = truncate
    sweeps.close_storages()


@pytest.fixture(autouse=True)
def _fresh_redis(request):
    """Every test beyond the unit tier starts with empty queues on the test Redis (its own
    database number: .ci/test.sh). Unit tests use no Redis and need none running."""
    import django_rq
    from django.conf import settings

    if _in_tier(request, "unit"):
        return
    try:
        django_rq.get_connection("default").flushdb()
    except Exception as exc:  # the suite needs Redis; say so plainly
        pytest.fail(
            f"Redis at {settings.REDIS_URL} does not answer ({exc}); run the suite with `make test`."
        )


@pytest.fixture(autouse=True)
def _quick_password_hashes(request, settings):
    """Passwords hashed with a quick hasher in this process (PBKDF2 takes ~0.25 s a hash, and
    most tests make users and log in), Django's own ones still known for a stored hash.
    Not for tests whose Procfile processes (their own settings) check the passwords."""
    if _in_tier(request, "unit") or _in_tier(request, "procs"):
        return
    settings.PASSWORD_HASHERS = [
        "django.contrib.auth.hashers.MD5PasswordHasher",
        *settings.PASSWORD_HASHERS,
    ]


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

    def make(
        owner, name="c1", *, nodes=1, gpus=1, model="a100-80gb", cpu=None, created_by=None,
        **extra,
    ):  # fmt: skip
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
        return cluster_create(owner=owner, spec=spec, created_by=created_by)

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
        # No metrics port unless a test names one: never the defaults (98x0) that a
        # developer's `make run` or another test tier's process may hold.
        self.env["SUANLI_METRICS_PORTS"] = ""
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
    """Run what is queued on a real RQ queue, in this process, until it is empty. The worker
    does not subscribe to the workers' command channel (nothing sends it a command): with
    redis-py 8 the end of that subscription (PubSubWorkerThread.stop) can wait out the
    thread's 60 s poll, when its unsubscribe reply is read before the stop."""
    import django_rq
    from rq import SimpleWorker

    class BurstWorker(SimpleWorker):
        def subscribe(self):
            pass

    def work(name="docker"):
        queue = django_rq.get_queue(name)
        BurstWorker([queue], connection=queue.connection, serializer=queue.serializer).work(
            burst=True
        )

    return work


@pytest.fixture
def running_cluster(make_host, make_cluster, alice):
    """A placed cluster on the real engines: `nodes` nodes, one host per engine (checked
    with `check="reuse"`: one real check per engine a session)."""
    from jobs.placement import scheduler

    def make(nodes=1, *, gpus=1, owner=None, name=None, **extra):
        if not make_host.__dict__.get("made"):
            # Real engines; their check proved once a session (test_host_proofs.py proves it).
            make_host("gpu-a-01", engine=0, zone="zone-a", gpus=2, check="reuse")
            make_host("gpu-b-01", engine=1, zone="zone-a", gpus=2, check="reuse")
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
    """Engine tests leave no container behind on the engines: no workspace after any of
    them, no replica after those that ran a cluster's jobs. Other tiers reach no engine."""
    yield
    if not _in_tier(request, "engine"):
        return
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
