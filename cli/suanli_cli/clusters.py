"""`suanli clusters`: request, list, show, stop, start, resize and release GPU clusters, and
set their scheduled and idle stop (定时关机)."""

from __future__ import annotations

import re
from datetime import datetime, timedelta

import click

from suanli_cli.core import (
    Api,
    Failure,
    all_pages,
    budget_body,
    budget_words,
    emit_json,
    group_json,
    json_option,
    print_fields,
    size_words,
    table,
    wants_json,
    when,
)
from suanli_cli.main import cli

# clusters


@cli.group()
@json_option
@click.pass_context
def clusters(ctx, as_json):
    """Request, list, resize, stop, start and release GPU clusters."""
    group_json(ctx, as_json)


_CLUSTER_COLUMNS = [
    ("id", "ID"), ("name", "NAME"), ("state", "STATE"), ("size", "SIZE"),
    ("image", "IMAGE"), ("created", "CREATED"),
]  # fmt: skip


def _cluster_row(c: dict) -> dict:
    return {
        **c,
        "size": size_words(c) + (" spot" if c.get("spot") else ""),
        "created": when(c.get("created_at")),
    }


def _show_cluster(c: dict, as_json: bool) -> None:
    if wants_json(as_json):
        emit_json(c)
        return
    print_fields(
        {**_cluster_row(c), "created_at": when(c.get("created_at")),
         "running_since": when(c.get("running_since")), "released_at": when(c.get("released_at")),
         "budget_stopped_at": when(c.get("budget_stopped_at"))},
        ["id", "name", "state", "state_reason", "size", "image", "network", "zone",
         "release_policy", "pub", "budget", "budget_stopped_at", "created_at", "running_since",
         "released_at", "url"],
    )  # fmt: skip
    click.echo(f"{'stops:'.ljust(15)}{_rules_words(c)}")


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
    help="When the console gives the nodes back on its own: never (the default: they stay, "
    "with your files, until you stop or release the cluster), after_last_job or idle (see "
    "--idle-minutes).",
)  # fmt: skip
@click.option("--idle-minutes", type=int, help="With --release-policy idle.")
@click.option("--ssh-key", "ssh_keys", type=int, multiple=True, metavar="ID", help="Repeatable.")
@click.option(
    "--stop-at",
    metavar="TIME",
    help="Stop it (files kept) once at TIME: "
    + "HH:MM (the next one), 'YYYY-MM-DD HH:MM' (this machine's zone) or ISO 8601.",
)
@click.option(
    "--stop-idle-minutes",
    type=int,
    metavar="N",
    help="Stop it after N minutes (10-1440) with every GPU under --stop-idle-below %.",
)
@click.option(
    "--stop-idle-below",
    type=int,
    metavar="PCT",
    help="With --stop-idle-minutes: the GPU utilisation, 1-100.",
)
@click.option(
    "--budget",
    metavar="AMOUNT",
    help="Stop at this much spent, e.g. 50 or 49.90 (stopped, every file kept, before its charges pass it).",
)
@json_option
def clusters_create(
    name, gpu_model, instance_type, image, volumes, pub, ssh_keys, stop_at, as_json, **rest
):
    """Request a cluster NAME (lower-case letters, digits, dashes); it runs once placed."""
    body = {"name": name, "image": image, "volumes": list(volumes)}
    if stop_at is not None:
        body["stop_at"] = _at(stop_at)
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
    if wants_json(as_json):
        emit_json(c)
        return
    click.echo(f"Cluster {c['id']} ({c['name']}) is {c['state']}: {c.get('url', '')}")


@clusters.command("budget")
@click.argument("cluster_id", type=int, metavar="CLUSTER")
@click.argument("amount", metavar="AMOUNT|none")
@json_option
def clusters_budget(cluster_id, amount, as_json):
    """Stop CLUSTER (every file kept) before its charges pass AMOUNT, or `none` for no
    budget."""
    c = Api.from_config().patch(
        f"clusters/{cluster_id}/budget", f"cluster {cluster_id}", budget_body(amount)
    )
    if wants_json(as_json):
        emit_json(c)
        return
    click.echo(budget_words("Cluster", c))


@clusters.command("list")
@json_option
def clusters_list(as_json):
    """Your clusters, newest first."""
    rows = all_pages(Api.from_config(), "clusters", "clusters")
    if wants_json(as_json):
        emit_json({"clusters": rows, "count": len(rows)})
        return
    table([_cluster_row(c) for c in rows], _CLUSTER_COLUMNS)


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
    if wants_json(as_json):
        emit_json(c)
        return
    click.echo(f"Cluster {c['id']} ({c['name']}) is {c['state']}.")


@clusters.command("stop")
@click.argument("cluster_id", type=int, metavar="CLUSTER")
@json_option
def clusters_stop(cluster_id, as_json):
    """Stop a running cluster, keeping its files: its jobs are cancelled, its GPUs given
    back (not charged from now), its workspaces stopped and kept until you start it."""
    c = Api.from_config().post(f"clusters/{cluster_id}/stop", f"cluster {cluster_id}")
    if wants_json(as_json):
        emit_json(c)
        return
    click.echo(
        f"Cluster {c['id']} ({c['name']}) is {c['state']}; released at {when(c.get('release_at'))} unless started."
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
    if wants_json(as_json):
        emit_json(c)
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
    if wants_json(as_json):
        emit_json(c)
        return
    click.echo(f"Cluster {c['id']} ({c['name']}) has {c['nodes']} node(s); it is {c['state']}.")


# scheduled and idle stop (定时关机)


def _at(text: str) -> str:
    """A time as the API takes it (ISO 8601 with an offset): HH:MM is the next such time in
    this machine's zone, a date and time without an offset is in this machine's zone."""
    text = text.strip()
    now = datetime.now()
    clock = re.fullmatch(r"(\d{1,2}):(\d{2})", text)
    try:
        if clock:
            at = now.replace(hour=int(clock[1]), minute=int(clock[2]), second=0, microsecond=0)
            if at <= now:
                at += timedelta(days=1)
        else:
            at = datetime.fromisoformat(text)
        return (at if at.tzinfo else at.astimezone()).isoformat()
    except ValueError:
        raise click.BadParameter(
            f"{text!r} is not a time: give HH:MM, 'YYYY-MM-DD HH:MM' or ISO 8601.",
            param_hint="--at",
        ) from None


def _rules_words(c: dict) -> str:
    words = []
    if c.get("stop_at"):
        local = datetime.fromisoformat(c["stop_at"].replace("Z", "+00:00")).astimezone()
        words.append(f"at {local:%Y-%m-%d %H:%M %Z} (once)")
    if c.get("stop_idle_minutes"):
        words.append(
            f"after {c['stop_idle_minutes']} min with every GPU under {c['stop_idle_below']} %"
        )
    return "; ".join(words) or "only when you stop it"


@clusters.command("shutdown")
@click.argument("cluster_id", type=int, metavar="CLUSTER")
@click.option(
    "--at",
    "at",
    metavar="TIME",
    help="Stop it once at TIME: HH:MM (the next one), "
    + "'YYYY-MM-DD HH:MM' (this machine's zone) or ISO 8601 with an offset.",
)
@click.option(
    "--idle-minutes",
    type=int,
    metavar="N",
    help="Stop it after N minutes (10-1440) with every GPU under --idle-below %.",
)
@click.option(
    "--idle-below", type=int, metavar="PCT", help="The GPU utilisation of --idle-minutes, 1-100."
)
@click.option("--no-at", is_flag=True, help="Clear the stop at a time.")
@click.option("--no-idle", is_flag=True, help="Clear the idle stop.")
@click.option("--clear", is_flag=True, help="Clear both: it stops only when you stop it.")
@json_option
def clusters_shutdown(cluster_id, at, idle_minutes, idle_below, no_at, no_idle, clear, as_json):
    """Stop the cluster on its own, its files kept: once at a time, and/or after N minutes
    with every GPU under X % (by the monitor's samples: without samples it never stops).
    What you leave out stays as it was; with no option, show its rules."""
    api, what = Api.from_config(), f"cluster {cluster_id}"
    body: dict = {}
    if at is not None:
        body["stop_at"] = _at(at)
    if idle_minutes is not None:
        body["stop_idle_minutes"] = idle_minutes
    if idle_below is not None:
        body["stop_idle_below"] = idle_below
    if no_at:
        body["stop_at"] = None
    if no_idle:
        body.update(stop_idle_minutes=None, stop_idle_below=None)
    try:
        if clear:
            c = api.delete(f"clusters/{cluster_id}/shutdown", what)
        elif body:
            c = api.post(f"clusters/{cluster_id}/shutdown", what, body)
        else:
            c = api.get(f"clusters/{cluster_id}", what)
    except Failure as exc:  # the refusals under this command's own options
        for field, option in (("stop-idle-", "idle-"), ("stop-at", "at")):
            exc.message = exc.message.replace(f"  --{field}", f"  --{option}")
        raise
    if wants_json(as_json):
        emit_json(c)
        return
    click.echo(f"Cluster {c['id']} ({c['name']}) stops {_rules_words(c)}.")
