"""Words kept in English in the database (for the API), shown in the reader's language.

`{{ image.source_note|source_note }}`: an own image's note ("saved from train-1 node 0",
"built on gpu-a-01", written by jobs.images.builds) as a sentence of the page's language;
any other note as it is.
"""

import re

from django import template
from django.utils.translation import gettext as _

register = template.Library()

_SAVED = re.compile(r"saved from (?P<cluster>.+) node (?P<index>\d+)")
_BUILT = re.compile(r"built on (?P<host>.+)")


@register.filter
def source_note(note: str) -> str:
    if m := _SAVED.fullmatch(note or ""):
        if m["cluster"] == "a cluster":  # its cluster was gone when the note was written
            return _("from a cluster's node %(index)s") % m.groupdict()
        return _("from cluster %(cluster)s, node %(index)s") % m.groupdict()
    if m := _BUILT.fullmatch(note or ""):
        return _("built on host %(host)s") % m.groupdict()
    return note
