"""A stop's save of a workspace's system disk (workspaces.save) counts against its owner's
image quota, on the real engines and the registry: a researcher cannot fill the registry's
disk by write-stop-start cycles at no charge. A save that would take her past the quota is
not pushed, and the cluster's timeline and a blocked start say why (it can start only on
its own host); one that fits counts, at its own layers' size on a host's disk (never its
cluster's image), on her images page until it is used or released. Saves run on the
builder's queue, with a job timeout of at least SUANLI_WORKSPACE_SAVE_S."""

import django_rq
import docker
import pytest

from jobs import tasks
from jobs.clusters import services
from jobs.hosts import services as host_services
from jobs.images import builds
from jobs.models import Host, Node
from jobs.nodes import registry, workspaces
from jobs.placement import scheduler

pytestmark = pytest.mark.django_db

MB = 2**20


def _node(cluster) -> Node:
    return Node.objects.filter(cluster=cluster, index=0).select_related("host").latest("pk")


def _workspace(cluster):
    node = _node(cluster)
    client = docker.DockerClient(base_url=node.host.engine_url, timeout=30)
    return client, client.containers.get(workspaces.container_name(cluster.pk, 0))


def _save_tags(cluster) -> list[str]:
    path, _tag = registry.split(workspaces.save_reference(cluster.owner_id, cluster.pk, 0))
    return registry.tags(path)


def _stopped_with(running_cluster, megabytes: int):
    cluster = running_cluster(1, gpus=2)
    tasks.cluster_network_ensure(cluster.pk)
    _client, ws = _workspace(cluster)
    code, out = ws.exec_run(
        ["/bin/sh", "-c", f"head -c {megabytes * MB} /dev/urandom > /tmp/big.bin"],
        user=ws.attrs["Config"]["User"],
    )
    assert code == 0, out
    services.cluster_stop(cluster=cluster, by="alice")
    assert tasks.cluster_workspaces_stop(cluster.pk)
    return cluster


def test_a_save_past_the_image_quota_is_not_pushed_and_the_timeline_says_so(
    running_cluster, make_cluster, alice, bob, settings
):
    settings.SUANLI_IMAGE_QUOTA_GB = 0.015  # 15 MB: less than the 24 MB she wrote
    cluster = _stopped_with(running_cluster, 24)
    host_a = _node(cluster).host

    # The stop queued the save on the builder's queue, with time for a long push.
    job = django_rq.get_queue("builds").fetch_job(f"ws-save-{cluster.pk}")
    assert job is not None and job.timeout >= settings.SUANLI_WORKSPACE_SAVE_S
    assert django_rq.get_queue("default").fetch_job(f"ws-save-{cluster.pk}") is None

    assert tasks.cluster_workspaces_save(cluster.pk), "done: not retried while it does not fit"
    node = _node(cluster)
    assert node.saved_image == "" and node.saved_layers == []
    assert _save_tags(cluster) == [], "nothing pushed"
    client, _ws = _workspace(cluster)
    assert not client.images.list(name=workspaces.save_reference(alice.pk, cluster.pk, 0))
    said = list(cluster.events.filter(kind=workspaces.NOT_SAVED).values_list("message", flat=True))
    assert len(said) == 1, said
    assert said[0].startswith("the system disk of node 0 was not saved: with its 2"), said[0]
    assert said[0].endswith(
        " image quota, so the cluster can start only on its own host "
        f"({host_a.name}); delete images you no longer need to make room"
    ), said[0]
    assert tasks.cluster_workspaces_save(cluster.pk)  # tried again: said once per stop
    assert cluster.events.filter(kind=workspaces.NOT_SAVED).count() == 1
    assert builds.quota(alice).bytes == 0, "nothing of hers is in the registry"

    # Bob takes host a's GPUs: a start says why it cannot go to host b.
    others = list(Host.objects.exclude(pk=host_a.pk))
    for other in others:
        host_services.host_set_draining(host=other, draining=True)
    try:
        bobs = make_cluster(bob, "bobs", nodes=1, gpus=2, release_policy="never")
        scheduler.place_pending()
    finally:
        for other in others:
            host_services.host_set_draining(host=other, draining=False)
    with pytest.raises(services.StartBlocked) as caught:
        services.cluster_start(cluster=cluster)
    assert (
        "Another host has room for it, but its system disk was not saved: your image quota "
        "is full (see its timeline)."
    ) in " ".join(caught.value.messages)
    cluster.refresh_from_db()
    assert cluster.state == "stopped"
    for done in (cluster, bobs):
        services.cluster_release(cluster=done)
        assert tasks.cluster_network_remove(done.pk)


def test_a_save_that_fits_counts_its_own_layers_until_it_is_released(running_cluster, alice):
    cluster = _stopped_with(running_cluster, 24)
    assert tasks.cluster_workspaces_save(cluster.pk)
    node = _node(cluster)
    assert node.saved_image and _save_tags(cluster) == ["latest"]
    size = sum(n for _layer, n in node.saved_layers)
    assert 24 * MB <= size < 30 * MB, node.saved_layers  # the system disk's writes, no base
    client, _ws = _workspace(cluster)
    base = client.images.get(cluster.image_reference).attrs["RootFS"]["Layers"]
    assert not {layer for layer, _n in node.saved_layers} & set(base)
    assert builds.quota(alice).bytes == size, "on her images page, against her quota"

    services.cluster_release(cluster=cluster)
    assert tasks.cluster_network_remove(cluster.pk)
    assert builds.quota(alice).bytes == 0 and _save_tags(cluster) == []
