"""The job page's Profile section, from a real job on the real engines: the job writes
its traces to SUANLI_PROFILE_DIR (on the tenant's storage), the worker summarises them
once, the page shows ranks, the slowest one and why, advice, charts and every file with
its download; a malformed and a truncated trace get a sentence. Then the attacker's
notebook: another researcher, links planted from inside the container, a fifo, odd names.
"""

import gzip
import json
import os

import pytest
import requests
from browsing import free_port
from django.test import Client
from django.urls import reverse
from test_cli import Cli
from test_profile_hta import GPU_T0, gpu_trace
from waiting import until

from console.models import ApiToken
from jobs.clusters import services
from jobs.clusters.services import JobSpec
from jobs.files import storage
from jobs.files.storage import VolumeSpec
from jobs.models import Job
from jobs.runs import dispatch
from monitoring import profiles
from monitoring.models import TraceSummary

pytestmark = pytest.mark.django_db

T0 = 5_608_258_569_889.0
DATALOADER = "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"
TABLE = """\
---------------------------------  ------------  ------------  ------------
                             Name    Self CPU %      Self CPU    # of Calls
---------------------------------  ------------  ------------  ------------
                          aten::mm        10.00%       1.000ms             3
enumerate(DataLoader)#_SingleP...        80.00%       8.000ms             3
                  gloo:all_reduce        10.00%     100.000us             3
---------------------------------  ------------  ------------  ------------
Self CPU time total: 9.100ms"""


def op(name, at, dur, *, cat="cpu_op", tid=11):
    return {"ph": "X", "cat": cat, "name": name, "pid": 11, "tid": tid, "ts": T0 + at,
            "dur": dur}  # fmt: skip


def trace(rank: int, loading_us: float) -> bytes:
    """Three steps of 10 ms: `loading_us` in the DataLoader, 1 ms of mm, the rest waiting
    in gloo's all-reduce (on its thread)."""
    events = []
    for step in range(3):
        at = step * 10_000
        events += [
            op(f"ProfilerStep#{step + 2}", at, 10_000, cat="user_annotation"),
            op(DATALOADER, at, loading_us, cat="user_annotation"),
            op("aten::mm", at + loading_us, 1000),
            op("gloo:all_reduce", at + loading_us + 1000, 9000 - loading_us,
               cat="user_annotation", tid=16),
        ]  # fmt: skip
    doc = {"distributedInfo": {"backend": "gloo", "rank": rank, "world_size": 2},
           "traceEvents": events}  # fmt: skip
    return json.dumps(doc).encode()


@pytest.fixture
def profiled_job(running_cluster, storage_root, alice, settle_until, work_queue):
    """A job whose two 'ranks' wrote their traces (rank 1 loads data for 8 ms a step),
    plus a malformed and a truncated one, and printed a key_averages table."""
    # The cluster makes its volume's folder (the tenant's); the test puts the files in it.
    cluster = running_cluster(1, volumes=(VolumeSpec(source="work", target="/workspace"),))
    src = storage_root / f"u{alice.pk}" / "work" / "src"
    src.mkdir()
    (src / "host_1.100.pt.trace.json").write_bytes(trace(0, 200))
    (src / "host_2.100.pt.trace.json").write_bytes(trace(1, 8000))
    (src / "host_3.100.pt.trace.json").write_bytes(b"<html>not a trace</html>")
    (src / "host_4.100.pt.trace.json").write_bytes(trace(0, 200)[:300])
    (src / "table.txt").write_text(TABLE + "\n")

    def run(command: str, *, summarise: bool = True) -> Job:
        job = services.job_submit(cluster=cluster, spec=JobSpec(name="prof", command=command))
        dispatch.dispatch(cluster.pk)
        job = settle_until(job, timeout=60)
        assert job.state == Job.State.SUCCEEDED, (job.state_reason, job.replicas.first().log)
        if summarise:
            work_queue("profiles")  # the summaries, queued when the job ended
        return job

    return run


COPY = 'mkdir -p "$SUANLI_PROFILE_DIR" && cp /workspace/src/*.json "$SUANLI_PROFILE_DIR"/'


def test_the_profile_section_summarises_each_ranks_traces(profiled_job, alice, client):
    job = profiled_job(f"{COPY} && cat /workspace/src/table.txt && echo $SUANLI_PROFILE_DIR")
    folder = f"/workspace/suanli-profiles/job-{job.pk}/attempt-1"
    assert folder in job.replicas.first().log  # the env var, as the job saw it
    assert TraceSummary.objects.filter(job=job).count() == 4
    client.force_login(alice)
    response = client.get(reverse("job_detail", args=[job.pk]))
    page = response.content.decode()
    assert reverse("job_profile", args=[job.pk]) in page  # the section loads from there
    assert 'data-testid="key-averages"' in page and 'data-value="8000.0"' in page
    # The diagnosis in words starts with what the profile says.
    advice = [a.text for a in response.context["profile_findings"]]
    assert any("takes 80 % of rank 1's step" in a and "num_workers" in a for a in advice), advice
    assert 'data-testid="profile-advice"' in page and "from the profile" in page

    section = client.get(reverse("job_profile", args=[job.pk]))
    assert section.status_code == 200
    html = section.content.decode()
    assert "hx-trigger" not in html  # ended and summarised: the section stops polling
    ranks = section.context["profile_ranks"]
    assert [r.rank for r in ranks] == [0, 1]
    rank1 = ranks[1]
    assert rank1.steps == 3 and rank1.step_us == 10_000
    assert rank1.split["dataloader"] == 8000 and rank1.split["compute"] == 1000
    assert section.context["profile_slowest"].rank == 1
    assert section.context["profile_slowest"].cause == "dataloader"
    assert 'data-testid="profile-slowest"' in html and "Slowest rank: 1" in html
    assert 'data-plotly-json="profile-split-data"' in html
    errors = {r.name: r.error for r in section.context["profile_files"] if r.error}
    assert "not valid JSON" in errors["host_3.100.pt.trace.json"]
    assert "ends early" in errors["host_4.100.pt.trace.json"]

    download = client.get(reverse("job_profile_file", args=[job.pk, 1, "host_2.100.pt.trace.json"]))
    assert download.status_code == 200
    assert b"".join(download.streaming_content) == trace(1, 8000)
    assert "attachment" in download["Content-Disposition"]

    # In Chinese: the section and the advice are in the reader's language.
    chinese = client.get(reverse("job_profile", args=[job.pk]), HTTP_ACCEPT_LANGUAGE="zh-CN")
    assert "最慢的进程：1" in chinese.content.decode() and "数据加载" in chinese.content.decode()
    page = client.get(reverse("job_detail", args=[job.pk]), HTTP_ACCEPT_LANGUAGE="zh-CN")
    assert "拖慢了其他进程" in page.content.decode()

    # Summaries are made once: a second run of the task reads nothing again.
    assert profiles.summarise_job(job.pk)["summarised"] == 0


def test_a_section_that_waited_for_summaries_redraws_the_page_once_they_are_in(
    profiled_job, alice, client
):
    job = profiled_job(COPY)
    client.force_login(alice)
    url = reverse("job_profile", args=[job.pk])
    headers = {"HX-Request": "true"}
    assert client.get(url + "?after=pending", headers=headers)["HX-Refresh"] == "true"
    assert "HX-Refresh" not in client.get(url, headers=headers)
    TraceSummary.objects.filter(job=job).delete()  # e.g. a trace rewritten: pending again
    pending = client.get(url, headers=headers)
    assert pending.context["profile_pending"] and "after=pending" in pending.content.decode()


def test_another_researcher_gets_404_for_the_section_and_the_downloads(profiled_job, bob):
    job = profiled_job(COPY)
    other = Client()
    other.force_login(bob)
    for url in (
        reverse("job_profile", args=[job.pk]),
        reverse("job_profile_file", args=[job.pk, 1, "host_2.100.pt.trace.json"]),
        reverse("job_detail", args=[job.pk]),
    ):
        assert other.get(url).status_code == 404, url
    assert Client().get(reverse("job_profile", args=[job.pk])).status_code == 302  # sign in


def test_links_fifos_and_odd_names_planted_in_the_folder_lead_nowhere(
    profiled_job, storage_root, alice, bob, client
):
    """From inside the container the researcher plants, in their own profile folder: a
    trace that is a link to another tenant's trace (by its host path, which they can
    guess), a link to /etc/shadow, a fifo (a reader would hang on it); then they swap the
    attempt's folder itself for a link to the other tenant's folder."""
    theirs = storage_root / f"u{bob.pk}" / "work"
    theirs.mkdir(parents=True)
    (theirs / "secret.pt.trace.json").write_bytes(trace(0, 100))
    plant = (
        f'{COPY} && cd "$SUANLI_PROFILE_DIR" '
        f"&& ln -s {theirs}/secret.pt.trace.json stolen.pt.trace.json "
        "&& ln -s /etc/shadow shadow.pt.trace.json && mkfifo fifo.pt.trace.json"
    )
    job = profiled_job(plant)
    client.force_login(alice)
    names = {r.name for r in client.get(reverse("job_profile", args=[job.pk])).context[
        "profile_files"]}  # fmt: skip
    assert "stolen.pt.trace.json" not in names and "fifo.pt.trace.json" not in names
    assert "shadow.pt.trace.json" not in names and "host_2.100.pt.trace.json" in names
    for name in ("stolen.pt.trace.json", "shadow.pt.trace.json", "fifo.pt.trace.json",
                 "..", "%2e%2e", "host_2.100.pt.trace.json%00"):  # fmt: skip
        response = client.get(f"/jobs/{job.pk}/profile/1/{name}")
        assert response.status_code == 404, name
    assert client.get(f"/jobs/{job.pk}/profile/2/host_2.100.pt.trace.json").status_code == 404
    assert client.get(f"/jobs/{job.pk}/profile/0/host_2.100.pt.trace.json").status_code == 404

    # The attempt's folder itself swapped for a link to the other tenant's folder.
    mine = storage_root / f"u{alice.pk}" / "work" / "suanli-profiles" / f"job-{job.pk}"
    os.rename(mine / "attempt-1", mine / "attempt-1.real")
    os.symlink(theirs, mine / "attempt-1")
    assert profiles.listing(job) == []
    assert client.get(f"/jobs/{job.pk}/profile/1/secret.pt.trace.json").status_code == 404
    profiles.summarise_job(job.pk)
    assert not TraceSummary.objects.filter(job=job).exists()  # the files are gone: forgotten


def test_without_a_volume_the_form_and_the_section_say_traces_are_not_kept(
    running_cluster, alice, client
):
    cluster = running_cluster(1, name="novol")
    client.force_login(alice)
    form = client.get(reverse("job_new", args=[cluster.pk])).content.decode()
    assert 'data-testid="profile-snippet"' in form and "SUANLI_PROFILE_DIR" in form
    assert 'data-testid="profile-warning"' in form
    base, kept = storage.profile_base([], "/workspace/checkpoints")
    assert (base, kept) == ("/tmp/suanli-profiles", False)


def test_a_trace_with_gpu_kernels_is_summarised_by_hta_in_the_worker(
    profiled_job, storage_root, alice, client
):
    src = storage_root / f"u{alice.pk}" / "work" / "src"
    for old in src.glob("*.json"):
        old.unlink()
    (src / "gpu_1.100.pt.trace.json").write_text(json.dumps(gpu_trace(rank=1)))
    # Rank 2's host sits in the DataLoader's __next__ while its GPU has nothing to do
    # (GPU time 300-350): HTA sees idle time, the split says data loading.
    loading = gpu_trace(rank=2)
    loading["traceEvents"].append(
        {"ph": "X", "cat": "user_annotation", "name": DATALOADER, "pid": 4242, "tid": 4242,
         "ts": GPU_T0 + 300, "dur": 50, "args": {"External id": 99}}
    )  # fmt: skip
    (src / "gpu_2.100.pt.trace.json").write_text(json.dumps(loading))
    job = profiled_job(COPY)
    row = TraceSummary.objects.get(job=job, rank=1)
    assert not row.error
    assert row.summary["source"] == "hta" and row.summary["gpu"] is True
    split = row.summary["split"]
    assert (split["compute"], split["communication"], split["memcpy"], split["idle"]) == (
        pytest.approx(600),
        pytest.approx(200),
        pytest.approx(50),
        pytest.approx(150),
    )
    two = TraceSummary.objects.get(job=job, rank=2).summary["split"]
    assert two["dataloader"] == pytest.approx(50) and two["idle"] == pytest.approx(100)
    assert sum(two.values()) == pytest.approx(sum(split.values()))
    assert row.summary["overlap_pct"] == pytest.approx(33.33, abs=0.01)
    assert row.summary["top"][0]["kind"] == "kernel"
    client.force_login(alice)
    html = client.get(reverse("job_profile", args=[job.pk])).content.decode()
    assert ">HTA<" in html


def test_files_built_to_break_the_worker_get_their_sentence_and_the_others_their_summary(
    profiled_job, storage_root, alice
):
    src = storage_root / f"u{alice.pk}" / "work" / "src"
    (src / "bigint.pt.trace.json").write_bytes(b'{"traceEvents": [{"ts": 1' + b"9" * 5000 + b"}]}")
    (src / "deep.pt.trace.json").write_bytes(b"[" * 100_000)
    (src / "inf.pt.trace.json").write_bytes(b'{"traceEvents": [{"ph": "X", "dur": Infinity}]}')
    (src / "suanli-j1-a1-r99999999999_1.pt.trace.json").write_bytes(trace(0, 200))
    job = profiled_job(COPY)
    rows = {r.name: r for r in TraceSummary.objects.filter(job=job)}
    assert "not valid JSON" in rows["bigint.pt.trace.json"].error
    assert "too deeply" in rows["deep.pt.trace.json"].error
    assert "Infinity" in rows["inf.pt.trace.json"].error
    odd = rows["suanli-j1-a1-r99999999999_1.pt.trace.json"]
    assert odd.summary and odd.rank == 0  # the trace's own rank; the name's is ignored
    assert rows["host_2.100.pt.trace.json"].summary["rank"] == 1
    assert profiles.summarise_job(job.pk)["summarised"] == 0  # errors are kept, not retried


def test_the_profiles_worker_caps_a_summarys_memory(profiled_job, storage_root, alice, processes):
    """A small gzip that unpacks to 3 million events: in the Procfile's `profiles` worker
    with 250 MB of data memory, its summary fails with a sentence and the worker goes on to
    the next file."""
    src = storage_root / f"u{alice.pk}" / "work" / "src"
    for old in src.glob("*.json"):
        old.unlink()
    event = json.dumps(op("aten::mm", 0, 1)).encode()
    with gzip.open(src / "bomb.pt.trace.json.gz", "wb", compresslevel=1) as bomb:
        bomb.write(b'{"traceEvents": [' + event)
        for _ in range(3_000):
            bomb.write((b"," + event) * 1000)
        bomb.write(b"]}")
    (src / "host_2.100.pt.trace.json").write_bytes(trace(1, 8000))
    job = profiled_job("mkdir -p \"$SUANLI_PROFILE_DIR\" && cp /workspace/src/*.json* \"$SUANLI_PROFILE_DIR\"/",
                       summarise=False)  # fmt: skip
    worker = processes.start(
        "profiles",
        "--burst",
        env={"SUANLI_PROFILE_WORKER_MEMORY_MB": "250", "SUANLI_STORAGE_ROOT": str(storage_root)},
    )
    assert worker.wait(timeout=120) == 0
    rows = {r.name: r for r in TraceSummary.objects.filter(job=job)}
    assert "needs more memory" in rows["bomb.pt.trace.json.gz"].error, rows[
        "bomb.pt.trace.json.gz"
    ].error
    assert rows["host_2.100.pt.trace.json"].summary["rank"] == 1


def test_the_profile_through_the_api_and_the_command_line(
    profiled_job, storage_root, alice, bob, processes, tmp_path
):
    job = profiled_job(COPY)
    _, token = ApiToken.issue(user=alice, name="laptop")
    api = Client(HTTP_AUTHORIZATION=f"Bearer {token}")
    answer = api.get(f"/api/v1/jobs/{job.pk}/profile")
    assert answer.status_code == 200, answer.content
    body = answer.json()
    assert body["pending"] is False and body["slowest"] == {"rank": 1, "cause": "dataloader"}
    assert [r["rank"] for r in body["ranks"]] == [0, 1]
    assert body["ranks"][1]["split_ms"]["dataloader"] == 8.0 and body["ranks"][1]["step_ms"] == 10
    assert any("takes 80 % of rank 1's step" in a["text"] for a in body["advice"])
    files = {f["name"]: f for f in body["files"]}
    assert files["host_3.100.pt.trace.json"]["state"] == "error"
    download = api.get(files["host_2.100.pt.trace.json"]["download"])
    assert download.status_code == 200
    assert b"".join(download.streaming_content) == trace(1, 8000)
    _, theirs = ApiToken.issue(user=bob, name="bob")
    other = Client(HTTP_AUTHORIZATION=f"Bearer {theirs}")
    assert other.get(f"/api/v1/jobs/{job.pk}/profile").status_code == 404
    assert other.get(files["host_2.100.pt.trace.json"]["download"]).status_code == 404

    port = free_port()
    processes.start("web", env={"PORT": str(port), "SUANLI_STORAGE_ROOT": str(storage_root)})
    url = f"http://127.0.0.1:{port}"
    until(lambda: _answers(url), timeout=20, what="the web process listens")
    cli = Cli(tmp_path / "alice")
    cli("login", "--url", url + "/", "--token", token)
    shown = cli("jobs", "profile", job.pk).stdout
    assert "Slowest rank: 1 (dataloader)" in shown
    assert "8.0 (80 %)" in shown and "host_2.100.pt.trace.json" in shown
    assert cli.json("jobs", "profile", job.pk)["slowest"]["rank"] == 1


def _answers(url: str) -> bool:
    try:
        return requests.get(f"{url}/api/v1/schema", timeout=2).status_code == 200
    except requests.ConnectionError:
        return False
