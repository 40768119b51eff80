"""`python -m suanli_cli`."""

from suanli_cli import main

main()
