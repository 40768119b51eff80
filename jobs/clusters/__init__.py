"""The console's verbs on clusters and jobs.

- `spec`: what a cluster request may ask, checked in one place (`ClusterRequest.check` /
  `validate` against an `Offer` of what the fleet and catalog offer its owner now), giving a
  `ClusterSpec`; the HTML form and the API both build from it.
- `services`: clusters created from a spec, resized, stopped, started (one function per
  flow) and released; jobs submitted and cancelled; SSH keys. Keyword-only, atomic where they
  span rows. A job is started or stopped by task name (jobs.base.queue), never by importing runs.
- `shutdown`: scheduled and idle shutdown (定时关机): a cluster's rules (`shutdown_set`,
  checked by spec's `ShutdownRequest`) and the cron tick that stops it through
  `services.cluster_stop` at its time or after N minutes of idle GPUs (the samples read by
  monitoring/idle.py, which sits above jobs).

Layer: clusters, beside hosts; uses access (webapps), nodes, placement, events, files, models
and base.
"""
