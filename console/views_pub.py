"""The public datasets and models page: what an operator published (jobs/files/pub.py), listed for
every signed-in researcher, with how to get it at /pub. Nothing unpublished is shown; the
operators publish in the admin (jobs.publish_publicdataset) or with
`manage.py publish_dataset`."""

from django.contrib.auth.decorators import login_required
from django.shortcuts import render

from jobs.files import pub


@login_required
def public_data(request):
    return render(
        request, "console/public_data.html", {"datasets": pub.published(), "target": pub.TARGET}
    )
