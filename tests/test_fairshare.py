"""Fair share between accounts in the placement queue, and the per-team GPU limit
(jobs/placement/fairshare.py): two labs on a full fleet of paper hosts (no engine), real
PostgreSQL, real placement passes at explicit times (`place_pending(now=...)`), nothing
slept or timed."""

import math
import random
from datetime import timedelta

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from console.models import ApiToken
from jobs.models import Cluster, GpuSlot, Node, Team
from jobs.placement import fairshare, fleet, scheduler
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
    """Both labs ask steadily for the whole fleet (one host), one slot freeing an hour, for
    100 arrivals: three of every four from the light lab, which is owed a thousand times
    the heavy lab's share and has a request waiting at every pass, so fair share alone would
    never pick the heavy lab. Usage decays slowly (a 1000 h half-life), so the order is fair
    share's until the bound: the light lab goes first while the heavy lab's requests are
    within it, and every request is placed within the bound plus one slot period."""
    settings.SUANLI_FAIRSHARE_HALF_LIFE_H = 1000
    settings.SUANLI_FAIRSHARE_MAX_WAIT_H = 6
    bound = timedelta(hours=6)
    heavy, light = labs
    Team.objects.filter(pk=light.pk).update(share=1000)
    make_paper_host("gpu-paper-01", gpus=8)
    start = timezone.now() - 150 * H
    running = _ask(make_cluster, heavy, "hog", at=start - 20 * H)  # 20 h of the whole fleet
    scheduler.place_pending(now=start - 20 * H)
    # Four light requests wait at the start, then one arrival an hour: the heavy lab's
    # every fourth hour, the light lab's the others (100 in all).
    arrivals = [(0, light, f"light-start-{k}") for k in range(4)] + [
        (hour, heavy if hour % 4 == 0 else light, f"{'heavy' if hour % 4 == 0 else 'light'}-{hour:02}")
        for hour in range(96)
    ]  # fmt: skip
    asked, order = {}, []
    hour = 0
    while hour < 96 or Cluster.objects.filter(state=Cluster.State.PENDING).exists():
        at = start + hour * H
        for _, team, name in (a for a in arrivals if a[0] == hour):
            asked[name] = _ask(make_cluster, team, name, at=at)
        _end(running, at=at)
        waiting = {c.name: c.queued_at for c in Cluster.objects.filter(state="pending")}
        scheduler.place_pending(now=at)
        running = Cluster.objects.get(state=Cluster.State.RUNNING)
        order.append(running.name)
        # While the heavy lab's request is within the bound, a waiting light one goes first.
        if running.name.startswith("heavy") and at - running.queued_at < bound:
            assert not any(name.startswith("light") for name in waiting), (hour, running.name)
        hour += 1
        assert hour < 150
    assert len(asked) == 100 and sorted(order) == sorted(asked)
    waits = {c.name: c.running_since - c.queued_at for c in Cluster.objects.filter(name__in=asked)}
    assert max(waits.values()) <= bound + H
    # The heavy lab waited its bound each time (fair share put the light lab first), and
    # the light lab was placed in its own arrival order, within four hours.
    assert {w for n, w in waits.items() if n.startswith("heavy")} == {bound}
    assert max(w for n, w in waits.items() if n.startswith("light")) <= 4 * H
    lights = [n for n in order if n.startswith("light")]
    assert lights == sorted(lights, key=lambda n: (asked[n].queued_at, asked[n].pk))


def test_a_pending_clusters_poll_reads_the_kept_standing(
    client, alice, labs, make_paper_host, make_cluster, settings
):
    """Many people watching pending clusters: the first poll after a placement pass works
    out the whole queue's standing, the next polls read it from Redis (no query of the
    queue or of the accounts' usage), and the next pass's order shows at the next poll.
    With Redis away, each poll works it out again and still says it."""
    heavy, light = labs
    make_paper_host("gpu-paper-01", gpus=8)
    now = timezone.now()
    hog = _ask(make_cluster, heavy, "hog", at=now - 10 * H)
    scheduler.place_pending(now=now - 10 * H)
    again = _ask(make_cluster, heavy, "heavy-again", at=now - 2 * H)
    _ask(make_cluster, light, "light-first", at=now - H)
    scheduler.place_pending(now=now - H)
    _act_for(client, alice, heavy)
    status = reverse("cluster_status", args=[again.pk]) + "?shown=pending"

    def poll() -> tuple[str, list[str]]:
        with CaptureQueriesContext(connection) as ctx:
            body = client.get(status).content.decode()
        return body, [q["sql"] for q in ctx.captured_queries]

    def of_the_queue(queries: list[str]) -> list[str]:
        """The queue's standing: the pending clusters, the accounts' teams and usage."""
        marks = ("\"jobs_cluster\".\"state\" = 'pending'", "power(2",
                 'SELECT "jobs_team"."principal_id", "jobs_team"."name"')  # fmt: skip
        return [q for q in queries if any(m in q for m in marks)]

    first, queries = poll()
    assert 'data-testid="queue-position">2<' in first
    assert len(of_the_queue(queries)) >= 2 and any("power(2" in q for q in queries)
    for _ in range(3):
        body, queries = poll()
        assert 'data-testid="queue-position">2<' in body and "fair share" in body
        assert of_the_queue(queries) == []
    # A pass places the light lab's request: the next poll says the heavy one is next.
    _end(hog, at=now)
    scheduler.place_pending(now=now)
    body, _ = poll()
    assert 'data-testid="queue-position">1<' in body
    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens there
    body, _ = poll()
    assert 'data-testid="queue-position">1<' in body


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


def test_recent_usage_is_the_decayed_gpu_hours_of_each_account_over_random_histories(
    alice, labs, make_paper_host, make_cluster
):
    """The usage aggregate (float arithmetic in SQL) gives each account the GPU-hours of its
    nodes weighted 2^(-age / H), as the integral computed here from the rows; so the order
    of the accounts (their factors) is the one the exact figures give."""
    for i in range(4):
        make_paper_host(f"gpu-paper-{i:02}", gpus=8)
    owners = [labs[0].principal, labs[1].principal, alice]
    rng = random.Random(43)  # noqa: S311 (a reproducible history, not a secret)
    for i in range(9):
        owner = owners[i % 3]
        make_cluster(owner, f"r{i}", gpus=rng.choice([1, 2, 4]), nodes=rng.choice([1, 2]))
    scheduler.place_pending()
    assert Node.objects.count() >= 9
    now = timezone.now()
    for node in Node.objects.all():
        placed = now - timedelta(hours=rng.uniform(0, 300))
        released = rng.choice([None, placed + timedelta(hours=rng.uniform(0, 100))])
        if released is not None and released > now:
            released = None
        Node.objects.filter(pk=node.pk).update(placed_at=placed, released_at=released)
    for seed in range(5):
        rng = random.Random(seed)  # noqa: S311
        at = now - timedelta(hours=rng.uniform(0, 48))
        half_life = rng.choice([1, 6, 24, 72])
        expected: dict[int, list] = {}
        cutoff = at - timedelta(hours=half_life * fairshare.WINDOW_HALF_LIVES)
        for node in Node.objects.select_related("cluster"):
            if node.released_at is not None and node.released_at <= cutoff:
                continue

            def weight(t, at=at, half_life=half_life):
                return 2 ** ((min(t, at) - at).total_seconds() / (half_life * 3600))

            end = node.released_at or at
            gpus = node.cluster.gpus_per_node
            used = gpus * half_life / math.log(2) * (weight(end) - weight(node.placed_at))
            mine = expected.setdefault(node.cluster.owner_id, [0.0, 0])
            mine[0] += used
            mine[1] += gpus if node.released_at is None else 0
        got = fairshare.recent_usage(now=at, half_life_h=half_life)
        assert got.keys() == expected.keys()
        for owner, (used, held) in expected.items():
            assert got[owner][0] == pytest.approx(used, rel=1e-9, abs=1e-9)
            assert got[owner][1] == held
        ranked = sorted(expected, key=lambda o: (expected[o][0], o))
        assert sorted(got, key=lambda o: (got[o][0], o)) == ranked


def test_a_node_live_for_more_than_a_thousand_half_lives_does_not_stop_placement(
    alice, labs, make_paper_host, make_cluster, settings
):
    """float8's power() raises on underflow (2^-1100), where numeric's gave 0: one tenant's
    node kept running for years (at a 1-hour half-life, 46 days) must not make every pass
    raise. Its old hours count as nothing, the GPUs it holds as held, and the next request
    of anyone is still placed."""
    settings.SUANLI_FAIRSHARE_HALF_LIFE_H = 1
    make_paper_host("gpu-paper-00", gpus=8)
    make_cluster(labs[0].principal, "ancient", gpus=2)
    scheduler.place_pending()
    now = timezone.now()
    Node.objects.update(placed_at=now - timedelta(hours=1100))
    got = fairshare.recent_usage(now=now, half_life_h=1)
    used, held = got[labs[0].principal.pk]
    assert held == 2
    assert used == pytest.approx(2 / math.log(2), rel=1e-9)  # its whole decayed history
    fresh = make_cluster(alice, "fresh", gpus=1)
    scheduler.place_pending()
    fresh.refresh_from_db()
    assert fresh.state == fresh.State.RUNNING
