"""`suanli`: the command line of the console, for researchers and their scripts.

It speaks only the public token API under /api/v1/ (console/api.py) and imports only the
standard library, click and requests: never Django, never our apps, so it runs on a laptop
with none of the console's settings. `suanli login` keeps the URL and token in
`$XDG_CONFIG_HOME/suanli/config.json` (or `~/.config/suanli/config.json`), readable by its
owner only; `SUANLI_URL` and `SUANLI_TOKEN` override it for scripts and CI.

Every command prints plain lines or a table, or with `--json` the API's JSON for scripts.
Errors are one sentence on stderr and a non-zero exit status (1; 2 for a misused command):
never a traceback.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path

import click
import requests

API = "/api/v1"
TIMEOUT_S = 30
POLL_S = float(os.environ.get("SUANLI_POLL_S", "1"))
JOB_ENDED = ("succeeded", "failed", "cancelled")
BUILD_ENDED = ("succeeded", "failed")
CLI_OPTION = {  # the API's field names as this command's options, in error messages
    "gpu_model": "--gpu",
    "instance_type": "--cpu",
    "gpus_per_node": "--gpus-per-node",
    "release_policy": "--release-policy",
    "idle_minutes": "--idle-minutes",
    "volumes": "--volume",
    "ssh_keys": "--ssh-key",
    "checkpoint_dir": "--checkpoint-dir",
    "preemption_script": "--preemption-script",
    "max_preemptions": "--max-preemptions",
    "max_runtime_min": "--max-runtime",
    "build_args": "--build-arg",
    "dockerfile": "DIR/Dockerfile",
}


class Failure(click.ClickException):
    """An error said in words: printed as one message, exit status 1."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status  # the API's HTTP status, if it answered

    def show(self, file=None) -> None:
        click.echo(f"suanli: {self.format_message()}", err=True)


# -- configuration ----------------------------------------------------------------------------


def config_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "suanli" / "config.json"


def _read_config() -> dict:
    path = config_path()
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise Failure(f"cannot read {path} ({exc}); run suanli login again.") from None
    return data if isinstance(data, dict) else {}


def _write_config(data: dict) -> Path:
    """Written whole or not at all, readable by its owner only (it holds the token)."""
    path = config_path()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".config-", suffix=".tmp")
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(data, out, indent=2)
            out.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def normalise_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if url.endswith(API):
        url = url[: -len(API)]
    if not re.match(r"^https?://[^/\s]+", url):
        raise Failure(f"{url or 'the URL'} is not a console URL: give http(s)://host[:port].")
    return url


# -- the API ----------------------------------------------------------------------------------


class Api:
    def __init__(self, url: str, token: str):
        self.url = normalise_url(url)
        self.token = token
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"Bearer {token}"
        self.session.headers["User-Agent"] = "suanli-cli"

    @classmethod
    def from_config(cls) -> Api:
        config = _read_config()
        url = os.environ.get("SUANLI_URL") or config.get("url")
        token = os.environ.get("SUANLI_TOKEN") or config.get("token")
        if not url or not token:
            raise Failure("not logged in: run suanli login (or set SUANLI_URL and SUANLI_TOKEN).")
        return cls(url, token)

    def get(self, path: str, what: str = "", **params) -> dict:
        return self.call("GET", path, what, params=params or None)

    def post(self, path: str, what: str = "", body: dict | None = None) -> dict:
        return self.call("POST", path, what, json=body or {})

    def delete(self, path: str, what: str = "") -> dict:
        return self.call("DELETE", path, what)

    def call(self, method: str, path: str, what: str, **kwargs) -> dict:
        """The answer's JSON, or a Failure that says what went wrong in words."""
        try:
            response = self.session.request(
                method, f"{self.url}{API}/{path}", timeout=TIMEOUT_S, **kwargs
            )
        except requests.exceptions.SSLError as exc:
            raise Failure(f"TLS with {self.url} failed: {_reason(exc)}.") from None
        except requests.exceptions.Timeout:
            raise Failure(
                f"the console at {self.url} did not answer within {TIMEOUT_S} s."
            ) from None
        except requests.exceptions.RequestException as exc:
            raise Failure(
                f"cannot reach the console at {self.url}: {_reason(exc)}. Check the URL "
                "(suanli login) and that the console is running."
            ) from None
        if response.status_code >= 500:
            raise Failure(
                f"the console at {self.url} failed (HTTP {response.status_code}); try again "
                "later, or tell its operator.",
                response.status_code,
            )
        if response.status_code == 204:  # done, nothing to say (a delete)
            return {}
        try:
            body = response.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise Failure(
                f"{self.url} answered HTTP {response.status_code} with "
                f"{response.headers.get('Content-Type') or 'no content type'}, not the Suanli "
                "API: is the URL the console's?"
            )
        if response.status_code < 400:
            return body
        raise Failure(
            _error_words(response.status_code, body, what, response.headers),
            response.status_code,
        )


def _reason(exc: Exception) -> str:
    """The innermost cause in a few words: 'Connection refused', not urllib3's chain."""
    text = str(exc)
    errno = re.findall(r"\[Errno -?\d+\] ([^'\")]+)", text)
    if errno:
        return errno[-1].strip().rstrip(".")
    for words in ("Connection refused", "Name or service not known", "certificate verify failed"):
        if words in text:
            return words
    return type(exc).__name__


def _error_words(status: int, body: dict, what: str, headers) -> str:
    message = str(body.get("error") or "")
    if status == 401:
        return "the token was refused (unknown or revoked); run suanli login."
    if status == 404:
        return f"{what or 'that'} was not found (not yours, or no such thing)."
    if status == 429:
        wait = headers.get("Retry-After", "a minute")
        return f"too many requests; the console asks to wait {wait} s. {message}".strip()
    fields = body.get("fields") if isinstance(body.get("fields"), dict) else {}
    lines = [message or f"refused (HTTP {status})."]
    for name, errors in fields.items():
        label = CLI_OPTION.get(name, f"--{name.replace('_', '-')}")
        for error in errors if isinstance(errors, list) else [errors]:
            lines.append(f"  {label}: {error}")
    return "\n".join(lines)


# -- output -----------------------------------------------------------------------------------


def _emit_json(data) -> None:
    click.echo(json.dumps(data, indent=2, ensure_ascii=False))


def _table(rows: list[dict], columns: list[tuple[str, str]]) -> None:
    if not rows:
        click.echo("(none)")
        return
    cells = [[title for _, title in columns]]
    cells += [
        ["" if row.get(key) is None else str(row.get(key)) for key, _ in columns] for row in rows
    ]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    for line in cells:
        click.echo(
            "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        )


def _fields(data: dict, keys: list[str]) -> None:
    width = max(len(k) for k in keys)
    for key in keys:
        value = data.get(key)
        if value is None or value == "":
            continue
        if isinstance(value, bool):
            value = "yes" if value else "no"
        text = str(value).replace("\n", "\n" + " " * (width + 2))
        click.echo(f"{key.replace('_', ' ')}:".ljust(width + 2) + text)


def _when(value: str | None) -> str:
    return value.replace("T", " ")[:19] if value else ""


def json_option(command):
    """`--json` on a command; `suanli --json ...` works too."""
    return click.option(
        "--json", "as_json", is_flag=True, help="Print the API's JSON (for scripts)."
    )(command)


def _wants_json(as_json: bool) -> bool:
    ctx = click.get_current_context()
    return as_json or bool((ctx.find_root().obj or {}).get("json"))


def _all_pages(api: Api, path: str, key: str, **params) -> list[dict]:
    rows, page = [], 1
    while True:
        body = api.get(path, **params, page=page)
        rows += body.get(key, [])
        if page >= int(body.get("pages") or 1):
            return rows
        page += 1


# -- commands ---------------------------------------------------------------------------------


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--json", "as_json", is_flag=True, help="Print the API's JSON (for scripts).")
@click.version_option(package_name="suanli", prog_name="suanli")
@click.pass_context
def cli(ctx, as_json):
    """Suanli's GPU clusters, jobs, images and balance from the command line.

    Start with `suanli login`; SUANLI_URL and SUANLI_TOKEN override the saved login.
    """
    ctx.obj = {"json": as_json}


@cli.command()
@click.option("--url", help="The console's address, e.g. https://suanli.example.edu.")
@click.option(
    "--token",
    help="An API token (the console's API page). If not given: read from a pipe, or "
    "prompted without echo.",
)
@json_option
def login(url, token, as_json):
    """Check a console URL and API token, and save them for the other commands."""
    saved = _read_config()
    if not url:
        url = click.prompt("Console URL", default=saved.get("url") or None)
    url = normalise_url(url)
    if not token and not sys.stdin.isatty():
        token = sys.stdin.readline()  # piped: `pass show suanli | suanli login --url ...`
    if not token:
        token = click.prompt("API token", hide_input=True)
    token = token.strip()
    balance = Api(url, token).get("balance")  # refused or unreachable: nothing is saved
    path = _write_config({"url": url, "token": token})
    if _wants_json(as_json):
        _emit_json({"url": url, "config": str(path), "balance": balance})
        return
    click.echo(
        f"Logged in to {url}: balance {balance.get('balance')} {balance.get('currency', '')}."
    )
    click.echo(f"Saved to {path} (readable by you only).")


@cli.command()
def logout():
    """Forget the saved URL and token."""
    path = config_path()
    path.unlink(missing_ok=True)
    click.echo(f"Removed {path}.")


@cli.command()
@json_option
def balance(as_json):
    """Your balance, burn rate and recent ledger entries."""
    data = Api.from_config().get("balance")
    if _wants_json(as_json):
        _emit_json(data)
        return
    currency = data.get("currency", "")
    click.echo(f"Balance:    {data.get('balance')} {currency}")
    click.echo(f"Burn rate:  {data.get('burn_per_hour')} {currency}/hour")
    if data.get("hours_left") is not None:
        click.echo(f"Hours left: {data['hours_left']}")
    entries = [
        {**e, "created_at": _when(e.get("created_at"))} for e in data.get("entries", [])[:10]
    ]
    if entries:
        click.echo("")
        _table(
            entries,
            [("created_at", "WHEN"), ("kind", "KIND"), ("amount", "AMOUNT"),
             ("balance_after", "BALANCE"), ("cluster", "CLUSTER"), ("memo", "MEMO")],
        )  # fmt: skip


# clusters


@cli.group()
def clusters():
    """Request, list, resize, stop, start and release GPU clusters."""


_CLUSTER_COLUMNS = [
    ("id", "ID"), ("name", "NAME"), ("state", "STATE"), ("size", "SIZE"),
    ("image", "IMAGE"), ("created", "CREATED"),
]  # fmt: skip


def _cluster_row(c: dict) -> dict:
    if c.get("gpu_model"):
        size = f"{c.get('nodes')} x {c.get('gpus_per_node')} {c['gpu_model']}"
    else:
        size = f"{c.get('nodes')} x {c.get('instance_type')}"
    return {
        **c,
        "size": size + (" spot" if c.get("spot") else ""),
        "created": _when(c.get("created_at")),
    }


def _show_cluster(c: dict, as_json: bool) -> None:
    if _wants_json(as_json):
        _emit_json(c)
        return
    _fields(
        {**_cluster_row(c), "created_at": _when(c.get("created_at")),
         "running_since": _when(c.get("running_since")), "released_at": _when(c.get("released_at"))},
        ["id", "name", "state", "state_reason", "size", "image", "network", "zone",
         "release_policy", "pub", "created_at", "running_since", "released_at", "url"],
    )  # fmt: skip


@clusters.command("create")
@click.argument("name")
@click.option("--gpu", "gpu_model", metavar="MODEL", help="GPU model slug, e.g. a100-80gb.")
@click.option("--cpu", "instance_type", metavar="TYPE", help="A CPU-only instance type instead.")
@click.option("--nodes", type=int, default=1, show_default=True)
@click.option("--gpus-per-node", type=int, default=1, show_default=True)
@click.option("--image", required=True, help="A catalog image reference, or any other.")
@click.option("--network", help="standard (default) or rdma.")
@click.option("--zone", help="Keep every node in this zone.")
@click.option("--spot", is_flag=True, help="Cheaper; the capacity can be taken back.")
@click.option("--volume", "volumes", multiple=True, metavar="FOLDER:/PATH[:ro]", help="Repeatable.")
@click.option(
    "--pub/--no-pub",
    default=None,
    help="The public datasets and models, read-only at /pub (default: --pub).",
)
@click.option(
    "--release-policy",
    help="When the console gives the nodes back on its own: after_last_job (default), idle "
    "(see --idle-minutes) or never.",
)  # fmt: skip
@click.option("--idle-minutes", type=int, help="With --release-policy idle.")
@click.option("--ssh-key", "ssh_keys", type=int, multiple=True, metavar="ID", help="Repeatable.")
@json_option
def clusters_create(name, gpu_model, instance_type, image, volumes, pub, ssh_keys, as_json, **rest):
    """Request a cluster NAME (lower-case letters, digits, dashes); it runs once placed."""
    body = {"name": name, "image": image, "volumes": list(volumes)}
    if pub is not None:
        body["pub"] = pub
    if gpu_model:
        body["gpu_model"] = gpu_model
    if instance_type:
        body["instance_type"] = instance_type
    if ssh_keys:
        body["ssh_keys"] = list(ssh_keys)
    body.update({k: v for k, v in rest.items() if v is not None and v is not False})
    c = Api.from_config().post("clusters", "the cluster", body)
    if _wants_json(as_json):
        _emit_json(c)
        return
    click.echo(f"Cluster {c['id']} ({c['name']}) is {c['state']}: {c.get('url', '')}")


@clusters.command("list")
@json_option
def clusters_list(as_json):
    """Your clusters, newest first."""
    rows = _all_pages(Api.from_config(), "clusters", "clusters")
    if _wants_json(as_json):
        _emit_json({"clusters": rows, "count": len(rows)})
        return
    _table([_cluster_row(c) for c in rows], _CLUSTER_COLUMNS)


@clusters.command("show")
@click.argument("cluster_id", type=int, metavar="CLUSTER")
@json_option
def clusters_show(cluster_id, as_json):
    """One cluster's state and shape."""
    _show_cluster(Api.from_config().get(f"clusters/{cluster_id}", f"cluster {cluster_id}"), as_json)


@clusters.command("release")
@click.argument("cluster_id", type=int, metavar="CLUSTER")
@json_option
def clusters_release(cluster_id, as_json):
    """Give the cluster's capacity back now (its running job is stopped)."""
    c = Api.from_config().post(f"clusters/{cluster_id}/release", f"cluster {cluster_id}")
    if _wants_json(as_json):
        _emit_json(c)
        return
    click.echo(f"Cluster {c['id']} ({c['name']}) is {c['state']}.")


@clusters.command("stop")
@click.argument("cluster_id", type=int, metavar="CLUSTER")
@json_option
def clusters_stop(cluster_id, as_json):
    """Stop a running cluster, keeping its files: its jobs are cancelled, its GPUs given
    back (not charged from now), its workspaces stopped and kept until you start it."""
    c = Api.from_config().post(f"clusters/{cluster_id}/stop", f"cluster {cluster_id}")
    if _wants_json(as_json):
        _emit_json(c)
        return
    click.echo(
        f"Cluster {c['id']} ({c['name']}) is {c['state']}; released at {_when(c.get('release_at'))} unless started."
    )


@clusters.command("start")
@click.argument("cluster_id", type=int, metavar="CLUSTER")
@click.option(
    "--no-gpu",
    "mode",
    flag_value="no_gpu",
    help="Start at once without GPUs (files, ssh, terminal; no jobs).",
)
@click.option(
    "--wait", "mode", flag_value="wait", help="Wait in line for its GPUs where they are taken."
)
@json_option
def clusters_start(cluster_id, mode, as_json):
    """Start a stopped cluster on the hosts that keep its files, with its GPUs (or say why
    not: then --wait or --no-gpu)."""
    try:
        c = Api.from_config().post(
            f"clusters/{cluster_id}/start", f"cluster {cluster_id}", {"mode": mode or "gpu"}
        )
    except Failure as exc:
        if exc.status != 409:
            raise
        words = exc.format_message().split(" (API: ")[0]
        raise Failure(f"{words} Run it again with --wait or --no-gpu.", 409) from None
    if _wants_json(as_json):
        _emit_json(c)
        return
    how = " without GPUs" if c.get("no_gpu") else ""
    click.echo(
        f"Cluster {c['id']} ({c['name']}) is {c['state']}{how}"
        + (f": {c['state_reason']}" if c.get("state_reason") else ".")
    )


@clusters.command("resize")
@click.argument("cluster_id", type=int, metavar="CLUSTER")
@click.option("--nodes", type=int, required=True, help="The new node count.")
@json_option
def clusters_resize(cluster_id, nodes, as_json):
    """Change a running cluster's node count (no job may be running)."""
    c = Api.from_config().post(
        f"clusters/{cluster_id}/resize", f"cluster {cluster_id}", {"nodes": nodes}
    )
    if _wants_json(as_json):
        _emit_json(c)
        return
    click.echo(f"Cluster {c['id']} ({c['name']}) has {c['nodes']} node(s); it is {c['state']}.")


# jobs


@cli.group()
def jobs():
    """Submit, list and cancel jobs."""


_JOB_COLUMNS = [
    ("id", "ID"), ("name", "NAME"), ("cluster", "CLUSTER"), ("state", "STATE"),
    ("exit_code", "EXIT"), ("attempt", "ATTEMPT"), ("created", "CREATED"),
]  # fmt: skip


def _env_pair(ctx, param, values):
    env = {}
    for value in values:
        key, sep, val = value.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{value!r} is not KEY=VALUE.")
        env[key] = val
    return env


def _pool_by_ref(api: Api, ref: str) -> dict:
    """One of your pools by its name (an active one first) or its id."""
    rows = _all_pages(api, "pools", "pools")
    named = [p for p in rows if p["name"] == ref]
    named.sort(key=lambda p: p["state"] != "active")
    if named:
        return named[0]
    by_id = [p for p in rows if str(p["id"]) == ref]
    if by_id:
        return by_id[0]
    raise Failure(f"you have no pool named {ref!r} (nor one with that id).")


@jobs.command("submit", context_settings={"allow_interspersed_args": False})
@click.option("--cluster", "cluster_id", type=int, help="Your cluster's id (or --pool).")
@click.option(
    "--pool",
    "pool_ref",
    metavar="NAME_OR_ID",
    help="One of your pools, by name or id, instead of a cluster: the job runs on the first "
    "of its clusters to be free.",
)
@click.option("--name", default="job", show_default=True)
@click.option("--env", multiple=True, callback=_env_pair, metavar="KEY=VALUE", help="Repeatable.")
@click.option("--workdir", help="The working directory in the container (default /workspace).")
@click.option(
    "--checkpoint-dir", help="Where the job writes checkpoints; put it under a volume to keep them."
)
@click.option(
    "--preemption-script",
    type=click.Path(exists=True, dir_okay=False, readable=True),
    metavar="FILE",
    help="A local file; its text is sent and, on a spot cluster's preemption notice, run "
    "in each replica with /bin/sh -c (e.g. to save a checkpoint).",
)
@click.option("--max-preemptions", type=int, help="Preemptions the job survives (default 5).")
@click.option("--retries", type=int, help="Restarts after a failure (default 0).")
@click.option("--max-runtime", type=int, metavar="MINUTES", help="Stop it after this long.")
@click.option("--torchrun", is_flag=True, help="Launch with torchrun, one process per GPU.")
@click.argument("command", nargs=-1, required=True)
@json_option
def jobs_submit(
    cluster_id, pool_ref, command, env, preemption_script, max_runtime, torchrun, as_json, **rest
):
    """Queue COMMAND (the words after --) on a cluster, or on a pool (--pool).

    The words are joined with spaces and run by the container's shell on every node, as
    ssh does: quote what your local shell must not expand, e.g.
    suanli jobs submit --cluster 7 -- 'python train.py --lr $LR'. With --torchrun,
    COMMAND is the script and its arguments.
    """
    if (cluster_id is None) == (pool_ref is None):
        raise click.UsageError("give either --cluster ID or --pool NAME_OR_ID (one of them).")
    body = {"command": " ".join(command), "env": env}
    body["launcher"] = "torchrun" if torchrun else "plain"
    if preemption_script:
        try:
            body["preemption_script"] = Path(preemption_script).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise Failure(f"cannot read {preemption_script}: {exc}") from None
    if max_runtime is not None:
        body["max_runtime_min"] = max_runtime
    body.update({k: v for k, v in rest.items() if v is not None})
    api = Api.from_config()
    if pool_ref is not None:
        pool = _pool_by_ref(api, pool_ref)
        job = api.post(f"pools/{pool['id']}/jobs", f"pool {pool['name']}", body)
        where = f"in pool {pool['name']} (on cluster {job['cluster']} for now)"
    else:
        job = api.post("jobs", f"cluster {cluster_id}", {**body, "cluster": cluster_id})
        where = f"on cluster {job['cluster']}"
    if _wants_json(as_json):
        _emit_json(job)
        return
    click.echo(f"Job {job['id']} ({job['name']}) is {job['state']} {where}.")
    click.echo(f"Follow it: suanli logs -f {job['id']}")


@jobs.command("list")
@click.option("--cluster", "cluster_id", type=int, help="Only this cluster's jobs.")
@json_option
def jobs_list(cluster_id, as_json):
    """Your jobs, newest first."""
    params = {"cluster": cluster_id} if cluster_id else {}
    rows = _all_pages(Api.from_config(), "jobs", "jobs", **params)
    if _wants_json(as_json):
        _emit_json({"jobs": rows, "count": len(rows)})
        return
    _table([{**j, "created": _when(j.get("created_at"))} for j in rows], _JOB_COLUMNS)


def _show_job(j: dict, as_json: bool) -> None:
    if _wants_json(as_json):
        _emit_json(j)
        return
    _fields(
        {**j, **{k: _when(j.get(k)) for k in ("created_at", "started_at", "finished_at")}},
        ["id", "name", "cluster", "state", "state_reason", "exit_code", "attempt", "launcher",
         "command", "created_at", "started_at", "finished_at", "preemptions", "max_preemptions",
         "resume_from", "preemption_script", "url"],
    )  # fmt: skip


@jobs.command("show")
@click.argument("job_id", type=int, metavar="JOB")
@json_option
def jobs_show(job_id, as_json):
    """One job's state, exit code and command."""
    _show_job(Api.from_config().get(f"jobs/{job_id}", f"job {job_id}"), as_json)


PARTS = ("dataloader", "compute", "memcpy", "communication", "idle")


@jobs.command("profile")
@click.argument("job_id", type=int, metavar="JOB")
@json_option
def jobs_profile(job_id, as_json):
    """The job's profiler traces (SUANLI_PROFILE_DIR) summarised: where each rank's step
    goes, the slowest rank, advice, and the files."""
    p = Api.from_config().get(f"jobs/{job_id}/profile", f"job {job_id}")
    if _wants_json(as_json):
        _emit_json(p)
        return
    if not p["files"]:
        folder = p["folders"][0]["path"] if p["folders"] else "SUANLI_PROFILE_DIR"
        click.echo(f"No profiler traces yet: the job writes them to {folder}.")
        return
    rows = [
        {
            "rank": "?" if r["rank"] is None else r["rank"], "steps": r["steps"],
            "step_ms": f"{r['step_ms']:.1f}",
            **{k: f"{r['split_ms'][k]:.1f} ({100 * r['split_ms'][k] / r['step_ms']:.0f} %)"
               if r["step_ms"] else "0" for k in PARTS},
            "overlap": "-" if r["overlap_pct"] is None else f"{r['overlap_pct']:.0f} %",
        }
        for r in p["ranks"]
    ]  # fmt: skip
    if rows:
        click.echo("Per step, ms:")
        _table(rows, [("rank", "RANK"), ("steps", "STEPS"), ("step_ms", "STEP"),
                      *((k, k.upper()) for k in PARTS), ("overlap", "OVERLAP")])  # fmt: skip
    if p["slowest"]:
        rank = "?" if p["slowest"]["rank"] is None else p["slowest"]["rank"]
        click.echo(f"Slowest rank: {rank} ({p['slowest']['cause']})")
    for advice in p["advice"]:
        click.echo(f"- {advice['title']}: {advice['text']}")
    click.echo("Files:")
    _table(
        [{**f, "rank": "?" if f["rank"] is None else f["rank"],
          "state": f["error"] if f["state"] == "error" else f["state"]} for f in p["files"]],
        [("attempt", "ATTEMPT"), ("rank", "RANK"), ("name", "NAME"), ("size", "BYTES"),
         ("state", "SUMMARY")],
    )  # fmt: skip
    if p["pending"]:
        click.echo("Some summaries are on their way: ask again in a moment.")


@jobs.command("cancel")
@click.argument("job_id", type=int, metavar="JOB")
@json_option
def jobs_cancel(job_id, as_json):
    """Cancel a queued job, or stop a running one (SIGTERM, then SIGKILL)."""
    j = Api.from_config().post(f"jobs/{job_id}/cancel", f"job {job_id}")
    if _wants_json(as_json):
        _emit_json(j)
        return
    if j["state"] in JOB_ENDED:
        click.echo(f"Job {j['id']} ({j['name']}) is {j['state']}.")
    else:
        click.echo(f"Job {j['id']} ({j['name']}) is stopping: SIGTERM, then SIGKILL.")


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
    as_json = _wants_json(as_json)
    if not follow:
        body = api.get(f"jobs/{job_id}/log", what)
        if as_json:
            _emit_json(body)
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


# ssh


@cli.command("ssh")
@click.argument("cluster_id", type=int, metavar="CLUSTER")
@click.argument("node", type=int, default=0, required=False)
@click.option(
    "-L", "--forward", "forwards", multiple=True, metavar="[LOCAL:]PORT:HOST:PORT",
    help="Reach a port of the workspace, as ssh -L (repeatable), e.g. 6006:localhost:6006.",
)  # fmt: skip
@click.option("--print", "print_only", is_flag=True, help="Print the ssh command, do not run it.")
@json_option
def ssh(cluster_id, node, forwards, print_only, as_json):
    """Log in to NODE (default 0) of a running cluster with your local ssh.

    It uses the SSH keys attached to the cluster, through the console's SSH gateway.
    """
    cluster = Api.from_config().get(f"clusters/{cluster_id}", f"cluster {cluster_id}")
    label = f"cluster {cluster_id} ({cluster.get('name')})"
    if cluster.get("state") != "running":
        raise Failure(f"{label} is {cluster.get('state')}: only a running cluster has a shell.")
    if not cluster.get("workspace", True):
        raise Failure(f"{label} was created without workspaces (jobs only): nothing to log in to.")
    logins = {login.get("node"): login for login in cluster.get("ssh") or []}
    login = logins.get(node)
    if login is None:
        have = ", ".join(str(n) for n in sorted(logins)) or "none"
        raise Failure(f"{label} has no node {node} (its nodes: {have}).")
    if _wants_json(as_json):
        _emit_json(login)
        return
    argv = ["ssh", "-p", str(login["port"])]
    for forward in forwards:
        argv += ["-L", forward]
    argv.append(f"{login['user']}@{login['host']}")
    if print_only:
        click.echo(shlex.join(argv))
        return
    click.echo(
        f"The gateway's host key is {login.get('host_key_fingerprint')}: check that ssh shows "
        "this if it asks.",
        err=True,
    )
    try:
        os.execvp(argv[0], argv)  # noqa: S606 (an argv list: no shell)
    except OSError as exc:
        raise Failure(
            f"cannot run ssh ({exc.strerror}): install OpenSSH's client, or run: {shlex.join(argv)}"
        ) from None


# images


@cli.group()
def images():
    """Your own images: list, build from a Dockerfile, delete."""


def _size(n) -> str:
    """Decimal units, as the console shows them: 340 MB, 1.2 GB."""
    size = float(n or 0)
    if size < 1000:
        return f"{int(size)} B"
    for unit in ("kB", "MB", "GB", "TB", "PB"):
        size /= 1000
        text = f"{size:.1f}" if size < 99.95 else f"{size:.0f}"
        if float(text) < 1000 or unit == "PB":
            return f"{text.removesuffix('.0')} {unit}"
    return f"{n} B"


@images.command("list")
@json_option
def images_list(as_json):
    """Your images, the clusters using them, and your quota."""
    data = Api.from_config().get("images")
    if _wants_json(as_json):
        _emit_json(data)
        return
    rows = [
        {
            **i, "image": f"{i.get('name')}:{i.get('tag')}", "size": _size(i.get("size_bytes")),
            "created": _when(i.get("created_at")),
            "used_by": ", ".join(str(c) for c in i.get("clusters") or []) or "-",
        }
        for i in data.get("images", [])
    ]  # fmt: skip
    _table(
        rows,
        [("id", "ID"), ("image", "IMAGE"), ("size", "SIZE"), ("created", "CREATED"),
         ("used_by", "CLUSTERS"), ("reference", "REFERENCE")],
    )  # fmt: skip
    q = data.get("quota") or {}
    if not data.get("enabled", True):
        click.echo("Own images are off: the operator has configured no image registry.")
    else:
        click.echo(
            f"{q.get('count')} of {q.get('max_count')} images · {_size(q.get('bytes'))} of "
            f"{_size(q.get('max_bytes'))}"
        )


def _build_arg(ctx, param, values):
    args = {}
    for value in values:
        key, sep, val = value.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{value!r} is not KEY=VALUE.")
        args[key] = val
    return args


@images.command("build")
@click.argument("directory", type=click.Path(exists=True, file_okay=False), metavar="DIR")
@click.option("--name", required=True, help="The image's name, e.g. my-torch.")
@click.option("--tag", default="latest", show_default=True)
@click.option(
    "--context", metavar="STORAGE_FOLDER",
    help="One of your storage folders on the console, sent as the build's context.",
)  # fmt: skip
@click.option(
    "--build-arg", "build_args", multiple=True, callback=_build_arg, metavar="KEY=VALUE",
    help="A value for an ARG of the Dockerfile (repeatable).",
)  # fmt: skip
@click.option("--no-follow", is_flag=True, help="Queue it and exit; do not print its log.")
@json_option
def images_build(directory, name, tag, context, build_args, no_follow, as_json):
    """Build DIR/Dockerfile on the console's build host and push it as one of your images.

    The build context is not DIR but the storage folder of --context (upload files to it
    with scp or sftp first). Without --no-follow, the log is printed as it comes and the
    exit status is 1 when the build fails.
    """
    path = Path(directory) / "Dockerfile"
    try:
        dockerfile = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise Failure(f"cannot read {path}: {exc}") from None
    body = {"name": name, "tag": tag, "dockerfile": dockerfile, "build_args": build_args}
    if context:
        body["context"] = context
    api = Api.from_config()
    build = api.post("images/builds", "the build", body)
    as_json = _wants_json(as_json)
    if no_follow:
        if as_json:
            _emit_json(build)
        else:
            click.echo(
                f"Build {build['id']} of {name}:{tag} is {build['state']}: {build.get('url', '')}"
            )
        return
    if not as_json:
        click.echo(f"Build {build['id']} of {name}:{tag}: {build.get('url', '')}", err=True)
    after = 0
    while True:
        try:
            build = api.get(f"images/builds/{build['id']}", f"build {build['id']}", after=after)
        except Failure as exc:
            if exc.status != 429:
                raise
            time.sleep(5)  # the rate limit of this token: wait, then go on
            continue
        for line in build.get("lines", []):
            after = max(after, int(line.get("seq") or 0))
            if as_json:
                click.echo(json.dumps(line, ensure_ascii=False))
            else:
                click.echo(line.get("text", ""))
        if build.get("state") in BUILD_ENDED:
            break
        time.sleep(POLL_S)
    if build["state"] == "succeeded":
        if not as_json:
            click.echo(f"--- build {build['id']} succeeded: {build.get('image')} ---", err=True)
        return
    if not as_json:
        click.echo(f"--- build {build['id']} failed: {build.get('error')} ---", err=True)
    sys.exit(1)


@images.command("delete")
@click.argument("image_id", type=int, metavar="ID")
def images_delete(image_id):
    """Delete one of your images from the registry (refused while a cluster uses it)."""
    Api.from_config().delete(f"images/{image_id}", f"image {image_id}")
    click.echo(f"Image {image_id} deleted.")


def main() -> None:
    try:
        cli.main(prog_name="suanli")
    except KeyboardInterrupt:
        click.echo("", err=True)
        sys.exit(130)
