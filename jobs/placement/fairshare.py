"""Fair share between accounts in the placement queue, and the operator's per-team GPU limit.

Every waiting cluster belongs to an account: its owner, a team's principal (the team's
`share`, the operator's weight, default 1) or a researcher alone (share 1). When the fleet
is full, who is placed first is decided as Slurm's fair-share factor does it:

* **Usage** `u`: the account's GPU-hours over a decaying window, each GPU-hour weighted
  `2^(-age / H)` (H = SUANLI_FAIRSHARE_HALF_LIFE_H): a GPU-hour used H hours ago counts
  half. From the nodes' placed and released times (jobs' own rows, not billing's); nodes
  that ended more than 8 half-lives ago (under 0.4 %) are left out.
* **Normalised** `U = u / (G * H / ln 2)`: the share of what the whole fleet (G GPUs of the
  active hosts) gives over that window; `S = share / the sum of the shares` of the accounts
  that are waiting or used GPUs in the window.
* **Factor** `F = 2^(-U / S)`, in (0, 1], compared to two decimals (accounts that used about
  the same stay in arrival order). An account that used nothing has F = 1; one that used
  exactly its share of the fleet has F = 0.5.
* **Age** `A = waited / W` (W = SUANLI_FAIRSHARE_MAX_WAIT_H). A request is in line by
  `F + A`, highest first: an account with a lower factor goes ahead once its request has
  waited longer by the difference times W.
* **The bound**: a request that has waited W goes ahead of every request that has waited
  less, and such requests go in arrival order. So no account starves: after W, only older
  requests are ahead of it, and the first in line for a resource holds every host it could
  use until it fits (capacity.Fleet.reserve_for).

Within an account the order is first come, first served (same F, older is higher). On-demand
requests stay ahead of spot ones. SUANLI_FAIRSHARE_HALF_LIFE_H = 0 turns fair share off
(first come, first served for everyone); the GPU limit holds either way.

A team with a `gpu_limit` is not placed past it: a request whose GPUs and the team's live
ones would pass the limit waits with the figures in words, and is skipped, not a head of line,
so the requests behind it are placed as if it were not there.

Cost: two queries a pass, whatever the queue's length: one aggregate of the recent nodes by
owner (usage and held GPUs), one of the teams among those owners. Nothing when a single
account waits with no limit of its own: its order is first come, first served anyway.

**Kept a few seconds** (`recall`, `remember`): a pending cluster's page polls its status every
3 s, and computing the whole queue's standing for each poll is several window aggregates a
second with many watchers. The standing a page computed is kept in Redis for STANDING_TTL_S
under the number of the latest placement pass (each pass counts itself: `passed`), so a
pass's changes show at the next poll, the age term drifts by at most those seconds, and a
poll costs two Redis reads and no query. The pass does not write it itself: its order skips
the usage of a lone account, and a pass's time is placement's. Redis away: computed each
time.

Layer: placement, beside capacity; uses models and base (text). Writes no rows.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta

import redis
from django.conf import settings
from django.db import connection
from django.db.models import Q
from django.utils.translation import gettext_noop

from jobs.base.text import Text, load
from jobs.models import Cluster, Node, Team

log = logging.getLogger(__name__)

# Nodes that ended more than this many half-lives ago weigh under 2^-8 (0.4 %): left out.
WINDOW_HALF_LIVES = 8

LIMIT_REASON = gettext_noop(
    "waiting for its team's GPU limit: %(team)s holds %(held)s of its %(limit)s GPUs and this "
    "asks for %(asks)s"
)
# Why a request stands where it does in line (the queue page, the cluster page, the API).
WHY_LIMIT = gettext_noop("waiting for its team's GPU limit")
WHY_OVERDUE = gettext_noop(
    "it has waited over %(hours)s h: it goes ahead of every request that waited less"
)
WHY_SHARE = gettext_noop(
    "accounts that used less of their fair share recently go first; a request goes ahead of "
    "younger ones after %(hours)s h"
)
WHY_ARRIVAL = gettext_noop("in order of arrival")
WHY_FIFO = gettext_noop("first come, first served")


@dataclass
class Account:
    """One owner as fair share sees it: a team (its principal) or a researcher alone."""

    owner_id: int
    name: str = ""  # the team's name; "" for a researcher
    share: int = 1
    limit: int | None = None
    used: float = 0.0  # GPU-hours, decayed
    held: int = 0  # GPUs its live nodes hold now (and those placed this pass)
    factor: float = 1.0

    @property
    def is_team(self) -> bool:
        return bool(self.name)


@dataclass
class Standing:
    """The accounts of one pass (or one page), and the order of the queue they give."""

    now: datetime
    accounts: dict[int, Account] = field(default_factory=dict)
    half_life_h: int = 0  # 0: fair share off (first come, first served)
    max_wait_h: int = 24

    def account(self, cluster: Cluster) -> Account:
        found = self.accounts.get(cluster.owner_id)
        if found is None:
            found = self.accounts[cluster.owner_id] = Account(owner_id=cluster.owner_id)
        return found

    def overdue(self, cluster: Cluster) -> bool:
        return self.now - cluster.queued_at >= timedelta(hours=self.max_wait_h)

    def key(self, cluster: Cluster) -> tuple:
        """Its place in line: on-demand first; then those that waited the bound, oldest
        first; then by F + A, highest first; ties in arrival order."""
        if not self.half_life_h:
            return (cluster.spot, 0, 0.0, cluster.queued_at, cluster.pk)
        if self.overdue(cluster):
            return (cluster.spot, 0, 0.0, cluster.queued_at, cluster.pk)
        waited = (self.now - cluster.queued_at).total_seconds() / (self.max_wait_h * 3600)
        return (cluster.spot, 1, -(self.account(cluster).factor + waited), cluster.queued_at,
                cluster.pk)  # fmt: skip

    def order(self, clusters: list[Cluster]) -> list[Cluster]:
        return sorted(clusters, key=self.key)

    def over_limit(self, cluster: Cluster) -> Text | None:
        """Why the cluster may not be placed now for its team's GPU limit; None when it may."""
        account = self.account(cluster)
        asks = cluster.total_gpus
        if account.limit is None or not asks or account.held + asks <= account.limit:
            return None
        return Text(
            LIMIT_REASON, team=account.name, held=account.held, limit=account.limit, asks=asks
        )

    def took(self, cluster: Cluster) -> None:
        """The cluster was planned in this pass: its GPUs count against its team's limit."""
        self.account(cluster).held += cluster.total_gpus

    def why(self, cluster: Cluster, *, younger_ahead: bool) -> Text:
        """Why it stands where it does, in a few words; `younger_ahead`: some request of its
        class (on-demand or spot) that came after it is ahead of it."""
        if self.over_limit(cluster) is not None:
            return Text(WHY_LIMIT)
        if not self.half_life_h:
            return Text(WHY_FIFO)
        if self.overdue(cluster):
            return Text(WHY_OVERDUE, hours=self.max_wait_h)
        if younger_ahead or self.account(cluster).factor < 1:
            return Text(WHY_SHARE, hours=self.max_wait_h)
        return Text(WHY_ARRIVAL)


def standing(
    pending: list[Cluster], *, now: datetime, fleet_gpus: int, exact: bool = False
) -> Standing:
    """The accounts of the `pending` clusters, with their recent usage, held GPUs, shares,
    limits and factors: two queries (one for a single account with no limit, whose order is
    first come, first served anyway, unless `exact`: a page showing its figures)."""
    half_life = max(settings.SUANLI_FAIRSHARE_HALF_LIFE_H, 0)
    out = Standing(now=now, half_life_h=half_life,
                   max_wait_h=max(settings.SUANLI_FAIRSHARE_MAX_WAIT_H, 1))  # fmt: skip
    owners = {c.owner_id for c in pending}
    if not owners:
        return out
    teams = {
        principal: (name, share, limit)
        for principal, name, share, limit in Team.objects.filter(principal_id__in=owners)
        .values_list("principal_id", "name", "share", "gpu_limit")
    }  # fmt: skip
    limited = any(limit is not None for _, _, limit in teams.values())
    if len(owners) == 1 and not limited and not exact:
        out.accounts = {o: _account(o, teams.get(o)) for o in owners}
        return out
    usage = recent_usage(now=now, half_life_h=half_life or 24)
    extra = set(usage) - owners - set(teams)
    if extra and half_life:
        teams.update(
            (principal, (name, share, limit))
            for principal, name, share, limit in Team.objects.filter(principal_id__in=extra)
            .values_list("principal_id", "name", "share", "gpu_limit")
        )  # fmt: skip
    for owner in owners | (set(usage) if half_life else set()):
        account = _account(owner, teams.get(owner))
        account.used, account.held = usage.get(owner, (0.0, 0))
        out.accounts[owner] = account
    if half_life:
        _factors(out.accounts.values(), fleet_gpus=fleet_gpus, half_life_h=half_life)
    return out


def _account(owner: int, team: tuple | None) -> Account:
    if team is None:
        return Account(owner_id=owner)
    name, share, limit = team
    return Account(owner_id=owner, name=name, share=max(share, 1), limit=limit)


def _factors(accounts, *, fleet_gpus: int, half_life_h: int) -> None:
    """F = 2^(-U/S) for each account, to two decimals (module docstring)."""
    accounts = list(accounts)
    window = fleet_gpus * half_life_h / math.log(2)  # GPU-hours the fleet gives, decayed
    shares = sum(a.share for a in accounts) or 1
    for a in accounts:
        if window <= 0:
            a.factor = 1.0
            continue
        a.factor = round(2 ** (-(a.used / window) / (a.share / shares)), 2)


# In float8: EXTRACT(EPOCH ...) is numeric (PostgreSQL 14+), and power() of a numeric is
# arbitrary-precision exponentiation, two per node of the window (0.34 s a pass of the 0.36 s
# this took over 23,000 nodes, bench/placement's placement_teams). The exponent is held at
# -1000 (2^-1000 is 1e-301, nothing beside a node's GPU-hours): float8's power() raises on
# underflow where numeric's gave 0, and one node live for 1,075 half-lives would otherwise
# stop every placement pass.
USAGE_SQL = """
SELECT c.owner_id,
       SUM(c.gpus_per_node * (
           power(2.0::float8, GREATEST(-1000.0::float8,
                 EXTRACT(EPOCH FROM (LEAST(COALESCE(n.released_at, %(now)s), %(now)s)
                                     - %(now)s))::float8 / %(h)s))
         - power(2.0::float8, GREATEST(-1000.0::float8,
                 EXTRACT(EPOCH FROM (LEAST(n.placed_at, %(now)s) - %(now)s))::float8 / %(h)s)))),
       COALESCE(SUM(c.gpus_per_node) FILTER (WHERE n.released_at IS NULL), 0)
  FROM jobs_node n JOIN jobs_cluster c ON c.id = n.cluster_id
 WHERE (n.released_at IS NULL OR n.released_at > %(cutoff)s)
   AND NOT n.no_gpu AND c.gpus_per_node > 0
 GROUP BY c.owner_id
"""


def recent_usage(*, now: datetime, half_life_h: int) -> dict[int, tuple[float, int]]:
    """owner id -> (GPU-hours over the decaying window, GPUs its live nodes hold): one
    aggregate over the nodes of the window. The integral of `gpus * 2^((t - now) / H)` from
    placed to released (or now) is `gpus * H/ln2 * (2^((end - now)/H) - 2^((start - now)/H))`."""
    seconds = half_life_h * 3600
    cutoff = now - timedelta(seconds=seconds * WINDOW_HALF_LIVES)
    scale = half_life_h / math.log(2)  # hours
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(USAGE_SQL, {"now": now, "h": seconds, "cutoff": cutoff})
            return {owner: (float(u or 0) * scale, int(held)) for owner, u, held in cursor}
    out: dict[int, tuple[float, int]] = {}  # elsewhere (a developer's SQLite): the same, here
    rows = Node.objects.filter(Q(released_at__isnull=True) | Q(released_at__gt=cutoff),
                               no_gpu=False, cluster__gpus_per_node__gt=0)  # fmt: skip
    for owner, gpus, start, end in rows.values_list(
        "cluster__owner_id", "cluster__gpus_per_node", "placed_at", "released_at"
    ):

        def weight(t):
            return 2 ** ((min(t, now) - now).total_seconds() / seconds)

        used, held = out.get(owner, (0.0, 0))
        used += gpus * scale * (weight(end or now) - weight(start))
        out[owner] = (used, held + (gpus if end is None else 0))
    return out


# -- where each pending cluster stands, kept a few seconds (module docstring) ------------

STANDING_TTL_S = 5
LATEST_KEY = "suanli:queue:pass"  # the number of the latest placement pass


@dataclass(frozen=True)
class Place:
    """Where one pending cluster stands: its `position` (1 first), `why` (a Text) and its
    `account` (whose it is, with their figures)."""

    position: int
    why: Text | str
    account: Account

    def as_json(self) -> str:
        why = self.why.as_json() if isinstance(self.why, Text) else self.why
        return json.dumps([self.position, why, asdict(self.account)])

    @classmethod
    def of_json(cls, data: bytes | str) -> Place:
        position, why, account = json.loads(data)
        return cls(position=position, why=load(why), account=Account(**account))


@functools.cache
def _redis(url: str) -> redis.Redis:
    """One client (and its connection pool) per process; short timeouts, as a page waits."""
    return redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)


def _standing_key(number: int) -> str:
    return f"suanli:queue:standing:{number}"


def passed() -> None:
    """A placement pass ended: what pages kept of the queue before it is no longer read."""
    try:
        _redis(settings.REDIS_URL).incr(LATEST_KEY)
    except redis.RedisError as exc:
        log.warning("queue standing: the pass was not counted (%s)", exc)


def recall(cluster_id: int) -> tuple[int | None, Place | None]:
    """The number of the latest pass (None with Redis away) and the kept place of the
    cluster under it (None when not kept)."""
    try:
        conn = _redis(settings.REDIS_URL)
        number = int(conn.get(LATEST_KEY) or 0)
        kept = conn.hget(_standing_key(number), str(cluster_id))
    except redis.RedisError:
        return None, None
    return number, (Place.of_json(kept) if kept else None)


def remember(number: int | None, places: dict[int, Place]) -> None:
    """Keep the whole queue's places under pass `number` for STANDING_TTL_S (replacing what
    was kept under it)."""
    if number is None or not places:
        return
    key = _standing_key(number)
    try:
        pipe = _redis(settings.REDIS_URL).pipeline()
        pipe.delete(key)
        pipe.hset(key, mapping={str(pk): place.as_json() for pk, place in places.items()})
        pipe.expire(key, STANDING_TTL_S)
        pipe.execute()
    except redis.RedisError as exc:
        log.warning("queue standing: not kept (%s)", exc)
