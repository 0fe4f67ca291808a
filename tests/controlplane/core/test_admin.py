from __future__ import annotations

import pytest
from django.contrib import admin
from django.test import Client
from django.urls import reverse

from controlplane.benchmarks.models import BenchmarkRun
from controlplane.deployments.models import Deployment


@pytest.fixture
def browser(admin_user) -> Client:
    client = Client()
    client.force_login(admin_user)
    return client


def test_every_registered_model_has_working_changelist_and_add_pages(
    browser, make_deployment
) -> None:
    make_deployment()
    failures = []
    for model in admin.site._registry:
        opts = model._meta
        pages = [
            reverse(f"admin:{opts.app_label}_{opts.model_name}_changelist"),
            reverse(f"admin:{opts.app_label}_{opts.model_name}_add"),  # 403 where adding is off
        ]
        for url in pages:
            status = browser.get(url).status_code
            if status not in (200, 403):
                failures.append(f"{url}: {status}")
        first = model.objects.first()
        if first is not None:
            url = reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[first.pk])
            if browser.get(url).status_code != 200:
                failures.append(f"{url}: {browser.get(url).status_code}")
    assert not failures, failures


def test_admin_actions_queue_work_after_commit(
    browser, make_deployment, django_capture_on_commit_callbacks
) -> None:
    deployment = make_deployment()
    url = reverse("admin:deployments_deployment_changelist")
    with django_capture_on_commit_callbacks() as callbacks:
        browser.post(url, {"action": "deploy", "_selected_action": [deployment.pk]})
    assert Deployment.objects.get(pk=deployment.pk).state == "deploying"
    assert len(callbacks) == 1  # the workflow task, queued only once the row committed
    with django_capture_on_commit_callbacks() as callbacks:
        browser.post(url, {"action": "run_benchmark", "_selected_action": [deployment.pk]})
    run = BenchmarkRun.objects.get(deployment=deployment)
    # The same defaults as the dashboard's form: a run that ends in about a minute.
    assert (run.scenario.name, run.mode) == ("short", "hetero")
    assert (run.concurrency, run.iterations) == ([1, 2, 4, 8], 8)
    assert len(callbacks) == 1


def test_node_list_query_count_is_pinned(
    admin_client, make_node, django_assert_num_queries
) -> None:
    for _ in range(5):
        make_node()
    # Count, page of nodes, then one query each for topology-prefetches (numa, accelerators).
    with django_assert_num_queries(4):
        assert admin_client.get("/api/v1/nodes/").status_code == 200
