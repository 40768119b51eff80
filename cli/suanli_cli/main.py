"""The `suanli` group and its top-level commands (login, logout, balance)."""

from __future__ import annotations

import sys

import click

from suanli_cli.core import (
    Api,
    config_path,
    emit_json,
    error_json,
    json_asked,
    json_option,
    normalise_url,
    read_config,
    table,
    wants_json,
    when,
    write_config,
)
from suanli_cli.version import VERSION

# -- commands ---------------------------------------------------------------------------------


def _version(ctx, param, value) -> None:
    """The version this copy was built as (no installed metadata needed)."""
    if not value or ctx.resilient_parsing:
        return
    if json_asked(sys.argv[1:]):
        emit_json({"name": "suanli", "version": VERSION})
    else:
        click.echo(f"suanli, version {VERSION}")
    ctx.exit()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--json", "as_json", is_flag=True, help="Print the API's JSON (for scripts).")
@click.option(
    "--team",
    metavar="NAME|ID",
    default=None,
    help="Act for one of your teams (its name or id; `me`: yourself). Default: SUANLI_TEAM, "
    "else the team saved by `suanli teams use`.",
)
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_version,
    help="Show the version and exit.",
)
@click.pass_context
def cli(ctx, as_json, team):
    """Suanli's GPU clusters, jobs, pools, sweeps, SSH keys, images, teams and balance from
    the command line.

    Start with `suanli login`; SUANLI_URL and SUANLI_TOKEN override the saved login.
    `--team NAME` (or SUANLI_TEAM) acts for one of your teams.
    """
    ctx.obj = {"json": as_json, "team": team}


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
    saved = read_config()
    if not url:
        url = click.prompt("Console URL", default=saved.get("url") or None)
    url = normalise_url(url)
    if not token and not sys.stdin.isatty():
        token = sys.stdin.readline()  # piped: `pass show suanli | suanli login --url ...`
    if not token:
        token = click.prompt("API token", hide_input=True)
    token = token.strip()
    balance = Api(url, token).get("balance")  # refused or unreachable: nothing is saved
    path = write_config({"url": url, "token": token})
    if wants_json(as_json):
        emit_json({"url": url, "config": str(path), "balance": balance})
        return
    click.echo(
        f"Logged in to {url}: balance {balance.get('balance')} {balance.get('currency', '')}."
    )
    click.echo(f"Saved to {path} (readable by you only).")


@cli.command()
@json_option
def logout(as_json):
    """Forget the saved URL and token."""
    path = config_path()
    path.unlink(missing_ok=True)
    if wants_json(as_json):
        emit_json({"removed": str(path)})
        return
    click.echo(f"Removed {path}.")


def _time_left(data: dict) -> str:
    """ "1 h 20 min", as the console's banner says it (its `time_left`; from `hours_left`
    for a console that does not send it)."""
    if data.get("time_left"):
        return data["time_left"]
    minutes = round(float(data["hours_left"]) * 60)
    hours, rest = divmod(minutes, 60)
    if not minutes:
        return "under 1 min"
    if not hours:
        return f"{rest} min"
    return f"{hours} h {rest} min" if rest else f"{hours} h"


@cli.command()
@json_option
def balance(as_json):
    """Your balance, burn rate and recent ledger entries."""
    data = Api.from_config().get("balance")
    if wants_json(as_json):
        emit_json(data)
        return
    currency = data.get("currency", "")
    click.echo(f"Balance:    {data.get('balance')} {currency}")
    click.echo(f"Burn rate:  {data.get('burn_per_hour')} {currency}/hour")
    if data.get("hours_left") is not None:
        click.echo(f"Time left:  about {_time_left(data)} at that rate")
    entries = [{**e, "created_at": when(e.get("created_at"))} for e in data.get("entries", [])[:10]]
    if entries:
        click.echo("")
        table(
            entries,
            [("created_at", "WHEN"), ("kind", "KIND"), ("amount", "AMOUNT"),
             ("balance_after", "BALANCE"), ("cluster", "CLUSTER"), ("memo", "MEMO")],
        )  # fmt: skip


def main() -> None:
    """`suanli`: errors are one sentence on stderr, or with `--json` anywhere before `--`
    the JSON `{"error": ...}` on stdout; either way a non-zero exit status."""
    args = sys.argv[1:]
    as_json = json_asked(args)
    try:
        code = cli.main(args=args, prog_name="suanli", standalone_mode=False)
    except KeyboardInterrupt:
        click.echo("", err=True)
        sys.exit(130)
    except click.Abort:
        if as_json:
            emit_json({"error": "Aborted."})
        else:
            click.echo("Aborted!", err=True)
        sys.exit(1)
    except click.ClickException as exc:
        if as_json:
            emit_json(error_json(exc))
        else:
            exc.show()
        sys.exit(exc.exit_code)
    sys.exit(code if isinstance(code, int) else 0)
