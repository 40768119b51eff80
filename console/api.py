"""The token JSON API (being built)."""

from django.http import Http404


def tokens_page(request):
    raise Http404
