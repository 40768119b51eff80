"""`suanli ssh`: log in to a node of a running cluster, or print the ssh command."""

from __future__ import annotations

import os
import shlex

import click

from suanli_cli.core import (
    Api,
    Failure,
    emit_json,
    json_option,
    wants_json,
)
from suanli_cli.main import cli

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
    if wants_json(as_json):
        emit_json(login)
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
