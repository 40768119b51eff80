"""`{% node_apps cluster logins as rows %}`: the workspace apps' tiles of the nodes the
login card lists (jobs.access.webapps.tiles), for templates/console/_cluster_apps.html, which the
cluster page and its status poll both include with the login card."""

from django import template

from jobs.access import webapps

register = template.Library()


@register.simple_tag
def node_apps(cluster, logins) -> list[webapps.NodeApps]:
    return webapps.tiles(cluster, [login.node for login in logins])
