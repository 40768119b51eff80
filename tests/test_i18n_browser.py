"""A researcher whose browser asks for Chinese works in Chinese, from the login to the
bill, and the English they switch to in the navigation stays across pages and sign-ins.
Through Debian's Chromium with the `zh-CN` locale."""

import os
import re

import pytest
from browsing import login
from django.urls import reverse
from django.utils import translation
from django.utils.translation import gettext
from playwright.sync_api import expect

from jobs.models import Cluster, Job

pytestmark = [
    pytest.mark.browser,
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("priced"),
]

HAN = re.compile(r"[\u4e00-\u9fff]")
# Words that give an English sentence away; none belongs on a Chinese page outside code,
# logs and names. Lower case or capitalised: "FROM" is Dockerfile, not English.
_WORDS = (
    "the your is are was and with from of for to this its no not on in at by that when it has"
    " have will can or as an than after before only all"
).split()
ENGLISH = re.compile(r"\b(" + "|".join(_WORDS + [w.capitalize() for w in _WORDS]) + r")\b")


@pytest.fixture
def zh_page(browser):
    context = browser.new_context(
        viewport={"width": 1366, "height": 800}, locale="zh-CN", timezone_id="Asia/Shanghai"
    )
    page = context.new_page()
    yield page
    context.close()


def _shot(page, name):
    page.screenshot(path=os.path.join(os.environ.get("SUANLI_SCREENSHOTS", "/tmp"), name),
                    full_page=True)  # fmt: skip


def _reads_chinese(page):
    """The page's words are Chinese (code, logs, inputs and names aside) and nothing sticks
    out of the page sideways."""
    text = page.evaluate(
        """() => {
          const body = document.body.cloneNode(true);
          body.querySelectorAll('code, pre, kbd, samp, script, style, select, textarea, input,'
            + ' [translate=no], .js-plotly-plot').forEach((e) => e.remove());
          return body.innerText;
        }"""
    )
    assert HAN.search(text), text[:500]
    english = sorted({m.group(0).lower() for m in ENGLISH.finditer(text)})
    assert not english, f"English words {english} on {page.url}:\n{text[:3000]}"
    overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 0, f"{page.url} is {overflow}px wider than the window"


def test_a_chinese_researcher_works_in_chinese_and_english_sticks_once_chosen(
    zh_page, live_server, alice, make_host, storage_root, rq_worker, settle_until
):
    page = zh_page
    make_host("gpu-a-01", engine=0, zone="zone-a", gpus=8, check="reuse")
    with translation.override("zh-hans"):
        running = str(Cluster.State.RUNNING.label)
        succeeded = str(Job.State.SUCCEEDED.label)
        billing = gettext("Billing")
    assert HAN.search(running) and HAN.search(succeeded)

    page.goto(f"{live_server.url}/login/")
    expect(page.locator("h1")).to_have_text("登录算力")
    login(page, live_server, "alice", "alice-pass-123")
    expect(page.locator("html")).to_have_attribute("lang", "zh-CN")
    expect(page.locator(".mainnav")).to_contain_text("集群")
    _reads_chinese(page)
    _shot(page, "zh_dashboard.png")

    # The cluster form, with a relative container path: the error is Chinese.
    page.goto(f"{live_server.url}/clusters/new/")
    page.fill("#id_name", "zh-run")
    page.select_option("#id_resource", "gpu:a100-80gb")
    page.fill("#id_nodes", "1")
    page.fill("#id_gpus_per_node", "1")
    page.fill("#id_volumes", "datasets:./data")
    page.locator("form.cluster-form button[type=submit]").click()
    error = page.locator("#field-volumes .errorlist")
    expect(error).to_contain_text("/workspace/data")
    expect(error).to_have_text(HAN)
    _reads_chinese(page)
    _shot(page, "zh_cluster_form_error.png")

    page.fill("#id_volumes", "datasets:/workspace/data")
    page.locator("form.cluster-form button[type=submit]").click()
    expect(page.get_by_test_id("cluster-state")).to_have_text(running, timeout=20_000)
    cluster = Cluster.objects.get(name="zh-run")
    _reads_chinese(page)
    _shot(page, "zh_cluster.png")

    # A job, followed to its end on its page.
    page.goto(f"{live_server.url}/clusters/{cluster.pk}/jobs/new/")
    page.fill("#id_name", "hello")
    page.fill("#id_command", "echo hello from rank $RANK")
    page.locator("form.card button[type=submit]").click()
    expect(page.get_by_test_id("job-state")).not_to_have_text("", timeout=10_000)
    settle_until(Job.objects.get(name="hello"))  # what the watch process does
    expect(page.get_by_test_id("job-state")).to_have_text(succeeded, timeout=30_000)
    expect(page.locator("body")).to_contain_text("hello from rank 0")
    _reads_chinese(page)
    _shot(page, "zh_job.png")

    page.goto(f"{live_server.url}/billing/")
    expect(page.locator("h1")).to_have_text(billing)
    expect(page.locator("body")).to_contain_text("余额")
    expect(page.locator("body")).to_contain_text("¥")
    _reads_chinese(page)
    _shot(page, "zh_billing.png")

    # English, chosen in the navigation: on every page after, and after signing in again.
    page.get_by_test_id("language-switch").click()
    expect(page.locator("html")).to_have_attribute("lang", "en")
    expect(page.locator("h1")).to_contain_text("Billing")
    page.goto(f"{live_server.url}/clusters/")
    expect(page.locator(".mainnav")).to_contain_text("Clusters")
    page.locator(".account form:not(.langswitch) button").click()  # log out
    expect(page.locator("html")).to_have_attribute("lang", "en")  # the cookie, signed out
    page.context.clear_cookies()  # a new browser: only the saved choice is left
    login(page, live_server, "alice", "alice-pass-123")
    expect(page.locator("html")).to_have_attribute("lang", "en")
    expect(page.get_by_test_id("language-switch")).to_have_text("中文")
    _shot(page, "en_after_login.png")


@pytest.mark.parametrize("who", ["researcher", "operator"])
def test_every_page_of_the_console_reads_chinese(
    zh_page, live_server, alice, operator, make_host, make_cluster, who
):
    """Each page a researcher or an operator reaches from the navigation, with something on
    it: Chinese words only, nothing wider than the window."""
    make_host("gpu-a-01", engine=0, zone="zone-a", gpus=8, check="reuse")
    cluster = make_cluster(alice, "zh-pages")
    user, password = (
        ("alice", "alice-pass-123") if who == "researcher" else ("olga", "olga-pass-123")
    )
    login(zh_page, live_server, user, password)
    names = ["dashboard", "cluster_list", "cluster_new", "image_list", "ssh_keys", "billing",
             "billing_detail", "webhooks", "api_tokens", "account_settings"]  # fmt: skip
    if who == "operator":
        names += ["ops_hosts", "ops_fleet", "ops_queue", "ops_billing"]
    else:
        names += [("cluster_detail", cluster.pk)]
    for name in names:
        name, *args = name if isinstance(name, tuple) else (name,)
        zh_page.goto(live_server.url + reverse(name, args=args))
        zh_page.wait_for_load_state("networkidle")
        _reads_chinese(zh_page)
        _shot(zh_page, f"zh_{who}_{name}.png")
