"""Two ways around a team member's caps (docs/user/teams.md, "Money") that an attacker's
review found, each shown closed as the member would try it: the page and the API.

1. A GPU subscription that rents for a team rents as the member who made it: the team's
   balance but that member's monthly budget and GPU cap, the cluster theirs (so the
   accrual charges it to them); a maker who is no longer a member, or only a viewer, rents
   nothing, and one who leaves has their waiting subscriptions cancelled, saying why.
2. Work on a teammate's pool is paid from the pool maker's budget, but the one who submits
   it (a job or a sweep) must still be within their own budget: else a member whose budget
   is spent would run on someone else's.

On real PostgreSQL, on hosts with no engine (the db tier): nothing here starts a container.
"""

import html
import json
from datetime import timedelta
from decimal import Decimal
from functools import partial

import pytest
from conftest import TEST_IMAGE
from django.test import Client
from django.utils import timezone

from console import pools as console_pools
from console import subscriptions as console_subscriptions
from console.acting import SESSION_KEY
from console.forms import check_funds
from console.models import ApiToken
from jobs.clusters.services import ClusterSpec
from jobs.models import Cluster, GpuSubscription, Image, Job, Sweep, TeamMember
from jobs.pools import autoscaler, subscriptions
from jobs.teams import services as teams
from jobs.tenancy.actors import Actor

pytestmark = pytest.mark.django_db
Role = TeamMember.Role
TEAM = "张老师课题组"
# 36.00 per GPU-hour: one GPU's first 10 minutes (the balance's look-ahead) need 6.00.
BUDGET_SPENT = (
    "Past your monthly budget in 张老师课题组: spent this month ¥0.00 / cap ¥5.00, and this "
    "needs ¥6.0000 for its first 10 minutes. Ask the team's owner to raise your budget."
)


@pytest.fixture
def lab(alice, bob, rate_card, fund, make_paper_host, storage_root):
    """Alice's lab with 100.00 in it, bob a member; 8 free A100s on a paper host."""
    rate_card({"a100-80gb": "36.00"}, effective_from=timezone.now() - timedelta(hours=1))
    team = teams.team_create(person=alice, name=TEAM)
    invite, _token = teams.invite_create(
        actor=Actor.for_team(alice, team.pk), role=Role.MEMBER, login="bob"
    )
    teams.invite_accept(person=bob, invite=invite)
    fund(team.principal, "100")
    make_paper_host()
    return team


def caps(team, person, *, monthly=None, gpus=None):
    owner = Actor.for_team(team.memberships.get(role=Role.OWNER).person, team.pk)
    member = team.memberships.get(person=person)
    teams.member_set_caps(actor=owner, member=member, monthly_cap=monthly, gpu_cap=gpus)


def acting(user, team) -> Client:
    """A logged-in browser acting for the team."""
    client = Client()
    client.force_login(user)
    session = client.session
    session[SESSION_KEY] = team.pk
    session.save()
    return client


def api(user, team):
    """POST with a token that acts for the team: (status, body)."""
    _, token = ApiToken.issue(user=user, name="script", team=team)
    client = Client(HTTP_AUTHORIZATION=f"Bearer {token}")

    def post(path, body):
        r = client.post(f"/api/v1/{path}", data=json.dumps(body), content_type="application/json")
        return r.status_code, r.json()

    return post


def subscribe(team, person, **fields):
    """`person`'s subscription for the team, to rent one A100 (as the page and API make it)."""
    actor = Actor.for_team(person, team.pk)
    return subscriptions.subscribe(
        subscriptions.SubscriptionRequest(
            owner=team.principal, created_by=person, gpu_model="a100-80gb", gpus_per_node=1,
            rent=True, name=fields.pop("name", "llama"), image=TEST_IMAGE, **fields,
        ),
        funds=partial(check_funds, actor),
    )  # fmt: skip


def fired(sub) -> GpuSubscription:
    assert console_subscriptions.tick()["fired"] == [sub.pk]
    sub.refresh_from_db()
    assert sub.state == "fired"
    return sub


# -- 1. a subscription rents as its maker ------------------------------------------------------


def test_a_team_subscription_rents_within_its_makers_caps_and_the_cluster_is_theirs(lab, bob):
    caps(lab, bob, monthly=Decimal("5.00"))
    status, body = api(bob, lab)(
        "gpu-subscriptions",
        {"gpu_model": "a100-80gb", "gpus_per_node": 1, "rent": True, "name": "llama",
         "image": TEST_IMAGE},
    )  # fmt: skip
    assert status == 201, body
    sub = GpuSubscription.objects.get(pk=body["id"])
    assert sub.owner == lab.principal and sub.created_by == bob

    # The team's balance covers it; bob's budget does not: nothing rented, said with figures.
    sub = fired(sub)
    assert sub.cluster is None and not Cluster.objects.filter(owner=lab.principal).exists()
    assert sub.outcome_shown == f"not rented: {BUDGET_SPENT}"

    # His GPU cap counts too.
    caps(lab, bob, monthly=Decimal("100"), gpus=0)
    sub = fired(subscribe(lab, bob, name="gpu-capped"))
    assert "Past your GPU cap in 张老师课题组: GPUs held 0 / cap 0" in sub.outcome_shown
    assert sub.cluster is None

    # Within both (made on the page this time): the cluster is bob's, charged to his budget.
    caps(lab, bob, monthly=Decimal("100"), gpus=1)
    response = acting(bob, lab).post(
        "/gpu-subscriptions/",
        {"gpu_model": "a100-80gb", "nodes": 1, "gpus_per_node": 1, "zone": "",
         "expires_in_hours": 24, "rent": "on", "name": "mine", "image": TEST_IMAGE},
    )  # fmt: skip
    assert response.status_code == 302, response.content.decode()[:2000]
    sub = fired(GpuSubscription.objects.get(rent__name="mine"))
    cluster = sub.cluster
    assert cluster is not None, sub.outcome_shown
    assert cluster.owner == lab.principal and cluster.created_by == bob
    assert list(cluster.members.all()) == [bob], "he sees the cluster he rented"


def test_a_subscription_whose_maker_may_no_longer_rent_rents_nothing(lab, alice, bob):
    owner = Actor.for_team(alice, lab.pk)
    sub = subscribe(lab, bob)
    teams.member_set_role(actor=owner, member=lab.memberships.get(person=bob), role=Role.VIEWER)
    sub = fired(sub)
    assert sub.cluster is None and not Cluster.objects.filter(owner=lab.principal).exists()
    assert sub.outcome_shown == (
        "not rented: bob, who made this subscription, may no longer rent for the team (no "
        "longer a member, or only a viewer)."
    )
    # One made for the team by nobody who is a member (as the principal: subscriptions from
    # before members had makers) rents nothing either.
    legacy = subscribe(lab, bob, name="legacy")
    GpuSubscription.objects.filter(pk=legacy.pk).update(created_by=lab.principal)
    assert fired(legacy).cluster is None
    assert not Cluster.objects.filter(owner=lab.principal).exists()


def test_a_member_who_leaves_has_their_waiting_subscriptions_cancelled_saying_why(lab, alice, bob):
    his, hers = subscribe(lab, bob), subscribe(lab, alice, name="hers")
    assert GpuSubscription.cancel_waiting_of(bob, lab.principal) == 1
    his.refresh_from_db()
    assert his.state == "cancelled"
    assert his.outcome_shown == "cancelled: bob is no longer a member of the team"
    assert console_subscriptions.tick()["fired"] == [hers.pk], "alice's still fires"
    assert GpuSubscription.cancel_waiting_of(bob, lab.principal) == 0


# -- 2. work on a teammate's pool --------------------------------------------------------------


@pytest.fixture
def her_pool(lab, alice, catalog):
    """Alice's pool of 1-GPU A100 clusters in the lab (no cluster yet)."""
    shape = ClusterSpec(
        name="", nodes=1, gpu_model=catalog["a100-80gb"], gpus_per_node=1,
        image=Image.objects.get(reference=TEST_IMAGE),
    )  # fmt: skip
    pool = autoscaler.pool_create(
        owner=lab.principal, spec=autoscaler.PoolSpec(name="train", cluster=shape),
        created_by=alice,
    )  # fmt: skip
    return console_pools.refresh(pool)


SWEEP = {
    "name": "lr", "command": "true", "env": "", "workdir": "/workspace",
    "space": "lr: log_uniform 1e-4 1e-1", "metric": "loss", "direction": "minimize",
    "trials": 2, "parallel": 1, "pruner": "none", "min_steps": 1,
}  # fmt: skip
JOB = {
    "name": "j", "command": "true", "launcher": "plain", "workdir": "/workspace",
    "checkpoint_dir": "/workspace/checkpoints", "retries": 0, "max_preemptions": 5,
}  # fmt: skip


def test_a_member_past_their_budget_runs_nothing_on_a_teammates_pool(lab, bob, her_pool):
    caps(lab, bob, monthly=Decimal("5.00"))  # alice, the pool's maker, has no cap
    page, post = acting(bob, lab), api(bob, lab)

    response = page.post(f"/pools/{her_pool.pk}/jobs/new/", JOB)
    assert response.status_code == 400
    assert BUDGET_SPENT in html.unescape(response.content.decode())
    status, body = post(f"pools/{her_pool.pk}/jobs", {"name": "j", "command": "true"})
    assert (status, body["error"]) == (400, BUDGET_SPENT)

    response = page.post("/sweeps/new/", {**SWEEP, "pool": her_pool.pk})
    assert response.status_code == 200
    assert BUDGET_SPENT in html.unescape(response.content.decode())
    status, body = post("sweeps", {**SWEEP, "space": SWEEP["space"], "pool": her_pool.pk})
    assert (status, body["error"]) == (400, BUDGET_SPENT)
    assert not Job.objects.exists() and not Sweep.objects.exists()

    # Within his budget he may: the work is the pool's, its clusters alice's (her budget).
    caps(lab, bob, monthly=Decimal("6.00"))
    status, body = post(f"pools/{her_pool.pk}/jobs", {"name": "j", "command": "true"})
    assert status == 201, body
    assert page.post("/sweeps/new/", {**SWEEP, "pool": her_pool.pk}).status_code == 302
    job = Job.objects.get(pk=body["id"])
    assert (
        job.pool == her_pool
        and job.cluster.created_by == lab.memberships.get(role=Role.OWNER).person
    )
