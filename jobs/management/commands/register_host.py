"""`register_host`: add (or update) a Docker host from the command line, and check it.

Layer: management, the top of jobs/ (beside tasks, admin and apps); uses hosts (services) and
models.
"""

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from jobs.hosts import services as host_services
from jobs.models import GpuModel, Host


class Command(BaseCommand):
    help = "Register (or update) a Docker host and check it now."

    def add_arguments(self, parser):
        parser.add_argument("--name", required=True)
        parser.add_argument(
            "--engine", required=True, help="unix:///var/run/docker.sock or tcp://HOST:2376"
        )
        parser.add_argument(
            "--address", default="127.0.0.1", help="its address on the hosts' network"
        )
        parser.add_argument("--zone", default="zone-a")
        parser.add_argument(
            "--gpu-model", default="", help="slug, e.g. a100-80gb; empty for CPU only"
        )
        parser.add_argument("--gpus", type=int, default=0)
        parser.add_argument("--rdma", action="store_true")
        parser.add_argument(
            "--build-host",
            action="store_true",
            help="Builds researchers' images (and saves workspaces as images).",
        )

    def handle(self, *args, **opts):
        model = None
        if opts["gpu_model"]:
            model = GpuModel.objects.filter(slug=opts["gpu_model"]).first()
            if model is None:
                known = ", ".join(GpuModel.objects.values_list("slug", flat=True)) or "none yet"
                raise CommandError(f"Unknown GPU model {opts['gpu_model']!r} (known: {known}).")
        host = Host.objects.filter(name=opts["name"]).first() or Host(name=opts["name"])
        host.engine_url = opts["engine"]
        host.address = opts["address"]
        host.zone = opts["zone"]
        host.gpu_model = model
        host.gpu_count = opts["gpus"]
        host.rdma = opts["rdma"]
        host.build_host = opts.get("build_host", False)
        try:
            host_services.host_save(host=host)
        except ValidationError as exc:
            raise CommandError(
                "; ".join(f"{k}: {' '.join(v)}" for k, v in exc.message_dict.items())
            ) from exc
        host = host_services.host_check(host_id=host.pk)
        if host.state in Host.UNHEALTHY:
            self.stderr.write(f"{host.name}: registered but {host.state}: {host.last_error}")
        else:
            kind = "emulated GPUs" if host.emulated_gpu else "NVIDIA runtime"
            self.stdout.write(f"{host.name}: {host.state}, Docker {host.docker_version}, {kind}")
