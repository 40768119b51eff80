"""`suanli logs`: a job's log, all nodes merged by time, followed with -f."""

from __future__ import annotations

import json
import sys
import time

import click

from suanli_cli.core import (
    POLL_S,
    Api,
    Failure,
    emit_json,
    json_option,
    wants_json,
)
from suanli_cli.main import cli

# logs


@cli.command()
@click.argument("job_id", type=int, metavar="JOB")
@click.option(
    "-f", "--follow", is_flag=True,
    help="Keep printing new lines until the job ends; exit with the job's exit code.",
)  # fmt: skip
@click.option(
    "--ranks/--no-ranks", default=None,
    help="Start lines with [rank N] (default: when the job runs on more than one node).",
)  # fmt: skip
@json_option
def logs(job_id, follow, ranks, as_json):
    """A job's log: its current attempt, all nodes merged by time.

    With --json: the API's answer, or with -f one JSON object per line.
    """
    api = Api.from_config()
    what = f"job {job_id}"
    as_json = wants_json(as_json)
    if not follow:
        body = api.get(f"jobs/{job_id}/log", what)
        if as_json:
            emit_json(body)
            return
        prefix = _wants_ranks(api, job_id, ranks)
        for line in body.get("lines", []):
            _print_line(line, prefix)
        return
    prefix = False if as_json else _wants_ranks(api, job_id, ranks)
    cursor, attempt = None, None
    while True:
        params = {"since": cursor} if cursor else {}
        try:
            body = api.get(f"jobs/{job_id}/log", what, **params)
        except Failure as exc:
            if exc.status != 429:
                raise
            time.sleep(5)  # the rate limit of this token: wait, then go on
            continue
        if attempt is not None and body.get("attempt") != attempt and not as_json:
            click.echo(f"--- attempt {body.get('attempt')} ---", err=True)
        attempt = body.get("attempt")
        for line in body.get("lines", []):
            if as_json:
                click.echo(json.dumps({**line, "attempt": attempt}, ensure_ascii=False))
            else:
                _print_line(line, prefix)
        cursor = body.get("cursor")
        if body.get("complete"):
            break
        time.sleep(POLL_S)
    code = body.get("exit_code")
    if not as_json:
        click.echo(f"--- job {job_id} {body.get('state')} (exit code {code}) ---", err=True)
    if code is None:
        code = 0 if body.get("state") == "succeeded" else 1
    sys.exit(max(0, min(int(code), 255)) if isinstance(code, int) else 1)


def _wants_ranks(api: Api, job_id: int, ranks: bool | None) -> bool:
    if ranks is not None:
        return ranks
    job = api.get(f"jobs/{job_id}", f"job {job_id}")
    cluster = api.get(f"clusters/{job['cluster']}", f"cluster {job['cluster']}")
    return int(cluster.get("nodes") or 1) > 1


def _print_line(line: dict, prefix: bool) -> None:
    text = line.get("text", "")
    click.echo(f"[rank {line.get('rank')}] {text}" if prefix else text)
