"""Issue 14's mount race, replayed on the real engines by a tenant with a shell.

Before: alice's storage root was hers, and a volume could name any sub-path of it. One of
her jobs swapped a volume's folder for a link to `/` and back in a tight loop while her
other cluster started jobs on it; one start won the race between the console's check and
the engine's mount, and `/data` showed the host's root, read-write. Now a bind source is one
folder of a root only the console can change (jobs/files/storage.py); she races what she can
still reach, and the starts beside it never see past her folder.
"""

import os
import time
import uuid

import docker
import pytest
from docker.types import Mount

from jobs.clusters import services
from jobs.clusters.services import JobSpec
from jobs.files.storage import VolumeSpec
from jobs.models import Job, Replica, Volume
from jobs.nodes import runtime
from jobs.runs import dispatch, stopping

pytestmark = pytest.mark.django_db

TEST_IMAGE = os.environ.get("SUANLI_TEST_IMAGE", "suanli/busybox:latest")
STARTS = 50


def test_in_a_container_as_her_uid_she_cannot_rename_or_replace_a_folder_of_her_root(
    make_cluster, alice, storage_root, engine_urls
):
    make_cluster(alice, volumes=(VolumeSpec("datasets", "/data"),))
    root = storage_root / f"u{alice.pk}"
    uid = runtime.tenant_uid(alice.pk)
    # Her root is never mounted for her; here it is, read-write, to try the swap that won
    # the race before, with the hardening every replica has.
    script = (
        "cd /t; mv datasets gone; echo mv=$?; ln -s / evil; echo ln=$?; "
        "rmdir datasets; echo rmdir=$?; mkdir planted; echo mkdir=$?; ls /t; echo ls=$?; "
        "echo mine > datasets/mine; echo write-inside=$?"
    )
    client = docker.DockerClient(base_url=engine_urls[0], timeout=30)
    try:
        out = client.containers.run(
            TEST_IMAGE, ["/bin/sh", "-c", script], user=f"{uid}:{uid}", cap_drop=["ALL"],
            security_opt=["no-new-privileges"], network_mode="none", remove=True,
            mounts=[Mount("/t", str(root), type="bind")], stdout=True, stderr=True,
        ).decode()  # fmt: skip
    finally:
        client.close()
    for step in ("mv", "ln", "rmdir", "mkdir", "ls"):
        assert f"{step}=1" in out, out
    assert out.count("Permission denied") == 5, out
    assert "write-inside=0" in out, "her folder is hers"
    assert (root / "datasets").is_dir() and not (root / "datasets").is_symlink()
    assert sorted(p.name for p in root.iterdir()) == ["datasets"]


def _look(marker_paths: list[str]) -> str:
    """A victim job: where /data/sub stands now, and whether anything outside her folder
    shows through /data."""
    probes = " ".join(f"/data{p}" for p in marker_paths)
    return (
        "if [ -L /data/sub ]; then echo STATE=link; elif [ -d /data/sub ]; then "
        "echo STATE=dir; else echo STATE=none; fi; "
        f"for p in {probes}; do [ -e $p ] && echo ESCAPED:$p && cat $p; done; "
        "ls /data; exit 0"
    )


def test_fifty_starts_beside_a_folder_swapping_loop_never_see_past_her_folder(
    running_cluster, settle_until, alice, storage_root
):
    # Markers the starts must never reach: beside the storage root, and things only the
    # host's root or her own root (the console's) would show.
    secret = f"outside-{uuid.uuid4()}"
    outside = storage_root.parent / "outside-marker"
    outside.write_text(secret)
    probes = [
        str(outside),  # /data the host's root
        "/outside-marker",  # /data the storage root's parent
        f"/u{alice.pk}",  # /data the storage root
        "/datasets",  # /data her root
        "/work/main/manage.py",  # the host's root again
    ]
    attacker = running_cluster(1, name="attacker", volumes=(VolumeSpec("datasets", "/data"),))
    victims = [
        running_cluster(1, name="victim-rw", volumes=(VolumeSpec("datasets", "/data"),)),
        running_cluster(1, name="victim-ro", volumes=(VolumeSpec("datasets", "/data", True),)),
    ]
    # A cluster made before this layout, whose volume names the sub-folder she swaps.
    legacy = running_cluster(1, name="legacy")
    Volume.objects.create(cluster=legacy, source="datasets/sub", target="/data")

    loop = (
        "mkdir -p /data/sub; echo inside > /data/sub/inside; "
        "while :; do mv /data/sub /data/sub.real; ln -s / /data/sub; rm /data/sub; "
        "mv /data/sub.real /data/sub; mv /data /data.gone && echo MOVED-HER-MOUNT; "
        "done 2>/dev/null"
    )
    race = services.job_submit(cluster=attacker, spec=JobSpec(name="swap", command=loop))
    dispatch.dispatch(attacker.pk)
    race.refresh_from_db()
    assert race.state == Job.State.RUNNING, race.state_reason
    time.sleep(0.5)

    started = time.monotonic()
    looks: list[Job] = []
    refusals: list[Job] = []
    while len(looks) < STARTS:
        batch = []
        for cluster in victims:
            batch.append(
                services.job_submit(
                    cluster=cluster, spec=JobSpec(name=f"look-{len(looks)}", command=_look(probes))
                )
            )
            dispatch.dispatch(cluster.pk)
            looks.append(batch[-1])
        if len(refusals) < 5:
            refusals.append(
                services.job_submit(cluster=legacy, spec=JobSpec(name="old", command="ls /data"))
            )
            dispatch.dispatch(legacy.pk)
        for job in batch:
            settle_until(job, timeout=20)
    elapsed = time.monotonic() - started

    states = {"link": 0, "dir": 0, "none": 0}
    for job in looks:
        job.refresh_from_db()
        log = "".join(r.log for r in job.replicas.all())
        assert job.state == Job.State.SUCCEEDED, (job.state, job.state_reason, log)
        assert "ESCAPED" not in log and secret not in log, log
        assert "manage.py" not in log, log
        for state in states:
            states[state] += f"STATE={state}" in log
    for job in refusals:
        job = settle_until(job)
        assert job.state == Job.State.FAILED
        assert "'datasets/sub' is a sub-folder" in job.state_reason
        assert "Mount datasets:/data instead and use /data/sub" in job.state_reason
        assert {r.state for r in job.replicas.all()} == {Replica.State.LOST}, "no container"

    race.refresh_from_db()
    assert race.state == Job.State.RUNNING, "the loop ran through every start"
    services.job_cancel(job=race, by="alice")
    stopping.kill(race.pk)
    race = settle_until(race)
    assert "MOVED-HER-MOUNT" not in race.replicas.get().log
    # She did race: the starts caught her folder both ways.
    assert states["link"] and states["dir"], states
    print(f"{STARTS} starts in {elapsed:.1f} s beside the loop; /data/sub seen as {states}")
