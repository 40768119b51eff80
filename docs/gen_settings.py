"""Writes docs/operator/settings.md: every environment variable console/settings.py reads,
with its default and the comment above it, in the file's order.

Run by `make docs`; tests/test_docs.py fails when the committed page differs from what this
writes, so a setting added to settings.py must reach the manual. `--check` prints the
difference and exits 1 instead of writing.
"""

from __future__ import annotations

import ast
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = ROOT / "console" / "settings.py"
OUT = ROOT / "docs" / "operator" / "settings.md"
READERS = {"envstr", "envint", "envbool", "envlist"}
KINDS = {"envstr": "text", "envint": "integer", "envbool": "boolean", "envlist": "list"}

# Settings whose line in settings.py has no comment of its own.
MORE = {
    "DEBUG": "Django's debug mode: off by default and in production (`make run` too).",
    "SECRET_KEY": "Django's secret key; required when DEBUG is off.",
    "ALLOWED_HOSTS": "The console's host names (never the apps' domain: `manage.py check` refuses it).",
    "CSRF_TRUSTED_ORIGINS": "Origins trusted for CSRF besides the console's own (never an app origin).",
    "SITE_URL": "The console's URL, linked from the app origins' pages.",
    "DATABASE_URL": "PostgreSQL in production (`postgres://user:pass@db:5432/suanli`); SQLite is the zero-setup default.",
    "DATABASE_CONN_MAX_AGE": "Seconds a database connection is kept for reuse.",
    "SUANLI_STATIC_MANIFEST": "Hashed static files with a gzip and a brotli copy each after `collectstatic`, cached for good (on unless DEBUG; `make run` too).",
    "SUANLI_CHANNEL_LAYER_REDIS": "The Channels layer on Redis (0: in memory, one process only).",
    "LOG_LEVEL": "The root logger's level.",
    "SUANLI_MAX_NODES": "The most nodes one cluster may have.",
    "SUANLI_STATIC_FINDERS": "Static files served straight from the source tree, no collectstatic (with `SUANLI_STATIC_MANIFEST=0`).",
    "SUANLI_CHART_CACHE_S": "Seconds a finished job's computed chart and diagnosis stay in each process's cache.",
    "SUANLI_CHART_CACHE_ENTRIES": "How many of them each process keeps.",
    "SUANLI_SQLITE_TIMEOUT_S": "SQLite only (`make run`): seconds a writer waits for the lock.",
    "SECURE_HSTS_SECONDS": "HSTS max-age over HTTPS.",
    "SUANLI_MEM_LIMIT_MB": "A GPU node's memory where its host's memory is not known yet.",
    "SUANLI_SHM_SIZE_MB": "`/dev/shm` of a container, at most half its memory.",
    "SUANLI_MASTER_PORT_BASE": "`MASTER_PORT` of a multi-node job.",
    "SUANLI_LOW_BALANCE_HOURS": "A balance lasting fewer hours at the current burn is low (pages warn, `balance.low`).",
    "SUANLI_NCCL_IB_HCA": "`NCCL_IB_HCA` of RDMA nodes.",
    "SUANLI_LOG_STORE_BYTES": "The last bytes of a replica's output kept as its stored log.",
    "SUANLI_JOB_COMMAND_MAX": "The longest job command accepted (characters).",
    "SUANLI_RECONCILE_INTERVAL": "Seconds between reconciler passes (and dispatch sweeps) in `cron`.",
    "SUANLI_MONITOR_INTERVAL": "Seconds between the monitor's samples.",
    "SUANLI_POOL_SAMPLE_DAYS": "Days a pool's queue-against-clusters samples are kept.",
    "SUANLI_WEBHOOK_TIMEOUT_S": "Seconds a webhook delivery waits for an answer.",
    "SUANLI_WEBHOOK_RETRY_DELAYS": "Seconds before each delivery attempt, comma-separated.",
    "SUANLI_WEBHOOK_DISABLE_AFTER_S": "An endpoint failing this long is disabled.",
    "SUANLI_PLACEMENT_INTERVAL": "Seconds between the `cron` process's placement passes (one also runs on every change).",
}

HEAD = """# Settings

Every setting comes from the environment (`console/settings.py`); a secret may instead be
read from a file named by `NAME_FILE` (e.g. `SECRET_KEY_FILE`; every text setting takes
this). Booleans are `1`/`0`, `true`/`false`, `yes`/`no`, `on`/`off`; lists are
comma-separated. What each one does in context is in the pages of this manual
([Installing](installing.md) first).

This page is generated from `console/settings.py` by `docs/gen_settings.py` (`make docs`);
the suite fails when it is out of date.

| variable | type | default | what the code says | in the manual |
|---|---|---|---|---|
"""


def _comment_above(lines: list[str], lineno: int) -> list[str]:
    """The comment lines directly above line `lineno` (1-based), top to bottom."""
    out: list[str] = []
    i = lineno - 2
    while i >= 0 and lines[i].lstrip().startswith("#"):
        out.insert(0, lines[i].strip().lstrip("#").strip())
        i -= 1
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ").strip()


def rows() -> list[tuple[str, str, str, str]]:
    source = SETTINGS.read_text()
    lines = source.splitlines()
    tree = ast.parse(source)
    seen: dict[str, int] = {}
    found: list[tuple[str, str, str, str]] = []
    for stmt in tree.body:
        group = _comment_above(lines, stmt.lineno)
        calls = []
        for node in ast.walk(stmt):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            name = node.func.id if isinstance(node.func, ast.Name) else None
            first = node.args[0]
            if name in READERS and isinstance(first, ast.Constant):
                default = ast.get_source_segment(source, node.args[1]) if len(node.args) > 1 else ""
                calls.append((node.lineno, first.value, KINDS[name], default))
            elif (  # os.environ.get("NAME", default) (SUANLI_TRUSTED_PROXIES)
                isinstance(node.func, ast.Attribute)
                and node.func.attr == "get"
                and ast.unparse(node.func.value) == "os.environ"
                and isinstance(first, ast.Constant)
            ):
                default = ast.get_source_segment(source, node.args[1]) if len(node.args) > 1 else ""
                calls.append((node.lineno, first.value, "list", default))
        if not calls:
            continue
        for lineno, var, kind, default in sorted(calls):
            if lineno == stmt.lineno:
                words = list(group)
            else:  # a call inside a longer statement: the comment right above its own line
                words = []
                i = lineno - 2
                while i >= stmt.lineno - 1 and lines[i].lstrip().startswith("#"):
                    words.insert(0, lines[i].strip().lstrip("#").strip())
                    i -= 1
            words = words or [MORE.get(var, "")]
            line = lines[lineno - 1]
            if "  # " in line:
                words.append(line.split("  # ", 1)[1].strip())
            if var in seen:
                continue
            seen[var] = lineno
            found.append((var, kind, default, " ".join(words)))
    return found


def _pages() -> dict[str, str]:
    """The manual's pages (but this one), by their path relative to this page's folder."""
    docs = ROOT / "docs"
    return {
        Path(os.path.relpath(page, OUT.parent)).as_posix(): page.read_text()
        for page in sorted(docs.rglob("*.md"))
        if page != OUT
    }


def _title(text: str) -> str:
    first = text.splitlines()[0] if text else ""
    return first.lstrip("#").strip() if first.startswith("# ") else "?"


def render() -> str:
    pages = _pages()
    out = []
    for var, kind, default, words in rows():
        word = re.compile(rf"(?<![A-Z0-9_]){re.escape(var)}(?![A-Z0-9_])")
        where = ", ".join(
            f"[{_title(text)}]({path})" for path, text in pages.items() if word.search(text)
        )
        value = f"`{_cell(default)}`" if default else ""
        out.append(f"| `{var}` | {kind} | {value} | {_cell(words)} | {where} |\n")
    return HEAD + "".join(out)


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if OUT.read_text() != text:
            print(f"{OUT.relative_to(ROOT)} is out of date: run `make docs` (docs/gen_settings.py)")
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
