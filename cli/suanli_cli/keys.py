"""`suanli keys`: your SSH keys: list, add, delete, make a default for new clusters, and
attach to or detach from a cluster (running or not: it takes effect from the next login)."""

from __future__ import annotations

from pathlib import Path

import click

from suanli_cli.core import (
    Api,
    Failure,
    all_pages,
    emit_json,
    group_json,
    json_option,
    table,
    wants_json,
    when,
)
from suanli_cli.main import cli

# keys


@cli.group()
@json_option
@click.pass_context
def keys(ctx, as_json):
    """Your SSH keys: list, add, delete, defaults, attach to and detach from clusters."""
    group_json(ctx, as_json)


_KEY_COLUMNS = [
    ("id", "ID"), ("name", "NAME"), ("key_type", "TYPE"), ("fingerprint", "FINGERPRINT"),
    ("default", "DEFAULT"), ("created", "ADDED"),
]  # fmt: skip


def _key_rows(rows: list[dict]) -> list[dict]:
    return [
        {**k, "default": "yes" if k.get("is_default") else "", "created": when(k.get("created_at"))}
        for k in rows
    ]


@keys.command("list")
@json_option
def keys_list(as_json):
    """Your SSH keys, oldest first; DEFAULT ones are attached to every new cluster."""
    rows = all_pages(Api.from_config(), "ssh-keys", "ssh_keys")
    if wants_json(as_json):
        emit_json({"ssh_keys": rows, "count": len(rows)})
        return
    table(_key_rows(rows), _KEY_COLUMNS)


@keys.command("add")
@click.argument("public_key_file", type=click.Path(exists=True, dir_okay=False), metavar="FILE")
@click.option("--name", help="Default: the key's comment.")
@click.option("--default", "is_default", is_flag=True, help="Attach it to every new cluster.")
@json_option
def keys_add(public_key_file, name, is_default, as_json):
    """Add the public key in FILE, your .pub file (never the private key)."""
    try:
        text = Path(public_key_file).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise Failure(f"cannot read {public_key_file}: {exc}") from None
    if "PRIVATE KEY" in text:
        raise Failure(f"{public_key_file} is a private key: give its .pub file.")
    body = {"public_key": text, "is_default": is_default}
    if name:
        body["name"] = name
    key = Api.from_config().post("ssh-keys", "the key", body)
    if wants_json(as_json):
        emit_json(key)
        return
    click.echo(f"Key {key['id']} ({key['name']}) added: {key['fingerprint']}.")


@keys.command("default")
@click.argument("key_id", type=int, metavar="KEY")
@click.option("--off", is_flag=True, help="No longer a default.")
@json_option
def keys_default(key_id, off, as_json):
    """Make KEY a default (attached to every new cluster), or with --off no longer."""
    key = Api.from_config().call(
        "PATCH", f"ssh-keys/{key_id}", f"key {key_id}", json={"is_default": not off}
    )
    if wants_json(as_json):
        emit_json(key)
        return
    click.echo(
        f"Key {key['id']} ({key['name']}) is {'' if key['is_default'] else 'not '}a default."
    )


@keys.command("delete")
@click.argument("key_id", type=int, metavar="KEY")
@json_option
def keys_delete(key_id, as_json):
    """Remove KEY: detached from every cluster, its next login is refused everywhere."""
    Api.from_config().delete(f"ssh-keys/{key_id}", f"key {key_id}")
    if wants_json(as_json):
        emit_json({"deleted": key_id})
        return
    click.echo(f"Key {key_id} deleted.")


def _attached(answer: dict, as_json: bool, said: str) -> None:
    if wants_json(as_json):
        emit_json(answer)
        return
    click.echo(said)
    table(_key_rows(answer.get("ssh_keys") or []), _KEY_COLUMNS[:4])


@keys.command("attached")
@click.argument("cluster_id", type=int, metavar="CLUSTER")
@json_option
def keys_attached(cluster_id, as_json):
    """The keys that log in to CLUSTER."""
    answer = Api.from_config().get(f"clusters/{cluster_id}/ssh-keys", f"cluster {cluster_id}")
    _attached(answer, as_json, f"Cluster {cluster_id}:")


@keys.command("attach")
@click.argument("cluster_id", type=int, metavar="CLUSTER")
@click.argument("key_id", type=int, metavar="KEY")
@json_option
def keys_attach(cluster_id, key_id, as_json):
    """Let KEY log in to CLUSTER from its next login on (no restart)."""
    answer = Api.from_config().post(
        f"clusters/{cluster_id}/ssh-keys", f"cluster {cluster_id} or key {key_id}", {"key": key_id}
    )
    _attached(answer, as_json, f"Key {key_id} is attached to cluster {cluster_id}:")


@keys.command("detach")
@click.argument("cluster_id", type=int, metavar="CLUSTER")
@click.argument("key_id", type=int, metavar="KEY")
@json_option
def keys_detach(cluster_id, key_id, as_json):
    """Refuse KEY's next login to CLUSTER (its open connections end within a minute)."""
    answer = Api.from_config().delete(
        f"clusters/{cluster_id}/ssh-keys/{key_id}", f"cluster {cluster_id} or key {key_id}"
    )
    _attached(answer, as_json, f"Key {key_id} is detached from cluster {cluster_id}:")
