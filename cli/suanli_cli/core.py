"""The constants, the error type, the saved login, the API client and the output helpers every command uses."""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

import click
import requests

API = "/api/v1"
TIMEOUT_S = 30
POLL_S = float(os.environ.get("SUANLI_POLL_S", "1"))
JOB_ENDED = ("succeeded", "failed", "cancelled")
BUILD_ENDED = ("succeeded", "failed")
CLI_OPTION = {  # the API's field names as this command's options, in error messages
    "address": "ADDRESS",
    "events": "--event",
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

    def __init__(self, message: str, status: int | None = None, fields: dict | None = None):
        super().__init__(message)
        self.status = status  # the API's HTTP status, if it answered
        self.fields = fields or {}  # the API's per-field refusals, as it names the fields

    def show(self, file=None) -> None:
        click.echo(f"suanli: {self.format_message()}", err=True)


def error_json(exc: click.ClickException) -> dict:
    """An error as `--json` prints it: `{"error": "...", ...}` (with the API's HTTP status
    and per-field refusals when it answered)."""
    out: dict = {"error": exc.format_message()}
    if isinstance(exc, click.UsageError):
        out["usage"] = True
    status = getattr(exc, "status", None)
    if status is not None:
        out["status"] = status
    if getattr(exc, "fields", None):
        out["fields"] = exc.fields
    return out


# -- configuration ----------------------------------------------------------------------------


def config_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "suanli" / "config.json"


def read_config() -> dict:
    path = config_path()
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise Failure(f"cannot read {path} ({exc}); run suanli login again.") from None
    return data if isinstance(data, dict) else {}


def write_config(data: dict) -> Path:
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


TEAM_HEADER = "X-Suanli-Team"


def team_asked(config: dict) -> str:
    """The team to act for: `suanli --team`, else SUANLI_TEAM, else the saved `team` ("" or
    `--team me`: yourself)."""
    ctx = click.get_current_context(silent=True)
    given = ((ctx.find_root().obj or {}) if ctx else {}).get("team")
    if given is None:
        given = os.environ.get("SUANLI_TEAM")
    if given is None:
        given = config.get("team") or ""
    return "" if given.strip() in ("", "me") else given.strip()


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
    def from_config(cls, *, acting: bool = True) -> Api:
        """The saved (or SUANLI_URL/SUANLI_TOKEN) login; acting for the team that `--team`,
        SUANLI_TEAM or the saved `team` names (sent as X-Suanli-Team), unless `acting` is
        false (the teams commands name their team themselves)."""
        config = read_config()
        url = os.environ.get("SUANLI_URL") or config.get("url")
        token = os.environ.get("SUANLI_TOKEN") or config.get("token")
        if not url or not token:
            raise Failure("not logged in: run suanli login (or set SUANLI_URL and SUANLI_TOKEN).")
        api = cls(url, token)
        team = team_asked(config) if acting else ""
        if team:
            api.session.headers[TEAM_HEADER] = str(api.team_by_ref(team)["id"])
        return api

    def team_by_ref(self, ref: str) -> dict:
        """One of your teams by its name or id (asked without acting for any team)."""
        ref = str(ref).strip()
        acting = self.session.headers.pop(TEAM_HEADER, None)
        try:
            rows = all_pages(self, "teams", "teams")
        finally:
            if acting is not None:
                self.session.headers[TEAM_HEADER] = acting
        named = [t for t in rows if t["name"] == ref] or [t for t in rows if str(t["id"]) == ref]
        if len(named) > 1:
            ids = ", ".join(str(t["id"]) for t in named)
            raise Failure(f"you are in several teams named {ref!r} ({ids}): give its id.")
        if not named:
            raise Failure(f"you are in no team named {ref!r} (nor one with that id).")
        return named[0]

    def get(self, path: str, what: str = "", **params) -> dict:
        return self.call("GET", path, what, params=params or None)

    def post(self, path: str, what: str = "", body: dict | None = None) -> dict:
        return self.call("POST", path, what, json=body or {})

    def patch(self, path: str, what: str = "", body: dict | None = None) -> dict:
        return self.call("PATCH", path, what, json=body or {})

    def put(self, path: str, what: str = "", body: dict | None = None) -> dict:
        return self.call("PUT", path, what, json=body or {})

    def delete(self, path: str, what: str = "", **params) -> dict:
        return self.call("DELETE", path, what, params=params or None)

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
        fields = body.get("fields") if isinstance(body.get("fields"), dict) else {}
        raise Failure(
            _error_words(response.status_code, body, what, response.headers),
            response.status_code,
            fields,
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


def emit_json(data) -> None:
    click.echo(json.dumps(data, indent=2, ensure_ascii=False))


def table(rows: list[dict], columns: list[tuple[str, str]]) -> None:
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


def print_fields(data: dict, keys: list[str]) -> None:
    width = max(len(k) for k in keys)
    for key in keys:
        value = data.get(key)
        if value is None or value == "":
            continue
        if isinstance(value, bool):
            value = "yes" if value else "no"
        text = str(value).replace("\n", "\n" + " " * (width + 2))
        click.echo(f"{key.replace('_', ' ')}:".ljust(width + 2) + text)


def when(value: str | None) -> str:
    return value.replace("T", " ")[:19] if value else ""


def json_option(command):
    """`--json` on a command; `suanli --json ...` works too."""
    return click.option(
        "--json", "as_json", is_flag=True, help="Print the API's JSON (for scripts)."
    )(command)


def json_asked(args: list[str]) -> bool:
    """`--json` anywhere among the words before `--` (after it they are a command's own)."""
    return "--json" in (args[: args.index("--")] if "--" in args else args)


def group_json(ctx: click.Context, as_json: bool) -> None:
    """`suanli clusters --json list`: a group's `--json` holds for its commands."""
    if as_json:
        ctx.ensure_object(dict)["json"] = True


def wants_json(as_json: bool = False) -> bool:
    ctx = click.get_current_context()
    return as_json or bool((ctx.find_root().obj or {}).get("json"))


def size_words(row: dict) -> str:
    """A cluster's (or pool's) nodes in words: `2 x 8 a100-80gb`, `1 x cpu-8`; a node
    without GPUs (a CPU-only type, or a cluster started without its GPUs) never names a GPU."""
    nodes = row.get("nodes")
    if row.get("no_gpu"):
        return f"{nodes} x no GPU"
    if row.get("gpu_model"):
        return f"{nodes} x {row.get('gpus_per_node')} {row['gpu_model']}"
    return f"{nodes} x {row.get('instance_type')}"


def all_pages(api: Api, path: str, key: str, **params) -> list[dict]:
    rows, page = [], 1
    while True:
        body = api.get(path, **params, page=page)
        rows += body.get(key, [])
        if page >= int(body.get("pages") or 1):
            return rows
        page += 1


def pool_by_ref(api: Api, ref: str) -> dict:
    """One of your pools by its name (an active one first) or its id."""
    rows = all_pages(api, "pools", "pools")
    named = [p for p in rows if p["name"] == ref]
    named.sort(key=lambda p: p["state"] != "active")
    if named:
        return named[0]
    by_id = [p for p in rows if str(p["id"]) == ref]
    if by_id:
        return by_id[0]
    raise Failure(f"you have no pool named {ref!r} (nor one with that id).")


def budget_body(amount: str) -> dict:
    """The body of `suanli jobs|clusters|sweeps budget ID AMOUNT|none`: the amount as
    written (the console checks it and says what is wrong with it), null for `none`."""
    amount = amount.strip()
    return {"budget": None if amount.lower() in ("", "none") else amount}


def budget_words(kind: str, obj: dict) -> str:
    """ "Job 12 (train) stops at 50.00 spent." or "... has no budget now."."""
    budget = obj.get("budget")
    if budget is None:
        return f"{kind} {obj['id']} ({obj['name']}) has no budget now."
    return f"{kind} {obj['id']} ({obj['name']}) stops at {float(budget):.2f} spent."
