"""Where work runs: reads of the fleet and the gang scheduler.

- `fleet`: reads of hosts, clusters, jobs and images that pages and other apps reuse (writes nothing).
- `scheduler`: gang placement of pending clusters, stranded nodes moved, spot reclaimed.
- `catalog`: the starting catalog of GPU models, images and instance types.

Layer: placement, beside nodes; uses events, models and base.
"""
