"""`watch` (Procfile): follow every engine's events for our labelled containers and
finalise a replica the moment its container dies. One thread per host; a host that stops
answering is retried with backoff; hosts added later are picked up.

Layer: management, the top of jobs/ (beside tasks, admin and apps); uses runs (exits), hosts
(services), nodes (runtime, engine), base (outage) and models."""

import logging
import threading
import time

import docker
from django.core.management.base import BaseCommand
from django.db import close_old_connections

from jobs.base import metrics
from jobs.base.outage import DB_DOWN, Outage, close_db_connections
from jobs.hosts import services as host_services
from jobs.models import Host, Replica
from jobs.nodes import engine, runtime
from jobs.runs import exits

log = logging.getLogger("suanli.watch")


def handle_die(event: dict) -> None:
    attrs = event.get("Actor", {}).get("Attributes", {})
    name = attrs.get("name", "")
    try:
        exit_code = int(attrs.get("exitCode"))
    except (TypeError, ValueError):
        exit_code = None
    close_old_connections()
    replica = Replica.objects.filter(container_name=name).only("pk", "state").first()
    if replica is None or replica.state not in (Replica.State.RUNNING, Replica.State.CREATING):
        return
    log.info("%s died with %s", name, exit_code)
    exits.replica_exited(replica.pk, exit_code=exit_code)


def follow(host_id: int, stop: threading.Event) -> None:
    """Follow one engine's events. The stream only ends when the engine goes (a restart, a
    crash, a lost connection): that is recorded as the start of an outage, and its end when
    the stream is back, so that containers the engine killed meanwhile are not counted as
    the jobs' failures (`exits._ended_by_engine`)."""
    backoff = 1
    following = False
    name = f"host {host_id}"
    while not stop.is_set():
        try:
            close_old_connections()
            host = Host.objects.filter(pk=host_id).first()
            if host is None:
                return
            name = host.name
            client = engine.client_for(host, timeout=60)
            since = int(time.time()) - 2  # a little overlap: handling is idempotent
            stream = client.events(
                decode=True,
                since=since,
                filters={"type": "container", "event": ["die"], "label": [runtime.LABEL_JOB]},
            )
            backoff = 1
            host_services.host_outage_ended(host_id=host_id)
            # Whatever died while no one was watching (this process starting, a lost
            # connection, an engine restart) is finalised now; from here on the stream has it.
            exits.finalise_exited(host)
            following = True
            log.info("watch %s: following its events", name)
            for event in stream:
                if stop.is_set():
                    break
                try:
                    handle_die(event)
                except DB_DOWN:
                    raise  # the stream is left; the next connection's catch-up finalises it
                except Exception:  # one bad event must not stop the watch
                    log.exception("watch %s: handling %s", name, event)
            else:
                log.warning("watch %s: the engine closed its events stream", name)
        except DB_DOWN as exc:
            # The database went, not the engine: no engine outage to record.
            following = False
            close_db_connections()
            log.warning("watch %s: database unreachable (%s); retrying in %ss", name, exc, backoff)
        except (docker.errors.DockerException, engine.EngineError, OSError) as exc:
            log.warning("watch %s: %s; retrying in %ss", name, exc, backoff)
        except Exception:
            log.exception("watch %s failed; retrying in %ss", name, backoff)
        if following and not stop.is_set():
            following = False
            try:
                host_services.host_outage_began(host_id=host_id)
            except Exception:  # the database is away too: the host check records it
                log.warning("watch %s: could not record the outage", name)
        stop.wait(backoff)
        backoff = min(backoff * 2, 30)


class Command(BaseCommand):
    help = "Follow the Docker engines' events and finalise replicas as their containers die."

    def handle(self, *args, **options):
        logging.basicConfig(level=logging.INFO)
        metrics.serve("watch")
        stop = threading.Event()
        threads: dict[int, threading.Thread] = {}
        self.stdout.write("watch: following container events of all hosts")
        # A PostgreSQL restart kills the connection CONN_MAX_AGE keeps: drop it, say so
        # once, back off, carry on (each follow() thread recovers on its own).
        database = Outage("PostgreSQL (watch)", log)
        try:
            while True:
                close_old_connections()
                try:
                    host_ids = list(Host.objects.values_list("pk", flat=True))
                except DB_DOWN as exc:
                    close_db_connections()
                    time.sleep(database.failed(exc))
                    continue
                database.ok()
                metrics.alive("watch")
                for host_id in host_ids:
                    thread = threads.get(host_id)
                    if thread is None or not thread.is_alive():
                        thread = threading.Thread(target=follow, args=(host_id, stop), daemon=True)
                        thread.start()
                        threads[host_id] = thread
                time.sleep(2)
        except KeyboardInterrupt:
            stop.set()
