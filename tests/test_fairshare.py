"""Fair share between accounts in the placement queue, and the per-team GPU limit
(jobs/placement/fairshare.py): two labs on a full fleet of paper hosts (no engine), real
PostgreSQL, real placement passes at explicit times (`place_pending(now=...)`), nothing
slept or timed."""

from datetime import timedelta

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from console.models import ApiToken
from jobs.models import Cluster, GpuSlot, Node, Team
from jobs.placement import fleet, scheduler
from jobs.teams import services as teams

pytestmark = pytest.mark.django_db

H = timedelta(hours=1)


@pytest.fixture
def labs(alice, bob):
    """Alice's lab (heavy: it will have used the fleet) and Bob's (light)."""
    return (
        teams.team_create(person=alice, name="Heavy lab"),
        teams.team_create(person=bob, name="Light lab"),
    )


def _ask(make_cluster, team, name, *, at, gpus=8, nodes=1):
    """A request of `team` that joined the queue at `at`."""
    cluster = make_cluster(team.principal, name, gpus=gpus, nodes=nodes)
    Cluster.objects.filter(pk=cluster.pk).update(queued_at=at)
    cluster.refresh_from_db()
    return cluster


def _end(cluster, *, at):
    """The cluster ends at `at` and its GPUs come back, as the engine's confirmation gives
    them back (paper hosts have no engine)."""
    GpuSlot.objects.filter(node__cluster=cluster).update(node=None)
    Node.objects.filter(cluster=cluster, released_at__isnull=True).update(released_at=at)
    Cluster.objects.filter(pk=cluster.pk).update(state=Cluster.State.RELEASED, released_at=at)


def _state(cluster):
    cluster.refresh_from_db()
    return cluster.state


def _line():
    return [c.name for c in fleet.queue()]


def test_the_lighter_team_is_placed_first_when_a_slot_frees(
    client, alice, bob, labs, make_paper_host, make_cluster
):
    heavy, light = labs
    make_paper_host("gpu-paper-01", gpus=8)
    now = timezone.now()
    # The heavy lab held the whole fleet for the last 10 hours.
    hog = _ask(make_cluster, heavy, "hog", at=now - 10 * H)
    scheduler.place_pending(now=now - 10 * H)
    assert _state(hog) == Cluster.State.RUNNING
    # Both ask for the whole fleet again; the heavy lab asked first.
    again = _ask(make_cluster, heavy, "heavy-again", at=now - 2 * H)
    first = _ask(make_cluster, light, "light-first", at=now - 1 * H)
    scheduler.place_pending(now=now - 1 * H)
    assert _line() == ["light-first", "heavy-again"]
    # The pending cluster's page says where it stands and why, to a member of its team.
    _act_for(client, alice, heavy)
    page = client.get(reverse("cluster_detail", args=[again.pk])).content.decode()
    assert 'data-testid="queue-position">2<' in page
    assert "accounts that used less of their fair share recently go first" in page
    # The slot frees: the light lab's request takes it, though it came later.
    _end(hog, at=now)
    scheduler.place_pending(now=now)
    assert _state(first) == Cluster.State.RUNNING
    assert _state(again) == Cluster.State.PENDING
    page = client.get(reverse("cluster_detail", args=[again.pk])).content.decode()
    assert 'data-testid="queue-position">1<' in page
    # The operator's queue page: the account, its figures, and why it stands there.
    client.force_login(_operator())
    body = client.get(reverse("ops_queue")).content.decode()
    assert "Heavy lab" in body and "fair share of the fleet recently go first" in body
    assert 'data-testid="why-here">accounts that used less' in body


def _act_for(client, person, team):
    client.force_login(person)
    client.post(reverse("act_for"), {"team": team.pk})


def _operator():
    from django.contrib.auth import get_user_model

    return get_user_model().objects.create_user("olga", is_staff=True, is_superuser=True)


def test_shares_change_the_order(labs, make_paper_host, make_cluster):
    heavy, light = labs
    make_paper_host("gpu-paper-01", gpus=8)
    make_paper_host("gpu-paper-02", gpus=8)
    now = timezone.now()
    # Heavy held 8 GPUs for 10 hours, light 8 GPUs for 3: the fleet is full.
    hog = _ask(make_cluster, heavy, "heavy-run", at=now - 10 * H)
    scheduler.place_pending(now=now - 10 * H)
    _ask(make_cluster, light, "light-run", at=now - 3 * H)
    scheduler.place_pending(now=now - 3 * H)
    mine = _ask(make_cluster, heavy, "heavy-next", at=now - H)
    _ask(make_cluster, light, "light-next", at=now - H + timedelta(seconds=1))
    # Equal shares: the lab that used less goes first, although it asked a second later.
    assert _line() == ["light-next", "heavy-next"]
    # The operator weighs the heavy lab 4 to 1: it is owed four times the GPU-hours.
    Team.objects.filter(pk=heavy.pk).update(share=4)
    assert _line() == ["heavy-next", "light-next"]
    _end(hog, at=now)
    scheduler.place_pending(now=now)
    assert _state(mine) == Cluster.State.RUNNING


def test_no_team_starves_over_100_arrivals(labs, make_paper_host, make_cluster, settings):
    """The light lab submits two requests an hour for 50 hours (100 arrivals) and is owed a
    thousand times the heavy lab's share, so fair share alone would never pick the heavy
    lab; one slot frees an hour. The heavy lab's request is placed within the bound."""
    heavy, light = labs
    Team.objects.filter(pk=light.pk).update(share=1000)
    make_paper_host("gpu-paper-01", gpus=8)
    bound = timedelta(hours=settings.SUANLI_FAIRSHARE_MAX_WAIT_H)
    start = timezone.now() - 60 * H
    hog = _ask(make_cluster, heavy, "hog", at=start - 20 * H)
    scheduler.place_pending(now=start - 20 * H)
    waiting = _ask(make_cluster, heavy, "heavy-waits", at=start)
    running, placed_light = hog, []
    for step in range(50):
        at = start + step * H
        for k in range(2):
            _ask(make_cluster, light, f"light-{step:02}-{k}", at=at)
        _end(running, at=at)
        scheduler.place_pending(now=at)
        running = Cluster.objects.get(state=Cluster.State.RUNNING)
        if running == waiting:
            break
        placed_light.append(running.name)
    waiting.refresh_from_db()
    assert waiting.state == Cluster.State.RUNNING, waiting.state_reason
    assert waiting.running_since - waiting.queued_at <= bound
    # The light lab was placed meanwhile, an hour at a time, in its own arrival order.
    assert len(placed_light) >= 20 and placed_light == sorted(placed_light)


def test_a_team_at_its_gpu_limit_waits_and_does_not_block_others(
    client, alice, labs, make_paper_host, make_cluster
):
    heavy, light = labs
    Team.objects.filter(pk=heavy.pk).update(gpu_limit=8)
    make_paper_host("gpu-paper-01", gpus=8)
    make_paper_host("gpu-paper-02", gpus=8)
    now = timezone.now()
    one = _ask(make_cluster, heavy, "heavy-one", at=now - 3 * H)
    two = _ask(make_cluster, heavy, "heavy-two", at=now - 2 * H)
    other = _ask(make_cluster, light, "light-one", at=now - H, gpus=4)
    scheduler.place_pending(now=now)
    assert _state(one) == Cluster.State.RUNNING
    # The second would fit on the free host, but not within the limit: it waits, in words...
    assert _state(two) == Cluster.State.PENDING
    assert two.state_reason == (
        "waiting for its team's GPU limit: Heavy lab holds 8 of its 8 GPUs and this asks for 8"
    )
    # ...and the request behind it is placed as if it were not there.
    assert _state(other) == Cluster.State.RUNNING
    _act_for(client, alice, heavy)
    page = client.get(reverse("cluster_detail", args=[two.pk])).content.decode()
    assert "Heavy lab holds 8 of its 8 GPUs" in page
    assert "Why this place: waiting for its team&#x27;s GPU limit" in page
    client.force_login(_operator())
    body = client.get(reverse("ops_queue")).content.decode()
    assert "8 of 8" in body and "waiting for its team&#x27;s GPU limit" in body
    # Once the first ends, the second is placed.
    _end(one, at=now + H)
    scheduler.place_pending(now=now + H)
    assert _state(two) == Cluster.State.RUNNING


def test_the_api_says_where_a_pending_cluster_stands(alice, labs, make_paper_host, make_cluster):
    heavy, _ = labs
    Team.objects.filter(pk=heavy.pk).update(gpu_limit=8)
    make_paper_host("gpu-paper-01", gpus=8)
    now = timezone.now()
    one = _ask(make_cluster, heavy, "heavy-one", at=now - 2 * H)
    two = _ask(make_cluster, heavy, "heavy-two", at=now - H)
    scheduler.place_pending(now=now)
    _, token = ApiToken.issue(user=alice, name="lab", team=heavy)
    api = Client(HTTP_AUTHORIZATION=f"Bearer {token}")
    said = api.get(f"/api/v1/clusters/{two.pk}").json()
    assert said["queue_position"] == 1
    assert said["queue_why"] == "waiting for its team's GPU limit"
    listed = {c["name"]: c for c in api.get("/api/v1/clusters").json()["clusters"]}
    assert listed["heavy-two"]["queue_position"] == 1
    assert listed["heavy-one"]["queue_position"] is None and listed["heavy-one"]["queue_why"] == ""
    assert one.pk != two.pk


def test_fair_share_off_is_first_come_first_served(labs, make_paper_host, make_cluster, settings):
    settings.SUANLI_FAIRSHARE_HALF_LIFE_H = 0
    heavy, light = labs
    make_paper_host("gpu-paper-01", gpus=8)
    now = timezone.now()
    _ask(make_cluster, heavy, "hog", at=now - 10 * H)
    scheduler.place_pending(now=now - 10 * H)
    _ask(make_cluster, heavy, "heavy-again", at=now - 2 * H)
    _ask(make_cluster, light, "light-first", at=now - H)
    assert _line() == ["heavy-again", "light-first"]
