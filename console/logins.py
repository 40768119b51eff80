"""How a researcher logs in to the workspaces of a running cluster: per node the SSH user
name, the gateway's host and port, the `ssh` command and the gateway's host key
fingerprint. The cluster page and the API (`ssh` of a cluster, which `suanli ssh` reads)
both say it from here, so they never disagree.

The host is `SUANLI_SSH_HOST` where the operator exposes the gateway under another name;
else the name the researcher reached the console by (the request's host, without its
port). The port and fingerprint are the gateway's own (jobs/access/sessions.py,
jobs/access/hostkey.py).
"""

from dataclasses import dataclass

from django.conf import settings
from django.http.request import split_domain_port

from jobs.access import hostkey, sessions
from jobs.models import Cluster
from jobs.nodes import workspaces


@dataclass(frozen=True)
class Login:
    node: int
    user: str
    host: str
    port: int
    host_key_fingerprint: str

    @property
    def command(self) -> str:
        return f"ssh -p {self.port} {self.user}@{self.host}"

    @property
    def host_key_state(self) -> str:
        """ "known" (a fingerprint to check), "none" (the gateway has not made its key yet) or
        "unknown" (unreadable here): the page says the last two in the reader's language, the
        API keeps the English words."""
        if self.host_key_fingerprint.startswith("SHA256:"):
            return "known"
        return "none" if self.host_key_fingerprint == hostkey.NO_HOST_KEY else "unknown"

    @property
    def alias(self) -> str:
        """The `Host` of the node's `~/.ssh/config` block (VS Code Remote-SSH lists it)."""
        return f"suanli-{self.user}"

    def as_dict(self) -> dict:
        return {
            "node": self.node, "user": self.user, "host": self.host, "port": self.port,
            "command": self.command, "host_key_fingerprint": self.host_key_fingerprint,
        }  # fmt: skip


def ssh_host(request) -> str:
    if settings.SUANLI_SSH_HOST:
        return settings.SUANLI_SSH_HOST
    domain, _ = split_domain_port(request.get_host())
    return domain.strip("[]")  # an IPv6 literal: ssh takes it bare after the `@`


def ssh_logins(cluster: Cluster, request) -> list[Login]:
    """One login per node of a running cluster with workspaces; none otherwise. A running
    cluster's nodes are indexed 0..nodes-1 (a resize adds and removes at the end; a moved
    node keeps its index), so this reads no rows."""
    if cluster.state != Cluster.State.RUNNING or not cluster.workspace:
        return []
    host, port = ssh_host(request), sessions.ssh_port()
    try:
        fingerprint = hostkey.host_key_fingerprint()
    except (OSError, ValueError):  # SUANLI_SSH_HOST_KEY unreadable from this process
        fingerprint = "unknown here (ask the operator)"
    return [
        Login(
            node=index,
            user=workspaces.login_name(cluster.pk, index),
            host=host,
            port=port,
            host_key_fingerprint=fingerprint,
        )
        for index in range(cluster.nodes)
    ]
