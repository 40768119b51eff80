"""The Docker contract (docs/architecture.md, "The Docker contract"): how one replica becomes one hardened container.

`container_spec` reads and checks, writing nothing but the tenant's storage folders it
must mount (created, or their old layout repaired, by `volume_mounts`). Everything a
researcher typed arrives here as data (environment
values, a command run by the container's own shell, volume paths already checked) and
never as a Docker argument of its own.

Layer: nodes, over network and under workspaces; uses network, files (storage, pub) and models.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

import docker
from django.conf import settings
from django.core.exceptions import ValidationError
from django.utils.translation import gettext as _
from docker.types import DeviceRequest, LogConfig, Mount, Ulimit

from jobs.files import pub, storage
from jobs.models import Cluster, Host, Job, Node, Replica
from jobs.nodes import network

LABEL_JOB = "suanli.job"
LABEL_REPLICA = "suanli.replica"
LABEL_CLUSTER = "suanli.cluster"
LABEL_OWNER = "suanli.owner"
LABEL_ATTEMPT = "suanli.attempt"


def tenant_uid(owner_id: int) -> int:
    """Each researcher's containers run as their own unprivileged uid."""
    return settings.SUANLI_TENANT_UID_BASE + owner_id


def container_name(job: Job, rank: int, attempt: int) -> str:
    return f"suanli-j{job.pk}-a{attempt}-r{rank}"


@dataclass(frozen=True)
class ContainerSpec:
    image: str
    name: str
    kwargs: dict


def distributed_env(job: Job, node: Node, master_name: str, nodes: int) -> dict[str, str]:
    """Rendezvous over the cluster's own network: rank 0's container name resolves there
    (Docker's DNS), and eth0 is that network in every replica."""
    cluster = job.cluster
    per_node = max(cluster.gpus_per_node, 1)
    env = {
        "MASTER_ADDR": master_name,
        "MASTER_PORT": str(master_port(job)),
        "NNODES": str(nodes),
        "NODE_RANK": str(node.index),
        "NPROC_PER_NODE": str(per_node),
        "LOCAL_WORLD_SIZE": str(per_node),
    }
    if job.launcher == Job.Launcher.TORCHRUN:
        # torchrun sets RANK/LOCAL_RANK per process; WORLD_SIZE counts processes.
        env["WORLD_SIZE"] = str(nodes * per_node)
        env["RANK"] = str(node.index * per_node)
    else:
        env["WORLD_SIZE"] = str(nodes)
        env["RANK"] = str(node.index)
    return env


class SpecError(Exception):
    """The job cannot be turned into a safe container (e.g. a volume that now escapes)."""


def master_port(job: Job) -> int:
    # Each cluster has a network of its own, so every job may use the same port.
    return job.master_port or settings.SUANLI_MASTER_PORT_BASE


def node_limits(cluster: Cluster, host: Host) -> tuple[float, int]:
    """(CPUs, memory bytes) of one node: a CPU instance type's own figures; for a GPU node
    its share of the host (Host.gpu_share), SUANLI_MEM_LIMIT_MB where the host's memory
    is not known yet; in no-GPU mode SUANLI_NO_GPU_CPUS and SUANLI_NO_GPU_MEMORY_MB."""
    if cluster.is_cpu_only:
        it = cluster.instance_type
        return float(it.vcpus), it.memory_gb * 2**30
    if cluster.no_gpu:  # started without GPUs: a small share, whatever the host
        return settings.SUANLI_NO_GPU_CPUS, settings.SUANLI_NO_GPU_MEMORY_MB * 2**20
    cpus, memory = host.gpu_share(cluster.gpus_per_node)
    return cpus, memory or settings.SUANLI_MEM_LIMIT_MB * 2**20


def volume_mounts(cluster: Cluster, owner_id: int) -> list[Mount]:
    """Bind mounts of the cluster's volumes, checked now, just before the engine mounts
    them: each source is one storage folder whose every parent directory only the console
    can change (storage.ensure_folders, which also repairs the layout before, where the
    tenant owned its storage root). A volume the console no longer accepts (a sub-folder,
    a folder swapped for a link) fails the start with what to mount instead. A cluster that
    asked for /pub gets the published datasets there, read-only (jobs/files/pub.py)."""
    volumes = list(cluster.volumes.all())
    try:
        sources = storage.ensure_folders(
            storage.tenant_root(owner_id), volumes, uid=tenant_uid(owner_id)
        )
        if cluster.pub and (why := pub.volumes_refusal(volumes)):
            raise ValidationError(why)
        public = pub.mount_source() if cluster.pub else None
    except ValidationError as exc:
        raise SpecError(" ".join(exc.messages)) from None
    mounts = [
        Mount(target=volume.target, source=source, type="bind", read_only=volume.read_only)
        for volume, source in zip(volumes, sources, strict=True)
    ]
    if public is not None:
        # The operator's published datasets, read-only for every tenant (jobs/files/pub.py).
        mounts.append(Mount(target=pub.TARGET, source=public, type="bind", read_only=True))
    return mounts


def wrapped_command(job: Job, env: dict[str, str]) -> list[str]:
    if job.launcher == Job.Launcher.TORCHRUN:
        launcher = (
            f"exec torchrun --nnodes {env['NNODES']} --nproc-per-node {env['NPROC_PER_NODE']} "
            f"--node-rank {env['NODE_RANK']} --master-addr {shlex.quote(env['MASTER_ADDR'])} "
            f"--master-port {env['MASTER_PORT']} "
        )
        # The researcher's command is a script and its arguments, handed to torchrun.
        return ["/bin/sh", "-c", launcher + job.command]
    if "SUANLI_PARAMS_FILE" in env and "SUANLI_PARAMS" in env:
        # A sweep's trial (jobs/pools/sweeps.py): its parameters as a JSON file too. The JSON is
        # handed over in the environment, never as shell words.
        return ["/bin/sh", "-c", PARAMS_WRITE + job.command]
    return ["/bin/sh", "-c", job.command]


PARAMS_WRITE = 'printf "%s\\n" "$SUANLI_PARAMS" > "$SUANLI_PARAMS_FILE" || exit 1\n'


def container_spec(
    *, job: Job, node: Node, nodes: int, attempt: int, nvidia: bool, network_name: str
) -> ContainerSpec:
    """The container of one replica. `network_name` is the cluster's own network
    (jobs.nodes.network); the container is on it alone: never the host's network."""
    cluster: Cluster = job.cluster
    # The cluster network is eth0; a researcher may name another interface in the job's env.
    env: dict[str, str] = {
        "NCCL_SOCKET_IFNAME": network.IFNAME,
        "GLOO_SOCKET_IFNAME": network.IFNAME,
    }
    env.update(job.env)
    env.update(distributed_env(job, node, container_name(job, 0, attempt), nodes))
    env.update(
        {
            "SUANLI_JOB": str(job.pk),
            "SUANLI_CLUSTER": str(cluster.pk),
            "SUANLI_ATTEMPT": str(attempt),
            "SUANLI_RESTART_COUNT": str(max(attempt - 1, 0)),
            "SUANLI_PREEMPTIONS": str(job.preemptions),
            "SUANLI_CHECKPOINT_DIR": job.checkpoint_dir,
            "SUANLI_PROFILE_DIR": storage.profile_dir(
                cluster.volumes.all(), job.checkpoint_dir, job.pk, attempt
            )[0],
            "HOME": "/tmp",  # noqa: S108 (the container's own /tmp)
        }
    )
    if job.resume_from:
        env["SUANLI_RESUME_FROM"] = job.resume_from
    name = container_name(job, node.index, attempt)
    kwargs = node_container_kwargs(
        cluster, node, owner_id=job.owner_id, network_name=network_name, name=name,
        nvidia=nvidia, share=replica_share(cluster),
    )  # fmt: skip
    # The node's own (GPUs, RDMA) win over anything the job's env names.
    kwargs["environment"] = {**env, **kwargs["environment"]}
    kwargs.update(
        command=wrapped_command(job, env),
        labels={
            LABEL_JOB: str(job.pk),
            LABEL_REPLICA: str(node.index),
            LABEL_CLUSTER: str(cluster.pk),
            LABEL_OWNER: str(job.owner_id),
            LABEL_ATTEMPT: str(attempt),
        },
        working_dir=job.workdir,
    )
    return ContainerSpec(image=cluster.image_reference, name=name, kwargs=kwargs)


def replica_share(cluster: Cluster) -> float:
    """A job's replicas get the node less its workspace's share (all of it without one)."""
    return 1 - settings.SUANLI_WORKSPACE_SHARE if cluster.workspace else 1.0


def node_container_kwargs(
    cluster: Cluster,
    node: Node,
    *,
    owner_id: int,
    network_name: str,
    name: str,
    nvidia: bool,
    share: float = 1.0,
) -> dict:
    """The hardening, limits, mounts, network and devices of any container of a node (a
    job's replica or the node's workspace): the tenant's uid, no capabilities, no new
    privileges, bounded pids, the node's share of CPU and memory, the cluster's volumes, its
    own network, its GPUs, an init as PID 1, its system disk where the host's engine
    enforces one. `share`: the part of the node's CPUs and
    memory this container gets (a workspace and a job's replica split the node)."""
    uid = tenant_uid(owner_id)
    gpus = ",".join(str(i) for i in node.gpu_indices)
    env = {"NVIDIA_VISIBLE_DEVICES": gpus or "void", "CUDA_VISIBLE_DEVICES": gpus}
    if cluster.network == Cluster.Network.RDMA:
        env["NCCL_IB_HCA"] = settings.SUANLI_NCCL_IB_HCA
    else:
        env["NCCL_IB_DISABLE"] = "1"
    mounts = volume_mounts(cluster, owner_id)
    cpus, memory = node_limits(cluster, node.host)
    cpus, memory = cpus * share, int(memory * share)
    kwargs: dict = {
        "environment": env,
        "user": f"{uid}:{uid}",
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges"],
        "privileged": False,
        "pids_limit": settings.SUANLI_PIDS_LIMIT,
        "nano_cpus": int(cpus * 1e9),
        "mem_limit": memory,
        "memswap_limit": memory,  # no swap beyond the limit
        "shm_size": f"{min(settings.SUANLI_SHM_SIZE_MB, memory // 2**21)}m",
        "mounts": mounts,
        "network": network_name,
        "hostname": name,
        "init": True,  # a real PID 1 forwards SIGTERM to the command and reaps zombies
        "detach": True,
        # What it prints is kept by the engine on the host's disk: a few rotated files, so
        # `yes` in a loop cannot fill it (the live and stored logs read the same files).
        "log_config": LogConfig(
            type="json-file",
            config={"max-size": f"{settings.SUANLI_CONTAINER_LOG_MB}m", "max-file": "3"},
        ),
    }
    if node.host.root_disk_enforced:
        # The system disk: the engine's storage driver refuses writes past it (ENOSPC or
        # EDQUOT inside); elsewhere the monitor measures it (monitoring.rootdisk).
        kwargs["storage_opt"] = {"size": f"{cluster.root_disk_gb}G"}
    if nvidia and node.gpu_indices:
        kwargs["device_requests"] = [
            DeviceRequest(device_ids=[str(i) for i in node.gpu_indices], capabilities=[["gpu"]])
        ]
    if cluster.network == Cluster.Network.RDMA:
        kwargs["devices"] = ["/dev/infiniband:/dev/infiniband"]
        kwargs["ulimits"] = [Ulimit(name="memlock", soft=-1, hard=-1)]
    return kwargs


def preemption_exec(job: Job, reason: str) -> dict:
    """The `exec_create` arguments of a replica's preemption script: the researcher's text
    is the shell's input (one argv element), run as the tenant's uid, never as root."""
    uid = tenant_uid(job.owner_id)
    # Its output joins the replica's own log (PID 1's stdout) where the container allows.
    wrapper = 'if [ -w /proc/1/fd/1 ]; then exec >/proc/1/fd/1 2>&1; fi; exec /bin/sh -c "$1"'
    return {
        "cmd": ["/bin/sh", "-c", wrapper, "preemption-script", job.preemption_script],
        "user": f"{uid}:{uid}",
        "workdir": job.workdir,
        "environment": {
            "SUANLI_PREEMPTION": "1",
            "SUANLI_PREEMPTION_REASON": reason[:300],
            "SUANLI_PREEMPTION_DEADLINE_S": str(settings.SUANLI_PREEMPT_SCRIPT_S),
            "SUANLI_CHECKPOINT_DIR": job.checkpoint_dir,
        },
        "stdout": True,
        "stderr": True,
        "privileged": False,
    }


def replica_labels_filter(job_id: int | None = None) -> dict:
    return {"label": [f"{LABEL_JOB}={job_id}"] if job_id is not None else [LABEL_JOB]}


def is_ours(replica: Replica, labels: dict) -> bool:
    return labels.get(LABEL_JOB) == str(replica.job_id) and labels.get(LABEL_ATTEMPT) == str(
        replica.attempt
    )


def with_image_volumes(client: docker.DockerClient, image: str, kwargs: dict) -> dict:
    """`kwargs` plus a bounded tmpfs over each VOLUME the image declares that no volume of
    the cluster covers: the engine would otherwise make an anonymous volume for it on the
    host's disk, outside the system disk's limit and its measure, and keep it after the
    container. A tmpfs is counted in the container's memory and goes with it."""
    try:
        declared = (client.images.get(image).attrs.get("Config") or {}).get("Volumes") or {}
    except docker.errors.ImageNotFound:
        return kwargs  # create says so; it is pulled and this is asked again
    taken = {m["Target"] for m in kwargs.get("mounts") or []}
    if pub.TARGET in taken:
        # Its mount point would be made inside the operator's read-only folder.
        inside = sorted(path for path in declared if pub.covers_pub(path))
        if inside:
            raise SpecError(
                _(
                    "The image declares VOLUME %(path)s inside /pub, where the public datasets "
                    "are mounted read-only: use an image without it, or go without /pub."
                )
                % {"path": inside[0]}
            )
    # In memory: at most a quarter of the container's, so that filling it is ENOSPC, not OOM.
    size = min(settings.SUANLI_IMAGE_VOLUME_MB * 2**20, int(kwargs.get("mem_limit") or 0) // 4)
    extra = [
        Mount(
            target=path,
            source=None,
            type="tmpfs",
            tmpfs_size=size or settings.SUANLI_IMAGE_VOLUME_MB * 2**20,
        )
        for path in sorted(declared)
        if path not in taken
    ]
    return {**kwargs, "mounts": [*(kwargs.get("mounts") or []), *extra]} if extra else kwargs
