"""`{% cluster_people cluster %}`: the "People" card of a team cluster's page: who was added
to it (they see it and log in with their own keys), and for admins and the person who made
it, adding a team member or taking one off (console/views_teams.py). Nothing for a
researcher's own cluster."""

from django import template

register = template.Library()


@register.inclusion_tag("console/_cluster_people.html", takes_context=True)
def cluster_people(context, cluster) -> dict:
    request = context.get("request")
    actor = getattr(request, "actor", None)
    if actor is None or actor.team is None or cluster.owner_id != actor.principal.pk:
        return {"shown": False}
    people = list(cluster.members.order_by("username"))
    may_change = actor.may_change(cluster) and cluster.state not in ("released", "failed")
    on = {p.pk for p in people}
    others = [
        m.person
        for m in actor.team.memberships.select_related("person").order_by("person__username")
        if m.person_id not in on
    ]
    return {
        "shown": True, "cluster": cluster, "people": people, "may_change": may_change,
        "others": others if may_change else [], "created_by_id": cluster.created_by_id,
        "request": request, "csrf_token": context.get("csrf_token"),
    }  # fmt: skip
