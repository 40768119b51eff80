"""`suanli sweeps`: start, list, show and cancel hyperparameter sweeps on a pool."""

from __future__ import annotations

import click

from suanli_cli.core import (
    Api,
    all_pages,
    budget_body,
    budget_words,
    emit_json,
    group_json,
    json_option,
    pool_by_ref,
    print_fields,
    table,
    wants_json,
    when,
)
from suanli_cli.main import cli

# sweeps


@cli.group()
@json_option
@click.pass_context
def sweeps(ctx, as_json):
    """Start, list, show and cancel hyperparameter sweeps (their trials run on a pool)."""
    group_json(ctx, as_json)


_SWEEP_COLUMNS = [
    ("id", "ID"), ("name", "NAME"), ("pool", "POOL"), ("state", "STATE"), ("done", "TRIALS"),
    ("best", "BEST"), ("created", "CREATED"),
]  # fmt: skip


def _sweep_row(s: dict) -> dict:
    best = s.get("best_value")
    return {
        **s,
        "done": f"{s.get('trials_done')}/{s.get('trials')}",
        "best": "-" if best is None else f"{s.get('metric')} {best:g} ({s.get('direction')})",
        "created": when(s.get("created_at")),
    }


def _env_pair(ctx, param, values):
    env = {}
    for value in values:
        key, sep, val = value.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{value!r} is not KEY=VALUE.")
        env[key] = val
    return env


@sweeps.command("list")
@json_option
def sweeps_list(as_json):
    """Your sweeps, newest first."""
    rows = all_pages(Api.from_config(), "sweeps", "sweeps")
    if wants_json(as_json):
        emit_json({"sweeps": rows, "count": len(rows)})
        return
    table([_sweep_row(s) for s in rows], _SWEEP_COLUMNS)


def _show_sweep(s: dict, as_json: bool) -> None:
    if wants_json(as_json):
        emit_json(s)
        return
    print_fields(
        {**_sweep_row(s), "created_at": when(s.get("created_at")),
         "finished_at": when(s.get("finished_at")),
         "budget_stopped_at": when(s.get("budget_stopped_at"))},
        ["id", "name", "pool", "state", "metric", "direction", "done", "parallel", "pruner",
         "best", "best_trial", "command", "budget", "budget_stopped_at", "created_at",
         "finished_at", "url"],
    )  # fmt: skip
    trials = [
        {**t, "params": " ".join(f"{k}={v}" for k, v in (t.get("params") or {}).items()),
         "last": "" if t.get("last_value") is None else f"{t['last_value']:g}"}
        for t in s.get("trial_list") or []
    ]  # fmt: skip
    if trials:
        click.echo("")
        table(
            trials,
            [("number", "TRIAL"), ("state", "STATE"), ("job", "JOB"), ("last_step", "STEP"),
             ("last", "VALUE"), ("params", "PARAMETERS")],
        )  # fmt: skip
    saved = s.get("savings") or {}
    if saved.get("pruned"):
        click.echo(
            f"Pruning stopped {saved['pruned']} trial(s) early: "
            f"{100 * float(saved.get('saved_share') or 0):.0f} % of the {saved.get('unit')}-time "
            "saved."
        )


@sweeps.command("show")
@click.argument("sweep_id", type=int, metavar="SWEEP")
@json_option
def sweeps_show(sweep_id, as_json):
    """One sweep: its settings, every trial so far, and what pruning saved."""
    _show_sweep(Api.from_config().get(f"sweeps/{sweep_id}", f"sweep {sweep_id}"), as_json)


@sweeps.command("create", context_settings={"allow_interspersed_args": False})
@click.option("--pool", "pool_ref", required=True, metavar="NAME_OR_ID", help="An active pool.")
@click.option("--name", help="Default: sweep.")
@click.option(
    "--param", "params", multiple=True, required=True, metavar="'NAME: TYPE ...'",
    help="A parameter to search, as the form's lines (repeatable): 'lr: log_uniform 1e-5 "
    "1e-1', 'layers: int 2 8', 'opt: categorical adam sgd'.",
)  # fmt: skip
@click.option("--metric", required=True, help="The name the trials print in SUANLI_METRIC lines.")
@click.option("--direction", type=click.Choice(["minimize", "maximize"]), help="Default minimize.")
@click.option("--trials", type=int, help="How many trials in all (default 20).")
@click.option("--parallel", type=int, help="Trials at a time (default 1).")
@click.option("--pruner", type=click.Choice(["asha", "median", "none"]), help="Default asha.")
@click.option("--min-steps", type=int, help="Steps before a trial may be pruned.")
@click.option("--env", multiple=True, callback=_env_pair, metavar="KEY=VALUE", help="Repeatable.")
@click.option("--workdir", help="The working directory (default /workspace).")
@click.option(
    "--budget",
    metavar="AMOUNT",
    help="Stop at this much spent, e.g. 50 or 49.90 (cancelled before its trials' cost passes it).",
)
@click.argument("command", nargs=-1, required=True)
@json_option
def sweeps_create(pool_ref, params, command, env, as_json, **rest):
    """Start a sweep of COMMAND (the words after --) on a pool: each trial reads its
    parameters from SUANLI_PARAM_<NAME> (or $SUANLI_PARAMS_FILE) and prints
    SUANLI_METRIC {"step": 100, "val_loss": 0.41} lines."""
    api = Api.from_config()
    pool = pool_by_ref(api, pool_ref)
    body = {"pool": pool["id"], "command": " ".join(command), "space": "\n".join(params)}
    if env:
        body["env"] = env
    body.update({k: v for k, v in rest.items() if v is not None})
    s = api.post("sweeps", "the sweep", body)
    if wants_json(as_json):
        emit_json(s)
        return
    click.echo(f"Sweep {s['id']} ({s['name']}) is {s['state']} on pool {pool['name']}: {s['url']}")


@sweeps.command("budget")
@click.argument("sweep_id", type=int, metavar="SWEEP")
@click.argument("amount", metavar="AMOUNT|none")
@json_option
def sweeps_budget(sweep_id, amount, as_json):
    """Cancel SWEEP before its trials' cost passes AMOUNT (no trial starts that would pass
    it), or `none` for no budget."""
    s = Api.from_config().patch(
        f"sweeps/{sweep_id}/budget", f"sweep {sweep_id}", budget_body(amount)
    )
    if wants_json(as_json):
        emit_json(s)
        return
    click.echo(budget_words("Sweep", s))


@sweeps.command("cancel")
@click.argument("sweep_id", type=int, metavar="SWEEP")
@json_option
def sweeps_cancel(sweep_id, as_json):
    """Cancel its running trials (SIGTERM, then SIGKILL); no new ones start."""
    s = Api.from_config().post(f"sweeps/{sweep_id}/cancel", f"sweep {sweep_id}")
    if wants_json(as_json):
        emit_json(s)
        return
    click.echo(f"Sweep {s['id']} ({s['name']}) is {s['state']}.")
