"""`catalog_prepare`: build a catalog image for this machine's engines by running the
script that builds it, its progress kept on the image (`Image.preparing`) so that the
cluster form says "being prepared: 40%" meanwhile. `make run` starts it in the background
for the JupyterLab image (.ci/jupyter-image.sh):

    manage.py catalog_prepare suanli/jupyter:2.13-cpu -- bash .ci/jupyter-image.sh ENGINE

The script's lines go to this command's output; a line with "(NN%)" in it moves the
progress on. When the script ends the image is no longer "being prepared": its hosts are
checked again at once, so the form says where it is (on the host that now has it) or,
when the script failed, that it is not available here. Stopped (make run's Ctrl-C sends
SIGTERM to its process group) it is not "being prepared" either; `catalog_prepare --reset`
(make run, before it starts one) clears what a killed one (SIGKILL, a power cut) left.

Layer: management, the top of jobs/ (beside tasks, admin and apps); uses hosts (services) and
models.
"""

import re
import signal
import subprocess

from django.core.management.base import BaseCommand, CommandError

from jobs.hosts import services as host_services
from jobs.models import Host, Image

PERCENT = re.compile(r"\((\d{1,3})%\)")


def percent_of(line: str) -> int | None:
    """The progress a script's line gives ("[jupyter-image 3.1s] packing (88%)": 88)."""
    found = PERCENT.search(line)
    return min(int(found.group(1)), 100) if found else None


class Command(BaseCommand):
    help = "Build a catalog image with the given command, its progress shown on the cluster form."

    def add_arguments(self, parser):
        parser.add_argument("reference", nargs="?", help="the catalog image's reference")
        parser.add_argument("command", nargs="*", help="the command that builds it (after --)")
        parser.add_argument(
            "--reset",
            action="store_true",
            help='no image is "being prepared" (what a killed build left); builds nothing',
        )

    def handle(self, *args, **opts):
        if opts["reset"]:
            stale = Image.objects.filter(preparing__isnull=False).update(preparing=None)
            self.stdout.write(f"{stale} image(s) no longer shown as being prepared")
            return
        if not opts["reference"] or not opts["command"]:
            raise CommandError("give the image's reference and, after --, the command")
        images = Image.objects.filter(reference=opts["reference"])
        if not images.exists():
            raise CommandError(f"no catalog image {opts['reference']}")
        images.update(preparing=0)
        # SIGTERM (make run's clean-up) ends the build and then the command through its
        # `finally`, as Ctrl-C does, instead of killing it with the image left "being
        # prepared: 40%". The handler only notes it and ends the build: raising there could
        # land in the middle of a query and leave the connection unusable for the clean-up.
        self._signalled, self._proc = None, None
        before = signal.signal(signal.SIGTERM, self._stop)
        try:
            code = self._run(images, opts["command"])
        finally:
            signal.signal(signal.SIGTERM, before)
            images.update(preparing=None)
        if self._signalled is not None:
            raise SystemExit(128 + self._signalled)
        for host_id in Host.objects.values_list("pk", flat=True):
            host_services.host_check(host_id=host_id)  # records the images its engine has now
        if code != 0:
            raise CommandError(
                f"{opts['command'][0]} exited with {code}: {opts['reference']} is not available here"
            )
        self.stdout.write(f"{opts['reference']} is ready")

    def _stop(self, signum, frame) -> None:
        self._signalled = signum
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()

    def _run(self, images, command: list[str]) -> int:
        """Run the build, its lines to our output and its progress onto the image."""
        shown = 0
        with subprocess.Popen(  # noqa: S603 (the operator's own command line)
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
        ) as proc:
            self._proc = proc
            for line in proc.stdout:
                if self._signalled is not None:
                    break
                self.stdout.write(line.rstrip("\n"))
                percent = percent_of(line)
                if percent is not None and percent > shown:
                    shown = percent
                    images.update(preparing=min(percent, 99))
        return proc.returncode
