"""The project's own contracts: deploy settings, layering, lint."""

import ast
import os
import secrets
import subprocess
import sys
from pathlib import Path

from cryptography.fernet import Fernet

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def _run(args, env=None):
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_check_deploy_with_production_settings_prints_no_warnings():
    env = {
        "PATH": os.environ["PATH"],
        "DEBUG": "0",
        "SECRET_KEY": secrets.token_urlsafe(50),
        "SUANLI_SECRETS_KEY": Fernet.generate_key().decode(),
        "ALLOWED_HOSTS": "console.example.com",
        "SUANLI_APPS_DOMAIN": "apps.example.net",
    }
    result = _run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"], env
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "System check identified no issues (0 silenced)." in result.stdout


def test_the_apps_domain_and_the_console_cookies_are_checked_apart():
    """An app origin never shares the console's cookies or hosts: `check` refuses settings
    that would (console/checks.py), and over HTTPS the cookies are `__Host-` prefixed."""
    base = {
        "PATH": os.environ["PATH"],
        "DEBUG": "0",
        "SECRET_KEY": secrets.token_urlsafe(50),
        "SUANLI_SECRETS_KEY": Fernet.generate_key().decode(),
        "SUANLI_APPS_DOMAIN": "apps.example.net",
    }
    for hosts, error in (
        (".example.net", "suanli.E004"),  # the console's hosts reach the apps' domain
        ("*", "suanli.E004"),
        ("console.apps.example.net", "suanli.E004"),
    ):
        result = _run([sys.executable, "manage.py", "check"], {**base, "ALLOWED_HOSTS": hosts})
        assert result.returncode != 0 and error in result.stderr, (hosts, result.stderr)
    for origin in ("https://x.apps.example.net", "https://*.example.net"):  # Django's wildcard
        trusted = {**base, "ALLOWED_HOSTS": "console.example.com", "CSRF_TRUSTED_ORIGINS": origin}
        result = _run([sys.executable, "manage.py", "check"], trusted)
        assert result.returncode != 0 and "suanli.E005" in result.stderr, (origin, result.stderr)
    names = _run(
        [sys.executable, "manage.py", "shell", "-c",
         "from django.conf import settings as s; print(s.SESSION_COOKIE_NAME, "
         "s.CSRF_COOKIE_NAME, s.SESSION_COOKIE_DOMAIN, s.CSRF_COOKIE_DOMAIN)"],
        {**base, "ALLOWED_HOSTS": "console.example.com"},
    )  # fmt: skip
    said = names.stdout.strip().splitlines()[-1:]  # after the shell's own greeting
    assert said == ["__Host-sessionid __Host-csrftoken None None"], names.stdout + names.stderr


def test_missing_secret_key_in_production_is_refused():
    env = {"PATH": os.environ["PATH"], "DEBUG": "0", "ALLOWED_HOSTS": "console.example.com"}
    result = _run([sys.executable, "manage.py", "check"], env)
    assert result.returncode != 0
    assert "SECRET_KEY (or SECRET_KEY_FILE) must be set" in result.stderr


def test_apps_keep_their_layers():
    result = _run([str(BIN / "lint-imports")])
    assert result.returncode == 0, result.stdout + result.stderr
    # the apps' layers, jobs' packages in layers, no circles in jobs, the CLI without the
    # console, the web process without asyncssh
    assert "5 kept, 0 broken" in result.stdout


def test_no_import_hides_inside_a_function_of_an_app():
    """The apps' modules import each other at the top, downward only (lint-imports sees
    that); an import inside a function is allowed only where a library demands it, with a
    comment on its line that says why."""
    hidden = set()
    paths = [
        p
        for app in ("jobs", "billing", "monitoring", "console")
        for p in (ROOT / app).rglob("*.py")
    ]
    for path in sorted(paths):
        if "migrations" in path.parts:
            continue
        source = path.read_text()
        lines = source.splitlines()
        for func in ast.walk(ast.parse(source)):
            if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(func):
                if (
                    isinstance(node, ast.Import | ast.ImportFrom)
                    and "#" not in lines[node.lineno - 1]
                ):
                    hidden.add(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not hidden, f"imports inside functions, without a comment why: {sorted(hidden)}"


def test_migrations_are_complete():
    result = _run([sys.executable, "manage.py", "makemigrations", "--check", "--dry-run"])
    assert result.returncode == 0, result.stdout + result.stderr
