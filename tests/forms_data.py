"""What the new-cluster form posts, for the tests that post it."""

from jobs.models import Image


def cluster_form(**fields) -> dict:
    data = {
        "name": "train-1",
        "resource": "gpu:a100-80gb",
        "nodes": "1",
        "gpus_per_node": "2",
        "image": str(Image.objects.get(reference="suanli/busybox:latest").pk),
        "custom_image": "",
        "network": "standard",
        "zone": "",
        "volumes": "workspace:/workspace",
        "release_policy": "never",
        "idle_minutes": "",
    }
    data.update(fields)
    return data
