"""`{% load sizes %}`: `{{ n|bytes }}` "340 MB", "1.2 GB" (jobs/nodes/registry.human: decimal
units, as Docker and registries count them)."""

from django import template

from jobs.nodes.registry import human

register = template.Library()
register.filter("bytes", human)
