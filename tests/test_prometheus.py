"""What an operator's Prometheus and Grafana get from deploy/ (docs/operator/metrics.md):
the scrape config and the alert rules pass Debian's `promtool`; each alert fires on the
series it is written for and not on the healthy ones; the Grafana dashboard is an importable
dashboard whose every query parses; every metric the rules and the dashboard name is one the
console's exporters serve; and Debian's real `prometheus`, started on the shipped scrape
config against the console's web and every Procfile process, scrapes the fleet the test made
(the GPUs it rented, the host it took down, its waiting request) and evaluates the shipped
rules.

`prometheus` and `promtool` come from Debian's `prometheus` package (.ci/install.sh installs
it); a test here fails, never skips, without them. The live test starts a Prometheus of its
own (its own config, data folder and port on 127.0.0.1) and stops it; a system Prometheus
the package may have started is left alone."""

import json
import re
import secrets
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import requests
import yaml
from browsing import free_port
from waiting import until

ROOT = Path(__file__).resolve().parent.parent
SCRAPE_CONFIG = ROOT / "deploy/prometheus/prometheus.yml"
RULES = ROOT / "deploy/prometheus/suanli-rules.yml"
DASHBOARD = ROOT / "deploy/grafana/suanli-dashboard.json"

# The Procfile's processes and the scrape job of each (METRICS: one job per process).
JOBS = {
    "web": "suanli-web",
    "cron": "suanli-cron",
    "worker": "suanli-worker",
    "monitor": "suanli-monitor",
    "gateway": "suanli-gateway",
    "logs": "suanli-logs",
    "watch": "suanli-watch",
    "builder": "suanli-builder",
    "profiles": "suanli-profiles",
}


def _tool(name: str) -> str:
    found = shutil.which(name)
    if not found:
        pytest.fail(
            f"`{name}` is not installed: it comes with Debian's `prometheus` package "
            "(.ci/install.sh installs it: apt-get install --no-install-recommends prometheus)"
        )
    return found


def _promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [_tool("promtool"), *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


def _rules() -> list[dict]:
    return [
        rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]
    ]


def _dashboard_panels() -> list[dict]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def _dashboard_exprs() -> list[str]:
    return [t["expr"] for p in _dashboard_panels() for t in p.get("targets", ())]


def _as_plain_promql(expr: str) -> str:
    """A dashboard query with Grafana's variables given values, as Grafana sends it."""
    return expr.replace("$__rate_interval", "1m").replace("$model", ".*").replace("$zone", ".*")


def _with_token_file(config: dict, token_file: Path) -> dict:
    for job in config["scrape_configs"]:
        if "authorization" in job:
            job["authorization"]["credentials_file"] = str(token_file)
    return config


# -- promtool on the shipped files ---------------------------------------------------------


def test_promtool_passes_the_shipped_rules():
    done = _promtool("check", "rules", str(RULES))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in done.stdout


def test_promtool_passes_the_shipped_scrape_config(tmp_path):
    """As shipped (its credentials file is the operator's to write), and whole: with a token
    file in place the config, and the rules file it names, pass every check."""
    done = _promtool("check", "config", "--syntax-only", str(SCRAPE_CONFIG))
    assert done.returncode == 0, done.stdout + done.stderr
    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    assert {job["job_name"] for job in config["scrape_configs"]} == set(JOBS.values())
    for job in config["scrape_configs"]:
        # Every process answers only the token (or the allow-list), read from a file.
        assert job["authorization"]["credentials_file"], job["job_name"]
        assert "credentials" not in job["authorization"], job["job_name"]
    token = tmp_path / "token"
    token.write_text("t0ken\n")
    shutil.copy(RULES, tmp_path / RULES.name)
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(_with_token_file(config, token)))
    done = _promtool("check", "config", str(tmp_path / "prometheus.yml"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 1 rule files found" in done.stdout + done.stderr


def test_every_alert_says_how_bad_and_what_to_do():
    rules = _rules()
    alerts = [r for r in rules if "alert" in r]
    assert len(alerts) == len(rules)
    assert len({r["alert"] for r in alerts}) == len(alerts)
    for rule in alerts:
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), rule["alert"]
        assert re.fullmatch(r"\d+[smh]", rule["for"]), rule["alert"]
        assert rule["annotations"]["summary"], rule["alert"]
        assert len(rule["annotations"]["description"]) > 100, rule["alert"]


# Each alert on series that must fire it, and on series just short of it. promtool's unit
# tests compare an alert's annotations too: they are checked above, and left out of the copy
# of the rules tested here.
WEBS = ("10.0.0.1:8000", "10.0.0.2:8000")  # two web processes, each scraped
ALERT_CASES = [
    {
        "interval": "1m",
        "input_series": [
            {"series": 'suanli_host_up{host="gpu-a-01",zone="zone-a"}', "values": "1 1 0x10"},
            {"series": 'suanli_host_up{host="gpu-a-02",zone="zone-a"}', "values": "1x12"},
            {"series": 'suanli_host_degraded{host="gpu-a-03",zone="zone-b"}', "values": "0 1x20"},
        ],
        "alert_rule_test": [
            {"eval_time": "3m", "alertname": "SuanliHostDown", "exp_alerts": []},
            {
                "eval_time": "6m",
                "alertname": "SuanliHostDown",
                "exp_alerts": [
                    {"exp_labels": {"severity": "critical", "host": "gpu-a-01", "zone": "zone-a"}}
                ],
            },
            {"eval_time": "5m", "alertname": "SuanliHostDegraded", "exp_alerts": []},
            {
                "eval_time": "15m",
                "alertname": "SuanliHostDegraded",
                "exp_alerts": [
                    {"exp_labels": {"severity": "warning", "host": "gpu-a-03", "zone": "zone-b"}}
                ],
            },
        ],
    },
    {
        "interval": "1m",
        "input_series": [{"series": "suanli_accrual_lag_seconds", "values": "5 8 50 90x10"}],
        "alert_rule_test": [
            {"eval_time": "3m", "alertname": "SuanliAccrualBehind", "exp_alerts": []},
            {
                "eval_time": "6m",
                "alertname": "SuanliAccrualBehind",
                "exp_alerts": [{"exp_labels": {"severity": "critical"}}],
            },
        ],
    },
    {
        # A100 requests wait 20 minutes with free A100s in another zone: an alert. H100
        # requests wait as long with no H100 free anywhere: the fleet is full, no alert.
        "interval": "1m",
        "input_series": [
            {"series": 'suanli_queue_oldest_seconds{model="A100"}', "values": "1200+60x30"},
            {"series": 'suanli_queue_oldest_seconds{model="H100"}', "values": "1200+60x30"},
            {"series": 'suanli_gpus{model="A100",zone="zone-a",state="free"}', "values": "0x30"},
            {"series": 'suanli_gpus{model="A100",zone="zone-b",state="free"}', "values": "4x30"},
            {"series": 'suanli_gpus{model="H100",zone="zone-a",state="free"}', "values": "0x30"},
            {"series": 'suanli_gpus{model="H100",zone="zone-a",state="rented"}', "values": "8x30"},
        ],
        "alert_rule_test": [
            {
                "eval_time": "10m",
                "alertname": "SuanliQueueWaitingWithFreeGpus",
                "exp_alerts": [{"exp_labels": {"severity": "warning", "model": "A100"}}],
            }
        ],
    },
    {
        # The cron process stops answering; every other job is scraped; then the logs job is
        # left out of the config.
        "interval": "1m",
        "input_series": [
            {"series": f'up{{job="{job}",instance="127.0.0.1:1"}}', "values": "1x20"}
            for job in JOBS.values()
            if job not in ("suanli-cron", "suanli-logs")
        ]
        + [
            {"series": 'up{job="suanli-cron",instance="127.0.0.1:9810"}', "values": "1 0x20"},
            {"series": 'up{job="suanli-logs",instance="127.0.0.1:9850"}', "values": "1 1 1"},
        ],
        "alert_rule_test": [
            {
                "eval_time": "5m",
                "alertname": "SuanliProcessNotScraped",
                "exp_alerts": [
                    {
                        "exp_labels": {
                            "severity": "critical",
                            "job": "suanli-cron",
                            "instance": "127.0.0.1:9810",
                        }
                    }
                ],
            },
            {"eval_time": "5m", "alertname": "SuanliProcessMissing", "exp_alerts": []},
            {
                "eval_time": "20m",
                "alertname": "SuanliProcessMissing",
                "exp_alerts": [{"exp_labels": {"severity": "warning", "job": "suanli-logs"}}],
            },
        ],
    },
    {
        # Beats every 15 s from the watch until minute 5, then none; the monitor beats on. (An
        # empty label is no label: the watch has no shard.)
        "interval": "15s",
        "input_series": [
            {
                "series": 'suanli_process_heartbeat_timestamp_seconds{process="watch",shard=""}',
                "values": "0+15x20 300x40",
            },
            {
                "series": 'suanli_process_heartbeat_timestamp_seconds{process="monitor",shard="0"}',
                "values": "0+15x60",
            },
            {"series": 'suanli_monitor_lag_seconds{shard="0"}', "values": "0x20 45x40"},
            {"series": 'suanli_monitor_lag_seconds{shard="1"}', "values": "0x60"},
        ],
        "alert_rule_test": [
            {"eval_time": "7m", "alertname": "SuanliProcessSilent", "exp_alerts": []},
            {
                # Silent since 5m: over 180 s from 8m, for 2 m.
                "eval_time": "11m",
                "alertname": "SuanliProcessSilent",
                "exp_alerts": [{"exp_labels": {"severity": "critical", "process": "watch"}}],
            },
            {"eval_time": "8m", "alertname": "SuanliMonitorBehind", "exp_alerts": []},
            {
                "eval_time": "12m",
                "alertname": "SuanliMonitorBehind",
                "exp_alerts": [{"exp_labels": {"severity": "warning", "shard": "0"}}],
            },
        ],
    },
    {
        "interval": "1m",
        "input_series": [
            {"series": 'suanli_rq_failed{queue="docker"}', "values": "2x10 3x30"},
            {"series": 'suanli_rq_failed{queue="default"}', "values": "7x40"},
            {"series": 'suanli_rq_queue_depth{queue="docker"}', "values": "500x30"},
            {"series": 'suanli_rq_queue_depth{queue="default"}', "values": "3x30"},
            {"series": "suanli_webhook_delivery_failures_total", "values": "0+1x90"},
        ],
        "alert_rule_test": [
            {"eval_time": "8m", "alertname": "SuanliRqFailedJobsRising", "exp_alerts": []},
            {
                "eval_time": "17m",
                "alertname": "SuanliRqFailedJobsRising",
                "exp_alerts": [{"exp_labels": {"severity": "warning", "queue": "docker"}}],
            },
            {
                "eval_time": "15m",
                "alertname": "SuanliRqBacklog",
                "exp_alerts": [{"exp_labels": {"severity": "warning", "queue": "docker"}}],
            },
            {"eval_time": "20m", "alertname": "SuanliWebhookDeliveriesFailing", "exp_alerts": []},
            {
                "eval_time": "40m",
                "alertname": "SuanliWebhookDeliveriesFailing",
                "exp_alerts": [{"exp_labels": {"severity": "warning"}}],
            },
        ],
    },
    {
        # Two web processes in suanli-web: each serves the same fleet-wide values. One alert
        # for the host, not one per web process; the webhook failures counted once (6 an
        # hour, under the alert's 10; summed over both web processes it would be 12).
        "interval": "1m",
        "input_series": [
            {
                "series": f'suanli_host_up{{job="suanli-web",instance="{web}",host="gpu-a-01",'
                'zone="zone-a"}',
                "values": "1 1 0x10",
            }
            for web in WEBS
        ]
        + [
            {
                "series": f'suanli_webhook_delivery_failures_total{{job="suanli-web",'
                f'instance="{web}"}}',
                "values": "0+0.1x120",
            }
            for web in WEBS
        ],
        "alert_rule_test": [
            {
                "eval_time": "6m",
                "alertname": "SuanliHostDown",
                "exp_alerts": [
                    {
                        "exp_labels": {
                            "severity": "critical",
                            "job": "suanli-web",
                            "host": "gpu-a-01",
                            "zone": "zone-a",
                        }
                    }
                ],
            },
            {"eval_time": "100m", "alertname": "SuanliWebhookDeliveriesFailing", "exp_alerts": []},
        ],
    },
]


def test_each_alert_fires_on_its_series_and_not_on_healthy_ones(tmp_path):
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    tested = {case["alertname"] for test in ALERT_CASES for case in test["alert_rule_test"]}
    assert tested == {r["alert"] for r in _rules()}, "every shipped alert is tested here"
    (tmp_path / "tests.yml").write_text(
        yaml.safe_dump(
            {"rule_files": ["rules.yml"], "evaluation_interval": "15s", "tests": ALERT_CASES}
        )
    )
    done = _promtool("test", "rules", "tests.yml", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


# -- the Grafana dashboard ------------------------------------------------------------------


def test_the_dashboard_imports_into_grafana_and_every_query_parses(tmp_path):
    dashboard = json.loads(DASHBOARD.read_text())
    assert 36 <= dashboard["schemaVersion"] <= 41
    # Imported, Grafana asks which Prometheus; provisioned, the same name is a variable.
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    titles = " ".join(p["title"] for p in dashboard["panels"])
    for part in ("Fleet", "Queue", "Money", "Latencies", "Processes"):
        assert part in titles
    for panel in _dashboard_panels():
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
    # Every query is PromQL Prometheus parses: promtool checks them as recording rules.
    recorded = [
        {"record": f"dashboard:query_{i}", "expr": _as_plain_promql(expr)}
        for i, expr in enumerate(_dashboard_exprs())
    ]
    (tmp_path / "queries.yml").write_text(
        yaml.safe_dump({"groups": [{"name": "dashboard", "rules": recorded}]})
    )
    done = _promtool("check", "rules", str(tmp_path / "queries.yml"))
    assert done.returncode == 0, done.stdout + done.stderr


_NAME = re.compile(r"\b((?:suanli|process|python)_[a-zA-Z0-9_]+)\b")


def _named_metrics() -> dict[str, set[str]]:
    """Every metric the rules and the dashboard's queries name, and where."""
    named: dict[str, set[str]] = {}
    for rule in _rules():
        for name in _NAME.findall(rule["expr"]):
            named.setdefault(name, set()).add(rule["alert"])
    for panel in _dashboard_panels():
        for target in panel["targets"]:
            for name in _NAME.findall(target["expr"]):
                named.setdefault(name, set()).add(panel["title"])
    return named


def _families(exposition: str) -> dict[str, str]:
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", exposition, re.M))


def _sample_names(families: dict[str, str]) -> set[str]:
    """The names a sample of each family has (a histogram's _bucket, _sum, _count)."""
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "summary": ("_sum", "_count", "_created"),
    }
    names = set()
    for family, kind in families.items():
        names.add(family)
        names |= {family + suffix for suffix in suffixes.get(kind, ())}
    return names


def test_every_metric_the_rules_and_the_dashboard_name_is_served(db):
    """The web's /metrics (fleet-wide) and what the processes serve on their ports (their
    own series in prometheus_client's registry, with its process and Python collectors):
    every family is declared even with no sample yet, so an empty fleet tells them all, once
    an accrual tick has run (its gauges are its last tick's)."""
    from prometheus_client import REGISTRY, generate_latest

    from billing import tasks
    from console import metrics as web_metrics
    from jobs.base import metrics as process_metrics  # noqa: F401 (declares the process series)

    tasks.accrue()  # as the worker runs it
    web_metrics.forget_cache()
    served = _sample_names(_families(web_metrics.exposition().decode()))
    served |= _sample_names(_families(generate_latest(REGISTRY).decode()))
    named = _named_metrics()
    assert {"suanli_gpus", "suanli_queue_oldest_seconds", "suanli_monitor_lag_seconds"} <= set(
        named
    )
    unknown = {name: sorted(where) for name, where in named.items() if name not in served}
    assert not unknown, f"named but not served: {unknown}"


# -- Debian's prometheus against the console and its processes ---------------------------


class Prometheus:
    """Debian's `prometheus`, of this test's own: config, data folder, free port."""

    def __init__(self, config: dict, tmp_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = open(tmp_path / "prometheus.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                _tool("prometheus"),
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.log_path = tmp_path / "prometheus.log"

    def ready(self) -> bool:
        assert self.proc.poll() is None, self.log_path.read_text()[-3000:]
        try:
            return requests.get(f"{self.url}/-/ready", timeout=2).status_code == 200
        except requests.ConnectionError:
            return False

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def api(self, path: str, **params):
        answer = requests.get(f"{self.url}/api/v1/{path}", params=params, timeout=10)
        body = answer.json()
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> dict[tuple, float]:
        """{(label values sorted by name): value} of an instant query."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", data
        return {tuple(sorted(r["metric"].items())): float(r["value"][1]) for r in data["result"]}

    def value(self, expr: str) -> float | None:
        found = self.query(expr)
        assert len(found) <= 1, found
        return next(iter(found.values()), None)


def _first_cron_round_done(processes) -> bool:
    """The cron's first round (every periodic task is due at its start) has been run by
    the worker: the host checks, the reconcile and the dispatch of every host and job that
    exist then, which are none yet. (The paper hosts made after it have no engine: a check
    would take them down.)"""
    import django_rq
    from rq.job import Job as RqJob
    from rq.job import JobStatus

    dead = [name for name, proc, _log in processes.procs if proc.poll() is not None]
    assert not dead, f"processes ended: {dead}"
    connection = django_rq.get_connection("default")
    for task in ("hosts_check_all", "reconcile", "dispatch_all"):
        try:
            job = RqJob.fetch(f"cron-jobs-tasks-{task}", connection=connection)
        except Exception:  # not queued yet
            return False
        if job.get_status(refresh=True) != JobStatus.FINISHED:
            return False
    return True


def _make_fleet(make_paper_host, make_cluster, alice, catalog) -> dict:
    """Three hosts of A100s (one active with 8, one down with 4, one degraded with 2), two
    running clusters of alice's holding 2 + 1 GPUs, a request for 8 that waits."""
    from jobs import tasks
    from jobs.models import Cluster, Host

    make_paper_host("gpu-p-01", zone="zone-a", gpus=8)
    make_paper_host("gpu-p-02", zone="zone-b", gpus=4, state=Host.State.DOWN)
    make_paper_host("gpu-p-03", zone="zone-b", gpus=2, state=Host.State.DEGRADED)
    running = [
        make_cluster(alice, "train-a", nodes=1, gpus=2),
        make_cluster(alice, "train-b", nodes=1, gpus=1),
    ]
    tasks.place_pending()  # a placement pass, as the worker runs it
    waiting = make_cluster(alice, "too-big", nodes=1, gpus=8)
    tasks.place_pending()
    for cluster in running:
        cluster.refresh_from_db()
        assert cluster.state == Cluster.State.RUNNING, cluster.state_reason
    waiting.refresh_from_db()
    assert waiting.state == Cluster.State.PENDING
    return {"model": catalog["a100-80gb"].name, "rented": 3}


def test_prometheus_scrapes_the_console_and_every_process_with_the_shipped_config(
    processes, make_paper_host, make_cluster, priced, alice, catalog, storage_root, tmp_path
):
    from django.utils import timezone

    from billing.pricing import RateBook
    from jobs.models import GpuModel

    token = secrets.token_urlsafe(24)
    ports = {name: free_port() for name in JOBS}
    env = {
        "SUANLI_METRICS_TOKEN": token,
        "SUANLI_METRICS_BIND": "127.0.0.1",
        "SUANLI_METRICS_PORTS": ",".join(f"{n}={p}" for n, p in ports.items() if n != "web"),
        "SUANLI_METRICS_PORT_TRIES": "1",
        # After the cron's first round, the hosts stay as the test makes them: no host check
        # or reconcile of the paper hosts' engines (there are none) while Prometheus looks.
        "SUANLI_HOST_CHECK_INTERVAL": "3600",
        "SUANLI_RECONCILE_INTERVAL": "3600",
        "SUANLI_STORAGE_ROOT": str(storage_root),
        "SUANLI_SSH_PORT": str(free_port()),
        "SUANLI_SSH_HOST_KEY": str(tmp_path / "gateway" / "ssh_host_ed25519_key"),
    }
    for name in JOBS:
        # The web as in production: HTTPS on, ALLOWED_HOSTS the console's name and the
        # address Prometheus scrapes (as docs/operator/metrics.md says).
        own = {
            "PORT": str(ports["web"]),
            "SUANLI_HTTPS": "1",
            "ALLOWED_HOSTS": "console.example,127.0.0.1",
        }
        processes.start(name, env={**env, **(own if name == "web" else {})})
    # A wait, not a timed assert: 9 processes start at once on what may be a loaded machine.
    until(lambda: _first_cron_round_done(processes), timeout=120, what="the cron's first round")
    fleet = _make_fleet(make_paper_host, make_cluster, alice, catalog)

    # The shipped config, as an operator installs it: its targets at this test's ports, the
    # token in a file of its own, the shipped rules file; scraped every 2 s, evaluated every second.
    token_file = tmp_path / "suanli-metrics-token"
    token_file.write_text(token + "\n")
    config = _with_token_file(yaml.safe_load(SCRAPE_CONFIG.read_text()), token_file)
    config["global"].update(scrape_interval="2s", scrape_timeout="2s", evaluation_interval="1s")
    config["rule_files"] = [str(RULES)]
    for job in config["scrape_configs"]:
        name = next(n for n, j in JOBS.items() if j == job["job_name"])
        job["static_configs"] = [{"targets": [f"127.0.0.1:{ports[name]}"]}]
    prometheus = Prometheus(config, tmp_path)
    try:
        until(prometheus.ready, timeout=60, what="prometheus is ready")
        _scraped_and_evaluated(prometheus, fleet)
        # The money: 3 A100s charged at the card's on-demand rate.
        card = RateBook.load().at(timezone.now())
        rate = card.rate(
            gpu_model_id=GpuModel.objects.get(name=fleet["model"]).pk,
            instance_type_id=None,
            spot=False,
        )
        assert prometheus.value("suanli_revenue_cny_per_hour") == pytest.approx(
            float(rate) * fleet["rented"]
        )
    except BaseException:
        print("--- prometheus log:", prometheus.log_path.read_text()[-3000:])
        raise
    finally:
        prometheus.stop()


def _scraped_and_evaluated(prometheus: Prometheus, fleet: dict):
    jobs = set(JOBS.values())

    def every_target_up():
        found = prometheus.query('up{job=~"suanli-.*"}')
        return {dict(k)["job"] for k, v in found.items() if v == 1} == jobs

    try:
        until(every_target_up, timeout=90, what="every process scraped", every=1)
    except AssertionError:
        targets = prometheus.api("targets")["activeTargets"]
        raise AssertionError(
            {t["labels"]["job"]: (t["health"], t["lastError"]) for t in targets}
        ) from None

    model = fleet["model"]
    expected = {
        "rented": 3,  # train-a's 2 and train-b's 1
        "free": 5 + 2,  # gpu-p-01's other 5; the degraded gpu-p-03's 2 (held by nobody)
        "stopped_held": 0,
        "down": 4,  # gpu-p-02's
    }
    seen = {}

    def gpus_by_state():
        found = prometheus.query(f'sum by (state) (suanli_gpus{{model="{model}"}})')
        seen.update(last={dict(k)["state"]: v for k, v in found.items()})
        return seen["last"] == expected

    try:  # the web's answer is kept SUANLI_METRICS_CACHE_S (5 s)
        until(gpus_by_state, timeout=30, what="the fleet's GPUs scraped", every=1)
    except AssertionError:
        assert seen.get("last") == expected
    assert prometheus.value('sum(suanli_gpus{state="rented"})') == fleet["rented"]
    hosts = prometheus.query("suanli_hosts")
    assert {dict(k)["state"]: v for k, v in hosts.items() if v} == {
        "active": 1,
        "down": 1,
        "degraded": 1,
    }
    assert prometheus.value('suanli_host_up{host="gpu-p-02", zone="zone-b"}') == 0
    assert prometheus.value('suanli_host_up{host="gpu-p-01", zone="zone-a"}') == 1
    assert prometheus.value('suanli_host_degraded{host="gpu-p-03"}') == 1
    assert prometheus.value('suanli_clusters{state="running"}') == 2
    assert prometheus.value(f'suanli_queue_length{{model="{model}"}}') == 1
    assert prometheus.value(f'suanli_queue_oldest_seconds{{model="{model}"}}') > 0
    # Both placements counted, each with its time in the queue.
    assert prometheus.value("suanli_placements_total") >= 2
    assert prometheus.value(f'suanli_queue_wait_seconds_count{{model="{model}"}}') >= 2
    assert prometheus.value("suanli_placement_pass_seconds_count") >= 2
    assert prometheus.value('suanli_rq_queue_depth{queue="docker"}') is not None
    # Each process serves its own port, and says which it is.
    for name, job in JOBS.items():
        if name != "web":
            info = prometheus.value(f'suanli_process_info{{job="{job}"}}')
            assert info == 1, job
    assert prometheus.value('suanli_monitor_ticks_total{job="suanli-monitor"}') is not None
    assert prometheus.value('suanli_gateway_sessions{job="suanli-gateway"}') == 0

    # The shipped rules are loaded and evaluate on these series.
    shipped = {r["alert"] for r in _rules()}

    def rules_evaluated():
        groups = prometheus.api("rules")["groups"]
        rules = {r["name"]: r for g in groups for r in g["rules"]}
        return (
            rules
            if set(rules) == shipped
            and all(r["health"] == "ok" and r["lastEvaluation"] > "2000" for r in rules.values())
            else None
        )

    rules = until(rules_evaluated, timeout=30, what="the shipped rules evaluated", every=1)
    for name, rule in rules.items():
        assert not rule.get("lastError"), (name, rule["lastError"])

    # The down host is pending (its `for:` not yet over), the degraded one too. (A scrape
    # that misses its 2 s timeout on a loaded machine may make SuanliProcessNotScraped
    # pending for a moment: not asserted either way.)
    def alerts():
        found = {
            (a["labels"]["alertname"], a["labels"].get("host"), a["state"])
            for a in prometheus.api("alerts")["alerts"]
        }
        seen["alerts"] = found
        return {
            ("SuanliHostDown", "gpu-p-02", "pending"),
            ("SuanliHostDegraded", "gpu-p-03", "pending"),
        } <= found

    until(alerts, timeout=30, what="the host alerts pending", every=1)

    # Every query of the dashboard answers on this Prometheus.
    for expr in _dashboard_exprs():
        prometheus.api("query", query=_as_plain_promql(expr), time=time.time())
