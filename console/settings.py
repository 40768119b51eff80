"""Suanli settings: one module, everything that differs between machines comes from the
environment (a `*_FILE` variant is read for secrets)."""

import base64
import hashlib
import os
from datetime import timedelta
from pathlib import Path

import dj_database_url
from cryptography.fernet import Fernet
from django.core.exceptions import ImproperlyConfigured

from console.env import envbool, envint, envlist, envstr, trusted_proxies

BASE_DIR = Path(__file__).resolve().parent.parent

DEBUG = envbool("DEBUG", False)

SECRET_KEY = envstr("SECRET_KEY", "")
if not SECRET_KEY:
    if not DEBUG:
        raise ImproperlyConfigured("SECRET_KEY (or SECRET_KEY_FILE) must be set when DEBUG is off.")
    SECRET_KEY = "dev-only-insecure-key-do-not-use-in-production-0123456789abcdef"  # noqa: S105

# Secrets at rest (jobs/base/crypto.py): webhook signing secrets and engines' TLS material are
# stored encrypted with these Fernet keys. Comma-separated keys rotate: the first encrypts,
# every one decrypts (put a new key first and keep the old one after it).
SUANLI_SECRETS_KEYS = [k.strip() for k in envstr("SUANLI_SECRETS_KEY", "").split(",") if k.strip()]
if not SUANLI_SECRETS_KEYS:
    if not DEBUG:
        raise ImproperlyConfigured(
            "SUANLI_SECRETS_KEY (or SUANLI_SECRETS_KEY_FILE) must be set when DEBUG is off: "
            "a Fernet key, e.g. from python -c 'from cryptography.fernet import Fernet; "
            "print(Fernet.generate_key().decode())'."
        )
    # Development only: a key derived from SECRET_KEY, so a DEBUG checkout runs without
    # setup. Rows written with it become unreadable once a real key replaces it.
    SUANLI_SECRETS_KEYS = [
        base64.urlsafe_b64encode(
            hashlib.sha256(b"suanli-secrets-key:" + SECRET_KEY.encode()).digest()
        ).decode()
    ]
for _key in SUANLI_SECRETS_KEYS:
    try:
        Fernet(_key.encode())
    except ValueError:
        raise ImproperlyConfigured(
            "SUANLI_SECRETS_KEY must be Fernet keys (32 url-safe base64-encoded bytes each)."
        ) from None

ALLOWED_HOSTS = envlist("ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]"] if DEBUG else [])
CSRF_TRUSTED_ORIGINS = envlist("CSRF_TRUSTED_ORIGINS", [])
SITE_URL = envstr("SITE_URL", "http://localhost:8000")
# The workspace apps' own origins (console/app_origin.py): c<cluster>-n<node>-<kind> under
# this domain, a registrable domain apart from the console's; its wildcard DNS record and
# certificate are the operator's. The port is the console's unless this one is set.
SUANLI_APPS_DOMAIN = envstr("SUANLI_APPS_DOMAIN", "apps.localhost").strip().strip(".").lower()
SUANLI_APPS_PORT = envint("SUANLI_APPS_PORT", 0)

INSTALLED_APPS = [
    "console.admin_site.SuanliAdminConfig",  # django.contrib.admin: a power, not staff alone
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "whitenoise.runserver_nostatic",
    "django.contrib.staticfiles",
    "django.contrib.humanize",
    "ninja",  # the API's docs page serves its own static Swagger UI (no CDN)
    "channels",
    "django_rq",
    "axes",
    "jobs",
    "billing",
    "monitoring",
    "console",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    # The language from the cookie or Accept-Language; console.preferences.UserLocale,
    # after authentication, puts the person's saved choice and time zone above it.
    "django.middleware.locale.LocaleMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "console.preferences.UserLocale",
    "django.contrib.messages.middleware.MessageMiddleware",
    # request.actor: whom the person acts for (themselves or a team), checked per request;
    # after messages, which say to a removed member that they act for themselves again.
    "console.acting.ActingFor",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # Last: turns a log-in refused for too many failures into the lock's page (console/auth.py).
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "console.urls"
ASGI_APPLICATION = "console.asgi.application"
WSGI_APPLICATION = None

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "console.context_processors.suanli",
                "console.acting.switcher",
            ],
        },
    },
]

DATABASES = {
    "default": dj_database_url.parse(
        envstr("DATABASE_URL", f"sqlite:///{BASE_DIR / 'db.sqlite3'}"),
        conn_max_age=envint("DATABASE_CONN_MAX_AGE", 60),
        # A kept connection is checked (SELECT 1) before its first use in each request or
        # task, so that one outliving a PostgreSQL restart is replaced, not a failed query.
        conn_health_checks=envbool("DATABASE_CONN_HEALTH_CHECKS", True),
    )
}
# SQLite (`make run`'s zero-setup default) has no NULLS NOT DISTINCT: the bill's one-line-
# per-member-and-hour constraint is PostgreSQL's alone (billing/rollups.py reads before it
# writes either way), so Django's warning about it would only repeat on every command.
SILENCED_SYSTEM_CHECKS = (
    ["models.W047"] if DATABASES["default"]["ENGINE"].endswith("sqlite3") else []
)
CACHES = {
    "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
    # A finished job's decimated chart and diagnosis (monitoring.selectors._kept), per
    # process: a 20,000-sample job's page costs ~0.3 s to compute and ~0.1 s when kept.
    "charts": {
        "BACKEND": "django.core.cache.backends.locmem.LocMemCache",
        "LOCATION": "charts",
        "TIMEOUT": envint("SUANLI_CHART_CACHE_S", 3600),
        "OPTIONS": {"MAX_ENTRIES": envint("SUANLI_CHART_CACHE_ENTRIES", 64)},
    },
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # The zero-setup default of `make run`: web, worker and cron write at once. WAL lets
    # readers go on beside the writer, IMMEDIATE takes the write lock when a transaction
    # starts (so no reader is refused an upgrade halfway through), and the timeout waits
    # for the lock rather than answering "database is locked".
    DATABASES["default"]["OPTIONS"] = {
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        "transaction_mode": "IMMEDIATE",
        "timeout": envint("SUANLI_SQLITE_TIMEOUT_S", 30),
        **DATABASES["default"].get("OPTIONS", {}),
    }
# A second suite on the same server (a helper's, a bench's) names its own test database.
if envstr("SUANLI_TEST_DATABASE", ""):
    DATABASES["default"]["TEST"] = {"NAME": envstr("SUANLI_TEST_DATABASE", "")}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]
# Log-in throttling (django-axes, console/auth.py): AXES_FAILURE_LIMIT failed passwords or API
# tokens from one address lock it for AXES_COOLOFF_MINUTES after the last failure (the right
# password is refused too); operators unlock it in the admin (Axes -> Access attempts).
# AxesStandaloneBackend needs the request: authenticate(request, ...), which Django's
# login views do; tests log in with the login form or force_login().
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    # Django's ModelBackend, refusing teams' principals (nobody logs in as a team).
    "console.auth.PeopleBackend",
]
AXES_ENABLED = envbool("AXES_ENABLED", True)
AXES_FAILURE_LIMIT = envint("AXES_FAILURE_LIMIT", 10)
# AXES_COOLOFF_SECONDS, where set, wins (tests lock an address for a few seconds).
AXES_COOLOFF_TIME = timedelta(
    seconds=envint("AXES_COOLOFF_SECONDS", 60 * envint("AXES_COOLOFF_MINUTES", 15))
)
AXES_LOCKOUT_PARAMETERS = ["ip_address"]
AXES_CLIENT_IP_CALLABLE = "console.auth.client_ip"
AXES_USERNAME_CALLABLE = "console.auth.attempt_username"  # cut to the column's length
AXES_LOCKOUT_CALLABLE = "console.auth.lockout_response"
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "dashboard"
LOGOUT_REDIRECT_URL = "login"
SUANLI_SIGNUP_ENABLED = envbool("SUANLI_SIGNUP_ENABLED", True)
# The API (console/api.py): requests a minute per researcher, across all their tokens, and
# the live tokens one researcher may hold (the next is refused with a sentence).
SUANLI_API_RATE_PER_MIN = envint("SUANLI_API_RATE_PER_MIN", 120)
SUANLI_API_TOKENS_MAX = envint("SUANLI_API_TOKENS_MAX", 20)

# Teams (课题组, docs/user/teams.md): the most teams one person owns, members one team has, open
# invitations one team holds, and how many days an invitation lasts unless it says.
SUANLI_TEAMS_MAX = envint("SUANLI_TEAMS_MAX", 10)
SUANLI_TEAM_MEMBERS_MAX = envint("SUANLI_TEAM_MEMBERS_MAX", 200)
SUANLI_TEAM_INVITES_MAX = envint("SUANLI_TEAM_INVITES_MAX", 50)
SUANLI_TEAM_INVITE_DAYS = envint("SUANLI_TEAM_INVITE_DAYS", 7)

# English and Simplified Chinese (locale/zh_Hans, compiled by `make run` and `make test`;
# the .mo files are not committed). The API speaks English whatever is asked.
LANGUAGE_CODE = "en"
LANGUAGES = [("en", "English"), ("zh-hans", "简体中文")]
LOCALE_PATHS = [BASE_DIR / "locale"]
LANGUAGE_COOKIE_AGE = 365 * 24 * 3600
LANGUAGE_COOKIE_SAMESITE = "Lax"
# The default zone of a person who chose none and reads English (Chinese: Asia/Shanghai).
TIME_ZONE = envstr("TIME_ZONE", "UTC")
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
# Where collectstatic writes and whitenoise serves from (a test collects into a folder of its own).
STATIC_ROOT = Path(envstr("SUANLI_STATIC_ROOT", str(BASE_DIR / "staticfiles")))
STATICFILES_DIRS = [BASE_DIR / "static"]
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {
        # Hashed, compressed files after `collectstatic` in production and `make run`:
        # whitenoise sends each under its hashed name cached for ten years (immutable), and
        # its .br or .gz beside it to a browser that accepts one (brotli writes the .br).
        # Plain names in `DEBUG=1` development and the live-server tests, which serve straight
        # from the finders.
        "BACKEND": "whitenoise.storage.CompressedManifestStaticFilesStorage"
        if envbool("SUANLI_STATIC_MANIFEST", not DEBUG)
        else "django.contrib.staticfiles.storage.StaticFilesStorage"
    },
}
WHITENOISE_USE_FINDERS = envbool("SUANLI_STATIC_FINDERS", DEBUG)

# Redis carries RQ and the channel layer; it may lose everything without losing a job.
REDIS_URL = envstr("REDIS_URL", "redis://127.0.0.1:6379/0")
_rq_queue = {
    "URL": REDIS_URL,
    "DEFAULT_TIMEOUT": 600,
    "SERIALIZER": "rq.serializers.JSONSerializer",
}
# "builds" has workers of its own (Procfile `builder`): a long image build never holds up
# a job's start on "docker".
RQ_QUEUES = {
    name: dict(_rq_queue) for name in ("docker", "default", "webhooks", "builds", "profiles")
}
RQ = {"COMMIT_MODE": "on_db_commit"}
# django-rq's pages are at /admin/rq/, each behind jobs.manage_queues (console/powers.py);
# its own copy inside the admin lets any staff user in, so it is not registered.
RQ_SHOW_ADMIN_LINK = False

CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        # redis-py 8 times reads out after 5 s, exactly channels_redis's blocking-pop
        # timeout: give reads room, or idle consumers die with TimeoutError.
        "CONFIG": {"hosts": [{"address": REDIS_URL, "socket_timeout": 30}]},
    }
    if envbool("SUANLI_CHANNEL_LAYER_REDIS", True)
    else {"BACKEND": "channels.layers.InMemoryChannelLayer"}
}

# Engine talk: a host check must never hang a page or a worker.
SUANLI_ENGINE_TIMEOUT = envint("SUANLI_ENGINE_TIMEOUT", 5)
SUANLI_HOST_CHECK_INTERVAL = envint("SUANLI_HOST_CHECK_INTERVAL", 30)
# Each check runs this image once (busybox: `sh`, `nc`, `cat`), hardened like a cluster's
# container on a bridge like a cluster's, removed at once: it proves the engine starts
# containers, that they reach neither the host, the control plane nor the other hosts,
# and that the host mounts the console's filesystem (jobs/hosts/proofs.py); pulled when missing.
SUANLI_CANARY_IMAGE = envstr("SUANLI_CANARY_IMAGE", "suanli/busybox:latest")
# Where the console's web process listens (the Procfile's SUANLI_BIND and PORT): a port no
# tenant container may reach, which each host check tries (jobs/hosts/proofs.py).
SUANLI_WEB_BIND = envstr("SUANLI_BIND", "127.0.0.1")
SUANLI_WEB_PORT = envint("PORT", 8000)
# A host that stays down this long loses its clusters' nodes to other hosts (when they
# fit); a degraded one loses them at once. Down nodes are not charged meanwhile.
SUANLI_HOST_DOWN_MOVE_S = envint("SUANLI_HOST_DOWN_MOVE_S", 60)
# Researchers' storage: the same path on the console and on every host. "moosefs": the
# researchers' distributed filesystem (MooseFS, docs/operator/storage.md) is mounted
# there everywhere, quotas are the filesystem's (mfssetquota) and each host check proves its
# mount; "local": a folder of one machine (`make run`), no quotas enforced.
SUANLI_STORAGE_ROOT = Path(envstr("SUANLI_STORAGE_ROOT", str(BASE_DIR / "storage")))
SUANLI_STORAGE_FS = envstr("SUANLI_STORAGE_FS", "local")
if SUANLI_STORAGE_FS not in ("local", "moosefs"):
    raise ImproperlyConfigured(
        f"SUANLI_STORAGE_FS={SUANLI_STORAGE_FS!r}: choose local (one machine) or moosefs"
    )
# The MooseFS master's client address (HOST:PORT) that joining hosts mount.
SUANLI_STORAGE_MASTER = envstr("SUANLI_STORAGE_MASTER", "")
# Where joining hosts mount it (empty: SUANLI_STORAGE_ROOT itself); the root may be a folder
# inside the mount, at the same path on every host.
SUANLI_STORAGE_MOUNT = envstr("SUANLI_STORAGE_MOUNT", "")
# Where a worker writes an engine's TLS material (from the database) for the Docker SDK.
SUANLI_TLS_DIR = Path(envstr("SUANLI_TLS_DIR", str(BASE_DIR / ".run" / "tls")))
# Joining hosts (Hosts -> Add, jobs/hosts/joins.py, jobs/hosts/scripts/join.sh). The console's CA for the
# engines (made on first use; its key never leaves this folder: share it between web
# machines), how long an engine's certificate and a join token last, and the URL hosts
# reach the console at (empty: the one the operator's browser used).
SUANLI_CA_DIR = envstr("SUANLI_CA_DIR", "")  # empty: SUANLI_TLS_DIR/ca
SUANLI_HOST_CERT_DAYS = envint("SUANLI_HOST_CERT_DAYS", 1825)
SUANLI_JOIN_TOKEN_S = envint("SUANLI_JOIN_TOKEN_S", 3600)
SUANLI_JOIN_URL = envstr("SUANLI_JOIN_URL", "")

# HTTPS hardening is on whenever DEBUG is off; SUANLI_HTTPS=0 serves plain HTTP behind a
# trusted proxy that terminates TLS elsewhere (and only then).
_https = envbool("SUANLI_HTTPS", not DEBUG)
# X-Forwarded-For and X-Forwarded-Proto are believed only from these proxies (addresses and
# networks, comma-separated; none by default): the Procfile's uvicorn gets them as
# --forwarded-allow-ips and puts the client's address and scheme into the request, so the
# app reads REMOTE_ADDR alone (console/auth.py). Anyone else's headers are ignored.
SUANLI_TRUSTED_PROXIES = trusted_proxies(os.environ.get("SUANLI_TRUSTED_PROXIES", ""))
if envbool("SUANLI_BEHIND_PROXY", False) and not SUANLI_TRUSTED_PROXIES:
    raise ImproperlyConfigured(
        "SUANLI_BEHIND_PROXY is replaced by SUANLI_TRUSTED_PROXIES: name the proxies' "
        "addresses or networks (e.g. SUANLI_TRUSTED_PROXIES=10.0.0.2), whose "
        "X-Forwarded-For and X-Forwarded-Proto are then believed."
    )
SECURE_PROXY_SSL_HEADER = None  # uvicorn sets the scheme from a trusted proxy's header
SECURE_SSL_REDIRECT = _https
# Prometheus scrapes each web process on its own address, as deploy/prometheus/prometheus.yml
# does on the console's machine: /metrics answers plain HTTP too (its bearer token is sent
# before any redirect could help; a redirect to https on uvicorn's plain port fails the scrape).
SECURE_REDIRECT_EXEMPT = [r"^metrics\Z"]  # exactly /metrics ($ would also match "metrics\n")
SESSION_COOKIE_SECURE = _https
CSRF_COOKIE_SECURE = _https
if _https:  # host-only and Secure: no other host (an app origin) can set or replace them
    SESSION_COOKIE_NAME = "__Host-sessionid"
    CSRF_COOKIE_NAME = "__Host-csrftoken"
LANGUAGE_COOKIE_SECURE = _https
SECURE_HSTS_SECONDS = envint("SECURE_HSTS_SECONDS", 31536000 if _https else 0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = _https
SECURE_HSTS_PRELOAD = _https
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
X_FRAME_OPTIONS = "DENY"
SESSION_COOKIE_HTTPONLY = True

# Error reports (the DEBUG page, admins' e-mails, logged reports) mask every URL's password
# besides Django's secret-looking names (console/errors.py).
DEFAULT_EXCEPTION_REPORTER_FILTER = "console.errors.CredentialsFilter"

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": envstr("LOG_LEVEL", "INFO")},
    "loggers": {
        "django.db.backends": {"level": "WARNING"},
        # RQ logs every job it runs and every cron tick at INFO (some 30 lines every 10 s):
        # the worker and cron say only what needs attention unless asked for more.
        "rq": {"level": envstr("SUANLI_WORKER_LOG_LEVEL", "WARNING")},
    },
}
SUANLI_WORKER_LOG_LEVEL = envstr("SUANLI_WORKER_LOG_LEVEL", "WARNING")

STATICFILES_FINDERS = [
    "django.contrib.staticfiles.finders.FileSystemFinder",
    "django.contrib.staticfiles.finders.AppDirectoriesFinder",
]

SUANLI_MAX_NODES = envint("SUANLI_MAX_NODES", 16)
SUANLI_PLACEMENT_INTERVAL = envint("SUANLI_PLACEMENT_INTERVAL", 15)
# Fair share between accounts (a team, or a researcher alone) when the fleet is full
# (jobs/placement/fairshare.py): recent usage is GPU-hours decaying by half every
# SUANLI_FAIRSHARE_HALF_LIFE_H hours (0: fair share off, first come, first served), and a
# request that has waited SUANLI_FAIRSHARE_MAX_WAIT_H hours goes ahead of every request
# that waited less, so none starves.
SUANLI_FAIRSHARE_HALF_LIFE_H = envint("SUANLI_FAIRSHARE_HALF_LIFE_H", 24)
SUANLI_FAIRSHARE_MAX_WAIT_H = envint("SUANLI_FAIRSHARE_MAX_WAIT_H", 24)

# The Docker contract: every replica runs as an unprivileged per-tenant uid, with limits.
SUANLI_TENANT_UID_BASE = envint("SUANLI_TENANT_UID_BASE", 100000)
SUANLI_PIDS_LIMIT = envint("SUANLI_PIDS_LIMIT", 4096)
# The system disk: each workspace's and replica's own root filesystem (files outside its
# volumes, the image's included), in GB, unless its GPU model or instance type sets one.
# Enforced by the engine's storage driver where it can (the host check says), else
# measured every SUANLI_ROOT_DISK_CHECK_S by the monitor and acted on.
SUANLI_ROOT_DISK_GB = envint("SUANLI_ROOT_DISK_GB", 30)
SUANLI_ROOT_DISK_CHECK_S = envint("SUANLI_ROOT_DISK_CHECK_S", 60)
SUANLI_MEM_LIMIT_MB = envint("SUANLI_MEM_LIMIT_MB", 8192)
SUANLI_SHM_SIZE_MB = envint("SUANLI_SHM_SIZE_MB", 2048)
# What one container's output may take on its host's disk (3 rotated files of this size),
# and the tmpfs over each VOLUME an image declares (counted in the container's memory).
SUANLI_CONTAINER_LOG_MB = envint("SUANLI_CONTAINER_LOG_MB", 100)
SUANLI_IMAGE_VOLUME_MB = envint("SUANLI_IMAGE_VOLUME_MB", 1024)
SUANLI_MASTER_PORT_BASE = envint("SUANLI_MASTER_PORT_BASE", 29500)
# MTU of the hosts' network: cluster bridges use it, overlays 50 bytes less (VXLAN).
SUANLI_NETWORK_MTU = envint("SUANLI_NETWORK_MTU", 1500)
# Billing: accrual every N seconds; a new cluster needs a balance for N minutes of it.
SUANLI_ACCRUAL_INTERVAL = envint("SUANLI_ACCRUAL_INTERVAL", 10)
SUANLI_MIN_BALANCE_MINUTES = envint("SUANLI_MIN_BALANCE_MINUTES", 10)
# Warn (the pages' banner, balance.low) when the balance lasts fewer hours than this at the
# current burn: the default of researchers who never set their own (0.5 to 168 h, their
# settings page). balance.critical follows at under 30 minutes whatever the threshold.
SUANLI_LOW_BALANCE_HOURS = envint("SUANLI_LOW_BALANCE_HOURS", 2)
# Researchers' storage quotas (jobs/files/storage.py, billing/storage.py): the free part of each
# researcher's quota in GB (1 GB = 1024³ bytes; a fraction such as 0.5 allowed), the most
# one may hold in all, and how many entries the usage walk of a "local" storage looks at
# before it says "at least" (MooseFS counts for itself). Above the free part, what a
# researcher bought is charged per GB-hour at the rate card's storage price.
SUANLI_STORAGE_FREE_GB = envstr("SUANLI_STORAGE_FREE_GB", "20")
SUANLI_STORAGE_MAX_GB = envint("SUANLI_STORAGE_MAX_GB", 10240)
SUANLI_STORAGE_WALK_MAX = envint("SUANLI_STORAGE_WALK_MAX", 100000)
# Files and folders one researcher may hold (a hard inode quota, MooseFS): the master keeps
# every file's metadata in RAM, about 300 bytes each (2,000,000 files: about 600 MB).
SUANLI_STORAGE_FILES_MAX = envint("SUANLI_STORAGE_FILES_MAX", 2_000_000)
# Files deleted while still open ("sustained") are in no folder, so under no quota, until
# closed: the hourly storage upkeep logs an error naming whose they are above this many GB.
SUANLI_STORAGE_SUSTAINED_MAX_GB = envint("SUANLI_STORAGE_SUSTAINED_MAX_GB", 100)
SUANLI_NCCL_IB_HCA = envstr("SUANLI_NCCL_IB_HCA", "mlx5")
SUANLI_STOP_GRACE_S = envint("SUANLI_STOP_GRACE_S", 10)
# Billing starts when a node runs (its workspace, or its first job). A node of a cluster
# without workspaces that has held its GPUs this long without a job is charged anyway, from
# its placement (GPUs held idle are not free). A never-ran cluster with workspaces whose
# node has not started this long after its placement, its pull making no progress, fails
# (nothing charged).
SUANLI_START_GRACE_S = envint("SUANLI_START_GRACE_S", 600)
SUANLI_START_DEADLINE_S = envint("SUANLI_START_DEADLINE_S", 1800)
# Spot preemption: the preemption script's time limit, then SIGTERM, then SIGKILL after
# the grace period.
SUANLI_PREEMPT_SCRIPT_S = envint("SUANLI_PREEMPT_SCRIPT_S", 60)
SUANLI_PREEMPT_GRACE_S = envint("SUANLI_PREEMPT_GRACE_S", 30)
# The scheduler preempts a spot cluster for an on-demand request only once it has run this
# long since its placement (an operator's reclaim is not held back).
SUANLI_SPOT_MIN_RUN_S = envint("SUANLI_SPOT_MIN_RUN_S", 120)
# ...and only for an on-demand request that has waited this long in line, so that requests
# released before they are placed cannot keep preempting other tenants' spot jobs.
SUANLI_RECLAIM_AFTER_S = envint("SUANLI_RECLAIM_AFTER_S", 30)
SUANLI_LOG_STORE_BYTES = envint("SUANLI_LOG_STORE_BYTES", 2_000_000)
# Live job logs: one streaming follower per running replica (the `logs` process) fans the
# lines out to every viewer through the job's Channels group; False: each log socket polls
# the engine for each replica once a second (the old path, without the `logs` process).
SUANLI_LOG_FOLLOWERS = envbool("SUANLI_LOG_FOLLOWERS", True)
SUANLI_JOB_COMMAND_MAX = envint("SUANLI_JOB_COMMAND_MAX", 16384)
SUANLI_RECONCILE_INTERVAL = envint("SUANLI_RECONCILE_INTERVAL", 15)
# Monitoring: 1-second samples for a day, 1-minute rollups for 30 days (monitoring.tasks).
SUANLI_METRICS_RAW_HOURS = envint("SUANLI_METRICS_RAW_HOURS", 24)
SUANLI_METRICS_ROLLUP_DAYS = envint("SUANLI_METRICS_ROLLUP_DAYS", 30)
SUANLI_MONITOR_INTERVAL = envint("SUANLI_MONITOR_INTERVAL", 1)
# For a host whose engine is on the monitor's own machine (unix://), read the containers'
# counters from the kernel (cgroup files, /proc/<pid>/net/dev) in one pass a second; the
# engine is asked only when a container appears. Remote engines keep the engine-stats path.
SUANLI_MONITOR_KERNEL = envbool("SUANLI_MONITOR_KERNEL", True)
# The grid's carbon intensity, grams of CO2 per kWh (e.g. 570.3), that a job's GPU energy
# is multiplied by for its carbon estimate (monitoring/energy.py): your grid's or your
# supplier's published figure. Empty (the default): no carbon estimate is shown, never a guess.
_grid = envstr("SUANLI_GRID_CO2_G_PER_KWH", "").strip()
try:
    SUANLI_GRID_CO2_G_PER_KWH = float(_grid) if _grid else None
except ValueError:
    SUANLI_GRID_CO2_G_PER_KWH = -1.0  # refused below
if SUANLI_GRID_CO2_G_PER_KWH is not None and not 0 < SUANLI_GRID_CO2_G_PER_KWH <= 2000:
    raise ImproperlyConfigured(
        f"SUANLI_GRID_CO2_G_PER_KWH={_grid!r}: grams of CO2 per kWh, a number above 0 and at "
        "most 2000 (a coal-fired grid is about 1000), or empty for no carbon estimate"
    )
# Prometheus metrics for operators (jobs/base/metrics.py, console/metrics.py). The web's
# GET /metrics answers a bearer token equal to this one (a long random secret; empty: no
# token opens it), an address of METRICS_ALLOW, or a signed-in user holding
# console.view_metrics; anyone else 401/403. The processes' own ports need it too.
SUANLI_METRICS_TOKEN = envstr("SUANLI_METRICS_TOKEN", "")
# Scrapers let in by their address (addresses and networks, comma-separated; none by
# default): the connection's own address, or the client a trusted proxy names. Never a
# proxy's own address (a loopback one: `manage.py check` warns); use the token there.
_metrics_allow = os.environ.get("SUANLI_METRICS_ALLOW", "")
SUANLI_METRICS_ALLOW = trusted_proxies(_metrics_allow, "SUANLI_METRICS_ALLOW")
# Seconds the fleet-wide series (read from PostgreSQL and Redis) are reused between scrapes.
SUANLI_METRICS_CACHE_S = envint("SUANLI_METRICS_CACHE_S", 5)
# The other processes serve their own series on this address; a non-loopback one needs
# METRICS_TOKEN, sent as a bearer token (`manage.py check` refuses it otherwise).
SUANLI_METRICS_BIND = envstr("SUANLI_METRICS_BIND", "127.0.0.1")
# Each process's metrics port (process=port, comma-separated; 0 or left out: none).
_metrics_ports = envstr(
    "SUANLI_METRICS_PORTS",
    "cron=9810,worker=9820,monitor=9830,gateway=9840,logs=9850,watch=9860,builder=9870,profiles=9880",
)
SUANLI_METRICS_PORTS = {
    name.strip(): int(port or 0)
    for name, _, port in (item.partition("=") for item in _metrics_ports.split(","))
    if name.strip()
}
# A second process of a kind on one machine takes the next free port of this many.
SUANLI_METRICS_PORT_TRIES = envint("SUANLI_METRICS_PORT_TRIES", 8)
# Profiler traces (SUANLI_PROFILE_DIR, monitoring.profiles), summarised by the `profiles`
# worker (its own queue and process, each summary in a forked horse whose data memory is
# capped at WORKER_MEMORY_MB): a file over STREAM_BYTES is read by streaming its events;
# one over MAX_BYTES (as JSON text, after gunzip), MAX_EVENTS events or FILE_SECONDS of
# work is refused with a sentence; one with GPU kernels up to HTA_MAX_BYTES (as JSON) is
# also read by Holistic Trace Analysis, which loads it whole.
SUANLI_PROFILE_STREAM_BYTES = envint("SUANLI_PROFILE_STREAM_BYTES", 64 * 2**20)
SUANLI_PROFILE_MAX_BYTES = envint("SUANLI_PROFILE_MAX_BYTES", 4 * 2**30)
SUANLI_PROFILE_MAX_EVENTS = envint("SUANLI_PROFILE_MAX_EVENTS", 5_000_000)
SUANLI_PROFILE_FILE_SECONDS = envint("SUANLI_PROFILE_FILE_SECONDS", 120)
SUANLI_PROFILE_HTA_MAX_BYTES = envint("SUANLI_PROFILE_HTA_MAX_BYTES", 512 * 2**20)
SUANLI_PROFILE_WORKER_MEMORY_MB = envint("SUANLI_PROFILE_WORKER_MEMORY_MB", 3072)
# Pools and sweeps (issue 26): how often the autoscaler and the sweeps' safety net run, and
# how long the pool's queue-against-clusters samples are kept.
SUANLI_POOL_INTERVAL = envint("SUANLI_POOL_INTERVAL", 5)
SUANLI_POOL_SAMPLE_DAYS = envint("SUANLI_POOL_SAMPLE_DAYS", 30)
# GPU subscriptions (issue 41, jobs/pools/subscriptions.py): the most waiting ones a researcher
# may have and the most she may make in 24 hours (guards against filling the table, cancelled
# ones included), and how often the cron tick checks them (GPUs coming back also queue a check).
SUANLI_GPU_SUBSCRIPTIONS_MAX = envint("SUANLI_GPU_SUBSCRIPTIONS_MAX", 20)
SUANLI_GPU_SUBSCRIPTIONS_PER_DAY = envint("SUANLI_GPU_SUBSCRIPTIONS_PER_DAY", 100)
SUANLI_GPU_SUBSCRIPTIONS_INTERVAL = envint("SUANLI_GPU_SUBSCRIPTIONS_INTERVAL", 60)
# Webhooks (jobs/events/webhooks.py): the console's public base URL for links in event bodies.
SUANLI_PUBLIC_URL = envstr("SUANLI_PUBLIC_URL", "http://localhost:8000")
SUANLI_WEBHOOK_TIMEOUT_S = envint("SUANLI_WEBHOOK_TIMEOUT_S", 15)
SUANLI_WEBHOOK_RETRY_DELAYS = [
    int(x)
    for x in envstr("SUANLI_WEBHOOK_RETRY_DELAYS", "0,5,300,1800,7200,18000,36000,36000").split(",")
]
SUANLI_WEBHOOK_DISABLE_AFTER_S = envint("SUANLI_WEBHOOK_DISABLE_AFTER_S", 5 * 24 * 3600)
# Webhook targets operators allow although not public (comma-separated; off by default).
SUANLI_WEBHOOK_ALLOW_HOSTS = [h for h in envstr("SUANLI_WEBHOOK_ALLOW_HOSTS", "").split(",") if h]
SUANLI_WEBHOOK_ALLOW_NETS = [n for n in envstr("SUANLI_WEBHOOK_ALLOW_NETS", "").split(",") if n]
# Notification channels (webhooks, e-mail addresses, chat robots) one researcher may have: a
# guard against filling the table (and each event's deliveries) in a loop.
SUANLI_NOTIFY_CHANNELS_MAX = envint("SUANLI_NOTIFY_CHANNELS_MAX", 20)
# Notification e-mail (e-mail channels and their confirmation links, jobs/events/webhooks.py),
# sent with Django's SMTP backend: the relay, its port, STARTTLS or implicit TLS, the log-in
# (blank: none), the sender, and how long one SMTP exchange may take (seconds).
EMAIL_HOST = envstr("EMAIL_HOST", "localhost")
EMAIL_PORT = envint("EMAIL_PORT", 25)
EMAIL_USE_TLS = envbool("EMAIL_USE_TLS", False)
EMAIL_USE_SSL = envbool("EMAIL_USE_SSL", False)
EMAIL_HOST_USER = envstr("EMAIL_HOST_USER", "")
EMAIL_HOST_PASSWORD = envstr("EMAIL_HOST_PASSWORD", "")
DEFAULT_FROM_EMAIL = envstr("DEFAULT_FROM_EMAIL", "Suanli <noreply@localhost>")
EMAIL_TIMEOUT = envint("EMAIL_TIMEOUT", 15)
# Workspaces (jobs/nodes/workspaces.py): the share of a node's CPUs and memory its workspace gets;
# a job's replicas get the rest (all of it on clusters without workspaces), so that the
# node's containers together never hold more than the node.
SUANLI_WORKSPACE_SHARE = min(max(envint("SUANLI_WORKSPACE_SHARE_PCT", 25), 5), 95) / 100
SUANLI_WORKSPACE_STOP_S = envint("SUANLI_WORKSPACE_STOP_S", 10)  # SIGTERM, then SIGKILL
# A workspace made again (another GPU set, no-GPU mode) is committed over its last save;
# past this many layers the save is flattened (overlay2 stacks about 125).
SUANLI_WORKSPACE_MAX_LAYERS = envint("SUANLI_WORKSPACE_MAX_LAYERS", 60)
SUANLI_WORKSPACE_SAVE_S = envint("SUANLI_WORKSPACE_SAVE_S", 3600)  # one save (docker commit)
# Stopping and starting (jobs/clusters/services.py): a stopped cluster keeps its workspaces on their
# hosts this many days (a fraction is allowed), counted from its stop, then is released; a
# warning goes out a day before. It is also the retention period of a balance that runs out:
# its clusters are stopped, not released, and their kept time is not charged while the
# balance is at or below 0 (billing/accrual.py stop_exhausted). Started without GPUs, each
# node's workspace gets this CPU and memory.
SUANLI_STOPPED_RELEASE_S = int(float(envstr("SUANLI_STOPPED_RELEASE_DAYS", "15")) * 86400)
SUANLI_NO_GPU_CPUS = float(envstr("SUANLI_NO_GPU_CPUS", "1"))
SUANLI_NO_GPU_MEMORY_MB = envint("SUANLI_NO_GPU_MEMORY_MB", 4096)
# They come on top of the GPU nodes' shares of the host: at most this many a host. And
# one researcher keeps at most this many stopped clusters (their workspaces' disk).
SUANLI_NO_GPU_PER_HOST = envint("SUANLI_NO_GPU_PER_HOST", 4)
SUANLI_MAX_STOPPED_CLUSTERS = envint("SUANLI_MAX_STOPPED_CLUSTERS", 10)
# Logging in (console/logins.py): the host name the cluster page, the API and `suanli ssh`
# give for the SSH gateway; empty: the name the console was reached by, without its port.
SUANLI_SSH_HOST = envstr("SUANLI_SSH_HOST", "")
# The SSH gateway (jobs/access/ssh.py, Procfile `gateway`): ssh, scp/sftp and `ssh -L` into the
# workspaces. Bound to this machine unless the operator binds it elsewhere. Its host key
# is made once (ed25519, 0600) and kept: researchers' known_hosts remember it.
SUANLI_SSH_PORT = envint("SUANLI_SSH_PORT", 2222)
SUANLI_SSH_BIND = envstr("SUANLI_SSH_BIND", "127.0.0.1")
SUANLI_SSH_HOST_KEY = Path(
    envstr("SUANLI_SSH_HOST_KEY", str(BASE_DIR / ".run" / "ssh_host_ed25519_key"))
)
SUANLI_SSH_IDLE_S = envint("SUANLI_SSH_IDLE_S", 3600)  # no data either way: closed
SUANLI_SSH_MAX_SESSIONS = envint("SUANLI_SSH_MAX_SESSIONS", 10)  # per researcher, all gateways
SUANLI_SSH_MAX_CHANNELS = envint("SUANLI_SSH_MAX_CHANNELS", 10)  # per connection (shells, -L, sftp)
# OpenSSH's sftp-server, rsync and scp alone (.ci/lib.sh builds it on every engine); never
# pulled. Runs sftp, and rsync or scp -O for a workspace whose image has none.
SUANLI_SFTP_IMAGE = envstr("SUANLI_SFTP_IMAGE", "suanli/sftp:latest")

# Researchers' own images (jobs/images/builds.py, jobs/nodes/registry.py). The registry they live in, as
# host[:port] (Harbor, a cloud registry, or `make run`'s docker-registry), with the
# console's credentials: researchers need none of their own. Empty: no own images.
SUANLI_REGISTRY = envstr("SUANLI_REGISTRY", "")
SUANLI_REGISTRY_USERNAME = envstr("SUANLI_REGISTRY_USERNAME", "")
SUANLI_REGISTRY_PASSWORD = envstr("SUANLI_REGISTRY_PASSWORD", "")
SUANLI_REGISTRY_CA = envstr("SUANLI_REGISTRY_CA", "")  # a PEM file; empty: the system's CAs
# Engines pull from public registries and from SUANLI_REGISTRY as spelled there, never from
# another registry on a loopback, private or link-local address (jobs/base/validators.py,
# registry_refusal) unless named here: host[:port] of an operator's mirror on the LAN.
SUANLI_PULL_ALLOW_REGISTRIES = envlist("SUANLI_PULL_ALLOW_REGISTRIES", [])
# The public registries (host[:port] as references spell them) besides Docker Hub that
# clusters may pull from: a researcher never hands the engine a registry of their choosing.
SUANLI_PULL_REGISTRIES = envlist(
    "SUANLI_PULL_REGISTRIES",
    ["ghcr.io", "nvcr.io", "quay.io", "registry.k8s.io", "gcr.io", "public.ecr.aws"],
)
# Builds run on hosts marked as build hosts, never privileged, with no host mounts, under
# these limits (a build over its time is stopped), on their own network: a bridge whose
# containers reach neither the host nor the private networks (the tenant firewall's slc+
# rules), or "none".
SUANLI_BUILD_CPUS = float(envstr("SUANLI_BUILD_CPUS", "2"))
SUANLI_BUILD_MEMORY_MB = envint("SUANLI_BUILD_MEMORY_MB", 4096)
SUANLI_BUILD_TIMEOUT_S = envint("SUANLI_BUILD_TIMEOUT_S", 3600)
SUANLI_BUILD_CONTEXT_MB = envint("SUANLI_BUILD_CONTEXT_MB", 512)  # a storage folder, tarred
SUANLI_BUILD_NETWORK = envstr("SUANLI_BUILD_NETWORK", "slcbuild")
SUANLI_BUILD_LOG_BYTES = envint("SUANLI_BUILD_LOG_BYTES", 1 << 20)  # kept per build (its end)
# The most one build may write on its host's disk (its steps' layers and the running
# step's files, measured every SUANLI_BUILD_POLL_S while it runs); past it, it is stopped.
SUANLI_BUILD_MAX_BYTES = envint("SUANLI_BUILD_MAX_BYTES", 30_000_000_000)
SUANLI_BUILD_POLL_S = float(envstr("SUANLI_BUILD_POLL_S", "1"))
# What FROM may name besides the catalog's images and the researcher's own: references,
# or prefixes ending in "*" (e.g. "docker.io/pytorch/pytorch:*"), comma-separated.
SUANLI_BUILD_FROM_ALLOWED = [
    r.strip() for r in envstr("SUANLI_BUILD_FROM_ALLOWED", "").split(",") if r.strip()
]
# Per researcher: how many own images, and how many GB of distinct layers in the registry.
SUANLI_IMAGE_QUOTA_COUNT = envint("SUANLI_IMAGE_QUOTA_COUNT", 20)
SUANLI_IMAGE_QUOTA_GB = float(envstr("SUANLI_IMAGE_QUOTA_GB", "50"))
SUANLI_IMAGE_PULL_S = envint("SUANLI_IMAGE_PULL_S", 3600)  # one pull onto a host
SUANLI_BUILDS_PER_RESEARCHER = envint("SUANLI_BUILDS_PER_RESEARCHER", 2)  # queued or running
