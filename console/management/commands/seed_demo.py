from decimal import Decimal

from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand
from django.db import transaction
from django.utils.translation import gettext_noop

from billing import services as billing
from billing.catalog import seed_rate_card
from jobs.models import Team, TeamMember
from jobs.placement.catalog import seed_catalog
from jobs.teams import services as teams

DEMO_USERS = [
    # username, password, operator?
    ("operator", "suanli-operator", True),
    ("researcher", "suanli-researcher", False),
    ("student", "suanli-student", False),
]
DEMO_TEAM = "Demo lab"


class Command(BaseCommand):
    help = "Seed the catalog and the demo accounts; register the local engine when given."

    def add_arguments(self, parser):
        parser.add_argument("--local-engine", default="", help="e.g. unix:///var/run/docker.sock")

    def handle(self, *args, **opts):
        with transaction.atomic():
            seed_catalog()
            User = get_user_model()
            for username, password, operator in DEMO_USERS:
                user, _ = User.objects.get_or_create(username=username)
                user.is_staff = user.is_superuser = operator
                user.set_password(password)
                user.save()
            seed_rate_card()
            researcher = User.objects.get(username="researcher")
            billing.post_entry(
                account=billing.account_for(researcher),
                kind="credit",
                amount=Decimal("100"),
                key="demo:welcome-credit:researcher",  # once, however often make run seeds
                memo=gettext_noop("welcome credit for the demo"),  # shown translated
            )
            self._seed_team(researcher, User.objects.get(username="student"))
        if opts["local_engine"]:
            call_command(
                "register_host",
                name="local",
                engine=opts["local_engine"],
                address="127.0.0.1",
                zone="zone-a",
                gpu_model="a100-80gb",
                gpus=8,
                build_host=True,
                stdout=self.stdout,
                stderr=self.stderr,
            )
        self.stdout.write(f"Demo team: {DEMO_TEAM!r} (researcher owns it, student is a member)")
        self.stdout.write("Demo logins:")
        for username, password, operator in DEMO_USERS:
            role = "operator (also the Django admin)" if operator else "researcher"
            self.stdout.write(f"  {role:34} {username} / {password}")

    def _seed_team(self, owner, student) -> None:
        """A lab the researcher owns, the student a member with a monthly budget of 50, and
        the team's own credit: to try the switcher, roles and caps at once."""
        team = Team.objects.filter(memberships__person=owner, name=DEMO_TEAM).first()
        if team is None:
            team = teams.team_create(person=owner, name=DEMO_TEAM)
        TeamMember.objects.get_or_create(
            team=team, person=student,
            defaults={"role": TeamMember.Role.MEMBER, "monthly_cap": Decimal("50")},
        )  # fmt: skip
        billing.post_entry(
            account=billing.account_for(team.principal),
            kind="credit",
            amount=Decimal("200"),
            key=f"demo:welcome-credit:team:{team.pk}",
            memo=gettext_noop("welcome credit for the demo"),
        )
