"""System checks of the settings that keep the workspace apps' origins apart from the
console's (console/app_origin.py): run by `manage.py check` and at every start."""

import ipaddress

from django.conf import settings
from django.core.checks import Error, Tags, Warning, register
from django.http.request import validate_host
from django.utils.http import is_same_domain

from console import app_origin
from jobs.base import metrics


def _under(name: str, domain: str) -> bool:
    name = name.strip().lstrip(".").lower()
    return bool(domain) and (name == domain or name.endswith("." + domain))


@register(Tags.security)
def apps_apart_from_the_console(app_configs=None, **kwargs) -> list:
    """The console's cookies stay host-only (`__Host-` over HTTPS), no console host is an
    app origin's, and no app origin is one the console trusts."""
    problems = []
    domain = app_origin.domain()
    if settings.SESSION_COOKIE_DOMAIN or settings.CSRF_COOKIE_DOMAIN:
        problems.append(Error(
            "SESSION_COOKIE_DOMAIN and CSRF_COOKIE_DOMAIN must stay unset: the console's "
            "cookies are host-only, so that no other host (an app origin) receives them.",
            id="suanli.E001",
        ))  # fmt: skip
    if settings.SESSION_COOKIE_SECURE and not (
        settings.SESSION_COOKIE_NAME.startswith("__Host-")
        and settings.CSRF_COOKIE_NAME.startswith("__Host-")
    ):
        problems.append(Error(
            "Over HTTPS the session and CSRF cookies are named __Host-…, so that no subdomain "
            "can set or replace them.",
            id="suanli.E002",
        ))  # fmt: skip
    if not domain or "." not in domain:
        problems.append(Error(
            "SUANLI_APPS_DOMAIN must name a domain (e.g. apps.example.net) whose wildcard "
            "*.apps.example.net reaches the web processes.",
            id="suanli.E003",
        ))  # fmt: skip
        return problems
    sample = app_origin.app_host(1, 0, "service")
    if validate_host(sample, settings.ALLOWED_HOSTS) or any(
        _under(host, domain) for host in settings.ALLOWED_HOSTS
    ):
        problems.append(Error(
            f"ALLOWED_HOSTS reaches the apps' domain {domain}: the console's hosts must lie "
            "outside it (a console page there would share an origin with the apps, and the "
            "console's websockets would take an app page's Origin).",
            id="suanli.E004",
        ))  # fmt: skip
    # As Django matches them: `https://*.example.net` trusts every host under example.net.
    trusted = [
        o
        for o in settings.CSRF_TRUSTED_ORIGINS
        if _under(o.split("://")[-1], domain)
        or is_same_domain(sample, o.split("://")[-1].split(":")[0].replace("*", ""))
    ]
    if trusted:
        problems.append(Error(
            f"CSRF_TRUSTED_ORIGINS names the apps' domain ({', '.join(trusted)}): a page an "
            "app serves must never be trusted by the console's forms.",
            id="suanli.E005",
        ))  # fmt: skip
    return problems


@register(Tags.security, deploy=True)
def apps_domain_is_set(app_configs=None, **kwargs) -> list:
    if _under(app_origin.domain(), "localhost"):
        return [Warning(
            "SUANLI_APPS_DOMAIN is under localhost: the apps are reachable only from a "
            "browser on this machine. Set it to a domain of its own (e.g. apps.example.net, a "
            "registrable domain apart from the console's) with a wildcard DNS record and "
            "certificate.",
            id="suanli.W001",
        )]  # fmt: skip
    return []


@register(Tags.security)
def metrics_ports_closed(app_configs=None, **kwargs) -> list:
    """The processes' metrics ports (jobs/base/metrics.py) leave the machine only behind a
    token: a non-loopback SUANLI_METRICS_BIND without SUANLI_METRICS_TOKEN is refused."""
    token = settings.SUANLI_METRICS_TOKEN
    if token and len(token) < 32:
        return [Error(
            "SUANLI_METRICS_TOKEN is shorter than 32 characters: use a long random secret "
            "(e.g. `openssl rand -hex 32`); it opens the fleet's metrics to whoever holds it.",
            id="suanli.E007",
        )]  # fmt: skip
    if metrics.is_loopback(settings.SUANLI_METRICS_BIND) or token:
        return []
    return [Error(
        f"SUANLI_METRICS_BIND={settings.SUANLI_METRICS_BIND} is not a loopback address: set "
        "SUANLI_METRICS_TOKEN (a long random secret; Prometheus sends it as a bearer token) "
        "or bind the processes' metrics ports to 127.0.0.1.",
        id="suanli.E006",
    )]  # fmt: skip


_LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))


def _reaches_loopback(entry: str) -> bool:
    network = ipaddress.ip_network(entry, strict=False)
    return any(network.version == n.version and network.overlaps(n) for n in _LOOPBACK)


@register(Tags.security)
def metrics_scrape_reachable(app_configs=None, **kwargs) -> list:
    """The shipped Prometheus config (deploy/prometheus/prometheus.yml) scrapes the web at
    http://127.0.0.1:8000/metrics: Django answers 400 to a Host outside ALLOWED_HOSTS.
    And no loopback address is let in by its address alone: a reverse proxy on this
    machine that is not a trusted proxy makes every visitor's request come from it."""
    problems = []
    allowed = settings.ALLOWED_HOSTS
    if settings.DEBUG and not allowed:  # as Django's request.get_host() does
        allowed = [".localhost", "127.0.0.1", "[::1]"]
    if settings.SUANLI_METRICS_TOKEN and not (
        validate_host("127.0.0.1", allowed) or validate_host("localhost", allowed)
    ):
        problems.append(Warning(
            "SUANLI_METRICS_TOKEN is set but ALLOWED_HOSTS names neither 127.0.0.1 nor "
            "localhost: Prometheus's scrape of http://127.0.0.1:8000/metrics (the shipped "
            "config) is answered 400. Add 127.0.0.1 to ALLOWED_HOSTS "
            "(docs/operator/metrics.md).",
            id="suanli.W002",
        ))  # fmt: skip
    loopback = [entry for entry in settings.SUANLI_METRICS_ALLOW if _reaches_loopback(entry)]
    if loopback:
        problems.append(Warning(
            f"SUANLI_METRICS_ALLOW lets in a loopback address ({', '.join(loopback)}): "
            "behind a reverse proxy on this machine (one not in SUANLI_TRUSTED_PROXIES) every "
            "visitor's request comes from it, so every researcher would read /metrics. "
            "Scrape from this machine with SUANLI_METRICS_TOKEN instead.",
            id="suanli.W003",
        ))  # fmt: skip
    return problems
