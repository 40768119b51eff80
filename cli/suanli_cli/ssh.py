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


class _RemoteCommand(click.Command):
    """The words after `--` are the remote command, passed to ssh as they are (never read
    as NODE or as options of ours)."""

    def parse_args(self, ctx, args):
        if "--" in args:
            at = args.index("--")
            ctx.meta["remote"] = args[at + 1 :]
            args = args[:at]
        return super().parse_args(ctx, args)


@cli.command("ssh", cls=_RemoteCommand)
@click.argument("cluster_id", type=int, metavar="CLUSTER")
@click.argument("node", type=int, default=0, required=False)
@click.option(
    "-i", "--identity", "identity", metavar="KEY_FILE",
    type=click.Path(exists=True, dir_okay=False),
    help="The private key to log in with, as ssh -i (one attached to the cluster).",
)  # fmt: skip
@click.option(
    "-L", "--forward", "forwards", multiple=True, metavar="[LOCAL:]PORT:HOST:PORT",
    help="Reach a port of the workspace, as ssh -L (repeatable), e.g. 6006:localhost:6006.",
)  # fmt: skip
@click.option("--print", "print_only", is_flag=True, help="Print the ssh command, do not run it.")
@json_option
@click.pass_context
def ssh(ctx, cluster_id, node, identity, forwards, print_only, as_json):
    """Log in to NODE (default 0) of a running cluster with your local ssh, or run a
    command there: suanli ssh CLUSTER [NODE] [-i KEY] -- COMMAND [ARGS...].

    It uses the SSH keys attached to the cluster, through the console's SSH gateway. The
    words after -- go to ssh as its remote command (the workspace's shell runs them; exit
    status is the command's).
    """
    remote = ctx.meta.get("remote", [])
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
    argv = ["ssh", "-p", str(login["port"])]
    if identity:
        argv += ["-i", identity]
    for forward in forwards:
        argv += ["-L", forward]
    argv.append(f"{login['user']}@{login['host']}")
    argv += remote
    if wants_json(as_json):
        emit_json({**login, "argv": argv})
        return
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
