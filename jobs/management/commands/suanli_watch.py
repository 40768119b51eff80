"""`watch` (Procfile): follow every engine's events for our labelled containers and
finalise a replica the moment its container dies. One thread per host; a host that stops
answering is retried with backoff; hosts added later are picked up."""

import logging
import threading
import time

import docker
from django.core.management.base import BaseCommand
from django.db import close_old_connections

from jobs import engine, runner, runtime
from jobs.models import Host, Replica

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
    runner.replica_exited(replica.pk, exit_code=exit_code)


def follow(host_id: int, stop: threading.Event) -> None:
    backoff = 1
    while not stop.is_set():
        close_old_connections()
        host = Host.objects.filter(pk=host_id).first()
        if host is None:
            return
        try:
            client = engine.client_for(host, timeout=60)
            since = int(time.time()) - 2  # a little overlap: handling is idempotent
            stream = client.events(
                decode=True,
                since=since,
                filters={"type": "container", "event": ["die"], "label": [runtime.LABEL_JOB]},
            )
            backoff = 1
            # Whatever died while no one was watching (this process starting, a lost
            # connection) is finalised now; from here on the stream has it.
            runner.finalise_exited(host)
            for event in stream:
                if stop.is_set():
                    break
                try:
                    handle_die(event)
                except Exception:  # one bad event must not stop the watch
                    log.exception("watch %s: handling %s", host.name, event)
        except (docker.errors.DockerException, engine.EngineError, OSError) as exc:
            log.warning("watch %s: %s; retrying in %ss", host.name, exc, backoff)
        except Exception:
            log.exception("watch %s failed; retrying in %ss", host.name, backoff)
        stop.wait(backoff)
        backoff = min(backoff * 2, 30)


class Command(BaseCommand):
    help = "Follow the Docker engines' events and finalise replicas as their containers die."

    def handle(self, *args, **options):
        logging.basicConfig(level=logging.INFO)
        stop = threading.Event()
        threads: dict[int, threading.Thread] = {}
        self.stdout.write("watch: following container events of all hosts")
        try:
            while True:
                close_old_connections()
                for host_id in Host.objects.values_list("pk", flat=True):
                    thread = threads.get(host_id)
                    if thread is None or not thread.is_alive():
                        thread = threading.Thread(target=follow, args=(host_id, stop), daemon=True)
                        thread.start()
                        threads[host_id] = thread
                time.sleep(2)
        except KeyboardInterrupt:
            stop.set()
