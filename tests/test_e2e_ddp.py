"""`make e2e`: real PyTorch DDP (CPU, gloo) across the two engines, as a researcher runs it.

Needs the suanli/torch:2.13-cpu image that `.ci/torch-image.sh` builds (make e2e does).
"""

import os
import textwrap

import pytest

from jobs.clusters import services
from jobs.clusters.services import JobSpec
from jobs.files.storage import VolumeSpec
from jobs.models import Image, Job
from jobs.runs import dispatch

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

TORCH_IMAGE = os.environ.get("SUANLI_TORCH_IMAGE", "suanli/torch:2.13-cpu")

DDP_SCRIPT = textwrap.dedent(
    """
    import os, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    loss = model(torch.ones(8, 4)).sum()
    loss.backward()  # gradients are all-reduced by DDP across every process
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    print(f"rank {rank}/{world} node {os.environ['NODE_RANK']} allreduce sum={t.item()}", flush=True)
    dist.destroy_process_group()
    """
)


@pytest.fixture
def torch_cluster(running_cluster, storage_root, alice):
    image, _ = Image.objects.get_or_create(
        name="PyTorch 2.13 CPU (local)", defaults={"reference": TORCH_IMAGE}
    )
    code = storage_root / f"u{alice.pk}" / "code"
    code.mkdir(parents=True, exist_ok=True)
    (code / "ddp.py").write_text(DDP_SCRIPT)

    def make(launcher_gpus):
        cluster = running_cluster(
            2, gpus=launcher_gpus, volumes=(VolumeSpec(source="code", target="/workspace"),)
        )
        cluster.image_reference = image.reference
        cluster.save(update_fields=["image_reference"])
        return cluster

    return make


def test_two_node_ddp_with_the_plain_launcher(torch_cluster, settle_until):
    cluster = torch_cluster(2)  # 2 GPUs per node fill a host: one node on each engine
    job = services.job_submit(
        cluster=cluster,
        spec=JobSpec(name="ddp", command="python3 /workspace/ddp.py"),
    )
    dispatch.dispatch(cluster.pk)
    job = settle_until(job, timeout=120)
    assert job.state == Job.State.SUCCEEDED, (
        job.state_reason,
        [r.log[-800:] for r in job.replicas.all()],
    )
    logs = {r.rank: r.log for r in job.replicas.all()}
    assert "rank 0/2 node 0 allreduce sum=3.0" in logs[0]
    assert "rank 1/2 node 1 allreduce sum=3.0" in logs[1]
    assert {r.host.name for r in job.replicas.all()} == {"gpu-a-01", "gpu-b-01"}


def test_two_node_ddp_under_torchrun_with_two_processes_per_node(torch_cluster, settle_until):
    cluster = torch_cluster(2)
    job = services.job_submit(
        cluster=cluster,
        spec=JobSpec(
            name="torchrun",
            command="/workspace/ddp.py",
            launcher=Job.Launcher.TORCHRUN,
        ),
    )
    dispatch.dispatch(cluster.pk)
    job = settle_until(job, timeout=180)
    assert job.state == Job.State.SUCCEEDED, (
        job.state_reason,
        [r.log[-800:] for r in job.replicas.all()],
    )
    assert {r.host.name for r in job.replicas.all()} == {"gpu-a-01", "gpu-b-01"}
    text = "\n".join(r.log for r in job.replicas.all())
    for rank in range(4):
        assert f"rank {rank}/4" in text and "allreduce sum=10.0" in text
