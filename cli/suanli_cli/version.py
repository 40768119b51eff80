"""The command line's version: the one place it is written (cli/pyproject.toml reads it), so
`suanli --version` needs no installed metadata (a copy on PYTHONPATH, a zipapp)."""

VERSION = "0.1.0"
