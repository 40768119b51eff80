"""The sweep form (issue 26): one command, its search space, the metric it prints and the
early-stopping rule, on one of the researcher's active pools. The rules of the space and
the metric are jobs/pools/sweeps.py's (`parse_space`, `validate_metric`), so the page and the
API refuse the same things with the same sentences."""

import json

from django import forms
from django.conf import settings
from django.core.exceptions import ValidationError
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy

from console.forms import BUDGET_HELP, BudgetField
from jobs.base import validators
from jobs.files import storage
from jobs.models import Pool, Sweep
from jobs.pools import sweeps

EXAMPLE_SPACE = (
    "lr: log_uniform 1e-5 1e-1\nlayers: int 1 8\ndropout: uniform 0 0.5\nopt: categorical adam sgd"
)


class SweepForm(forms.Form):
    name = forms.CharField(max_length=100, initial="sweep", label=gettext_lazy("Name"))
    pool = forms.ModelChoiceField(
        queryset=Pool.objects.none(),
        label=gettext_lazy("Pool"),
        empty_label=None,
        help_text=gettext_lazy("Every trial is a job on this pool; it adds clusters for them."),
    )
    command = forms.CharField(
        label=gettext_lazy("Command"),
        widget=forms.Textarea(
            attrs={"rows": 3, "spellcheck": "false", "placeholder": "python train.py"}
        ),
        help_text=gettext_lazy("Run by the container's shell, once per trial."),
    )
    env = forms.CharField(
        label=gettext_lazy("Environment"),
        required=False,
        widget=forms.Textarea(
            attrs={"rows": 2, "spellcheck": "false", "placeholder": "EPOCHS=20\nWANDB_MODE=offline"}
        ),
        help_text=gettext_lazy("KEY=VALUE, one per line; the same for every trial."),
    )
    workdir = forms.CharField(
        label=gettext_lazy("Working directory"), initial="/workspace", max_length=255
    )
    space = forms.CharField(
        label=gettext_lazy("Search space"),
        initial=EXAMPLE_SPACE,
        widget=forms.Textarea(attrs={"rows": 5, "spellcheck": "false"}),
        help_text=gettext_lazy(
            "One parameter a line: name: uniform LOW HIGH, name: log_uniform LOW HIGH (above 0), "
            "name: int LOW HIGH, or name: categorical A B C. Lines starting with # are skipped; "
            "a JSON list of objects works too."
        ),
    )
    metric = forms.CharField(
        label=gettext_lazy("Metric"),
        max_length=64,
        initial="val_loss",
        help_text=gettext_lazy("The name of the number each trial prints, e.g. val_loss."),
    )
    direction = forms.ChoiceField(
        label=gettext_lazy("Direction"),
        choices=Sweep.Direction.choices,
        initial=Sweep.Direction.MINIMIZE,
        widget=forms.RadioSelect,
    )
    trials = forms.IntegerField(
        label=gettext_lazy("Number of trials"), initial=20, min_value=1, max_value=sweeps.MAX_TRIALS
    )
    parallel = forms.IntegerField(
        label=gettext_lazy("Trials at a time"),
        initial=2,
        min_value=1,
        max_value=sweeps.MAX_TRIALS,
        help_text=gettext_lazy("At most this many trials run at once, each on its own cluster."),
    )
    pruner = forms.ChoiceField(
        label=gettext_lazy("Early stopping"),
        choices=Sweep.Pruner.choices,
        initial=Sweep.Pruner.ASHA,
        widget=forms.RadioSelect,
    )
    min_steps = forms.IntegerField(
        label=gettext_lazy("Minimum steps before pruning"),
        initial=1,
        min_value=1,
        max_value=2**31 - 1,
        help_text=gettext_lazy(
            "Every trial runs at least this many steps before it may be stopped."
        ),
    )
    budget = BudgetField(help_text=BUDGET_HELP["sweep"])

    def __init__(self, *args, owner, **kwargs):
        super().__init__(*args, **kwargs)
        self.owner = owner
        # Only the researcher's own active pools: another's id is "not one of the choices".
        self.fields["pool"].queryset = Pool.objects.filter(
            owner=owner, state=Pool.State.ACTIVE
        ).order_by("name", "id")

    def clean_command(self):
        text = self.cleaned_data["command"].replace("\r\n", "\n").strip()
        limit = settings.SUANLI_JOB_COMMAND_MAX
        if len(text) > limit:
            raise ValidationError(
                _(
                    "The command is %(length)s characters; at most %(limit)s. Put long scripts in "
                    "a file on a volume."
                )
                % {"length": f"{len(text):,}", "limit": f"{limit:,}"}
            )
        if "\x00" in text:
            raise ValidationError(_("The command may not contain NUL characters."))
        return text

    def clean_env(self):
        return validators.parse_env(self.cleaned_data.get("env", ""))

    def clean_workdir(self):
        return storage.validate_target(self.cleaned_data["workdir"], allow_system=True)

    def clean_space(self):
        return sweeps.parse_space(self.cleaned_data["space"])

    def clean_metric(self):
        return sweeps.validate_metric(self.cleaned_data["metric"])

    def clean(self):
        data = super().clean()
        trials, parallel = data.get("trials"), data.get("parallel")
        if trials and parallel and parallel > trials:
            self.add_error(
                "parallel",
                _("The trials at a time must be between 1 and the number of trials."),
            )
        return data

    def spec(self) -> sweeps.SweepSpec:
        d = self.cleaned_data
        return sweeps.SweepSpec(
            name=d["name"],
            command=d["command"],
            space=d["space"],
            metric=d["metric"],
            direction=d["direction"],
            trials=d["trials"],
            parallel=d["parallel"],
            pruner=d["pruner"],
            min_steps=d["min_steps"],
            env=d["env"],
            workdir=d["workdir"],
            budget=d.get("budget"),
        )


def space_field_text(value) -> str:
    """The API's `space` as the form's text: a JSON list stays JSON, lines stay lines."""
    if isinstance(value, list | dict):
        return json.dumps(value)
    return "" if value is None else str(value)
