"""`{% node_apps cluster logins as rows %}`: the workspace apps' tiles of the nodes the
login card lists (jobs.access.webapps.tiles), for templates/console/_cluster_apps.html, which the
cluster page and its status poll both include with the login card. `{% page_messages as listed %}`:
the messages base.html lists, those of the tiles left out."""

from django import template

from jobs.access import webapps

register = template.Library()


@register.simple_tag
def node_apps(cluster, logins) -> list[webapps.NodeApps]:
    return webapps.tiles(cluster, [login.node for login in logins])


@register.simple_tag(takes_context=True)
def page_messages(context) -> list:
    """The messages the page's own list shows (base.html): not those an app tile shows
    beside its button (extra tags "app-…", on a page with tiles: one with logins)."""
    logins = context.get("logins")
    return [
        m
        for m in context.get("messages") or ()
        if not (logins and (m.extra_tags or "").startswith("app-"))
    ]
