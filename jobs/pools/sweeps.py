"""Sweeps: trials of one command on a pool, searched by Optuna, bad ones stopped early
(issue 26).

Optuna does the searching and the pruning, by ask and tell, with its storage in the
project's own database (`storage()`: SQLAlchemy on the same PostgreSQL or SQLite). The
console does the rest: each trial is a job on the sweep's pool with its parameters in
the environment (`SUANLI_PARAM_<NAME>`) and in a JSON file (`$SUANLI_PARAMS_FILE`); the
trial reports its metric by printing

    SUANLI_METRIC {"step": 100, "val_loss": 0.41}

lines, which `observe` reads from the job's numbered log (rank 0's lines: the live log
follower keeps them in Redis and queues `observe` when it sees one) and reports to the
trial. When the pruner says stop, the trial is told pruned, the next trial is queued on the
pool at once, and the job gets SIGTERM with its grace period (so it can checkpoint): its
cluster, free a moment later, takes the next trial without a new placement. A sweep that
finishes tells its owner its best trial (`sweep.finished`).

Layer: pools, over the autoscaler; uses it, clusters (services), runs (livelogs), events
(webhooks), models and base (text)."""

from __future__ import annotations

import json
import logging
import math
import re
import threading
import uuid
import warnings
from dataclasses import dataclass
from decimal import Decimal
from urllib.parse import quote

import optuna
from django.core.exceptions import ValidationError
from django.db import connection, transaction
from django.utils import timezone
from django.utils.translation import gettext as _
from django.utils.translation import gettext_noop
from sqlalchemy.pool import NullPool

from jobs.base.text import Text, load, twin_fields
from jobs.clusters import services
from jobs.events import webhooks
from jobs.models import Job, Pool, Sweep, Trial
from jobs.pools import autoscaler
from jobs.runs import livelogs, progress

log = logging.getLogger(__name__)
optuna.logging.set_verbosity(optuna.logging.WARNING)

MARKER = progress.MARKER  # "SUANLI_METRIC"
PARAMS_FILE = "/tmp/suanli-params.json"  # noqa: S108 (the container's own /tmp)
TYPES = ("uniform", "log_uniform", "int", "categorical")
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,39}")  # whole: fullmatch
METRIC = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-/]{0,63}")
MAX_BOUND = 2**53  # a bound beyond this is not a float to search over
REPORTS_PER_ROUND = 20  # Optuna writes per observe round (the rest of a burst: thinned)
MAX_PARAMS = 20
MAX_CHOICES = 50
MAX_TRIALS = 1000
CURVE_POINTS = 2000  # per trial: beyond this, every other point is dropped
LINE_MAX = progress.LINE_MAX  # a metric line longer than this is not read


# -- the search space -------------------------------------------------------------------------


def _number(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        try:
            value = float(str(value))
        except ValueError:
            raise ValidationError(
                _("%(what)s must be a number, not %(value)s.")
                % {"what": what, "value": str(value)[:40]}
            ) from None
    try:
        value = float(value)
    except OverflowError:
        value = math.inf
    if not math.isfinite(value) or abs(value) > MAX_BOUND:
        raise ValidationError(
            _("%(what)s must be a finite number, at most 2^53 either way.") % {"what": what}
        )
    return value


def parse_space(text_or_list) -> list[dict]:
    """The search space, from the form's lines (`x: uniform -5 10`, `lr: log_uniform 1e-5
    1e-1`, `layers: int 1 8`, `opt: categorical adam sgd`) or a JSON list of
    {"name", "type", "low", "high"} / {"name", "type": "categorical", "choices"}. Raises
    ValidationError with one sentence per problem."""
    items = _space_items(text_or_list)
    out, seen = [], set()
    for i, item in enumerate(items, 1):
        out.append(_parameter(i, item, seen))
    return out


def _space_items(text_or_list) -> list:
    """The space's items, from JSON or the form's lines, and their count within bounds."""
    if isinstance(text_or_list, str):
        text = text_or_list.strip()
        if text.startswith(("[", "{")):
            try:
                items = json.loads(text)
            except ValueError as exc:
                raise ValidationError(
                    _("The search space is not valid JSON: %(error)s.") % {"error": exc}
                ) from None
        else:
            items = [
                _line(n, line)
                for n, line in enumerate(text.splitlines(), 1)
                if line.strip() and not line.strip().startswith("#")
            ]
    else:
        items = text_or_list
    if not isinstance(items, list):
        raise ValidationError(
            _(
                'The search space in JSON is a list: [{"name": "x", "type": "uniform", "low": 0, "high": 1}, ...].'
            )
        )
    if not items:
        raise ValidationError(_("The search space needs at least one parameter."))
    if len(items) > MAX_PARAMS:
        raise ValidationError(_("A search space has at most %(n)s parameters.") % {"n": MAX_PARAMS})
    return items


def _parameter(i: int, item, seen: set[str]) -> dict:
    """The `i`th parameter checked (its name not among `seen`, which it joins)."""
    if not isinstance(item, dict):
        raise ValidationError(
            _("Parameter %(n)s is not an object with a name and a type.") % {"n": i}
        )
    name = item.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValidationError(
            _(
                "Parameter %(n)s: the name must be letters, digits and _ (not starting with a digit), up to 40."
            )
            % {"n": i}
        )
    if name.upper() in seen:
        raise ValidationError(_("Parameter %(name)s is named twice.") % {"name": name})
    seen.add(name.upper())
    kind = item.get("type")
    if kind not in TYPES:
        raise ValidationError(
            _("Parameter %(name)s: the type must be one of %(types)s.")
            % {"name": name, "types": ", ".join(TYPES)}
        )
    if kind == "categorical":
        return {"name": name, "type": kind, "choices": _choices(name, item.get("choices"))}
    low = _number(item.get("low"), _("%(name)s's low") % {"name": name})
    high = _number(item.get("high"), _("%(name)s's high") % {"name": name})
    if not low < high:
        raise ValidationError(_("Parameter %(name)s: low must be below high.") % {"name": name})
    if kind == "log_uniform" and low <= 0:
        raise ValidationError(
            _("Parameter %(name)s: a log-uniform range must be above 0.") % {"name": name}
        )
    if kind == "int":
        if low != int(low) or high != int(high):
            raise ValidationError(
                _("Parameter %(name)s: an integer range needs whole numbers.") % {"name": name}
            )
        low, high = int(low), int(high)
    return {"name": name, "type": kind, "low": low, "high": high}


def _choices(name: str, choices) -> list:
    """A categorical parameter's choices: words or numbers, each once."""
    if not isinstance(choices, list) or not choices or len(choices) > MAX_CHOICES:
        raise ValidationError(
            _("Parameter %(name)s: categorical needs 1 to %(n)s choices.")
            % {"name": name, "n": MAX_CHOICES}
        )
    for choice in choices:
        if (
            not isinstance(choice, str | int | float | bool)
            or (isinstance(choice, float) and not math.isfinite(choice))
            or (isinstance(choice, float) and abs(choice) > MAX_BOUND)
            or (
                isinstance(choice, int) and not isinstance(choice, bool) and abs(choice) > MAX_BOUND
            )
            or (isinstance(choice, str) and (len(choice) > 100 or _control(choice)))
        ):
            raise ValidationError(
                _(
                    "Parameter %(name)s: each choice must be a word (up to 100 characters, no control characters) or a number (at most 2^53 either way)."
                )
                % {"name": name}
            )
    if len({json.dumps(c) for c in choices}) != len(choices):
        raise ValidationError(_("Parameter %(name)s: a choice is given twice.") % {"name": name})
    return choices


def _control(text: str) -> bool:
    return any(ord(c) < 32 or ord(c) == 127 for c in text)


def _line(n: int, line: str) -> dict:
    name, colon, rest = line.partition(":")
    words = rest.split()
    if not colon or not words:
        raise ValidationError(
            _(
                "Search space line %(n)s: write it as 'name: type low high' or 'name: categorical a b c'."
            )
            % {"n": n}
        )
    kind = words[0].replace("-", "_").lower()
    if kind == "categorical":
        return {"name": name.strip(), "type": kind, "choices": [_choice(w) for w in words[1:]]}
    if len(words) != 3:
        raise ValidationError(
            _("Search space line %(n)s: %(type)s needs a low and a high.")
            % {"n": n, "type": words[0]}
        )
    return {"name": name.strip(), "type": kind, "low": words[1], "high": words[2]}


def _choice(word: str):
    try:
        return int(word)
    except ValueError:
        pass
    try:
        value = float(word)
        return value if math.isfinite(value) else word
    except ValueError:
        return word


def space_text(space: list[dict]) -> str:
    """The lines the form reads back."""
    out = []
    for p in space:
        if p["type"] == "categorical":
            out.append(f"{p['name']}: categorical " + " ".join(str(c) for c in p["choices"]))
        else:
            out.append(f"{p['name']}: {p['type']} {p['low']} {p['high']}")
    return "\n".join(out)


def distributions(space: list[dict]) -> dict:
    out = {}
    for p in space:
        if p["type"] == "categorical":
            out[p["name"]] = optuna.distributions.CategoricalDistribution(p["choices"])
        elif p["type"] == "int":
            out[p["name"]] = optuna.distributions.IntDistribution(p["low"], p["high"])
        else:
            out[p["name"]] = optuna.distributions.FloatDistribution(
                p["low"], p["high"], log=p["type"] == "log_uniform"
            )
    return out


def validate_metric(name: str) -> str:
    name = (name or "").strip()
    if not METRIC.fullmatch(name) or name == "step":
        raise ValidationError(
            _(
                "The metric is the name of a number the trial prints, e.g. val_loss: letters, digits, _ . - / (not 'step')."
            )
        )
    return name


# -- metric lines -----------------------------------------------------------------------------


MetricLineError = progress.MetricLineError  # the one reader of the line: jobs/runs/progress.py


def parse_metric_line(text: str, metric: str) -> tuple[int, float] | None:
    """(step, value) of a `SUANLI_METRIC {...}` line; None when the line has no marker or
    does not name this metric; MetricLineError with a sentence when it is malformed."""
    data = progress.metric_line(text)
    if data is None or metric not in data:
        return None  # another metric's line: not an error
    step = data.get("step")
    why = progress.step_problem(step)
    if why is not None:
        raise MetricLineError(why)
    value = data[metric]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise MetricLineError(gettext_noop("the metric's value must be a finite number"))
    return step, float(value)


# -- Optuna's storage -------------------------------------------------------------------------

_storages: dict[str, optuna.storages.RDBStorage] = {}
LIBPQ_OPTIONS = {
    "sslmode", "sslrootcert", "sslcert", "sslkey", "sslcrl", "connect_timeout",
    "options", "target_session_attrs", "application_name", "keepalives", "keepalives_idle",
}  # fmt: skip
_storages_lock = threading.Lock()


def storage_url() -> str:
    s = connection.settings_dict
    if "sqlite" in s["ENGINE"]:
        # SQLite has one writer at a time: Optuna's own connection writing while a Django
        # transaction holds the lock would wait on it for good. The zero-setup default
        # keeps the studies in a file beside the database instead.
        return f"sqlite:///{s['NAME']}.optuna"
    user = _quote(s.get("USER") or "")
    password = _quote(s.get("PASSWORD") or "")
    auth = f"{user}:{password}@" if password else (f"{user}@" if user else "")
    host = s.get("HOST") or ""
    port = f":{s['PORT']}" if s.get("PORT") else ""
    url = f"postgresql+psycopg://{auth}{host}{port}/{_quote(s['NAME'])}"
    if host.startswith("/"):  # a socket folder
        url = f"postgresql+psycopg://{auth}/{_quote(s['NAME'])}?host={_quote(host)}{'&port=' + str(s['PORT']) if s.get('PORT') else ''}"
    return url


def _quote(value: str) -> str:
    return quote(str(value), safe="")


def storage() -> optuna.storages.RDBStorage:
    """Optuna's storage in the project's database (its own tables, made on first use;
    beside it with SQLite)."""
    url = storage_url()
    with _storages_lock:
        if url not in _storages:
            # No pool of its own: a connection per use, closed after (no idle sessions
            # left on the database; the calls are few, on a sweep's events).
            kwargs = {"poolclass": NullPool}
            options = connection.settings_dict.get("OPTIONS") or {}
            tls = {k: str(v) for k, v in options.items() if k in LIBPQ_OPTIONS}
            if tls and url.startswith("postgresql"):
                kwargs["connect_args"] = tls  # the same TLS and timeouts as Django's
            _storages[url] = optuna.storages.RDBStorage(url, engine_kwargs=kwargs)
        return _storages[url]


def close_storages() -> None:
    """Let go of Optuna's engines (a process that ends, or a test run's database)."""
    with _storages_lock:
        for kept in _storages.values():
            kept.engine.dispose()
        _storages.clear()


def _pruner(sweep: Sweep) -> optuna.pruners.BasePruner:
    if sweep.pruner == Sweep.Pruner.ASHA:
        return optuna.pruners.SuccessiveHalvingPruner(
            min_resource=max(sweep.min_steps, 1), reduction_factor=2, min_early_stopping_rate=0
        )
    if sweep.pruner == Sweep.Pruner.MEDIAN:
        return optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=sweep.min_steps)
    return optuna.pruners.NopPruner()


def study_of(sweep: Sweep) -> optuna.Study:
    with warnings.catch_warnings():
        # constant_liar (trials asked for side by side spread out) is marked experimental.
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        sampler = optuna.samplers.TPESampler(
            n_startup_trials=max(2, min(10, sweep.trials // 4)), constant_liar=True
        )
    return optuna.load_study(
        study_name=sweep.study_name, storage=storage(), pruner=_pruner(sweep), sampler=sampler
    )


# -- creating, advancing ----------------------------------------------------------------------


@dataclass(frozen=True)
class SweepSpec:
    name: str
    command: str
    space: list[dict]
    metric: str
    direction: str = Sweep.Direction.MINIMIZE
    trials: int = 10
    parallel: int = 1
    pruner: str = Sweep.Pruner.ASHA
    min_steps: int = 1
    env: dict | None = None
    workdir: str = "/workspace"
    budget: Decimal | None = None  # cancelled at this much spent (billing/budgets.py)


def sweep_create(*, owner, pool: Pool, spec: SweepSpec, created_by=None) -> Sweep:
    """`owner`: whose the sweep is (a researcher, a team's principal); `created_by`: the
    person who started it (default: the owner)."""
    if pool.owner_id != owner.pk:
        raise ValidationError(_("No such pool."))
    if pool.state != Pool.State.ACTIVE:
        raise ValidationError(
            _("Pool %(pool)s is closed: it takes no more jobs.") % {"pool": pool.name}
        )
    space = parse_space(spec.space)
    metric = validate_metric(spec.metric)
    if not 1 <= spec.trials <= MAX_TRIALS:
        raise ValidationError(_("A sweep runs 1 to %(n)s trials.") % {"n": MAX_TRIALS})
    if not 1 <= spec.parallel <= spec.trials:
        raise ValidationError(_("The trials at a time must be between 1 and the number of trials."))
    if spec.direction not in Sweep.Direction.values or spec.pruner not in Sweep.Pruner.values:
        raise ValidationError(_("Unknown direction or early stopping rule."))
    name = f"suanli-{uuid.uuid4().hex}"
    with transaction.atomic():
        sweep = Sweep.objects.create(
            owner=owner, created_by=created_by or owner, pool=pool, name=spec.name, command=spec.command, env=spec.env or {},
            workdir=spec.workdir, space=space, metric=metric, direction=spec.direction,
            trials=spec.trials, parallel=spec.parallel, pruner=spec.pruner,
            min_steps=max(spec.min_steps, 1), study_name=name, budget=spec.budget,
        )  # fmt: skip
        # Optuna's own connection, committed at once: made last, so that a failure
        # before it leaves no study behind (and a failure here no sweep).
        optuna.create_study(
            study_name=name,
            storage=storage(),
            direction="minimize" if spec.direction == Sweep.Direction.MINIMIZE else "maximize",
        )
    advance(sweep.pk)
    return sweep


def _env_of(sweep: Sweep, number: int, params: dict) -> dict:
    env = dict(sweep.env)
    for name, value in params.items():
        env[f"SUANLI_PARAM_{name.upper()}"] = (
            json.dumps(value) if isinstance(value, bool) else str(value)
        )
    env["SUANLI_PARAMS"] = json.dumps(params, sort_keys=True)
    env["SUANLI_PARAMS_FILE"] = PARAMS_FILE
    env["SUANLI_SWEEP"] = str(sweep.pk)
    env["SUANLI_TRIAL"] = str(number)
    return env


def advance(sweep_id: int) -> int:
    """Start trials while fewer than `parallel` run and trials remain; end the sweep when
    all have ended. Returns how many it started."""
    with transaction.atomic():
        sweep = Sweep.objects.select_for_update().filter(pk=sweep_id).first()
        if sweep is None or sweep.state != Sweep.State.RUNNING:
            return 0
        trials = list(sweep.trial_set.all())
        in_flight = sum(1 for t in trials if t.state == Trial.State.RUNNING)
        started = 0
        study = None
        waiting = None
        held = None  # the next trial would pass the sweep's budget
        while in_flight < sweep.parallel and len(trials) < sweep.trials:
            waiting = autoscaler.blocked(sweep.pool)
            if waiting is not None:
                break  # asked again on the next round; no trial is used up meanwhile
            waiting = held = budget_hold(sweep)
            if held is not None:
                break
            study = study or study_of(sweep)
            ask = study.ask(distributions(sweep.space))
            params = dict(ask.params)
            spec = services.JobSpec(
                name=f"{sweep.name[:80]}-trial-{ask.number}",
                command=sweep.command,
                env=_env_of(sweep, ask.number, params),
                workdir=sweep.workdir,
                checkpoint_dir=f"{sweep.workdir.rstrip('/')}/checkpoints/trial-{ask.number}",
            )
            try:
                with transaction.atomic():
                    job = autoscaler.pool_submit(pool=sweep.pool, spec=spec)
                    trial = Trial.objects.create(
                        sweep=sweep, number=ask.number, optuna_id=ask._trial_id,
                        params=params, job=job,
                    )  # fmt: skip
            except ValidationError as exc:
                study.tell(ask.number, state=optuna.trial.TrialState.FAIL)
                waiting = " ".join(exc.messages)
                break
            except Exception:
                # Optuna's ask is committed on its own connection: not left running.
                study.tell(ask.number, state=optuna.trial.TrialState.FAIL)
                raise
            trials.append(trial)
            in_flight += 1
            started += 1
        note = (
            Text(gettext_noop("no trial can start now: %(why)s"), why=waiting) if waiting else None
        )
        said = twin_fields(Sweep, "note", note)
        if said["note"] != sweep.note:
            Sweep.objects.filter(pk=sweep.pk).update(**said)
        pool = sweep.pool
        gone = (
            held is not None
            or pool.state != Pool.State.ACTIVE
            or (pool.budget_total is not None and pool.spent >= pool.budget_total)
        )
        if in_flight == 0 and (len(trials) >= sweep.trials or (waiting and gone)):
            # All trials ended, or none can start again: its pool is closed or its total
            # budget spent (neither comes back), or the next trial would pass its own.
            now = timezone.now()
            Sweep.objects.filter(pk=sweep.pk).update(
                state=Sweep.State.FINISHED, finished_at=now,
                **({"budget_stopped_at": now} if held is not None else {}),
            )  # fmt: skip
            # Once: the sweep's row is locked and was running (its end is the guard).
            _tell_finished(sweep, trials)
            if held is not None:
                _tell_held(sweep, held)
        return started


def _tell_held(sweep: Sweep, held: Text) -> None:
    """A sweep that ended because its next trial would pass its budget: told as a budget
    cancel is (the amounts as billing judged them on `Sweep.budget_hold`, to the cent). It
    ends finished and does not start again."""
    hold = sweep.budget_hold if isinstance(sweep.budget_hold, dict) else {}
    tell_budget_stopped(
        sweep, state=Sweep.State.FINISHED, spent=hold.get("spent"),
        currency=hold.get("currency"),
        words=gettext_noop("Sweep %(sweep)s ended at its budget: %(why)s: %(url)s"), why=held,
    )  # fmt: skip


def tell_budget_stopped(
    sweep: Sweep, *, state: str, spent: str | None, currency: str | None, words: str, why: Text
) -> None:
    """The owner's `sweep.budget_stopped`, the one writer of its data, whichever way the
    sweep ended at its budget: cancelled by billing's watch (billing.budgets.stop_sweep) or
    finished because its next trial would pass it (`_tell_held`). `spent` is "1.00" (to the
    cent); `words` a message with %(sweep)s, %(why)s and %(url)s."""
    url = webhooks.console_link("sweep_detail", sweep.pk)
    webhooks.emit(
        owner_id=sweep.owner_id,
        event_type="sweep.budget_stopped",
        data={
            "sweep": {"id": sweep.pk, "name": sweep.name, "state": state, "url": url},
            "budget": {"budget": f"{sweep.budget:.2f}", "spent": spent, "currency": currency},
        },
        summary=Text(words, sweep=sweep.name, why=why, url=url),
    )


def best_of(sweep: Sweep, trials: list[Trial]) -> Trial | None:
    """The complete trial with the best last value for the sweep's direction, or None."""
    scored = [t for t in trials if t.state == Trial.State.COMPLETE and t.last_value is not None]
    if not scored:
        return None
    pick = min if sweep.direction == Sweep.Direction.MINIMIZE else max
    return pick(scored, key=lambda t: t.last_value)


def _tell_finished(sweep: Sweep, trials: list[Trial]) -> None:
    """The owner's `sweep.finished` event, in the transaction that ends the sweep: its best
    trial (number, parameters, value, its job's link), or that none reported the metric."""
    url = webhooks.console_link("sweep_detail", sweep.pk)
    best = best_of(sweep, trials)
    data = {
        "sweep": {
            "id": sweep.pk, "name": sweep.name, "state": Sweep.State.FINISHED,
            "metric": sweep.metric, "direction": sweep.direction, "trials": len(trials),
            "note": sweep.note, "url": url,
        },
        "best": None,
        "url": url,
    }  # fmt: skip
    summary = Text(
        gettext_noop("Sweep %(sweep)s finished; no trial reported %(metric)s: %(url)s"),
        sweep=sweep.name, metric=sweep.metric, url=url,
    )  # fmt: skip
    if best is not None:
        value = f"{best.last_value:.6g}"
        data["best"] = {
            "trial": best.number, "id": best.pk, "params": best.params,
            "value": best.last_value, "job": best.job_id,
            "url": webhooks.console_link("job_detail", best.job_id) if best.job_id else url,
        }  # fmt: skip
        params = ", ".join(f"{name}={best.params[name]}" for name in best.params)
        summary = Text(
            gettext_noop(
                "Sweep %(sweep)s finished: the best of its %(count)s trials is trial "
                "%(trial)s, %(metric)s = %(value)s with %(params)s: %(url)s"
            ),
            sweep=sweep.name, count=len(trials), trial=best.number, metric=sweep.metric,
            value=value, params=params or "-", url=url,
        )  # fmt: skip
    webhooks.emit(owner_id=sweep.owner_id, event_type="sweep.finished", data=data, summary=summary)


def sweep_cancel(*, sweep: Sweep, reason: Text | None = None) -> Sweep:
    """Cancel a running sweep: no trial starts again, its running trials are cancelled
    (SIGTERM, then SIGKILL). With `reason` (billing's budget stop) that is its note, and its
    trials end with it (`services.job_stop_for`)."""
    with transaction.atomic():
        sweep = Sweep.objects.select_for_update().get(pk=sweep.pk)
        if sweep.state != Sweep.State.RUNNING:
            return sweep
        Sweep.objects.filter(pk=sweep.pk).update(
            state=Sweep.State.CANCELLED, finished_at=timezone.now(),
            **(twin_fields(Sweep, "note", reason) if reason is not None else {}),
        )  # fmt: skip
        for trial in sweep.trial_set.filter(state=Trial.State.RUNNING).select_related("job"):
            if trial.job and not trial.job.is_ended:
                if reason is not None:
                    services.job_stop_for(job=trial.job, reason=reason)
                else:
                    services.job_cancel(job=trial.job, by=Text(gettext_noop("the sweep's owner")))
    sweep.refresh_from_db()
    return sweep


def budget_hold(sweep: Sweep) -> Text | None:
    """Why no trial of `sweep` may start now for its budget (None: it may), as billing last
    judged it (billing.budgets.enforce, each accrual tick, writes `Sweep.budget_hold`: what
    its trials cost so far, with what its running trials are still expected to cost and the
    next trial's expected cost, would pass it). A judgement made against another budget (it
    was changed since) holds nothing: billing judges the new one on its next tick. jobs
    never asks billing (it sits above): the round reads the row it locked."""
    hold = sweep.budget_hold
    if sweep.budget is None or not isinstance(hold, dict) or not hold.get("words"):
        return None
    if hold.get("budget") != str(sweep.budget):
        return None
    words = load(hold["words"])
    return words if isinstance(words, Text) else None


# -- reading the metric, pruning --------------------------------------------------------------


def observe(job_id: int, *, full: bool = False) -> str:
    """Read the trial's new metric lines, report them, prune when the pruner says so.
    `full`: every kept line, not only those after the last one read (at the job's end:
    the numbers start again when Redis lost the log and the stored log is read instead;
    a step already reported is skipped either way)."""
    trial = Trial.objects.filter(job_id=job_id).select_related("sweep", "job").first()
    if trial is None or trial.state != Trial.State.RUNNING:
        return "not a running trial"
    lines = livelogs.lines(trial.job)
    top = max((number for number, _payload in lines), default=0)
    floor = 0 if full or top < trial.log_seq else trial.log_seq
    points, problems, seq = [], [], floor
    last_step = trial.last_step if trial.last_step is not None else -1
    for number, payload in lines:
        if number <= floor:
            continue
        seq = max(seq, number)
        rank, _tab, rest = payload.partition("\t")
        if rank != "0" or MARKER not in rest:
            continue
        text = rest.partition(" ")[2]  # after the timestamp
        try:
            found = parse_metric_line(text, trial.sweep.metric)
        except MetricLineError as exc:
            problems.append((number, str(exc)))
            continue
        if found is None:
            continue
        step, value = found
        if step <= last_step:
            continue  # a step already read (or out of order): the first one counts
        points.append((step, value))
        last_step = step
    if not points and not problems and seq <= trial.log_seq:
        return "nothing new"
    return _report(trial.pk, points, problems, seq)


def _report(trial_id: int, points: list, problems: list, seq: int) -> str:
    with transaction.atomic():
        trial = (
            Trial.objects.select_for_update(of=("self",))
            .select_related("sweep", "job")
            .get(pk=trial_id)
        )
        if trial.state != Trial.State.RUNNING:
            return "ended meanwhile"
        sweep = trial.sweep
        fresh = [(s, v) for s, v in points if trial.last_step is None or s > trial.last_step]
        curve = trial.curve + [[s, v] for s, v in fresh]
        while len(curve) > CURVE_POINTS:
            curve = curve[:1] + curve[1:-1:2] + curve[-1:]
        trial.curve = curve
        trial.log_seq = seq
        if problems:
            number, why = problems[-1]
            _set_trial_note(
                trial,
                Text(
                    gettext_noop("log line %(n)s: %(why)s (the line is shown in the trial's log)"),
                    n=number, why=Text(why),
                ),
            )  # fmt: skip
        pruned_at = None
        if fresh and _settled_by_optuna(trial):
            fresh = []  # told already (a worker that died before this row was saved)
        if fresh:
            study = study_of(sweep)
            handle = optuna.trial.Trial(study, trial.optuna_id)
            better = min if sweep.direction == Sweep.Direction.MINIMIZE else max
            # Every point is on the curve; Optuna gets at most REPORTS_PER_ROUND of a
            # burst (evenly spread, the last always: what the pruner judges), so a trial
            # printing thousands of lines a second is not thousands of writes.
            told = fresh
            if len(fresh) > REPORTS_PER_ROUND:
                every = math.ceil(len(fresh) / REPORTS_PER_ROUND)
                told = fresh[-1::-every][::-1]
            for step, value in told:
                handle.report(value, step)
            for _step, value in fresh:
                trial.best_value = (
                    value if trial.best_value is None else better(trial.best_value, value)
                )
            trial.last_step, trial.last_value = fresh[-1]
            if (
                sweep.pruner != Sweep.Pruner.NONE
                and sweep.state == Sweep.State.RUNNING
                and handle.should_prune()
            ):
                pruned_at = trial.last_step
                study.tell(
                    trial.number, state=optuna.trial.TrialState.PRUNED, skip_if_finished=True
                )
                trial.state = Trial.State.PRUNED
        trial.save()
        if pruned_at is not None and trial.job and not trial.job.is_ended:
            try:
                with transaction.atomic():
                    services.job_cancel(
                        job=trial.job,
                        by=Text(
                            gettext_noop("sweep %(sweep)s's pruner at step %(step)s (%(metric)s %(value)s)"),
                            sweep=sweep.name, step=pruned_at, metric=sweep.metric,
                            value=f"{trial.last_value:.6g}",
                        ),
                    )  # fmt: skip
            except ValidationError:
                pass  # it ended meanwhile: pruned all the same (Optuna has been told)
    if pruned_at is not None:
        advance(sweep.pk)  # the next trial waits for the cluster the pruned one frees
        return f"pruned at step {pruned_at}"
    return f"{len(fresh)} points"


def job_ended(job_id: int) -> str:
    """A trial's job ended: its last lines, then complete (its last value) or failed, and
    the next trial."""
    trial = Trial.objects.filter(job_id=job_id).select_related("sweep", "job").first()
    if trial is None:
        return "not a trial"
    if trial.state == Trial.State.RUNNING:
        observe(job_id, full=True)
    with transaction.atomic():
        trial = (
            Trial.objects.select_for_update(of=("self",))
            .select_related("sweep", "job")
            .get(pk=trial.pk)
        )
        told = _settled_by_optuna(trial) if trial.state == Trial.State.RUNNING else None
        if told is not None:
            trial.state = told
            trial.save()
        elif trial.state == Trial.State.RUNNING:
            study = study_of(trial.sweep)
            if trial.job.state == Job.State.SUCCEEDED and trial.last_value is not None:
                study.tell(trial.number, trial.last_value, skip_if_finished=True)
                trial.state = Trial.State.COMPLETE
            elif trial.sweep.state == Sweep.State.CANCELLED:
                study.tell(trial.number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
                trial.state = Trial.State.CANCELLED
                _set_trial_note(trial, Text(gettext_noop("stopped with its sweep")))
            else:
                study.tell(trial.number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
                trial.state = Trial.State.FAILED
                if not trial.note:
                    _set_trial_note(
                        trial,
                        Text(
                            gettext_noop(
                                "the trial's job ended (%(state)s) without printing its metric"
                            )
                            if trial.last_value is None
                            else gettext_noop("the trial's job ended (%(state)s)"),
                            state=Text(trial.job.state),
                        ),
                    )
            trial.save()
    advance(trial.sweep_id)
    return trial.state


_FROM_OPTUNA = {
    optuna.trial.TrialState.COMPLETE: Trial.State.COMPLETE,
    optuna.trial.TrialState.PRUNED: Trial.State.PRUNED,
    optuna.trial.TrialState.FAIL: Trial.State.FAILED,
}


def _settled_by_optuna(trial: Trial) -> str | None:
    """The trial's state when Optuna has it finished (its storage commits on its own
    connection, so a rollback or a crash here can leave our row behind it); else None."""
    state = storage().get_trial(trial.optuna_id).state
    return _FROM_OPTUNA.get(state)


def _lost(trial: Trial) -> None:
    try:
        study_of(trial.sweep).tell(
            trial.number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True
        )
    except KeyError:
        pass  # the study itself is gone
    _set_trial_note(trial, Text(gettext_noop("its job was deleted")))
    trial.state = Trial.State.FAILED
    trial.save(update_fields=["state", "note", "note_text"])


def _set_trial_note(trial: Trial, note: Text) -> None:
    """Set the (unsaved) trial's note and its twin, cut to what the field keeps."""
    for field, value in twin_fields(Trial, "note", note).items():
        setattr(trial, field, value)


def tick() -> int:
    """Cron, the safety net: every running trial's new lines (or its end, missed), then
    each sweep's next."""
    n = 0
    for trial in Trial.objects.filter(state=Trial.State.RUNNING).select_related("job"):
        if trial.job is None:
            _lost(trial)  # its job was deleted (by an operator): the trial failed
            continue
        try:
            if trial.job.is_ended:
                job_ended(trial.job_id)
            else:
                observe(trial.job_id)
        except Exception:  # one trial's trouble must not stop the others' rounds
            log.exception("sweep trial %s: not read", trial.pk)
        n += 1
    for sweep_id in Sweep.objects.filter(state=Sweep.State.RUNNING).values_list("pk", flat=True):
        try:
            advance(sweep_id)
        except Exception:
            log.exception("sweep %s: not advanced", sweep_id)
    return n


# -- figures for the page ---------------------------------------------------------------------


@dataclass
class TrialFigures:
    trial: Trial
    seconds: float  # run so far (or in all)
    full_seconds: float  # to its end (estimated for a pruned trial)
    cost: Decimal | None


@dataclass
class SweepFigures:
    trials: list[TrialFigures]
    best: Trial | None
    full_steps: int | None
    used_seconds: float
    full_seconds: float
    units: int  # GPUs per trial (nodes for a CPU-only pool)
    unit_word: str  # "GPU" or "node"
    used_cost: Decimal | None
    saved_cost: Decimal | None

    @property
    def saved_seconds(self) -> float:
        return max(self.full_seconds - self.used_seconds, 0.0)

    @property
    def used_unit_seconds(self) -> float:
        return self.used_seconds * self.units

    @property
    def full_unit_seconds(self) -> float:
        return self.full_seconds * self.units

    @property
    def saved_unit_seconds(self) -> float:
        return self.saved_seconds * self.units

    @property
    def saved_share(self) -> float:
        return self.saved_seconds / self.full_seconds if self.full_seconds else 0.0

    def priced(self, costs: dict[int, Decimal | None]) -> SweepFigures:
        """These figures with each trial's cost as billing prices its job's runs so far
        (`costs`: job id -> amount, billing.estimates.costs_so_far), instead of the pool's
        price per hour over its last attempt: the sweep page, its projection and its budget
        then say one amount. What pruning saved is at the sweep's mean price a second."""
        for f in self.trials:
            f.cost = costs.get(f.trial.job_id) if f.trial.job_id else None
        known = [f.cost for f in self.trials if f.cost is not None]
        self.used_cost = _cent(sum(known, Decimal(0))) if known else None
        self.saved_cost = None
        if self.used_cost is not None and self.used_seconds > 0:
            per_s = sum(known, Decimal(0)) / Decimal(str(round(self.used_seconds, 3)))
            self.saved_cost = _cent(per_s * Decimal(str(round(self.saved_seconds, 3))))
        return self


def _cent(amount: Decimal) -> Decimal:
    return amount.quantize(Decimal("0.01"))


def _seconds(job: Job | None, now) -> float:
    if job is None or job.started_at is None:
        return 0.0
    end = job.finished_at or now
    return max((end - job.started_at).total_seconds(), 0.0)


def figures(sweep: Sweep, *, now=None, curves: bool = True) -> SweepFigures:
    """What each trial ran and would have run, and what pruning saved: a pruned trial's
    full length is its seconds per step times the steps of the longest trial that ran to
    its end."""
    now = now or timezone.now()
    trials = sweep.trial_set.select_related("job__cluster")
    trials = list(trials if curves else trials.defer("curve"))  # a list page needs none
    ended = [t for t in trials if t.state == Trial.State.COMPLETE and t.last_step]
    full_steps = max((t.last_step for t in ended), default=None)
    rate = sweep.pool.rate_per_hour
    pool = sweep.pool
    units = pool.total_gpus or pool.nodes
    out = []
    for t in trials:
        seconds = _seconds(t.job, now)
        full = seconds
        if (
            t.state == Trial.State.PRUNED
            and full_steps
            and t.last_step
            and t.last_step < full_steps
        ):
            full = seconds * full_steps / t.last_step
        cost = (
            None
            if rate is None
            else (rate * Decimal(str(round(seconds, 3))) / 3600).quantize(Decimal("0.0001"))
        )
        out.append(TrialFigures(trial=t, seconds=seconds, full_seconds=full, cost=cost))
    best = best_of(sweep, trials)
    used = sum(f.seconds for f in out)
    full = sum(f.full_seconds for f in out)
    used_cost = saved_cost = None
    if rate is not None:
        used_cost = (rate * Decimal(str(round(used, 3))) / 3600).quantize(Decimal("0.01"))
        saved_cost = (rate * Decimal(str(round(max(full - used, 0), 3))) / 3600).quantize(
            Decimal("0.01")
        )
    return SweepFigures(
        trials=out, best=best, full_steps=full_steps, used_seconds=used, full_seconds=full,
        units=units, unit_word="GPU" if pool.total_gpus else "node",
        used_cost=used_cost, saved_cost=saved_cost,
    )  # fmt: skip
