"""`suanli jobs`: submit, list, show, profile and cancel jobs."""

from __future__ import annotations

from pathlib import Path

import click

from suanli_cli.core import (
    JOB_ENDED,
    Api,
    Failure,
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

# jobs


@cli.group()
@json_option
@click.pass_context
def jobs(ctx, as_json):
    """Submit, list and cancel jobs."""
    group_json(ctx, as_json)


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
@click.option(
    "--budget",
    metavar="AMOUNT",
    help="Stop at this much spent, e.g. 50 or 49.90 (its preemption script, then SIGTERM and SIGKILL after the grace).",
)
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
        pool = pool_by_ref(api, pool_ref)
        job = api.post(f"pools/{pool['id']}/jobs", f"pool {pool['name']}", body)
        where = f"in pool {pool['name']} (on cluster {job['cluster']} for now)"
    else:
        job = api.post("jobs", f"cluster {cluster_id}", {**body, "cluster": cluster_id})
        where = f"on cluster {job['cluster']}"
    if wants_json(as_json):
        emit_json(job)
        return
    click.echo(f"Job {job['id']} ({job['name']}) is {job['state']} {where}.")
    click.echo(f"Follow it: suanli logs -f {job['id']}")


@jobs.command("list")
@click.option("--cluster", "cluster_id", type=int, help="Only this cluster's jobs.")
@json_option
def jobs_list(cluster_id, as_json):
    """Your jobs, newest first."""
    params = {"cluster": cluster_id} if cluster_id else {}
    rows = all_pages(Api.from_config(), "jobs", "jobs", **params)
    if wants_json(as_json):
        emit_json({"jobs": rows, "count": len(rows)})
        return
    table([{**j, "created": when(j.get("created_at"))} for j in rows], _JOB_COLUMNS)


def _show_job(j: dict, as_json: bool) -> None:
    if wants_json(as_json):
        emit_json(j)
        return
    print_fields(
        {**j, **{k: when(j.get(k)) for k in ("created_at", "started_at", "finished_at")},
         **_outlook(j)},
        ["id", "name", "cluster", "state", "state_reason", "exit_code", "attempt", "launcher",
         "command", "created_at", "started_at", "finished_at", "preemptions", "max_preemptions",
         "resume_from", "preemption_script", "url", *OUTLOOK],
    )  # fmt: skip


OUTLOOK = ("projection", "progress", "budget", "compared", "energy")


def _outlook(j: dict) -> dict:
    """The projection, its progress, the budget, the comparison after the run and the
    energy, as the job page says them (the API's English words); absent from a job list."""
    p = j.get("projection") or {}
    progress = None
    if p.get("step") is not None:
        total = p.get("total")
        progress = (
            f"step {p['step']} of {total} ({100 * p['step'] / total:.1f} %)"
            if total
            else f"step {p['step']}; no total declared"
        )
    return {
        "projection": p.get("words"),
        "progress": progress,
        "budget": p.get("budget_words"),
        "compared": (j.get("comparison") or {}).get("words"),
        "energy": (j.get("energy") or {}).get("words"),
    }


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
    if wants_json(as_json):
        emit_json(p)
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
        table(rows, [("rank", "RANK"), ("steps", "STEPS"), ("step_ms", "STEP"),
                      *((k, k.upper()) for k in PARTS), ("overlap", "OVERLAP")])  # fmt: skip
    if p["slowest"]:
        rank = "?" if p["slowest"]["rank"] is None else p["slowest"]["rank"]
        click.echo(f"Slowest rank: {rank} ({p['slowest']['cause']})")
    for advice in p["advice"]:
        click.echo(f"- {advice['title']}: {advice['text']}")
    click.echo("Files:")
    table(
        [{**f, "rank": "?" if f["rank"] is None else f["rank"],
          "state": f["error"] if f["state"] == "error" else f["state"]} for f in p["files"]],
        [("attempt", "ATTEMPT"), ("rank", "RANK"), ("name", "NAME"), ("size", "BYTES"),
         ("state", "SUMMARY")],
    )  # fmt: skip
    if p["pending"]:
        click.echo("Some summaries are on their way: ask again in a moment.")


@jobs.command("budget")
@click.argument("job_id", type=int, metavar="JOB")
@click.argument("amount", metavar="AMOUNT|none")
@json_option
def jobs_budget(job_id, amount, as_json):
    """Stop JOB at AMOUNT spent (its preemption script, then SIGTERM and SIGKILL after the
    grace), or `none` for no budget."""
    j = Api.from_config().patch(f"jobs/{job_id}/budget", f"job {job_id}", budget_body(amount))
    if wants_json(as_json):
        emit_json(j)
        return
    click.echo(budget_words("Job", j))


@jobs.command("cancel")
@click.argument("job_id", type=int, metavar="JOB")
@json_option
def jobs_cancel(job_id, as_json):
    """Cancel a queued job, or stop a running one (SIGTERM, then SIGKILL)."""
    j = Api.from_config().post(f"jobs/{job_id}/cancel", f"job {job_id}")
    if wants_json(as_json):
        emit_json(j)
        return
    if j["state"] in JOB_ENDED:
        click.echo(f"Job {j['id']} ({j['name']}) is {j['state']}.")
    else:
        click.echo(f"Job {j['id']} ({j['name']}) is stopping: SIGTERM, then SIGKILL.")
