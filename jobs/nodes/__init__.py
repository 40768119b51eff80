"""A node's life on a host's engine: the engine client (the only module that builds one),
image pulls from the registry, the cluster's network, the hardened container (the Docker
contract) and the long-lived workspace.

- `engine`: Docker engines through the SDK.
- `registry`: the registry of researchers' images: names, its HTTP API, pulls onto hosts.
- `network`: one network per cluster, never the host's.
- `runtime`: how one replica becomes one hardened container (`container_spec`).
- `workspaces`: one long-lived container per live node; saved at stop, started again.

Layer: nodes, beside placement; uses events, files, models and base.
"""
