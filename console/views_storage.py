"""The storage page: a researcher's usage against their quota, its free and bought parts,
what the bought part costs, and the form that buys more or gives some back.

It only ever shows and changes the signed-in researcher's own storage: no id is read from
the URL or the form, so there is nothing of another researcher's to guess. Writes go
through billing/storage.py (`quota_set`, which checks the balance and the usage and writes
the filesystem's quota); reads too (`summary`). Acting for a team, it is the team's storage
(request.actor's principal): every member sees it, its admins and owner change the quota."""

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.shortcuts import redirect, render
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy

from billing import selectors as money
from billing import storage as bought
from jobs.files import storage
from jobs.tenancy.actors import Role


class StorageForm(forms.Form):
    # Text, not IntegerField: the service says what is wrong with "-5", "2.5" or "lots" in
    # one place for the page and any other caller.
    extra_gb = forms.CharField(
        label=gettext_lazy("GB bought above the free part"),
        max_length=20,
        widget=forms.TextInput(attrs={"inputmode": "numeric", "autocomplete": "off"}),
    )


@login_required
def storage_page(request):
    user = request.actor.principal
    form = StorageForm(request.POST or None)
    if request.method == "POST":
        request.actor.require(Role.ADMIN)
    if request.method == "POST" and form.is_valid():
        try:
            grant = bought.quota_set(
                owner=user, extra_gb=form.cleaned_data["extra_gb"], by=request.actor.person
            )
        except ValidationError as exc:
            form.add_error("extra_gb", exc)
        else:
            if grant is None:
                messages.info(request, _("Your quota is already that."))
            else:
                messages.success(
                    request,
                    _(
                        "Your quota is now %(quota)s GB: the free %(free)s GB and %(extra)s GB bought."
                    )
                    % {
                        "quota": storage.free_gb() + grant.extra_gb,
                        "free": storage.free_gb(),
                        "extra": grant.extra_gb,
                    },
                )
            return redirect("storage")
    summary = bought.summary(user)
    if not form.is_bound:
        form = StorageForm(initial={"extra_gb": summary.extra_gb})
    return render(
        request,
        "console/storage.html",
        {"summary": summary, "form": form, "standing": money.standing(user)},
    )
