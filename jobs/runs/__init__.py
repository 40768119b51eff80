"""Jobs on the engines: one container per node started, followed to its end, stopped, and
repaired after a crash; and live logs with one follower per replica. Every step is
idempotent: a duplicate RQ delivery, a watcher and the reconciler racing for the same
container all end the same. No worker waits on a container: starting returns once the
containers run, the `watch` process (or the reconciler) reports each exit, and stopping
sends SIGTERM then schedules the SIGKILL.

- `dispatch`: claim a cluster's next job and start one container per node (`dispatch`,
  `start_replicas`); a failed start ends the attempt, or moves the job off a failed host.
- `exits`: a replica's end recorded (code, log, whether its engine ended it), a lost
  replica, a host caught up on what its watcher missed, a running replica's log lines.
- `settle`: the job's next state from its replicas (succeeded, failed, retried, requeued
  after a host failed it, preempted, cancelled) and `finish`, which frees its cluster.
- `preemption`: a preemption notice followed (the job's script, then the stop).
- `stopping`: SIGTERM now, SIGKILL after the grace period.
- `repair`: the reconciler, comparing the database with the engines and mending.
- `shared`: the follow-up task (by name) every step queues; timeline entries are written by
  `jobs.events.timeline`.
- `livelogs`: live logs, one follower per replica.

Inside, each imports only those listed after it (repair > dispatch > preemption > exits >
settle > stopping > shared). Their own follow-ups (a start, a kill, a check) are queued by
task name ("jobs.tasks.*").

Layer: runs, beside access and images; uses nodes, placement and below; never clusters,
hosts or pools.
"""
