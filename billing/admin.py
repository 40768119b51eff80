"""Operators' money tools: the rate card (versioned; past versions read-only), accounts
with top-up / refund / adjustment (each entry records who and why), the ledger (read-only).

Posting an entry needs the custom permission `billing.post_ledgerentry` ("Can post
top-ups, refunds and adjustments"; Django's `add_ledgerentry` is not used, the ledger is
never edited as rows): seeing an account ("Can view account") shows its entries only."""

import uuid

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied, ValidationError
from django.shortcuts import get_object_or_404, redirect
from django.urls import path, reverse
from django.utils import timezone
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy

from billing import formatting, services
from billing.models import Account, LedgerEntry, Meter, Price, RateCard
from jobs.admin import EstimatedCountPaginator, ReadOnlyAdmin


class PriceInline(admin.TabularInline):
    model = Price
    extra = 0

    def has_change_permission(self, request, obj=None):
        return not (obj and obj.in_force_or_past) and super().has_change_permission(request, obj)

    has_add_permission = has_change_permission
    has_delete_permission = has_change_permission


@admin.register(RateCard)
class RateCardAdmin(admin.ModelAdmin):
    """A card that has taken effect is history: change prices with "Save as new" and a
    later effective-from time. That goes for the per node-hour prices of a stopped GPU
    cluster too (started without GPUs; its kept workspaces, 0 for free): each version keeps
    its own, so every past second keeps the price it was charged at."""

    list_display = [
        "effective_from",
        "currency",
        "spot_discount_pct",
        "min_charge_s",
        "no_gpu_per_hour",
        "stopped_per_hour",
        "storage_per_gb_hour",
        "in_force",
        "note",
    ]
    inlines = [PriceInline]
    save_as = True
    readonly_fields = ["created_by", "created_at"]

    @admin.display(boolean=True, description=gettext_lazy("in force now"))
    def in_force(self, card):
        current = RateCard.objects.filter(effective_from__lte=timezone.now()).first()
        return current is not None and current.pk == card.pk

    def has_change_permission(self, request, obj=None):
        if obj is not None and obj.in_force_or_past and "_saveasnew" not in request.POST:
            return False
        return super().has_change_permission(request, obj)

    def has_delete_permission(self, request, obj=None):
        return not (obj and obj.in_force_or_past) and super().has_delete_permission(request, obj)

    def save_model(self, request, obj, form, change):
        if not change or "_saveasnew" in request.POST:
            obj.created_by = request.user
            obj.created_at = timezone.now()
            if obj.effective_from < timezone.now():
                obj.effective_from = timezone.now()  # never rewrite seconds already billed
        super().save_model(request, obj, form, change)


class EntryForm(forms.Form):
    kind = forms.ChoiceField(
        label=gettext_lazy("Kind"),
        choices=[(k, LedgerEntry.Kind(k).label) for k in services.OPERATOR_KINDS],
    )
    amount = forms.DecimalField(
        label=gettext_lazy("Amount"),
        max_digits=18,
        decimal_places=4,
        help_text=gettext_lazy("Positive adds money; an adjustment may be negative."),
    )
    memo = forms.CharField(
        label=gettext_lazy("Reason"),
        max_length=300,
        help_text=gettext_lazy("Kept with the entry, e.g. invoice 2026-117."),
        widget=forms.TextInput(attrs={"class": "vTextField", "style": "width: 32em"}),
    )
    token = forms.CharField(widget=forms.HiddenInput)


@admin.register(Account)
class AccountAdmin(admin.ModelAdmin):
    list_display = ["holder", "balance", "exhausted_at"]
    # A team's account is found and labelled by the team's name (its principal's login is
    # a random "team.…" nobody knows).
    search_fields = ["user__username", "user__email", "user__team__name"]
    list_select_related = ["user__team"]
    readonly_fields = ["user", "balance", "exhausted_at"]
    change_form_template = "admin/billing/account/change_form.html"

    def has_add_permission(self, request):
        return False  # every user has one: made at sign-up, or here for users made otherwise

    def changelist_view(self, request, extra_context=None):
        # Users made in the admin or by createsuperuser get theirs here, so that any user
        # can be found and topped up.
        services.accounts_ensure()
        return super().changelist_view(request, extra_context)

    def has_delete_permission(self, request, obj=None):
        return False

    def get_urls(self):
        return [
            path(
                "<int:account_id>/entry/",
                self.admin_site.admin_view(self.post_entry_view),
                name="billing_account_entry",
            ),
            *super().get_urls(),
        ]

    @admin.display(description=gettext_lazy("account of"), ordering="user__username")
    def holder(self, account):
        return account.holder

    @staticmethod
    def may_post(request) -> bool:
        return request.user.has_perm("billing.post_ledgerentry")

    def change_view(self, request, object_id, form_url="", extra_context=None):
        extra_context = extra_context or {}
        extra_context["entry_form"] = (
            EntryForm(initial={"token": uuid.uuid4().hex, "kind": "topup"})
            if self.may_post(request)
            else None
        )
        extra_context["entries"] = LedgerEntry.objects.filter(account_id=object_id).select_related(
            "created_by", "cluster"
        )[:20]
        return super().change_view(request, object_id, form_url, extra_context)

    def post_entry_view(self, request, account_id: int):
        account = get_object_or_404(Account, pk=account_id)
        back = reverse("admin:billing_account_change", args=[account.pk])
        if request.method != "POST":
            return redirect(back)
        if not (self.has_view_permission(request, account) and self.may_post(request)):
            raise PermissionDenied(_("Posting ledger entries needs billing.post_ledgerentry."))
        form = EntryForm(request.POST)
        if not form.is_valid():
            messages.error(
                request,
                "; ".join(
                    _("%(field)s: %(errors)s")
                    % {
                        "field": form.fields[k].label if k in form.fields else k,
                        "errors": " ".join(v),
                    }
                    for k, v in form.errors.items()
                ),
            )
            return redirect(back)
        d = form.cleaned_data
        try:
            # The form's one-time token is the key: a double submit posts once.
            entry = services.post_entry(
                account=account, kind=d["kind"], amount=d["amount"],
                key=f"op:{d['token']}", by=request.user, memo=d["memo"],
            )  # fmt: skip
        except ValidationError as exc:
            messages.error(request, " ".join(exc.messages))
            return redirect(back)
        messages.success(
            request,
            _("%(kind)s of %(amount)s: balance now %(balance)s.")
            % {
                "kind": entry.get_kind_display(),
                "amount": entry.amount,
                "balance": entry.balance_after,
            },
        )
        return redirect(back)


@admin.register(LedgerEntry)
class LedgerEntryAdmin(ReadOnlyAdmin):
    list_display = [
        "created_at",
        "account",
        "kind",
        "amount",
        "balance_after",
        "cluster",
        "units",
        "rate_per_hour",
        "created_by",
        "memo",
    ]
    list_filter = ["kind"]

    @admin.display(description=gettext_lazy("rate per unit-hour"), ordering="rate")
    def rate_per_hour(self, entry):
        return formatting.text(formatting.rate(entry.rate))

    search_fields = ["account__user__username", "account__user__team__name", "key", "memo"]
    list_select_related = ["account__user__team", "cluster", "created_by"]
    # A million rows: no second COUNT(*) for "N total", and the pages' count from
    # PostgreSQL's statistics while the list is unfiltered.
    show_full_result_count = False
    paginator = EstimatedCountPaginator


@admin.register(Meter)
class MeterAdmin(ReadOnlyAdmin):
    list_display = ["cluster", "account", "billed_until", "charged", "settled"]
    list_filter = ["settled"]
