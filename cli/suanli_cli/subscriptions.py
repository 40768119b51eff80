"""`suanli subscriptions`: be told when GPUs are free (订阅GPU通知), optionally have the
cluster created then within a budget: list, add, cancel."""

from __future__ import annotations

import click

from suanli_cli.core import (
    Api,
    all_pages,
    emit_json,
    group_json,
    json_option,
    table,
    wants_json,
    when,
)
from suanli_cli.main import cli


@cli.group()
@json_option
@click.pass_context
def subscriptions(ctx, as_json):
    """GPU subscriptions: be told once when GPUs are free (and rent them)."""
    group_json(ctx, as_json)


_COLUMNS = [
    ("id", "ID"), ("what", "WHAT"), ("where", "ZONE"), ("state", "STATE"),
    ("expires", "EXPIRES"), ("rent", "RENT"),
]  # fmt: skip


def _what(s: dict) -> str:
    if s.get("nodes", 1) == 1:
        return f"{s['gpus_per_node']} x {s['gpu_model_name']}"
    return f"{s['nodes']} x {s['gpus_per_node']} x {s['gpu_model_name']}"


def _rows(rows: list[dict]) -> list[dict]:
    out = []
    for s in rows:
        rent = "notify only"
        if s.get("rent"):
            rent = f"cluster {s['rent'].get('name')}"
            if s.get("budget_per_hour") is not None:
                rent += f", at most {s['budget_per_hour']}/h"
            if s.get("cluster"):
                rent += f" (cluster {s['cluster']})"
        out.append(
            {
                **s, "what": _what(s), "where": s.get("zone") or "any",
                "expires": when(s.get("expires_at")) if s.get("state") == "waiting" else "",
                "rent": rent,
            }
        )  # fmt: skip
    return out


@subscriptions.command("list")
@json_option
def subscriptions_list(as_json):
    """Your GPU subscriptions, newest first."""
    rows = all_pages(Api.from_config(), "gpu-subscriptions", "gpu_subscriptions")
    if wants_json(as_json):
        emit_json({"gpu_subscriptions": rows, "count": len(rows)})
        return
    table(_rows(rows), _COLUMNS)


@subscriptions.command("add")
@click.option("--gpu", "gpu_model", required=True, help="A GPU model's slug, e.g. a100-80gb.")
@click.option("--gpus-per-node", type=int, required=True)
@click.option("--nodes", type=int, default=1, show_default=True)
@click.option("--zone", default=None, help="Default: any zone.")
@click.option("--expires-in-hours", type=int, default=None, help="1 to 720; default 24.")
@click.option("--rent", is_flag=True, help="Create the cluster when they are free.")
@click.option("--name", default=None, help="The rented cluster's name.")
@click.option("--image", default=None, help="The rented cluster's image reference.")
@click.option("--spot", is_flag=True, help="Rent it as spot.")
@click.option("--budget-per-hour", default=None,
              help="The most the rented cluster may cost an hour, e.g. 30.00.")  # fmt: skip
@json_option
def subscriptions_add(
    gpu_model, gpus_per_node, nodes, zone, expires_in_hours, rent, name, image, spot,
    budget_per_hour, as_json,
):  # fmt: skip
    """Be told once when the GPUs are free in that shape; with --rent --name --image, the
    cluster is created for you then (within --budget-per-hour, and your balance)."""
    body = {"gpu_model": gpu_model, "gpus_per_node": gpus_per_node, "nodes": nodes}
    given = {"zone": zone, "expires_in_hours": expires_in_hours, "name": name, "image": image,
             "budget_per_hour": budget_per_hour}  # fmt: skip
    body.update({key: value for key, value in given.items() if value is not None})
    if rent:
        body.update(rent=True, spot=spot)
    made = Api.from_config().post("gpu-subscriptions", "the subscription", body)
    if wants_json(as_json):
        emit_json(made)
        return
    click.echo(
        f"Subscription {made['id']}: {_what(made)} in {made.get('zone') or 'any zone'}, "
        f"until {when(made.get('expires_at'))}."
    )


@subscriptions.command("cancel")
@click.argument("subscription_id", type=int, metavar="ID")
@json_option
def subscriptions_cancel(subscription_id, as_json):
    """Cancel a waiting subscription: it never fires."""
    Api.from_config().delete(
        f"gpu-subscriptions/{subscription_id}", f"subscription {subscription_id}"
    )
    if wants_json(as_json):
        emit_json({"cancelled": subscription_id})
        return
    click.echo(f"Subscription {subscription_id} cancelled.")
