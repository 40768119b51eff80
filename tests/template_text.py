"""Words in a template that a reader sees but no translator ever will: text between tags,
and the attributes a browser shows (title, placeholder, aria-label, alt, confirmations;
the string literals of an `on...` handler),
outside `{% translate %}` and `{% blocktranslate %}`.

`python tests/template_text.py templates/console/x.html ...` prints each with its line;
tests/test_i18n.py runs it over every template. Code (`<code>`, `<pre>`, `<kbd>`,
`<samp>`) is not language and stays as written; so do scripts and styles (a script's
words come from the page, through data attributes, already translated)."""

from __future__ import annotations

import re
import sys
from html.parser import HTMLParser
from pathlib import Path

# What may stand in a template untranslated: the product's name. So may whatever is in an
# element marked `translate="no"` (HTML's own attribute: the logo, a language's own name).
_NAMES = re.compile(r"\bSuanli\b")
SHOWN_ATTRIBUTES = {
    "title",
    "placeholder",
    "aria-label",
    "alt",
    "label",
    "hx-confirm",
    "data-confirm",
    "hx-prompt",
}
CODE = {"code", "pre", "kbd", "samp", "script", "style"}
VOID = {
    "area",
    "base",
    "br",
    "col",
    "embed",
    "hr",
    "img",
    "input",
    "link",
    "meta",
    "source",
    "track",
    "wbr",
}
LETTER = re.compile(r"[A-Za-z]")

_COMMENT = re.compile(r"\{#.*?#\}|\{%\s*comment\s*%\}.*?\{%\s*endcomment\s*%\}", re.S)
_BLOCK = re.compile(r"\{%\s*blocktrans(?:late)?\b.*?%\}.*?\{%\s*endblocktrans(?:late)?\s*%\}", re.S)
_LITERAL = re.compile(r"'[^']*'|\"[^\"]*\"")
_TAG = re.compile(r"\{%.*?%\}|\{\{.*?\}\}", re.S)


def _blank(match: re.Match) -> str:
    """Replaces template syntax with a mark of no letters, keeping the line numbers."""
    return "\u00a7" + "\n" * match.group(0).count("\n")


class _Reader(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.open: list[str] = []
        self.found: list[tuple[int, str]] = []
        self.kept: list[str] = []

    def _flag(self, text: str) -> None:
        words = " ".join(text.split())
        if LETTER.search(_NAMES.sub("", words)):
            self.found.append((self.getpos()[0], words))

    def handle_starttag(self, tag, attrs):
        if dict(attrs).get("translate") == "no" and tag not in VOID:
            self.open.append("translate=no")  # a name, a language in its own words
            self.kept.append(tag)
            return
        for name, value in attrs:
            if name in SHOWN_ATTRIBUTES and value:
                self._flag(value)
            if name.startswith("on") and value:  # confirm('...') and the like
                for literal in _LITERAL.findall(value):
                    self._flag(literal[1:-1])
            if (
                name == "value"
                and tag == "input"
                and dict(attrs).get("type") in ("submit", "button", "reset")
            ):
                self._flag(value or "")
        if tag not in VOID:
            self.open.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if tag not in VOID and self.open and self.open[-1] == tag:
            self.open.pop()

    def handle_endtag(self, tag):
        if "translate=no" in self.open:
            if self.kept and self.kept[-1] == tag:
                self.kept.pop()
                while self.open and self.open.pop() != "translate=no":
                    pass
            return
        if tag in self.open:
            while self.open and self.open.pop() != tag:
                pass

    def handle_data(self, data):
        if not CODE.intersection(self.open) and "translate=no" not in self.open:
            self._flag(data)


def untranslated(source: str) -> list[tuple[int, str]]:
    """(line, text) of each piece of shown text outside the translation tags."""
    text = _COMMENT.sub(_blank, source)
    text = _BLOCK.sub(_blank, text)
    text = _TAG.sub(_blank, text)
    reader = _Reader()
    reader.feed(text)
    reader.close()
    return reader.found


if __name__ == "__main__":
    bad = 0
    for name in sys.argv[1:]:
        for line, words in untranslated(Path(name).read_text(encoding="utf-8")):
            print(f"{name}:{line}: {words}")
            bad += 1
    sys.exit(1 if bad else 0)
