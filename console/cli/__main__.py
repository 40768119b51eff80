"""`python -m console.cli` (or `python -m suanli_cli` where installed alone)."""

from . import main

main()
