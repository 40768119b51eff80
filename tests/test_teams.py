"""Teams' core (jobs/teams/services.py, jobs/tenancy/actors.py): making a team, invitations
by link and by login, roles and who may grant them, what each role sees (404) and may do
(403), and removal handing a member's clusters to the owner."""

from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.core.exceptions import PermissionDenied, ValidationError
from django.http import Http404
from django.utils import timezone

from jobs.models import Cluster, Team, TeamMember
from jobs.placement import fleet
from jobs.teams import services as teams
from jobs.tenancy.actors import Actor

Role = TeamMember.Role
pytestmark = pytest.mark.django_db


def person(name):
    return get_user_model().objects.create_user(name, password=f"{name}-pass-123")


@pytest.fixture
def lab(alice):
    """Alice's lab: alice owner, ada admin, mo member, vi viewer."""
    team = teams.team_create(person=alice, name="张老师课题组")
    owner = Actor.for_team(alice, team.pk)
    for login, role in (("ada", Role.ADMIN), ("mo", Role.MEMBER), ("vi", Role.VIEWER)):
        who = person(login)
        invite, token = teams.invite_create(actor=owner, role=role, login=login)
        assert token == ""
        teams.invite_accept(person=who, invite=invite)
    return team


def actor(team, login):
    return Actor.for_team(get_user_model().objects.get(username=login), team.pk)


def test_a_team_owns_as_its_own_account_that_nobody_logs_in_as(alice, client):
    team = teams.team_create(person=alice, name="  Vision   lab ")
    assert team.name == "Vision lab"
    assert not team.principal.has_usable_password()
    assert TeamMember.objects.get(team=team).role == Role.OWNER
    page = client.post("/login/", {"username": team.principal.username, "password": ""})
    assert page.status_code == 200 and "_auth_user_id" not in client.session
    with pytest.raises(ValidationError):
        teams.team_create(person=alice, name="   ")
    with pytest.raises(PermissionDenied):
        teams.team_create(person=team.principal, name="nested")


def test_a_link_invitation_is_shown_once_and_used_once(alice, bob, lab):
    invite, token = teams.invite_create(actor=actor(lab, "ada"), role=Role.MEMBER)
    assert token.startswith("sli_") and invite.digest != token
    assert teams.invite_for_token(token) == invite
    teams.invite_accept(person=bob, invite=invite)
    assert actor(lab, "bob").role == Role.MEMBER
    assert teams.invite_for_token(token) is None
    carol = person("carol")
    with pytest.raises(ValidationError, match="used, revoked or has expired"):
        teams.invite_accept(person=carol, invite=invite)


def test_invitations_expire_are_revoked_and_are_for_their_login_alone(alice, bob, lab):
    owner = actor(lab, "alice")
    invite, _ = teams.invite_create(actor=owner, role=Role.VIEWER, login="bob")
    carol = person("carol")
    with pytest.raises(ValidationError, match="someone else"):
        teams.invite_accept(person=carol, invite=invite)
    teams.invite_revoke(actor=owner, invite=invite)
    with pytest.raises(ValidationError):
        teams.invite_accept(person=bob, invite=invite)
    old, token = teams.invite_create(actor=owner, role=Role.MEMBER)
    type(old).objects.filter(pk=old.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert teams.invite_for_token(token) is None
    with pytest.raises(ValidationError):
        teams.invite_accept(person=bob, invite=old)
    with pytest.raises(ValidationError, match="No researcher"):
        teams.invite_create(actor=owner, role=Role.MEMBER, login=lab.principal.username)


def test_each_role_grants_only_below_itself(lab):
    with pytest.raises(PermissionDenied):
        teams.invite_create(actor=actor(lab, "mo"), role=Role.VIEWER)
    with pytest.raises(PermissionDenied):
        teams.invite_create(actor=actor(lab, "ada"), role=Role.ADMIN)
    with pytest.raises(ValidationError):
        teams.invite_create(actor=actor(lab, "alice"), role=Role.OWNER)
    ada = TeamMember.objects.get(team=lab, person__username="ada")
    with pytest.raises(PermissionDenied):
        teams.member_remove(actor=actor(lab, "ada"), member=ada)  # an admin: the owner's call
    owner_row = TeamMember.objects.get(team=lab, role=Role.OWNER)
    with pytest.raises(PermissionDenied):
        teams.member_remove(actor=actor(lab, "alice"), member=owner_row)
    mo = TeamMember.objects.get(team=lab, person__username="mo")
    with pytest.raises(PermissionDenied):
        teams.member_set_caps(actor=actor(lab, "ada"), member=mo, monthly_cap=None, gpu_cap=2)
    teams.member_set_role(actor=actor(lab, "ada"), member=mo, role=Role.VIEWER)
    assert actor(lab, "mo").role == Role.VIEWER


def test_each_role_sees_what_it_should_and_acts_only_where_it_may(lab, make_cluster):
    mo, vi = actor(lab, "mo"), actor(lab, "vi")
    theirs = make_cluster(lab.principal, "mo-run", created_by=mo.person)
    admins = make_cluster(lab.principal, "ada-run", created_by=actor(lab, "ada").person)
    assert theirs.created_by == mo.person and mo.person in theirs.members.all()
    # admins and the owner see every team cluster; a member sees what they were added to.
    assert set(fleet.clusters_for(actor(lab, "ada"))) == {theirs, admins}
    assert set(fleet.clusters_for(actor(lab, "alice"))) == {theirs, admins}
    assert list(fleet.clusters_for(mo)) == [theirs]
    with pytest.raises(Http404):
        fleet.cluster_for_user(mo, admins.pk)
    # A viewer added to a cluster sees it (read only) and may not use it: 403.
    assert list(fleet.clusters_for(vi)) == []
    theirs.members.add(vi.person)
    assert fleet.cluster_for_user(vi, theirs.pk) == theirs
    with pytest.raises(PermissionDenied):
        vi.require_use(theirs)
    mo.require_use(theirs)
    # Nobody acting for themselves sees the team's clusters.
    assert list(fleet.clusters_for(mo.person)) == []


def test_a_removed_member_loses_the_team_at_once_and_their_clusters_go_to_the_owner(
    lab, make_cluster
):
    mo = actor(lab, "mo")
    theirs = make_cluster(lab.principal, "mo-run", created_by=mo.person)
    member = TeamMember.objects.get(team=lab, person=mo.person)
    done = teams.member_remove(actor=actor(lab, "alice"), member=member, clusters=teams.HAND)
    assert done == {"handed": [theirs.pk], "stopped": [], "restarted": []}
    theirs.refresh_from_db()
    assert theirs.created_by.username == "alice"
    assert list(theirs.members.values_list("username", flat=True)) == ["alice"]
    with pytest.raises(Http404):
        Actor.for_team(mo.person, lab.pk)
    assert "handed to alice" in theirs.events.latest("at").message
    assert Cluster.objects.filter(owner=lab.principal).count() == 1


def test_the_owner_leaves_only_after_handing_ownership_on(lab):
    alice = actor(lab, "alice")
    with pytest.raises(ValidationError, match="hand ownership"):
        teams.member_leave(person=alice.person, team=lab)
    ada = TeamMember.objects.get(team=lab, person__username="ada")
    teams.owner_transfer(actor=alice, member=ada)
    assert actor(lab, "ada").role == Role.OWNER and actor(lab, "alice").role == Role.ADMIN
    teams.member_leave(person=alice.person, team=lab)
    assert not Team.objects.get(pk=lab.pk).memberships.filter(person=alice.person).exists()


def test_a_removed_or_demoted_admins_links_let_nobody_in(lab, bob):
    """An admin's invitation links end with their power: kept by an admin who is removed,
    a link must not bring them back, nor anyone else."""
    ada = actor(lab, "ada")
    _, kept = teams.invite_create(actor=ada, role=Role.MEMBER)
    _, given = teams.invite_create(actor=ada, role=Role.MEMBER)
    owner = actor(lab, "alice")
    teams.member_set_role(
        actor=owner, member=TeamMember.objects.get(team=lab, person=ada.person), role=Role.VIEWER
    )
    assert teams.invite_for_token(given) is None  # revoked with the demotion
    teams.member_remove(actor=owner, member=TeamMember.objects.get(team=lab, person=ada.person))
    assert teams.invite_for_token(kept) is None
    # Even an invitation still open (made before the revocation existed) opens nothing once
    # its maker may no longer grant its role.
    invite, token = teams.invite_create(actor=owner, role=Role.ADMIN)
    teams.owner_transfer(
        actor=owner, member=TeamMember.objects.get(team=lab, person__username="mo")
    )
    with pytest.raises(ValidationError, match="used, revoked or has expired"):
        teams.invite_accept(person=bob, invite=invite)


def test_what_a_removed_member_made_for_the_team_stays_the_teams(lab, catalog):
    """Their pools and sweeps go to the owner (so that no uncapped spender remains), their
    waiting GPU subscriptions end."""
    from jobs.models import GpuModel, GpuSubscription, Pool

    mo = actor(lab, "mo")
    pool = Pool.objects.create(owner=lab.principal, created_by=mo.person, name="mo-pool")
    sub = GpuSubscription.objects.create(
        owner=lab.principal, created_by=mo.person, gpu_model=GpuModel.objects.first(),
        gpus_per_node=1, expires_at=timezone.now() + timedelta(days=1),
    )  # fmt: skip
    teams.member_remove(
        actor=actor(lab, "alice"), member=TeamMember.objects.get(team=lab, person=mo.person)
    )
    pool.refresh_from_db()
    assert pool.created_by.username == "alice"
    sub.refresh_from_db()
    assert sub.state != GpuSubscription.State.WAITING


def test_nobody_logs_in_as_a_team_even_with_a_password(lab, client):
    """An operator who gives a team's account a password in the admin gets no log-in."""
    lab.principal.set_password("team-pass-123")
    lab.principal.save()
    page = client.post("/login/", {"username": lab.principal.username, "password": "team-pass-123"})
    assert page.status_code == 200 and "_auth_user_id" not in client.session


def test_a_member_sees_their_job_on_a_teammates_pool(lab, make_cluster):
    """A team's pools are shared with its people: a job a member sent to the admin's pool
    is on a cluster nobody added them to, and still theirs to open."""
    from jobs.models import Job, Pool

    ada, mo = actor(lab, "ada"), actor(lab, "mo")
    pool = Pool.objects.create(owner=lab.principal, created_by=ada.person, name="ada-pool")
    pooled = make_cluster(lab.principal, "ada-pool-1", created_by=ada.person, pool=pool)
    job = Job.objects.create(
        cluster=pooled, owner=lab.principal, pool=pool, name="mo-train", command="true"
    )
    assert fleet.job_for_user(mo, job.pk) == job
    assert list(fleet.jobs_for(mo)) == [job]
    with pytest.raises(Http404):
        fleet.cluster_for_user(mo, pooled.pk)  # the pool's cluster stays the admin's
    with pytest.raises(Http404):
        fleet.job_for_user(mo.person, job.pk)  # acting for himself: not his


def test_stop_for_a_leaving_member_leaves_nothing_of_theirs_to_be_placed(lab, make_cluster):
    """ "Stop their clusters" also withdraws their requests still waiting: nothing of theirs
    is placed and charged to the team after they leave."""
    mo = actor(lab, "mo")
    waiting = make_cluster(lab.principal, "mo-wait", created_by=mo.person, gpus=64)  # no room
    assert waiting.state == Cluster.State.PENDING
    done = teams.member_remove(
        actor=actor(lab, "alice"), member=TeamMember.objects.get(team=lab, person=mo.person),
        clusters=teams.STOP,
    )  # fmt: skip
    assert done["stopped"] == [waiting.pk]
    waiting.refresh_from_db()
    assert waiting.state == Cluster.State.RELEASED and "withdrawn" in waiting.state_reason


def test_team_services_answer_404_to_someone_acting_for_themselves(lab, alice):
    member = TeamMember.objects.get(team=lab, person__username="mo")
    with pytest.raises(Http404):
        teams.member_set_caps(actor=Actor.of(alice), member=member, monthly_cap=None, gpu_cap=1)
    with pytest.raises(Http404):
        teams.invite_create(actor=Actor.of(alice), role=Role.MEMBER)


def test_a_gpu_cap_holds_for_a_shape_with_no_price(lab, catalog):
    """No rate-card price means no balance to check, not no GPU cap."""
    from console.forms import check_funds

    owner, mo = actor(lab, "alice"), actor(lab, "mo")
    teams.member_set_caps(
        actor=owner, member=TeamMember.objects.get(team=lab, person=mo.person),
        monthly_cap=None, gpu_cap=1,
    )  # fmt: skip
    shape = {"gpu_model": catalog["a100-80gb"], "instance_type": None, "spot": False}
    assert check_funds(mo, units=1, **shape) is None
    refused = check_funds(mo, units=2, **shape)
    assert refused.short and "GPU cap" in refused.capped


def test_a_revocation_reaches_the_gateways_of_its_own_console_and_no_other_on_the_server():
    """Redis pub/sub channels are the whole server's: a console whose queues are on another
    database number of the same Redis (another console, or a test process beside this one)
    must not end this console's sessions, nor this one its."""
    import json
    import time

    import django_rq
    import redis

    from jobs.tenancy import revocations

    ours = django_rq.get_connection("default")
    kwargs = ours.connection_pool.connection_kwargs
    other = redis.Redis(
        connection_pool=redis.ConnectionPool(
            connection_class=ours.connection_pool.connection_class,
            **{**kwargs, "db": (kwargs.get("db", 0) + 1) % 16},
        )
    )
    heard = {}
    for name, connection in (("ours", ours), ("other", other)):
        pubsub = connection.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(revocations.channel(connection))
        heard[name] = pubsub
    try:
        revocations.announce_revoked(person_id=7, principal_id=9)
        got = {name: [] for name in heard}
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and not got["ours"]:
            for name, pubsub in heard.items():
                message = pubsub.get_message(timeout=0.1)
                if message and message["type"] == "message":
                    got[name].append(json.loads(message["data"]))
        assert got["ours"] == [{"person": 7, "principal": 9}]
        assert heard["other"].get_message(timeout=0.5) is None and got["other"] == []
    finally:
        for pubsub in heard.values():
            pubsub.close()
        other.close()
