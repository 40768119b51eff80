"""The starting catalog an operator gets (and edits in the admin afterwards), and where each
catalog image can run now (`availability`). Its descriptions are stored in English and
marked for the catalogue, so pages show the seeded ones in the reader's language
(`{% translate it.description %}`); one an operator types shows as typed.

An image's availability is read from the database only (no engine is asked per page): the
catalog images each active host's engine had at its last check (`Host.images`, written by
the host check), whether hosts may pull it (`Image.pullable`, or one of Suanli's registry),
and how far this machine is in building it (`Image.preparing`, `make run`).

Layer: placement; uses models and base.
"""

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from django.db import transaction
from django.utils.translation import gettext as _
from django.utils.translation import gettext_noop

from jobs.base import validators
from jobs.models import GpuModel, Host, Image, InstanceType

GPU_MODELS = [
    # name, slug, memory GB, BF16, NVLink
    ("T4 16 GB", "t4-16gb", 16, False, False),
    ("A10 24 GB", "a10-24gb", 24, True, False),
    ("A100 40 GB", "a100-40gb", 40, True, True),
    ("A100 80 GB", "a100-80gb", 80, True, True),
    ("H100 80 GB", "h100-80gb", 80, True, True),
]
INSTANCE_TYPES = [
    ("cpu-2c-4g", 2, 4, gettext_noop("Debug a training script before paying for GPUs.")),
    ("cpu-4c-16g", 4, 16, gettext_noop("Data preparation and small CPU jobs.")),
    ("cpu-8c-32g", 8, 32, gettext_noop("Preprocessing and evaluation.")),
]
JUPYTER_IMAGE = "suanli/jupyter:2.13-cpu"
IMAGES = [
    # name, reference, framework, CUDA, description, pulled from its registry, apps
    (
        "PyTorch 2.4 (CUDA 12.1)",
        "pytorch/pytorch:2.4.0-cuda12.1-cudnn9-runtime",
        "PyTorch 2.4",
        "12.1",
        gettext_noop("Official PyTorch runtime image with cuDNN 9; torchrun included."),
        True,
        "",
    ),
    (
        "PyTorch 2.13 + JupyterLab (CPU)",
        JUPYTER_IMAGE,
        "PyTorch 2.13",
        "",
        gettext_noop(
            "PyTorch 2.13 (CPU) with JupyterLab 4 and TensorBoard, started from the cluster "
            "page; built on this machine by .ci/jupyter-image.sh (make run, make e2e)."
        ),
        False,
        "jupyter tensorboard",
    ),
    (
        "Busybox (local test image)",
        "suanli/busybox:latest",
        "none",
        "",
        gettext_noop(
            "A tiny image built on this machine with docker import: a shell and coreutils, no Python."
        ),
        False,
        "",
    ),
]


@transaction.atomic
def seed_catalog() -> None:
    for name, slug, mem, bf16, nvlink in GPU_MODELS:
        GpuModel.objects.update_or_create(
            slug=slug, defaults={"name": name, "memory_gb": mem, "bf16": bf16, "nvlink": nvlink}
        )
    for name, vcpus, mem, desc in INSTANCE_TYPES:
        InstanceType.objects.update_or_create(
            name=name, defaults={"vcpus": vcpus, "memory_gb": mem, "description": desc}
        )
    for name, ref, framework, cuda, desc, pullable, apps in IMAGES:
        Image.objects.update_or_create(
            name=name,
            defaults={
                "reference": ref,
                "framework": framework,
                "cuda_version": cuda,
                "description": desc,
                "pullable": pullable,
                "apps": apps,
            },
        )


# -- where each image can run ----------------------------------------------------------------


@dataclass(frozen=True)
class Availability:
    """Where a catalog image can run now: on `hosts` active hosts that have it ("hosts"),
    pulled onto one on first use ("pull"), being built here ("preparing", `percent` done),
    or nowhere ("none")."""

    state: str
    hosts: int = 0
    percent: int = 0

    @property
    def runnable(self) -> bool:
        return self.state in ("hosts", "pull")

    def __str__(self) -> str:
        """The words the form shows beside the image, in the reader's language."""
        if self.state == "hosts":
            return _("on %(count)s host(s)") % {"count": self.hosts}
        if self.state == "pull":
            return _("pulled onto a host on first use (progress on the cluster page)")
        if self.state == "preparing":
            return _("being prepared: %(percent)s%%") % {"percent": self.percent}
        return _("not available here")

    def refusal(self, image: Image) -> str:
        """Why a cluster cannot have the image now, in the reader's language."""
        if self.state == "preparing":
            return _(
                "%(image)s is being prepared on this machine (%(percent)s%%): pick it again "
                "when it is ready, or pick another image."
            ) % {"image": image.name, "percent": self.percent}
        return _(
            "%(image)s is not available here: no host has it and it cannot be pulled. Pick "
            "another image, or ask an operator to put it on a host."
        ) % {"image": image.name}


def pullable(image: Image) -> bool:
    """Hosts may pull it when they lack it: one of Suanli's registry, or marked so."""
    return image.pullable or validators.names_registry(image.reference)


def availability(images: Iterable[Image]) -> dict[int, Availability]:
    """Image id -> where it can run now (one query, whatever the count of hosts)."""
    present: Counter[str] = Counter()
    for refs in Host.objects.filter(state=Host.State.ACTIVE).values_list("images", flat=True):
        present.update({str(ref) for ref in refs or ()})
    out = {}
    for image in images:
        if present[image.reference]:
            out[image.pk] = Availability("hosts", hosts=present[image.reference])
        elif pullable(image):
            out[image.pk] = Availability("pull")
        elif image.preparing is not None:
            out[image.pk] = Availability("preparing", percent=image.preparing)
        else:
            out[image.pk] = Availability("none")
    return out


def on_engine(tags: Iterable[str]) -> list[str]:
    """The active catalog images' references among an engine's image tags (what a host
    check records on the host): `busybox` and `docker.io/library/busybox:latest` are one."""
    have = {validators.image_repository(t) + ":" + _tag(t) for t in tags}
    return sorted(
        ref
        for ref in Image.objects.filter(active=True).values_list("reference", flat=True)
        if validators.image_repository(ref) + ":" + _tag(ref) in have
    )


def _tag(reference: str) -> str:
    name = reference.strip().partition("@")[0]
    last = name.rpartition("/")[2]
    return last.partition(":")[2] or "latest"


def with_app(kind: str) -> list[Image]:
    """The active catalog images that carry the workspace app `kind` (jupyter,
    tensorboard) and can run now, by name."""
    images = [i for i in Image.objects.filter(active=True) if kind in i.apps.split()]
    found = availability(images)
    return [i for i in images if found[i.pk].runnable]
