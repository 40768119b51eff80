"""The fleet's machines: registered, checked (the canary's proofs from inside the host),
drained, joined with one command and left with another.

- `services`: the host verbs (`host_save`, `host_check`, `host_set_draining`, ...).
- `proofs`: what every host check proves from inside the host.
- `joins`: join tokens, the join and leave protocol (`scripts/join.sh`).
- `pki`: the console's CA for the hosts' engines.
- `forms`: the operator's host form (the admin's).
- `scripts/`: `join.sh` and `host-firewall.sh`, run on the hosts.

Layer: hosts, beside clusters; uses nodes, placement, events, files, models and base.
"""
