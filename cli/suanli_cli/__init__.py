"""`suanli`: the command line of the console, for researchers and their scripts.

It speaks only the public token API under /api/v1/ (console/api.py) and imports only the
standard library, click and requests: never Django, never our apps, so it runs on a laptop
with none of the console's settings. `suanli login` keeps the URL and token in
`$XDG_CONFIG_HOME/suanli/config.json` (or `~/.config/suanli/config.json`), readable by its
owner only; `SUANLI_URL` and `SUANLI_TOKEN` override it for scripts and CI.

Every command prints plain lines or a table, or with `--json` (accepted anywhere before
`--`) JSON for scripts: the API's answer, or `{"error": "..."}` on stdout for an error.
Errors are one sentence on stderr (or that JSON) and a non-zero exit status (1; 2 for a
misused command): never a traceback.
"""

from suanli_cli import (  # noqa: F401 (each registers its commands)
    clusters,
    images,
    jobs,
    keys,
    logs,
    notify,
    pools,
    ssh,
    subscriptions,
    sweeps,
    teams,
)
from suanli_cli.main import cli, main
from suanli_cli.version import VERSION as __version__

__all__ = ["__version__", "cli", "main"]
