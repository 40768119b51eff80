"""The operator's host form (the admin's).

Layer: hosts; uses models only.
"""

from django import forms
from django.utils.translation import gettext as _

from jobs.models import Host


class HostForm(forms.ModelForm):
    """The operator's host form. The stored private key is never shown again; leaving
    the field empty on an existing host keeps it."""

    class Meta:
        model = Host
        fields = [
            "name",
            "engine_url",
            "address",
            "zone",
            "gpu_model",
            "gpu_count",
            "rdma",
            "build_host",
            "tls_ca",
            "tls_cert",
            "tls_key",
        ]
        widgets = {
            "tls_ca": forms.Textarea(
                attrs={"rows": 4, "placeholder": "-----BEGIN CERTIFICATE-----"}
            ),
            "tls_cert": forms.Textarea(
                attrs={"rows": 4, "placeholder": "-----BEGIN CERTIFICATE-----"}
            ),
            "tls_key": forms.Textarea(attrs={"rows": 4}),
        }

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._stored_key = self.instance.tls_key if self.instance.pk else ""
        self.initial["tls_key"] = ""
        self.fields["gpu_count"].widget.attrs.update({"min": 0, "max": 16})
        if self._stored_key:
            self.fields["tls_key"].help_text = _(
                "A key is stored. Leave empty to keep it; paste a new one to replace it."
            )

    def clean_tls_key(self) -> str:
        return self.cleaned_data.get("tls_key") or self._stored_key
