"""The starting catalog an operator gets (and edits in the admin afterwards). Its
descriptions are stored in English and marked for the catalogue, so pages show the seeded
ones in the reader's language (`{% translate it.description %}`); one an operator types
shows as typed.

Layer: placement; uses models only.
"""

from django.db import transaction
from django.utils.translation import gettext_noop

from jobs.models import GpuModel, Image, InstanceType

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
IMAGES = [
    (
        "PyTorch 2.4 (CUDA 12.1)",
        "pytorch/pytorch:2.4.0-cuda12.1-cudnn9-runtime",
        "PyTorch 2.4",
        "12.1",
        gettext_noop("Official PyTorch runtime image with cuDNN 9; torchrun included."),
    ),
    (
        "PyTorch 2.13 + JupyterLab (CPU)",
        "suanli/jupyter:2.13-cpu",
        "PyTorch 2.13",
        "",
        gettext_noop(
            "PyTorch 2.13 (CPU) with JupyterLab 4 and TensorBoard, started from the cluster "
            "page; built on this machine by .ci/jupyter-image.sh (make e2e)."
        ),
    ),
    (
        "Busybox (local test image)",
        "suanli/busybox:latest",
        "none",
        "",
        gettext_noop(
            "A tiny image built on this machine with docker import: a shell and coreutils, no Python."
        ),
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
    for name, ref, framework, cuda, desc in IMAGES:
        Image.objects.update_or_create(
            name=name,
            defaults={
                "reference": ref,
                "framework": framework,
                "cuda_version": cuda,
                "description": desc,
            },
        )
