"""API keys (on and off), /health through loading, ready and failure, and 503 while loading."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
from dependency_injector import providers

from tests.app.conftest import MODEL, make_container, start_server


@pytest.fixture(scope="module")
def keyed():
    server = start_server(api_key="s3cret-key")
    yield server
    server.stop()


def test_wrong_or_missing_key_is_401_in_openai_shape(keyed):
    bad = openai.OpenAI(base_url=keyed.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert info.value.body["code"] == "invalid_api_key"
    for path in ("/v1/models", "/v1/stats", "/v1/stats/steps", "/v1/stats/steps?since=0", "/metrics",
                 "/v1/cache/status"):
        r = httpx.get(keyed.base_url + path)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", path
    r = httpx.get(keyed.base_url + "/v1/models", headers={"Authorization": "Basic s3cret-key"})
    assert r.status_code == 401
    assert httpx.post(keyed.base_url + "/v1/cache/rebuild", json={"kv_tokens": 1}).status_code == 401


def test_right_key_works_and_health_stays_open(keyed):
    good = openai.OpenAI(base_url=keyed.base_url + "/v1", api_key="s3cret-key", max_retries=0)
    r = good.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert r.choices[0].message.role == "assistant"
    assert httpx.get(keyed.base_url + "/health").status_code == 200
    steps = httpx.get(keyed.base_url + "/v1/stats/steps", headers={"Authorization": "Bearer s3cret-key"})
    assert steps.status_code == 200 and steps.json()["steps"], steps.text  # the request above ran steps


def test_no_key_configured_means_open(server):
    assert httpx.get(server.base_url + "/v1/models").status_code == 200


def test_binds_loopback_by_default(server):
    assert server.settings.host == "127.0.0.1"


def test_loading_reports_progress_and_generation_answers_503():
    blocker = threading.Event()
    srv = start_server(make_container(blocker=blocker), wait=False)
    try:
        health = httpx.get(srv.base_url + "/health")
        assert health.status_code == 503
        body = health.json()
        assert body["status"] == "loading" and body["phase"] and "bytes_total" in body
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = httpx.post(srv.base_url + "/v1/chat/completions", json=body)
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        assert "loading" in r.json()["error"]["message"]
        blocker.set()
        assert srv.runtime.wait_ready(10)
        srv.runtime.check_valid()
        assert httpx.get(srv.base_url + "/health").json()["status"] == "ok"
        assert httpx.post(srv.base_url + "/v1/chat/completions", json=body).status_code == 200
    finally:
        blocker.set()
        srv.stop()


def test_load_failure_is_reported_not_crashed():
    container = make_container()

    def broken():
        raise FileNotFoundError("no such checkpoint: /nowhere")

    container.model_spec.override(providers.Singleton(broken))
    srv = start_server(container, wait=False)
    try:
        srv.runtime.wait_ready(10)
        srv.runtime.check_valid()
        health = httpx.get(srv.base_url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "error"
        assert "/nowhere" in health.json()["error"]
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        r = httpx.post(srv.base_url + "/v1/chat/completions", json=body)
        assert r.status_code == 503 and r.json()["error"]["code"] == "load_failed"
    finally:
        srv.stop()
