"""Where work runs: reads of the fleet and the gang scheduler.

- `fleet`: reads of hosts, clusters, jobs and images that pages and other apps reuse (writes nothing).
- `scheduler`: the placement pass (`place_pending`): stranded nodes moved first, then the queue
  planned first-in-first-out and written in batches, then spot capacity reclaimed.
- `capacity`: the free capacity in memory for one pass (`Fleet`) and the plan of one cluster
  (gang, best fit, one zone, RDMA, one network, a fair head of line); why it does not fit.
- `slots`: nodes written with their GPU slots locked (`place_nodes`, `replace_node`).
- `restart`: stopped clusters starting again, on their kept hosts or elsewhere with their saves.
- `stranded`: nodes moved off degraded or long-down hosts (`move_stranded`).
- `reclaim`: spot clusters preempted for an on-demand request (`reclaim_spot`).
- `catalog`: the starting catalog of GPU models, images and instance types.

Inside, each imports only those listed after it in: scheduler > stranded | reclaim |
restart > slots > capacity.

Layer: placement, beside nodes; uses events, models and base.
"""
