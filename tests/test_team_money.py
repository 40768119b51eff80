"""A team's money (docs/user/teams.md, "Money") on real PostgreSQL, exact Decimals: a
member moves money into the team once per request; each team charge is its maker's (the
member whose budget it counts against); a rental that would pass a member's monthly
budget or GPU cap is refused with the figures; a member who reaches their budget has
their running clusters stopped (files kept) at that tick, billed to the second, told
once; the billing page shows the owner every member's spending per cluster and day, and
a member only their own.

Clusters are placed on the real scheduler (on hosts with no engine: the db tier) and the
accrual is driven with explicit seconds, as tests/test_billing.py does; the pages are also
looked at in Chromium (en and zh-hans, 1280 and 390 wide)."""

import csv
import io
import json
import os
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
import time_machine
from conftest import TEST_IMAGE
from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.db.models import Sum
from django.test import Client
from django.utils import translation
from node_start import ran

from billing import accrual, caps
from billing import services as billing
from billing.models import Account, BillLine, LedgerEntry
from console import pools as console_pools
from console.acting import SESSION_KEY
from console.forms import check_funds, start_refusal
from console.views_billing import LEDGER_HEADER, STATEMENT_HEADER
from jobs.base.text import show
from jobs.clusters import services as cluster_services
from jobs.clusters.services import ClusterSpec
from jobs.models import Image, Node, TeamMember, WebhookEndpoint, WebhookEvent
from jobs.placement import scheduler
from jobs.pools import autoscaler
from jobs.teams import services as teams
from jobs.tenancy.actors import Actor

pytestmark = pytest.mark.django_db
Role = TeamMember.Role

# The first of a month in every zone the suite may run in (UTC+8 at most): the month's
# spending is all of these tests' charges.
T0 = datetime(2026, 12, 10, 8, 0, 0, tzinfo=UTC)
RATE = "36.00"  # per GPU-hour: 0.01 per GPU-second; 10 minutes ahead of 1 GPU: 6.00


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


@pytest.fixture
def lab(alice, bob, rate_card, fund):
    """Alice's lab, 100.00 in it; bob a member with 50.00 of his own."""
    rate_card({"a100-80gb": RATE}, effective_from=at(-3600))
    team = teams.team_create(person=alice, name="张老师课题组")
    owner = Actor.for_team(alice, team.pk)
    invite, _token = teams.invite_create(actor=owner, role=Role.MEMBER, login="bob")
    teams.invite_accept(person=bob, invite=invite)
    fund(team.principal, "100")
    fund(bob, "50")
    return team


def caps_of(team, person, *, monthly=None, gpus=None):
    owner = Actor.for_team(team.memberships.get(role=Role.OWNER).person, team.pk)
    member = team.memberships.get(person=person)
    return teams.member_set_caps(actor=owner, member=member, monthly_cap=monthly, gpu_cap=gpus)


@pytest.fixture
def placed(make_paper_host, make_cluster):
    """A team cluster made by `by`, placed (on a host with no engine: nothing here starts a
    container) and running from second `when`."""

    def make(team, by, name="c1", *, when=0, gpus=1):
        with time_machine.travel(at(when), tick=False):
            if not make_paper_host.__dict__.get("made"):
                make_paper_host(gpus=8)
                make_paper_host.__dict__["made"] = True
            cluster = make_cluster(team.principal, name, gpus=gpus, created_by=by)
            scheduler.place_pending()
        ran(cluster)
        cluster.refresh_from_db()
        assert cluster.state == "running", cluster.state_reason
        return cluster

    return make


def tick(seconds):
    with time_machine.travel(at(seconds), tick=False):
        return accrual.accrue()


def ledger_adds_up(user) -> Decimal:
    account = Account.objects.get(user=user)
    total = LedgerEntry.objects.filter(account=account).aggregate(s=Sum("amount"))["s"]
    assert total == account.balance
    lines = BillLine.objects.filter(account=account).aggregate(s=Sum("amount"))["s"]
    assert lines == account.balance
    return account.balance


# -- moving money in -------------------------------------------------------------------------


def test_a_member_moves_money_into_the_team_once_per_request(lab, bob):
    key = uuid.uuid4().hex
    out, into = billing.transfer_to_team(person=bob, team=lab, amount="30.00", key=key)
    assert (out.amount, into.amount) == (Decimal("-30.00"), Decimal("30.00"))
    assert out.kind == into.kind == LedgerEntry.Kind.TRANSFER
    again = billing.transfer_to_team(person=bob, team=lab, amount="30.00", key=key)
    assert again == (out, into), "a retried request moves the money once"
    assert ledger_adds_up(bob) == Decimal("20.00")
    assert ledger_adds_up(lab.principal) == Decimal("130.00")
    assert into.memo == "← bob" and out.memo == "→ 张老师课题组"

    with pytest.raises(ValidationError, match=r"Your balance is 20.00: it does not cover 20.01"):
        billing.transfer_to_team(person=bob, team=lab, amount="20.01", key=uuid.uuid4().hex)
    for wrong in ("0", "-5", "0.001", "abc", "NaN"):
        with pytest.raises(ValidationError):
            billing.transfer_to_team(person=bob, team=lab, amount=wrong, key=uuid.uuid4().hex)
    stranger = get_user_model().objects.create_user("eve", password="eve-pass-123")
    with pytest.raises(ValidationError, match="not in this team"):
        billing.transfer_to_team(person=stranger, team=lab, amount="1", key=uuid.uuid4().hex)
    with pytest.raises(ValidationError, match="expired"):  # someone else's key: not theirs
        billing.transfer_to_team(person=lab.memberships.get(role=Role.OWNER).person, team=lab,
                                 amount="30.00", key=key)  # fmt: skip
    assert ledger_adds_up(bob) == Decimal("20.00")
    assert ledger_adds_up(lab.principal) == Decimal("130.00")


def test_the_transfer_form_on_the_billing_page(lab, bob):
    client = Client()
    client.force_login(bob)
    client.post("/acting/", {"team": lab.pk})
    page = client.get("/billing/")
    assert page.status_code == 200 and 'data-testid="transfer-form"' in page.content.decode()
    token = uuid.uuid4().hex
    for _ in range(2):  # sent twice: moved once
        done = client.post("/billing/transfer/", {"amount": "12.50", "token": token})
        assert done.status_code == 302
    assert Account.objects.get(user=bob).balance == Decimal("37.50")
    assert Account.objects.get(user=lab.principal).balance == Decimal("112.50")
    short = client.post("/billing/transfer/", {"amount": "99", "token": uuid.uuid4().hex})
    assert short.status_code == 400
    assert "does not cover 99.00" in short.content.decode()


# -- whose charge it is ------------------------------------------------------------------------


def test_each_team_charge_is_its_makers_and_a_handed_cluster_keeps_its_past(
    lab, alice, bob, placed
):
    theirs = placed(lab, bob, "bobs")
    hers = placed(lab, alice, "alices")
    tick(100)
    bobs = LedgerEntry.objects.filter(cluster=theirs)
    assert set(bobs.values_list("member", flat=True)) == {bob.pk}
    assert set(LedgerEntry.objects.filter(cluster=hers).values_list("member", flat=True)) == {
        alice.pk
    }
    assert caps.spent_by_member(Account.objects.get(user=lab.principal).pk) == {
        bob.pk: Decimal("1.00"), alice.pk: Decimal("1.00"),
    }  # fmt: skip
    # Bob leaves: his cluster is handed to alice; what he spent stays his.
    teams.member_leave(person=bob, team=lab)
    tick(150)
    account = Account.objects.get(user=lab.principal).pk
    assert caps.spent(account, bob.pk) == Decimal("1.00")
    assert caps.spent(account, alice.pk) == Decimal("2.00")
    ledger_adds_up(lab.principal)
    # A researcher's own cluster has no member.
    assert (
        not LedgerEntry.objects.filter(member__isnull=False)
        .exclude(account__user=lab.principal)
        .exists()
    )


# -- caps at the edge ----------------------------------------------------------------------------


def test_a_rental_that_would_pass_the_monthly_budget_is_refused_with_the_figures(
    lab, bob, placed, catalog
):
    placed(lab, bob, "first")
    tick(100)  # bob spent 1.00
    actor = Actor.for_team(bob, lab.pk)
    ask = {"gpu_model": catalog["a100-80gb"], "instance_type": None, "spot": False}

    caps_of(lab, bob, monthly=Decimal("7.00"))  # 1.00 + 6.00 ahead: exactly the cap
    with time_machine.travel(at(100), tick=False):
        assert not check_funds(actor, units=1, **ask).short
    caps_of(lab, bob, monthly=Decimal("6.99"))  # a cent short
    with time_machine.travel(at(100), tick=False):
        funds = check_funds(actor, units=1, **ask)
        assert funds.short and funds.balance >= funds.needed, "the team's balance covers it"
        with translation.override("en"):
            words = check_funds(actor, units=1, **ask).refusal("unused %(balance)s")
    assert words == (
        "Past your monthly budget in 张老师课题组: spent this month ¥1.00 / cap ¥6.99, and "
        "this needs ¥6.0000 for its first 10 minutes. Ask the team's owner to raise your "
        "budget."
    )
    # The owner has no cap; a researcher acting for themselves neither.
    owner = Actor.for_team(lab.memberships.get(role=Role.OWNER).person, lab.pk)
    with time_machine.travel(at(100), tick=False):
        assert not check_funds(owner, units=1, **ask).short
        assert not check_funds(bob, units=1, **ask).short


def test_the_gpu_cap_counts_what_the_member_holds_and_a_start_is_judged_for_its_maker(
    lab, alice, bob, placed, catalog
):
    mine = placed(lab, bob, "mine", gpus=1)
    placed(lab, alice, "hers", gpus=2)  # alice's GPUs are not bob's
    caps_of(lab, bob, gpus=2)
    actor = Actor.for_team(bob, lab.pk)
    ask = {"gpu_model": catalog["a100-80gb"], "instance_type": None, "spot": False}
    with time_machine.travel(at(10), tick=False):
        assert not check_funds(actor, units=1, **ask).short
        funds = check_funds(actor, units=2, **ask)
        with translation.override("en"):
            assert funds.refusal("") == (
                "Past your GPU cap in 张老师课题组: GPUs held 1 / cap 2, and this asks for 2. "
                "Ask the team's owner to raise your cap."
            )
        # Growing his own cluster: its new size is the ask, its current GPUs not held twice.
        assert not check_funds(mine.owner, units=2, cluster=mine, **ask).short
        assert check_funds(mine.owner, units=3, cluster=mine, **ask).short
    # Stopped, then started by alice (the owner): still bob's cluster, bob's cap.
    with time_machine.travel(at(20), tick=False):
        cluster_services.cluster_stop(cluster=mine)
        mine.refresh_from_db()
        caps_of(lab, bob, gpus=0)
        owner = Actor.for_team(alice, lab.pk)
        with translation.override("en"):
            assert start_refusal(mine, "gpu", actor=owner) == (
                "Past bob's GPU cap in 张老师课题组: GPUs held 0 / cap 0, and this asks for 1. "
                "Ask the team's owner to raise their cap."
            ), "alice presses Start: told whose cap it is"
            assert start_refusal(mine, "gpu", actor=actor).startswith("Past your GPU cap")


# -- stopped at the cap ------------------------------------------------------------------------


def test_a_member_at_the_cap_has_their_clusters_stopped_files_kept_billed_exactly_told_once(
    lab, alice, bob, placed
):
    WebhookEndpoint.objects.create(
        owner=lab.principal, url="https://hooks.example.com/x", events=["team.member_capped"],
        secret="whsec_" + "a" * 32,
    )  # fmt: skip
    caps_of(lab, bob, monthly=Decimal("1.00"))
    theirs = placed(lab, bob, "bobs")
    hers = placed(lab, alice, "alices")
    assert tick(50).charged > 0
    theirs.refresh_from_db()
    assert theirs.state == "running"  # 0.50 of 1.00
    tick(100)  # 1.00: reached
    theirs.refresh_from_db()
    assert theirs.state == "stopped" and theirs.stopped_at == at(100)
    assert show(theirs.state_reason) == "stopped: bob reached their monthly budget"
    kept = Node.objects.get(cluster=theirs)
    assert kept.stopped_at == at(100) and kept.kept_until is None, "its files are kept"
    hers.refresh_from_db()
    assert hers.state == "running", "the owner's cluster runs on"
    # The ledger at the edge: every second to the stop, once; nothing after.
    charged = LedgerEntry.objects.filter(cluster=theirs)
    assert charged.aggregate(s=Sum("amount"))["s"] == Decimal("-1.00")
    assert charged.latest("period_to").period_to == at(100)
    for t in (150, 400):
        tick(t)
    assert charged.aggregate(s=Sum("amount"))["s"] == Decimal("-1.00")
    assert ledger_adds_up(lab.principal) == Decimal("100") - Decimal("1.00") - Decimal("4.00")
    # Told once, on the team's channels, in words.
    told = WebhookEvent.objects.get(type="team.member_capped")
    assert told.owner_id == lab.principal_id
    with translation.override("en"):
        words = show(told.summary)
    assert "bob reached their monthly budget in 张老师课题组" in words and "bobs" in words
    assert "(spent ¥1.00 / cap ¥1.00)" in words, "money as every page shows it"
    assert json.loads(told.body)["data"]["spent"] == "1.0000"
    assert TeamMember.objects.get(team=lab, person=bob).capped_at == at(100)
    # Starting it again is refused while the month's budget is spent.
    with time_machine.travel(at(400), tick=False), translation.override("en"):
        assert "spent this month ¥1.00 / cap ¥1.00" in start_refusal(theirs, "gpu")
        assert start_refusal(theirs, "gpu", actor=Actor.for_team(alice, lab.pk)).startswith(
            "Past bob's monthly budget in 张老师课题组: spent this month ¥1.00 / cap ¥1.00"
        ), "the owner starting bob's cluster is told it is bob's budget"


# -- a pool grows within its maker's GPU cap ------------------------------------------------


def test_a_capped_members_pool_grows_no_further_than_their_gpu_cap(lab, bob, placed, catalog):
    placed(lab, bob, "by-hand", gpus=1)
    caps_of(lab, bob, gpus=2)
    shape = ClusterSpec(
        name="", nodes=1, gpu_model=catalog["a100-80gb"], gpus_per_node=1,
        image=Image.objects.get(reference=TEST_IMAGE),
    )  # fmt: skip
    spec = autoscaler.PoolSpec(name="sweep", cluster=shape, min_clusters=3, max_clusters=3)

    def live():
        return pool.clusters.filter(state__in=autoscaler.LIVE).count()

    with time_machine.travel(at(10), tick=False):
        pool = autoscaler.pool_create(owner=lab.principal, spec=spec, created_by=bob)
        console_pools.refresh(pool)
        assert pool.gpu_room == 1  # a cap of 2, 1 held by hand
        autoscaler.pool_scale(pool.pk)
        assert live() == 1
        autoscaler.pool_scale(pool.pk)  # before the console writes the room again
        console_pools.refresh(pool)
        autoscaler.pool_scale(pool.pk)
    assert live() == 1 and caps.gpus_held(lab.principal_id, bob.pk) == 2, "never past the cap"
    with translation.override("en"):
        held = [show(e.text) for e in pool.events.filter(kind="held").order_by("at", "id")]
    assert held[-1] == (
        "1 clusters, below the minimum of 3: 2 more wanted, held back: the GPU cap of bob "
        "(its maker) leaves room for 0 more GPUs: 0 clusters of 1"
    ), held
    # The owner raises the cap: the next round grows to it.
    caps_of(lab, bob, gpus=3)
    with time_machine.travel(at(20), tick=False):
        console_pools.refresh(pool)
        autoscaler.pool_scale(pool.pk)
    assert live() == 2 and caps.gpus_held(lab.principal_id, bob.pk) == 3


# -- the pages -----------------------------------------------------------------------------


def _acting(user, team) -> Client:
    client = Client()
    client.force_login(user)
    session = client.session
    session[SESSION_KEY] = team.pk
    session.save()
    return client


def test_the_owner_sees_every_members_spending_a_member_only_their_own(
    lab, alice, bob, placed, settings
):
    settings.LANGUAGE_CODE = "en"
    caps_of(lab, bob, monthly=Decimal("20.00"), gpus=4)
    placed(lab, bob, "bobs", gpus=2)
    placed(lab, alice, "alices")
    tick(100)  # bob 2.00, alice 1.00
    with time_machine.travel(at(100), tick=False):
        owner = _acting(alice, lab).get("/billing/", HTTP_ACCEPT_LANGUAGE="en").content.decode()
        mine = _acting(bob, lab).get("/billing/", HTTP_ACCEPT_LANGUAGE="en")
    assert 'data-login="bob"' in owner and 'data-login="alice"' in owner
    assert "bobs" in owner and "alices" in owner  # per cluster
    assert 'data-testid="team-day"' in owner  # per day
    assert 'data-testid="balance">97.00<' in owner  # the team's balance
    page = mine.content.decode()
    assert mine.status_code == 200
    assert 'data-testid="my-spent">2.00<' in page and 'data-testid="my-left">18.00<' in page
    assert 'data-testid="my-gpus">2 / 4<' in page
    assert "alices" not in page and 'data-login="alice"' not in page
    assert 'data-testid="team-balance"' not in page, "a member does not see the team's balance"
    member = _acting(bob, lab)
    for url in ("/billing/ledger/", "/billing/statement/2026-12.csv",
                "/billing/statement/2026-12-detail.csv"):  # fmt: skip
        assert member.get(url).status_code == 403, url
    assert _acting(alice, lab).get("/billing/statement/2026-12.csv").status_code == 200


def _csv(response) -> tuple[list[str], list[dict]]:
    text = b"".join(response.streaming_content).decode("utf-8-sig")
    return next(csv.reader(io.StringIO(text))), list(csv.DictReader(io.StringIO(text)))


def test_the_owners_statements_name_each_members_lines(lab, alice, bob, placed, settings):
    settings.LANGUAGE_CODE = "en"
    placed(lab, bob, "bobs", gpus=2)
    placed(lab, alice, "alices")
    tick(100)
    owner = _acting(alice, lab)
    with time_machine.travel(at(100), tick=False):
        header, rows = _csv(owner.get("/billing/statement/2026-12.csv"))
        ledger_header, entries = _csv(owner.get("/billing/statement/2026-12-detail.csv"))
    assert header == STATEMENT_HEADER and header[5:8] == ["cluster", "member", "resource"]
    assert ledger_header == LEDGER_HEADER and "member" in ledger_header
    for listing in (rows, entries):
        usage = [r for r in listing if r["kind"] == "usage"]
        assert {(r["cluster"], r["member"]) for r in usage} == {
            ("bobs", "bob"),
            ("alices", "alice"),
        }
        assert {r["member"] for r in listing if r["kind"] != "usage"} == {""}, "the top-up"
        by = {}
        for r in usage:
            by[r["member"]] = by.get(r["member"], 0) + Decimal(r["amount"])
        assert by == {"bob": Decimal("-2.00"), "alice": Decimal("-1.00")}


SHOTS = os.environ.get("SUANLI_SCREENSHOTS", "/tmp")


@pytest.mark.browser
@pytest.mark.django_db(transaction=True)  # the live server's thread reads committed rows
def test_screenshots_of_the_team_billing_pages(
    browser, live_server, make_paper_host, make_cluster, rate_card, fund, alice, bob
):
    from django.utils import timezone

    from tests.browsing import login

    rate_card({"a100-80gb": RATE}, effective_from=timezone.now() - timedelta(hours=1))
    team = teams.team_create(person=alice, name="张老师课题组")
    invite, _token = teams.invite_create(
        actor=Actor.for_team(alice, team.pk), role=Role.MEMBER, login="bob"
    )
    teams.invite_accept(person=bob, invite=invite)
    fund(team.principal, "100")
    fund(bob, "50")
    caps_of(team, bob, monthly=Decimal("20.00"), gpus=4)
    make_paper_host(gpus=8)
    for who, name in ((bob, "bert-base"), (alice, "llama-ft")):
        make_cluster(team.principal, name, gpus=2, created_by=who)
    scheduler.place_pending()
    Node.objects.update(started_at=timezone.now() - timedelta(seconds=300))
    accrual.accrue()
    for login_name, who in (("alice", "owner"), ("bob", "member")):
        for language, locale in (("en", "en-US"), ("zh-hans", "zh-CN")):
            for width in (1280, 390):
                context = browser.new_context(
                    viewport={"width": width, "height": 900}, locale=locale
                )
                page = context.new_page()
                login(page, live_server, login_name, f"{login_name}-pass-123")
                page.request.post(
                    f"{live_server.url}/acting/",
                    form={"team": str(team.pk), "csrfmiddlewaretoken": _csrf(page)},
                    headers={"Referer": f"{live_server.url}/"},
                )
                page.goto(f"{live_server.url}/billing/")
                assert page.get_by_test_id("transfer-form").is_visible()
                rows = page.get_by_test_id("member-spending")
                assert rows.count() == (2 if who == "owner" else 1)
                page.screenshot(
                    path=os.path.join(SHOTS, f"team-billing-{who}-{language}-{width}.png"),
                    full_page=True,
                )
                context.close()


def _csrf(page) -> str:
    return next(c["value"] for c in page.context.cookies() if c["name"] == "csrftoken")


def test_the_api_shows_a_teams_money_by_role(lab, alice, bob, placed):
    from console.models import ApiToken

    placed(lab, bob, "bobs")
    tick(100)
    tokens = {
        who: ApiToken.issue(user=user, name="script", team=lab)[1]
        for who, user in (("owner", alice), ("member", bob))
    }

    def get(who, url):
        return Client().get(f"/api/v1{url}", HTTP_AUTHORIZATION=f"Bearer {tokens[who]}")

    with time_machine.travel(at(100), tick=False):
        bill = get("owner", "/bill?month=2026-12")
        assert bill.status_code == 200
        assert {line["kind"] for line in bill.json()["lines"]} == {"topup", "usage"}
        assert {(line["kind"], line["member"]) for line in bill.json()["lines"]} == {
            ("topup", ""), ("usage", "bob"),
        }  # fmt: skip
        usage = next(line for line in bill.json()["lines"] if line["kind"] == "usage")
        pieces = get("owner", f"/bill/{usage['id']}/pieces").json()
        assert pieces["line"]["member"] == "bob"
        assert pieces["pieces"] and {p["member"] for p in pieces["pieces"]} == {"bob"}
        assert get("owner", "/balance").json()["balance"] == "99.0000"
        for url in ("/bill?month=2026-12", "/balance"):
            refused = get("member", url)
            assert refused.status_code == 403, url
