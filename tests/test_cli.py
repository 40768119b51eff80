"""The `suanli` command line (cli/suanli_cli/), run as a researcher runs it: a process of its
own, with its own home folder, against the Procfile's web, worker and watch processes and
the real engines."""

import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import requests
from browsing import free_port
from conftest import TEST_IMAGE
from waiting import until

from console.models import ApiToken
from jobs.models import Cluster, Job, Node

pytestmark = pytest.mark.django_db

ROOT = Path(__file__).resolve().parent.parent


class Cli:
    """`suanli` in a fresh process with its own HOME and config folder."""

    def __init__(self, home: Path):
        self.home = home
        self.env = {
            "PATH": os.environ["PATH"],
            "HOME": str(home),
            "XDG_CONFIG_HOME": str(home / "config"),
            "LANG": "C.UTF-8",
            "SUANLI_POLL_S": "0.3",
        }
        self.config = home / "config" / "suanli" / "config.json"

    def command(self, *args) -> list[str]:
        return [sys.executable, "-m", "suanli_cli", *map(str, args)]

    def __call__(self, *args, input=None, ok=True) -> subprocess.CompletedProcess:
        done = subprocess.run(
            self.command(*args), cwd=ROOT, env=self.env, input=input,
            capture_output=True, text=True, timeout=60, start_new_session=True,
        )  # fmt: skip
        assert "Traceback" not in done.stderr, done.stderr
        if ok:
            assert done.returncode == 0, (args, done.stdout, done.stderr)
        return done

    def json(self, *args):
        return json.loads(self(*args, "--json").stdout)

    def json_error(self, *args) -> dict:
        """A command that fails, with --json: its error as JSON on stdout, exit status 1."""
        done = self(*args, "--json", ok=False)
        assert done.returncode == 1 and done.stderr == "", (args, done.stdout, done.stderr)
        return json.loads(done.stdout)


@pytest.fixture
def console_url(processes, make_host, priced):
    """The web process (ASGI, as the Procfile runs it), a worker and the watch process."""
    host = make_host("gpu-a-01", engine=0, zone="zone-a", gpus=2, check="reuse")
    assert host.state == "active", host.last_error  # its canary ran: clusters can be placed
    port = free_port()
    processes.start("web", env={"PORT": str(port)})
    processes.start("worker", "--worker-class", "console.rqworker.SimpleWorker")
    processes.start("watch")
    url = f"http://127.0.0.1:{port}"

    def answers():
        try:
            return requests.get(f"{url}/api/v1/schema", timeout=10).status_code == 200
        except requests.RequestException:  # not listening yet, or busy starting (a loaded CI)
            return False

    until(answers, timeout=20, what="the web process listens")
    return url


def test_a_researcher_runs_a_job_from_the_command_line(console_url, alice, bob, tmp_path):
    _, token = ApiToken.issue(user=alice, name="laptop")
    cli = Cli(tmp_path / "alice")
    done = cli("login", "--url", console_url + "/", "--token", token)
    assert f"Logged in to {console_url}: balance 1000.0000" in done.stdout
    assert stat.S_IMODE(cli.config.stat().st_mode) == 0o600
    assert json.loads(cli.config.read_text()) == {"url": console_url, "token": token}

    # Field errors come back per option, and nothing is created.
    done = cli("clusters", "create", "Bad Name!", "--gpu", "a100-80gb", "--nodes", 0,
               "--image", TEST_IMAGE, ok=False)  # fmt: skip
    assert done.returncode == 1 and "  --name: " in done.stderr and "  --nodes: " in done.stderr
    assert not Cluster.objects.exists()

    cluster = cli.json("clusters", "create", "cli-run", "--gpu", "a100-80gb",
                       "--image", TEST_IMAGE, "--release-policy", "never")  # fmt: skip
    assert cluster["name"] == "cli-run" and cluster["nodes"] == 1
    until(lambda: Cluster.objects.get(pk=cluster["id"]).state == "running", what="placed")
    assert "running" in cli("clusters", "list").stdout.splitlines()[1]

    script = tmp_path / "restart.sh"
    script.write_text("touch $SUANLI_CHECKPOINT_DIR/.save-now\n")
    job = json.loads(cli(
        "jobs", "submit", "--cluster", cluster["id"], "--name", "count", "--env", "WORD=hello",
        "--preemption-script", script, "--max-preemptions", 2, "--json",
        "--", "echo $WORD one; sleep 2; echo two; echo three; exit 3",
    ).stdout)  # fmt: skip
    assert job["preemption_script"] == "touch $SUANLI_CHECKPOINT_DIR/.save-now"
    assert job["max_preemptions"] == 2 and job["command"].startswith("echo $WORD one;")

    # -f prints each line as it comes, once, and exits with the job's exit code.
    follow = subprocess.Popen(
        cli.command("logs", "-f", job["id"]), cwd=ROOT, env=cli.env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    first = follow.stdout.readline()
    assert first == "hello one\n"
    # Live: the job has not ended (it sleeps 2 s after this line). Its record may still say
    # "starting" for a moment: the line can come before the watch has seen every replica run.
    assert Job.objects.get(pk=job["id"]).state in ("starting", "running"), (
        "the first line came live"
    )
    rest, err = follow.communicate(timeout=40)
    assert follow.returncode == 3, err
    assert rest.splitlines() == ["two", "three"] and "Traceback" not in err
    assert "failed (exit code 3)" in err

    log = cli.json("logs", job["id"])
    assert [line["text"] for line in log["lines"]] == ["hello one", "two", "three"]
    assert log["complete"] and log["exit_code"] == 3
    shown = cli.json("jobs", "show", job["id"])
    assert shown["state"] == "failed" and shown["exit_code"] == 3
    assert "count" in cli("jobs", "list", "--cluster", cluster["id"]).stdout

    # A second, long job: cancelled while it runs.
    long = json.loads(cli(
        "--json", "jobs", "submit", "--cluster", cluster["id"], "--name", "long",
        "--", "trap 'exit 143' TERM; sleep 300 & wait",
    ).stdout)  # fmt: skip
    until(lambda: Job.objects.get(pk=long["id"]).state == "running", what="the long job runs")
    assert "stopping" in cli("jobs", "cancel", long["id"]).stdout
    until(lambda: Job.objects.get(pk=long["id"]).state == "cancelled", what="cancelled")

    # Another researcher's token: the cluster and the job do not exist for it.
    _, bobs = ApiToken.issue(user=bob, name="bob")
    other = Cli(tmp_path / "bob")
    other("login", input=f"{console_url}\n{bobs}\n")  # prompted: URL, then the hidden token
    theirs = [
        ("clusters", "show", cluster["id"]), ("clusters", "release", cluster["id"]),
        ("jobs", "show", job["id"]), ("jobs", "cancel", job["id"]), ("logs", job["id"]),
    ]  # fmt: skip
    for args in theirs:
        done = other(*args, ok=False)
        assert done.returncode == 1 and "not found" in done.stderr, args
    assert other.json("clusters", "list")["clusters"] == []

    released = cli.json("clusters", "release", cluster["id"])
    assert released["state"] in ("releasing", "released")
    balance = cli.json("balance")
    assert balance["entries"] and "Balance:" in cli("balance").stdout

    # A wrong token is refused in words, and the saved login is kept.
    done = cli("login", "--url", console_url, "--token", "sk_suanli_wrong", ok=False)
    assert done.returncode == 1
    assert "the token was refused" in done.stderr and "suanli login" in done.stderr
    assert json.loads(cli.config.read_text())["token"] == token
    cli.env["SUANLI_TOKEN"] = "sk_suanli_wrong"  # the environment overrides the file
    assert "the token was refused" in cli("balance", ok=False).stderr


def test_an_unreachable_console_is_an_error_in_words(tmp_path):
    cli = Cli(tmp_path)
    done = cli("clusters", "list", ok=False)
    assert done.returncode == 1 and "not logged in: run suanli login" in done.stderr
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    done = cli("login", "--url", url, "--token", "sk_suanli_x", ok=False)
    assert done.returncode == 1
    assert f"cannot reach the console at {url}: Connection refused" in done.stderr
    assert not cli.config.exists()
    cli.env.update(SUANLI_URL=url, SUANLI_TOKEN="sk_suanli_x")
    assert "cannot reach the console" in cli("logs", "-f", "1", ok=False).stderr


def test_the_command_line_loads_no_django_and_is_installed():
    """It runs on a laptop with none of the console: the standard library, click and
    requests only; and the install puts `suanli` next to the interpreter."""
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, suanli_cli; print(sorted(sys.modules))"],
        cwd=ROOT, capture_output=True, text=True, check=True, env={"PATH": os.environ["PATH"]},
    ).stdout.split("'")  # fmt: skip
    ours = {"django", "jobs", "billing", "monitoring"}
    assert not [m for m in loaded if m.split(".")[0] in ours], "imports Django or an app"
    assert not [m for m in loaded if m.startswith("console.")]
    script = Path(sys.executable).parent / "suanli"
    assert script.exists(), "reinstall the project: `make venv`"
    done = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and "suanli login" in done.stdout


def test_the_command_line_installs_alone_with_pip(console_url, alice, tmp_path):
    """`pip install ./cli` into an environment with no Django and no console gives
    a `suanli` that works against the console."""
    source, copy = tmp_path / "cli", tmp_path / "copy"
    shutil.copytree(
        ROOT / "cli", source, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
    )
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", venv], check=True, timeout=120)
    install = subprocess.run(
        [venv / "bin" / "pip", "install", "-q", "--disable-pip-version-check", source],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr[-2000:]
    alone = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8"}
    no_django = subprocess.run(
        [venv / "bin" / "python", "-c", "import django"], capture_output=True, env=alone
    )
    assert no_django.returncode != 0, "the CLI's environment must not need the console's"
    _, token = ApiToken.issue(user=alice, name="laptop")
    done = subprocess.run(
        ["suanli", "--json", "balance"], capture_output=True, text=True, timeout=60,
        env={**alone, "SUANLI_URL": console_url, "SUANLI_TOKEN": token},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["balance"] == "1000.0000"

    # --version, installed alone, and from a copy of the package with no installed metadata
    # at all (a vendored copy, a zipapp): the version it was built as, never a traceback.
    from suanli_cli.version import VERSION

    for where, env in [("installed", alone), ("a copy", {**alone, "PYTHONPATH": str(copy)})]:
        if where == "a copy":
            subprocess.run([venv / "bin" / "pip", "uninstall", "-q", "-y", "suanli-cli"],
                           check=True, timeout=120)  # fmt: skip
            shutil.copytree(source / "suanli_cli", copy / "suanli_cli")
        done = subprocess.run(
            [venv / "bin" / "python", "-m", "suanli_cli", "--version"],
            capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path,
        )  # fmt: skip
        assert (done.returncode, done.stdout, done.stderr) == (
            0, f"suanli, version {VERSION}\n", ""
        ), where  # fmt: skip
        done = subprocess.run(
            [venv / "bin" / "python", "-m", "suanli_cli", "--version", "--json"],
            capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path,
        )  # fmt: skip
        assert json.loads(done.stdout) == {"name": "suanli", "version": VERSION}, where


def test_suanli_ssh_prints_or_runs_the_nodes_ssh_command(
    console_url, alice, bob, make_cluster, tmp_path
):
    from jobs.access import hostkey, sessions
    from jobs.placement import scheduler

    cluster = make_cluster(alice, "shell", release_policy="never", volumes=())
    waits = make_cluster(alice, "waits", gpus=8)  # more than the one host has
    scheduler.place_pending()
    until(lambda: Cluster.objects.get(pk=cluster.pk).state == "running", what="placed")
    _, token = ApiToken.issue(user=alice, name="laptop")
    cli = Cli(tmp_path / "alice")
    cli.env.update(SUANLI_URL=console_url, SUANLI_TOKEN=token)
    done = cli("ssh", waits.pk, ok=False)
    assert done.returncode == 1 and f"cluster {waits.pk} (waits) is pending" in done.stderr
    port, user = sessions.ssh_port(), f"c{cluster.pk}-0"

    assert cli("ssh", cluster.pk, "--print").stdout == f"ssh -p {port} {user}@127.0.0.1\n"
    forward = cli("ssh", cluster.pk, 0, "-L", "6006:localhost:6006", "--print").stdout
    assert forward == f"ssh -p {port} -L 6006:localhost:6006 {user}@127.0.0.1\n"
    login = cli.json("ssh", cluster.pk)
    assert login == {
        "node": 0, "user": user, "host": "127.0.0.1", "port": port,
        "command": f"ssh -p {port} {user}@127.0.0.1",
        "host_key_fingerprint": hostkey.host_key_fingerprint(),
        "argv": ["ssh", "-p", str(port), f"{user}@127.0.0.1"],
    }  # fmt: skip
    # -i KEY and a remote command after -- go to ssh as they are (the words after -- are
    # never NODE or our options, --json included).
    key = tmp_path / "id_ed25519"
    key.write_text("not read by suanli\n")
    remote = cli("ssh", cluster.pk, "-i", key, "--print", "--", "python", "-c", "print('a b')",
                 "--json").stdout  # fmt: skip
    assert shlex.split(remote) == [
        "ssh", "-p", str(port), "-i", str(key), f"{user}@127.0.0.1",
        "python", "-c", "print('a b')", "--json",
    ]  # fmt: skip
    done = cli("ssh", cluster.pk, 0, "--print", "--", "ls", "-la")
    assert done.stdout == f"ssh -p {port} {user}@127.0.0.1 ls -la\n"
    done = cli("ssh", cluster.pk, "-i", tmp_path / "no-such-key", ok=False)
    assert done.returncode == 2 and "no-such-key" in done.stderr
    done = cli("ssh", cluster.pk, 1, ok=False)
    assert done.returncode == 1 and "has no node 1 (its nodes: 0)" in done.stderr

    # Without --print it becomes the local ssh, with those arguments (here a stand-in that
    # prints them, one a line).
    stand_in = tmp_path / "bin" / "ssh"
    stand_in.parent.mkdir()
    stand_in.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    stand_in.chmod(0o755)
    cli.env["PATH"] = f"{stand_in.parent}:{os.environ['PATH']}"
    done = cli("ssh", cluster.pk)
    assert done.stdout.splitlines() == ["-p", str(port), f"{user}@127.0.0.1"]
    assert login["host_key_fingerprint"] in done.stderr
    done = cli("ssh", cluster.pk, "-i", key, "--", "echo", "$HOME", "two words")
    assert done.stdout.splitlines() == [
        "-p", str(port), "-i", str(key), f"{user}@127.0.0.1", "echo", "$HOME", "two words"
    ]  # fmt: skip

    _, bobs = ApiToken.issue(user=bob, name="bob")
    cli.env["SUANLI_TOKEN"] = bobs
    done = cli("ssh", cluster.pk, "--print", ok=False)
    assert done.returncode == 1 and "not found" in done.stderr and "ssh -p" not in done.stdout


def test_suanli_stops_a_cluster_and_starts_it_again_without_gpus_when_they_are_taken(
    console_url, alice, bob, make_cluster, tmp_path, processes
):
    from jobs.placement import scheduler

    # The builder saves stopped workspaces (the queue "builds"), as the Procfile runs it.
    processes.start("builder", "--worker-class", "console.rqworker.SimpleWorker")

    cluster = make_cluster(alice, "keep", gpus=2, release_policy="never", volumes=())
    scheduler.place_pending()
    try:
        until(lambda: Cluster.objects.get(pk=cluster.pk).state == "running", what="placed")
    except AssertionError:  # say where it stands, and why
        cluster.refresh_from_db()
        raise AssertionError(f"not placed: {cluster.state}: {cluster.state_reason}") from None
    _, token = ApiToken.issue(user=alice, name="laptop")
    cli = Cli(tmp_path / "alice")
    cli.env.update(SUANLI_URL=console_url, SUANLI_TOKEN=token)
    done = cli("clusters", "stop", cluster.pk)
    assert f"Cluster {cluster.pk} (keep) is stopped; released at " in done.stdout
    # Its GPUs go to the next tenant once the worker's stop task saw its workspace stopped.
    from jobs import tasks

    assert tasks.cluster_workspaces_stop(cluster.pk)
    # The builder saves its system disk to the registry next (for a start on another host,
    # which this one-host fleet has not): waited for, so no save races the start below.
    # A push that fails is tried again 30 s later (tasks.cluster_workspaces_save): room
    # for one retry on a loaded machine.
    until(lambda: Node.objects.filter(cluster=cluster).exclude(saved_image="").exists(),
          timeout=150, what="its workspace saved")  # fmt: skip
    make_cluster(bob, "takes", gpus=2, release_policy="never", volumes=())
    scheduler.place_pending()
    done = cli("clusters", "start", cluster.pk, ok=False)
    assert done.returncode == 1 and "in use by other clusters" in done.stderr
    assert done.stderr.rstrip().endswith("Run it again with --wait or --no-gpu.")
    assert "API:" not in done.stderr
    done = cli("clusters", "start", cluster.pk, "--no-gpu")
    assert done.stdout == f"Cluster {cluster.pk} (keep) is running without GPUs.\n"
    shown = cli.json("clusters", "show", cluster.pk)
    assert shown["no_gpu"] is True and shown["state"] == "running"
    # Its nodes run without GPUs: no line of ours names one.
    for args in [("clusters", "show", cluster.pk), ("clusters", "list")]:
        out = cli(*args).stdout
        assert "1 x no GPU" in out and "a100" not in out.lower() and "GPUs" not in out, out
    assert shown["stopped_at"] is None and shown["release_at"] is None


def _commands(command, path=()):
    """Every command and group of `suanli`, as the words that name it."""
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _commands(sub, (*path, name))


def test_every_command_and_group_takes_json_after_it():
    from suanli_cli import cli

    for path, command in _commands(cli):
        options = [opt for param in command.params for opt in getattr(param, "opts", [])]
        assert "--json" in options, path


def test_every_command_prints_json_under_json_and_its_errors_too(console_url, alice, tmp_path):
    """Each command with --json after it: JSON on stdout, success or not; an error is
    `{"error": ...}` (with the API's status and fields when it answered) and a non-zero
    exit status, and nothing on stderr."""
    from suanli_cli import cli as suanli

    _, token = ApiToken.issue(user=alice, name="laptop")
    cli = Cli(tmp_path / "alice")
    folder = tmp_path / "image"
    folder.mkdir()
    (folder / "Dockerfile").write_text("FROM scratch\n")
    missing = 999999
    rows = {  # the words of each command: (arguments, exit status)
        ("login",): (["--url", console_url, "--token", token], 0),
        ("logout",): ([], 0),
        ("balance",): ([], 0),
        ("clusters", "list"): ([], 0),
        ("clusters", "show"): ([missing], 1),
        ("clusters", "create"): (["Bad Name!", "--gpu", "a100-80gb", "--image", TEST_IMAGE], 1),
        ("clusters", "release"): ([missing], 1),
        ("clusters", "stop"): ([missing], 1),
        ("clusters", "start"): ([missing], 1),
        ("clusters", "resize"): ([missing, "--nodes", 2], 1),
        ("clusters", "shutdown"): ([missing, "--clear"], 1),
        ("clusters", "budget"): ([missing, "50"], 1),
        ("jobs", "list"): ([], 0),
        ("jobs", "show"): ([missing], 1),
        ("jobs", "submit"): (["--cluster", missing, "--", "true"], 1),
        ("jobs", "profile"): ([missing], 1),
        ("jobs", "cancel"): ([missing], 1),
        ("jobs", "budget"): ([missing, "none"], 1),
        ("logs",): ([missing, "-f"], 1),
        ("ssh",): ([missing], 1),
        ("images", "list"): ([], 0),
        ("images", "build"): ([folder, "--name", "Bad Name!", "--no-follow"], 1),
        ("images", "delete"): ([missing], 1),
        ("pools", "list"): ([], 0),
        ("pools", "show"): (["nope"], 1),
        ("pools", "create"): (["Bad Name!", "--gpu", "a100-80gb", "--image", TEST_IMAGE], 1),
        ("pools", "close"): (["nope"], 1),
        ("sweeps", "list"): ([], 0),
        ("sweeps", "show"): ([missing], 1),
        ("sweeps", "create"): (
            ["--pool", "nope", "--param", "x: uniform 0 1", "--metric", "loss", "--", "true"],
            1,
        ),  # fmt: skip
        ("sweeps", "cancel"): ([missing], 1),
        ("sweeps", "budget"): ([missing, "5"], 1),
        ("keys", "list"): ([], 0),
        ("keys", "add"): ([folder / "Dockerfile"], 1),  # not a public key
        ("keys", "default"): ([missing], 1),
        ("keys", "delete"): ([missing], 1),
        ("keys", "attached"): ([missing], 1),
        ("keys", "attach"): ([missing, missing], 1),
        ("keys", "detach"): ([missing, missing], 1),
        ("subscriptions", "list"): ([], 0),
        ("subscriptions", "add"): (["--gpu", "a100-80gb", "--gpus-per-node", 0], 1),
        ("subscriptions", "cancel"): ([missing], 1),
        ("notify", "list"): ([], 0),
        ("notify", "add"): (["email", "not-an-address", "--event", "job.failed"], 1),
        ("notify", "remove"): ([missing], 1),
        ("notify", "test"): ([missing], 1),
        ("notify", "log"): ([missing], 1),
        ("teams", "list"): ([], 0),
        ("teams", "create"): ([" "], 1),
        ("teams", "show"): (["nope"], 1),
        ("teams", "members"): (["nope"], 1),
        ("teams", "invitations"): ([], 0),
        ("teams", "invite"): (["nope", "--link"], 1),
        ("teams", "revoke"): (["nope", missing], 1),
        ("teams", "role"): (["nope", "bob", "viewer"], 1),
        ("teams", "caps"): (["nope", "bob", "--gpus", 1], 1),
        ("teams", "remove"): (["nope", "bob"], 1),
        ("teams", "leave"): (["nope"], 1),
        ("teams", "accept"): (["sli_nope"], 1),
        ("teams", "decline"): ([missing], 1),
        ("teams", "use"): (["nope"], 1),
    }
    leaves = {path for path, c in _commands(suanli) if path and not hasattr(c, "commands")}
    assert leaves == set(rows), "a command without a row here"
    for path, (args, status) in rows.items():
        cli.env.update(SUANLI_URL=console_url, SUANLI_TOKEN=token)
        # --json after the command's own words (before `--`, where there is one)
        words = [*path, *args]
        at = words.index("--") if "--" in words else len(words)
        done = cli(*words[:at], "--json", *words[at:], ok=False)
        assert done.returncode == status and done.stderr == "", (path, done.stdout, done.stderr)
        answer = json.loads(done.stdout)
        if status:
            assert isinstance(answer, dict) and answer["error"], (path, answer)
    shown = cli.json_error("clusters", "show", missing)
    assert shown["status"] == 404 and "not found" in shown["error"]
    bad = cli.json_error("clusters", "create", "Bad Name!", "--gpu", "a100-80gb",
                         "--image", TEST_IMAGE)  # fmt: skip
    assert bad["status"] == 400 and "name" in bad["fields"]
    # A misused command (exit status 2) and a group's --json, the same way.
    done = cli("clusters", "show", "seven", "--json", ok=False)
    assert done.returncode == 2 and json.loads(done.stdout)["usage"] is True
    assert "seven" in json.loads(done.stdout)["error"]
    assert cli("clusters", "--json", "list").stdout.startswith("{")
    cli.env.pop("SUANLI_TOKEN")
    cli.env.pop("SUANLI_URL")
    done = cli("balance", "--json", ok=False)
    assert done.returncode == 1 and "not logged in" in json.loads(done.stdout)["error"]


def test_pools_and_sweeps_from_the_command_line(console_url, alice, bob, tmp_path):
    _, token = ApiToken.issue(user=alice, name="laptop")
    cli = Cli(tmp_path / "alice")
    cli.env.update(SUANLI_URL=console_url, SUANLI_TOKEN=token)
    pool = cli.json("pools", "create", "cli-pool", "--gpu", "a100-80gb", "--nodes", 1,
                    "--gpus-per-node", 1, "--image", TEST_IMAGE, "--max", 1)  # fmt: skip
    assert pool["name"] == "cli-pool" and pool["state"] == "active" and pool["max_clusters"] == 1
    listed = cli("pools", "list").stdout.splitlines()
    assert listed[0].split()[:4] == ["ID", "NAME", "STATE", "EACH"]
    assert listed[1].split()[:7] == [str(pool["id"]), "cli-pool", "active", "1", "x", "1",
                                     "a100-80gb"]  # fmt: skip
    shown = cli("pools", "show", "cli-pool").stdout
    assert "name:" in shown and "cli-pool" in shown and pool["url"] in shown
    assert cli.json("pools", "show", pool["id"])["id"] == pool["id"]

    sweep = json.loads(cli(
        "sweeps", "create", "--pool", "cli-pool", "--name", "lr", "--param",
        "lr: log_uniform 1e-5 1e-1", "--metric", "loss", "--trials", 2, "--json",
        "--", 'echo "SUANLI_METRIC {\\"step\\": 1, \\"loss\\": $SUANLI_PARAM_LR}"',
    ).stdout)  # fmt: skip
    assert sweep["pool"] == pool["id"] and sweep["trials"] == 2 and sweep["metric"] == "loss"
    assert sweep["command"].startswith('echo "SUANLI_METRIC')
    assert [s["id"] for s in cli.json("sweeps", "list")["sweeps"]] == [sweep["id"]]
    row = cli("sweeps", "list").stdout.splitlines()[1].split()
    assert row[:5] == [str(sweep["id"]), "lr", str(pool["id"]), "running", "0/2"]
    assert "metric:" in cli("sweeps", "show", sweep["id"]).stdout
    cancelled = cli.json("sweeps", "cancel", sweep["id"])
    assert cancelled["state"] == "cancelled"
    assert cli("sweeps", "show", sweep["id"]).stdout.count("cancelled") >= 1

    # Another researcher: neither exists for them.
    _, bobs = ApiToken.issue(user=bob, name="bob")
    other = Cli(tmp_path / "bob")
    other.env.update(SUANLI_URL=console_url, SUANLI_TOKEN=bobs)
    assert "not found" in other("sweeps", "show", sweep["id"], ok=False).stderr
    assert "no pool named 'cli-pool'" in other("pools", "close", "cli-pool", ok=False).stderr
    assert "no pool named" in other("pools", "show", str(pool["id"]), ok=False).stderr

    done = cli("pools", "close", "cli-pool")
    assert done.stdout == f"Pool {pool['id']} (cli-pool) is closed.\n"
    assert cli.json("pools", "list")["pools"][0]["state"] == "closed"


def test_ssh_keys_from_the_command_line(console_url, alice, bob, make_cluster, tmp_path):
    """Add a key, make it a default, attach it to a cluster and detach it again; another
    researcher sees none of it."""
    cluster = make_cluster(alice, "keys", release_policy="never", volumes=())
    _, token = ApiToken.issue(user=alice, name="laptop")
    cli = Cli(tmp_path / "alice")
    cli.env.update(SUANLI_URL=console_url, SUANLI_TOKEN=token)
    private = tmp_path / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "lab", "-f", private],
                   check=True)  # fmt: skip
    done = cli("keys", "add", private, ok=False)
    assert done.returncode == 1 and "is a private key: give its .pub file" in done.stderr
    key = cli.json("keys", "add", f"{private}.pub")
    assert key["name"] == "lab" and key["fingerprint"].startswith("SHA256:")
    assert not key["is_default"]
    listed = cli("keys", "list").stdout.splitlines()
    assert listed[1].split()[:4] == [str(key["id"]), "lab", "ssh-ed25519", key["fingerprint"]]
    assert cli("keys", "default", key["id"]).stdout == f"Key {key['id']} (lab) is a default.\n"
    assert cli.json("keys", "list")["ssh_keys"][0]["is_default"] is True

    done = cli("keys", "attach", cluster.pk, key["id"])
    assert done.stdout.startswith(f"Key {key['id']} is attached to cluster {cluster.pk}:")
    assert [k.pk for k in Cluster.objects.get(pk=cluster.pk).ssh_keys.all()] == [key["id"]]
    attached = cli.json("keys", "attached", cluster.pk)
    assert [k["id"] for k in attached["ssh_keys"]] == [key["id"]]

    _, bobs = ApiToken.issue(user=bob, name="bob")
    other = Cli(tmp_path / "bob")
    other.env.update(SUANLI_URL=console_url, SUANLI_TOKEN=bobs)
    for args in [("keys", "detach", cluster.pk, key["id"]), ("keys", "delete", key["id"]),
                 ("keys", "attached", cluster.pk)]:  # fmt: skip
        done = other(*args, ok=False)
        assert done.returncode == 1 and "not found" in done.stderr, args
    assert other.json("keys", "list")["ssh_keys"] == []

    assert cli.json("keys", "detach", cluster.pk, key["id"])["ssh_keys"] == []
    assert cli("keys", "delete", key["id"]).stdout == f"Key {key['id']} deleted.\n"
    assert cli.json("keys", "list")["count"] == 0
