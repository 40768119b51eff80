"""`suanli pools`: create, list, show and close pools (clusters added while jobs wait, up to a
maximum and a budget; `suanli jobs submit --pool` queues a job on one)."""

from __future__ import annotations

import click

from suanli_cli.core import (
    Api,
    all_pages,
    emit_json,
    group_json,
    json_option,
    pool_by_ref,
    print_fields,
    size_words,
    table,
    wants_json,
    when,
)
from suanli_cli.main import cli

# pools


@cli.group()
@json_option
@click.pass_context
def pools(ctx, as_json):
    """Create, list, show and close pools of clusters that grow while jobs wait."""
    group_json(ctx, as_json)


_POOL_COLUMNS = [
    ("id", "ID"), ("name", "NAME"), ("state", "STATE"), ("size", "EACH"), ("clusters", "CLUSTERS"),
    ("jobs", "JOBS (WAITING/RUNNING)"), ("spent", "SPENT"), ("created", "CREATED"),
]  # fmt: skip


def _pool_row(p: dict) -> dict:
    return {
        **p,
        "size": size_words(p) + (" spot" if p.get("spot") else ""),
        "clusters": f"{p.get('clusters_live')} of {p.get('min_clusters')}..{p.get('max_clusters')}",
        "jobs": f"{p.get('jobs_waiting')}/{p.get('jobs_running')}",
        "created": when(p.get("created_at")),
    }


@pools.command("list")
@json_option
def pools_list(as_json):
    """Your pools, newest first (closed ones too)."""
    rows = all_pages(Api.from_config(), "pools", "pools")
    if wants_json(as_json):
        emit_json({"pools": rows, "count": len(rows)})
        return
    table([_pool_row(p) for p in rows], _POOL_COLUMNS)


@pools.command("show")
@click.argument("ref", metavar="POOL")
@json_option
def pools_show(ref, as_json):
    """One pool (by name or id): its settings, money, clusters and queue."""
    api = Api.from_config()
    p = api.get(f"pools/{pool_by_ref(api, ref)['id']}", f"pool {ref}")
    if wants_json(as_json):
        emit_json(p)
        return
    row = _pool_row(p)
    print_fields(
        {**row, "created_at": when(p.get("created_at")), "closed_at": when(p.get("closed_at")),
         "volumes": ", ".join(p.get("volumes") or [])},
        ["id", "name", "state", "size", "image", "network", "zone", "volumes", "clusters",
         "jobs", "idle_minutes", "rate_per_hour", "budget_per_hour", "budget_total", "spent",
         "created_at", "closed_at", "url"],
    )  # fmt: skip
    live = p.get("clusters") or []
    if live:
        click.echo("")
        table(
            [{**c, "size": size_words(c)} for c in live],
            [("id", "CLUSTER"), ("name", "NAME"), ("state", "STATE"), ("size", "SIZE")],
        )
    queue = (p.get("running") or []) + (p.get("waiting") or [])
    if queue:
        click.echo("")
        table(queue, [("id", "JOB"), ("name", "NAME"), ("state", "STATE"), ("cluster", "CLUSTER")])


@pools.command("create")
@click.argument("name")
@click.option("--gpu", "gpu_model", metavar="MODEL", help="GPU model slug, e.g. a100-80gb.")
@click.option("--cpu", "instance_type", metavar="TYPE", help="A CPU-only instance type instead.")
@click.option("--nodes", type=int, help="Nodes of each cluster (default 1).")
@click.option("--gpus-per-node", type=int)
@click.option("--image", required=True, help="A catalog image reference, or any other.")
@click.option("--network", help="standard (default) or rdma.")
@click.option("--zone", help="Keep every cluster in this zone.")
@click.option("--spot", is_flag=True, help="Cheaper clusters whose capacity can be taken back.")
@click.option("--volume", "volumes", multiple=True, metavar="FOLDER:/PATH[:ro]", help="Repeatable.")
@click.option("--pub/--no-pub", default=None, help="The public datasets at /pub (default --pub).")
@click.option("--min", "min_clusters", type=int, help="Clusters kept even when idle (default 0).")
@click.option("--max", "max_clusters", type=int, help="Clusters at most (default 1).")
@click.option("--idle-minutes", type=int, help="An idle cluster is released after (default 10).")
@click.option("--budget-per-hour", metavar="AMOUNT", help="No more clusters than this pays.")
@click.option("--budget-total", metavar="AMOUNT", help="Once spent, no cluster is added.")
@json_option
def pools_create(name, volumes, pub, spot, as_json, **rest):
    """Create a pool NAME: clusters of one shape, added while its jobs wait."""
    body = {"name": name, "volumes": list(volumes)}
    if pub is not None:
        body["pub"] = pub
    if spot:
        body["spot"] = True
    body.update({k: v for k, v in rest.items() if v is not None})
    p = Api.from_config().post("pools", "the pool", body)
    if wants_json(as_json):
        emit_json(p)
        return
    click.echo(f"Pool {p['id']} ({p['name']}) is {p['state']}: {p.get('url', '')}")
    click.echo(f"Queue a job: suanli jobs submit --pool {p['name']} -- COMMAND")


@pools.command("close")
@click.argument("ref", metavar="POOL")
@json_option
def pools_close(ref, as_json):
    """No more jobs: waiting ones are cancelled, running ones finish, and the pool's
    clusters are released as they turn idle."""
    api = Api.from_config()
    pool = pool_by_ref(api, ref)
    p = api.post(f"pools/{pool['id']}/close", f"pool {ref}")
    if wants_json(as_json):
        emit_json(p)
        return
    click.echo(f"Pool {p['id']} ({p['name']}) is {p['state']}.")
