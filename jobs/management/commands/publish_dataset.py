"""`publish_dataset NAME SRC`: copy a local folder in as a public dataset or model and
publish it (jobs/files/pub.py): read-only at /pub/NAME in every cluster that asks for /pub.

Run it where the console runs (the researchers' filesystem is mounted at
SUANLI_STORAGE_ROOT there). The files are copied into the draft folder first, with the
progress printed, and appear under /pub in one step at the end, never half-copied.
`--draft` stops before publishing (publish it later in the admin); `--unpublish NAME`
takes one off /pub again.

Layer: management, the top of jobs/ (beside tasks, admin and apps); uses files (pub) and
models.
"""

from pathlib import Path

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError
from django.template.defaultfilters import filesizeformat

from jobs.files import pub
from jobs.models import PublicDataset


class Command(BaseCommand):
    help = "Copy a local folder in as a public dataset or model, and publish it at /pub/NAME."

    def add_arguments(self, parser):
        parser.add_argument("name", help="its folder under /pub, e.g. imagenet-1k")
        parser.add_argument("src", nargs="?", help="the local folder to copy in")
        parser.add_argument(
            "--kind", choices=[k.value for k in PublicDataset.Kind], default="dataset"
        )
        parser.add_argument("--description", default="", help="what researchers read about it")
        parser.add_argument(
            "--draft", action="store_true", help="copy it in, but do not publish it yet"
        )
        parser.add_argument(
            "--unpublish", action="store_true", help="take NAME off /pub (its files are kept)"
        )

    def handle(self, *args, **opts):
        name = opts["name"]
        try:
            if opts["unpublish"]:
                self._unpublish(name)
                return
            if not opts["src"]:
                raise CommandError("Give the folder to copy in: publish_dataset NAME SRC.")
            dataset = PublicDataset.objects.filter(name=name).first()
            if dataset is None:
                dataset = pub.dataset_create(
                    name=name, kind=opts["kind"], description=opts["description"]
                )
            elif opts["description"]:
                dataset.description = opts["description"]
                dataset.save(update_fields=["description"])
            pub.copy_in(Path(opts["src"]), dataset, report=self._progress)
            self.stdout.write("")
            if opts["draft"]:
                self.stdout.write(
                    f"Copied into {pub.folder(dataset)}; not published yet (the admin's "
                    "Publish, or run this again without --draft)."
                )
                return
            dataset = pub.dataset_publish(dataset=dataset)
        except ValidationError as exc:
            raise CommandError(" ".join(exc.messages)) from exc
        self.stdout.write(
            self.style.SUCCESS(
                f"Published {dataset.name}: {filesizeformat(dataset.size_bytes)} in "
                f"{dataset.file_count} files, read-only at {pub.TARGET}/{dataset.name} for "
                "clusters that ask for /pub."
            )
        )

    def _unpublish(self, name: str) -> None:
        dataset = PublicDataset.objects.filter(name=name).first()
        if dataset is None:
            raise CommandError(f"No public dataset or model named {name!r}.")
        dataset = pub.dataset_unpublish(dataset=dataset)
        self.stdout.write(f"Unpublished {name}: its files are in {pub.folder(dataset)}.")

    def _progress(self, p: pub.Progress) -> None:
        share = 100 * p.done_bytes // p.total_bytes if p.total_bytes else 100
        self.stdout.write(
            f"\rcopied {filesizeformat(p.done_bytes)} of {filesizeformat(p.total_bytes)} "
            f"({share} %), {p.done_files} of {p.total_files} files",
            ending="",
        )
        self.stdout.flush()
