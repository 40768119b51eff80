"""A year of history (issue 17): the clusters page and jobs in the admin.

Alice keeps two clusters going (one running, one waiting for GPUs) and has ended 30 before.
Her clusters page shows the two, then her 25 newest ended ones; page 2 shows the 5
oldest. Bob's clusters never appear on her pages. Olga (superuser) and Victor (staff who
may view jobs) look jobs up in the admin, where nobody adds, changes or deletes one;
Alice, a researcher, is sent to log in.

No Docker engine is needed: the host is a row, and the clusters are placed on it by the
real scheduler."""

import re

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.urls import reverse

from jobs.clusters import services
from jobs.models import Cluster, Job
from jobs.placement import scheduler

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("priced")]

ENDED = 30


@pytest.fixture
def history(paper_host, make_cluster, alice, bob):
    """Alice: old-00 (oldest) to old-29 (newest) ended, `live` running, `waiting` pending.
    Bob: `bobs-live` running, `bobs-old` ended."""
    for i in range(ENDED):
        services.cluster_release(cluster=make_cluster(alice, f"old-{i:02d}"))
    live = make_cluster(alice, "live", gpus=2)
    make_cluster(bob, "bobs-live", gpus=1)
    services.cluster_release(cluster=make_cluster(bob, "bobs-old"))
    scheduler.place_pending()
    waiting = make_cluster(alice, "waiting", gpus=8)  # 5 GPUs are left: it waits
    scheduler.place_pending()
    live.refresh_from_db()
    waiting.refresh_from_db()
    assert (live.state, waiting.state) == (Cluster.State.RUNNING, Cluster.State.PENDING)
    return {"live": live, "waiting": waiting}


def _table(body: str, table_id: str) -> str:
    found = re.search(rf'<table[^>]*id="{table_id}".*?</table>', body, re.S)
    return found.group(0) if found else ""


def _names(table: str) -> list[str]:
    return re.findall(r'<a href="/clusters/\d+/">(?:<strong>)?([\w-]+)<', table)


def _old(*numbers: int) -> list[str]:
    return [f"old-{i:02d}" for i in numbers]


def test_the_page_shows_what_runs_and_waits_then_the_newest_ended(client, alice, history):
    client.force_login(alice)
    body = client.get(reverse("cluster_list")).content.decode()
    active = _table(body, "active-clusters")
    assert sorted(_names(active)) == ["live", "waiting"]
    assert "gpu-paper-01" in active  # where the running one's node is
    assert _names(_table(body, "ended-clusters")) == _old(*range(ENDED - 1, ENDED - 26, -1))
    assert "30 in all" in body and "page 1 of 2" in body
    assert 'href="?page=2#history"' in body and "older →" in body and "← newer" not in body


def test_page_two_shows_the_older_ended_clusters(client, alice, history):
    client.force_login(alice)
    body = client.get(reverse("cluster_list"), {"page": 2}).content.decode()
    assert _names(_table(body, "ended-clusters")) == _old(4, 3, 2, 1, 0)
    assert "page 2 of 2" in body and 'href="?page=1#history"' in body and "older →" not in body
    # What runs stays on top of every page.
    assert sorted(_names(_table(body, "active-clusters"))) == ["live", "waiting"]


def test_a_page_past_the_end_or_not_a_number_shows_a_real_page(client, alice, history):
    client.force_login(alice)
    last = client.get(reverse("cluster_list"), {"page": 99}).content.decode()
    assert _names(_table(last, "ended-clusters")) == _old(4, 3, 2, 1, 0)
    first = client.get(reverse("cluster_list"), {"page": "x"}).content.decode()
    assert _names(_table(first, "ended-clusters"))[0] == "old-29"


def test_another_researchers_clusters_never_appear(client, alice, bob, history):
    client.force_login(alice)
    for page in (1, 2):
        body = client.get(reverse("cluster_list"), {"page": page}).content.decode()
        assert "bobs-" not in body
    client.force_login(bob)
    body = client.get(reverse("cluster_list")).content.decode()
    assert _names(_table(body, "active-clusters")) == ["bobs-live"]
    assert _names(_table(body, "ended-clusters")) == ["bobs-old"]
    assert "old-" not in body.replace("bobs-old", "") and "waiting" not in body
    # One page of history: no pager.
    assert "page 1 of" not in body and "?page=" not in body


def test_a_researcher_with_nothing_ended_sees_no_history(client, make_cluster, paper_host):
    carol = get_user_model().objects.create_user("carol", password="carol-pass-123")
    client.force_login(carol)
    body = client.get(reverse("cluster_list")).content.decode()
    assert "No active cluster" in body
    assert "Ended" not in body and 'id="ended-clusters"' not in body and "?page=" not in body


def test_the_page_costs_the_same_queries_with_more_history(
    client, alice, history, make_cluster, django_assert_max_num_queries
):
    client.force_login(alice)
    client.get(reverse("cluster_list"))  # warm: session, account
    # 13: the page's own, and one for the person's teams (the acting-for switcher and
    # request.actor share it: console/acting.py).
    with django_assert_max_num_queries(13) as before:
        client.get(reverse("cluster_list"))
    for i in range(ENDED, ENDED + 30):
        services.cluster_release(cluster=make_cluster(alice, f"old-{i:02d}"))
    with django_assert_max_num_queries(len(before.captured_queries)):
        body = client.get(reverse("cluster_list"), {"page": 2}).content.decode()
    assert "60 in all" in body and "page 2 of 3" in body


# -- jobs in the admin ------------------------------------------------------------------------


@pytest.fixture
def jobs(history, bob):
    """Two jobs queued on Alice's waiting cluster, one on Bob's running one."""
    spec = services.JobSpec
    bobs = Cluster.objects.get(name="bobs-live")
    return {
        "train": services.job_submit(cluster=history["waiting"], spec=spec("train", "true")),
        "eval": services.job_submit(cluster=history["waiting"], spec=spec("eval", "true")),
        "bobs": services.job_submit(cluster=bobs, spec=spec("bobs-job", "true")),
    }


@pytest.fixture
def victor(db):
    """Victor: staff who may view jobs, and nothing else."""
    user = get_user_model().objects.create_user("victor", password="victor-pass-123", is_staff=True)
    user.user_permissions.add(
        Permission.objects.get(content_type__app_label="jobs", codename="view_job")
    )
    return user


def _listed(client, **params) -> list[str]:
    page = client.get(reverse("admin:jobs_job_changelist"), params)
    assert page.status_code == 200
    return re.findall(
        r'<a href="/admin/jobs/job/\d+/change/[^"]*">([a-z][\w-]*)</a>', page.content.decode()
    )


def test_operators_list_jobs_newest_first_and_filter_them(client, operator, victor, jobs):
    for user in (operator, victor):
        client.force_login(user)
        assert _listed(client) == ["bobs-job", "eval", "train"]
        assert _listed(client, state="queued") == ["bobs-job", "eval", "train"]
        assert _listed(client, state="running") == []
        assert _listed(client, cluster=jobs["train"].cluster_id) == ["eval", "train"]
        assert _listed(client, cluster=f"#{jobs['bobs'].cluster_id}") == ["bobs-job"]
        assert _listed(client, cluster="not-a-number") == []
        assert _listed(client, owner="bob") == ["bobs-job"]
        assert _listed(client, owner="alice", q="tra") == ["train"]
        assert _listed(client, q=str(jobs["eval"].pk)) == ["eval"]
        assert _listed(client, q=f"#{jobs['eval'].pk}") == ["eval"]


def test_the_cluster_and_owner_filters_are_boxes_not_lists(client, operator, jobs):
    client.force_login(operator)
    body = client.get(reverse("admin:jobs_job_changelist"), {"state": "queued"}).content.decode()
    assert (
        '<input type="search" name="cluster"' in body
        and '<input type="search" name="owner"' in body
    )
    # Typing into one box keeps the other filters.
    assert '<input type="hidden" name="state" value="queued">' in body
    # No cluster is listed in the sidebar: each job's cluster links to its filter instead.
    assert f'href="?cluster={jobs["bobs"].cluster_id}"' in body
    assert f"bobs-live (#{jobs['bobs'].cluster_id})" in body


def test_jobs_are_read_only_in_the_admin(client, operator, victor, jobs):
    job = jobs["train"]
    change = reverse("admin:jobs_job_change", args=[job.pk])
    for user in (operator, victor):
        client.force_login(user)
        page = client.get(change)
        assert page.status_code == 200 and "train" in page.content.decode()
        assert 'name="_save"' not in page.content.decode()
        assert client.post(change, {"name": "renamed", "state": "succeeded"}).status_code == 403
        assert client.get(reverse("admin:jobs_job_add")).status_code == 403
        assert client.post(reverse("admin:jobs_job_add"), {"name": "x"}).status_code == 403
        assert (
            client.post(
                reverse("admin:jobs_job_delete", args=[job.pk]), {"post": "yes"}
            ).status_code
            == 403
        )
        listing = client.post(
            reverse("admin:jobs_job_changelist"),
            {"action": "delete_selected", "_selected_action": [job.pk], "post": "yes"},
        )
        assert listing.status_code in (200, 302)  # "No action selected": nothing happens
    job.refresh_from_db()
    assert (job.name, job.state) == ("train", Job.State.QUEUED)
    assert Job.objects.count() == 3


def test_researchers_are_sent_to_log_in_and_other_staff_refused(client, alice, jobs):
    client.force_login(alice)
    page = client.get(reverse("admin:jobs_job_changelist"))
    assert page.status_code == 302 and page["Location"].startswith(reverse("admin:login"))
    staff = get_user_model().objects.create_user("sam", password="sam-pass-12345", is_staff=True)
    client.force_login(staff)  # staff with no power at all: the admin's log-in too
    page = client.get(reverse("admin:jobs_job_changelist"))
    assert page.status_code == 302 and page["Location"].startswith(reverse("admin:login"))
    staff.user_permissions.add(Permission.objects.get(codename="view_host"))  # another power
    client.force_login(get_user_model().objects.get(pk=staff.pk))
    assert client.get(reverse("admin:jobs_job_changelist")).status_code == 403
