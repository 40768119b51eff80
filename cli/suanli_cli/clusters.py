"""`suanli clusters`: request, list, show, stop, start, resize and release GPU clusters."""

from __future__ import annotations

import click

from suanli_cli.core import (
    Api,
    Failure,
    all_pages,
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
         "running_since": when(c.get("running_since")), "released_at": when(c.get("released_at"))},
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
    help="When the console gives the nodes back on its own: never (the default: they stay, "
    "with your files, until you stop or release the cluster), after_last_job or idle (see "
    "--idle-minutes).",
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
    if wants_json(as_json):
        emit_json(c)
        return
    click.echo(f"Cluster {c['id']} ({c['name']}) is {c['state']}: {c.get('url', '')}")


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
