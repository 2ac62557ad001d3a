"""The stand-in provider itself: wire shapes, per-model scripts, records, control API, entry point."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.runtime.standin import Fault, StandinProvider

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-standin-test-key-abcdef0123456789"
ANTHROPIC = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
OPENAI = {"authorization": f"Bearer {KEY}"}


def anthropic_body(model: str = "m1", text: str = "hello there") -> dict[str, Any]:
    return {"model": model, "max_tokens": 10, "messages": [{"role": "user", "content": text}]}


def openai_body(model: str = "m1", text: str = "hello there") -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": text}]}


def client(timeout: float = 5.0) -> httpx.Client:
    return httpx.Client(timeout=timeout, trust_env=False)


def test_default_replies_are_deterministic(standin: StandinProvider) -> None:
    long_text = "plan the launch " * 12
    with client() as http:
        a = http.post(f"{standin.base_url}/v1/messages", headers=ANTHROPIC, json=anthropic_body(text=long_text))
        o = http.post(f"{standin.base_url}/v1/chat/completions", headers=OPENAI, json=openai_body(text="hi"))
    assert a.status_code == o.status_code == 200
    cut = "plan the launch plan the launch plan the launch plan the launch plan the launch ..."
    assert a.json()["content"] == [
        {"type": "text", "text": f'Noted, you asked "{cut}"; I will take it from here and report back in this room.'}
    ]
    assert a.json()["stop_reason"] == "end_turn"
    message = o.json()["choices"][0]["message"]
    assert message == {
        "role": "assistant",
        "content": 'Noted, you asked "hi"; I will take it from here and report back in this room.',
    }
    assert o.json()["usage"]["total_tokens"] > 0


def test_scripts_are_per_model_then_any_model(standin: StandinProvider) -> None:
    standin.enqueue_fault("overloaded", model="m1")
    standin.enqueue_reply("for anyone")
    with client() as http:
        url = f"{standin.base_url}/v1/messages"
        first_m2 = http.post(url, headers=ANTHROPIC, json=anthropic_body("m2"))
        first_m1 = http.post(url, headers=ANTHROPIC, json=anthropic_body("m1"))
        second_m1 = http.post(url, headers=ANTHROPIC, json=anthropic_body("m1"))
    assert first_m2.json()["content"][0]["text"] == "for anyone"
    assert first_m1.status_code == 529
    assert first_m1.json() == {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    assert second_m1.json()["content"][0]["text"].startswith("Noted, you asked ")
    assert [r.answer for r in standin.requests("m1")] == ["fault:overloaded", "default"]
    assert len(standin.requests()) == 3


@pytest.mark.parametrize(
    ("fault", "anthropic_status", "openai_status", "openai_code"),
    [
        ("rate_limit", 429, 429, "rate_limit_exceeded"),
        ("overloaded", 529, 503, "server_is_overloaded"),
        ("server_error", 500, 500, None),
        ("key_rejected", 401, 401, "invalid_api_key"),
        ("unknown_model", 404, 404, "model_not_found"),
        ("quota", 400, 429, "insufficient_quota"),
        ("spend_cap", 429, 429, "organization_spend_limit_exceeded"),
    ],
)
def test_fault_shapes(
    standin: StandinProvider, fault: str, anthropic_status: int, openai_status: int, openai_code: str | None
) -> None:
    standin.enqueue_fault(fault, times=2)
    with client() as http:
        a = http.post(f"{standin.base_url}/v1/messages", headers=ANTHROPIC, json=anthropic_body())
        o = http.post(f"{standin.base_url}/v1/chat/completions", headers=OPENAI, json=openai_body())
    assert a.status_code == anthropic_status
    assert a.json()["type"] == "error" and set(a.json()["error"]) >= {"type", "message"}
    assert o.status_code == openai_status
    assert set(o.json()["error"]) == {"message", "type", "param", "code"}
    assert o.json()["error"]["code"] == openai_code
    assert KEY not in o.text
    if fault == "spend_cap":
        assert a.json()["error"]["details"] == {"error_code": "enforced_spend_limit_reached"}


def test_rate_limit_headers(standin: StandinProvider) -> None:
    standin.enqueue_fault(Fault("rate_limit", retry_after=3, retry_after_ms=2500), times=2)
    with client() as http:
        a = http.post(f"{standin.base_url}/v1/messages", headers=ANTHROPIC, json=anthropic_body())
        o = http.post(f"{standin.base_url}/v1/chat/completions", headers=OPENAI, json=openai_body())
    assert a.headers["retry-after"] == "3" and "retry-after-ms" not in a.headers
    assert o.headers["retry-after"] == "3" and o.headers["retry-after-ms"] == "2500"


def test_raw_fault(standin: StandinProvider) -> None:
    standin.enqueue_fault("raw", status=413, body="<html>too big</html>", headers={"x-should-retry": "false"})
    with client() as http:
        response = http.post(f"{standin.base_url}/v1/messages", headers=ANTHROPIC, json=anthropic_body())
    assert response.status_code == 413
    assert response.text == "<html>too big</html>"
    assert response.headers["x-should-retry"] == "false"


def test_drop_closes_without_answer(standin: StandinProvider) -> None:
    standin.enqueue_fault("drop")
    with client() as http, pytest.raises(httpx.RemoteProtocolError):
        http.post(f"{standin.base_url}/v1/chat/completions", headers=OPENAI, json=openai_body())
    assert len(standin.requests()) == 1


def test_timeout_and_slow_reply_outlast_a_short_client(standin: StandinProvider) -> None:
    standin.enqueue_fault("timeout", seconds=30)
    standin.enqueue_reply("slow", delay_seconds=30)
    with client(timeout=0.2) as http:
        for _ in range(2):
            with pytest.raises(httpx.ReadTimeout):
                http.post(f"{standin.base_url}/v1/messages", headers=ANTHROPIC, json=anthropic_body())
    assert [r.answer for r in standin.requests()] == ["fault:timeout", "reply"]


def test_slow_reply_arrives(standin: StandinProvider) -> None:
    standin.enqueue_reply("eventually", delay_seconds=0.2)
    with client() as http:
        response = http.post(f"{standin.base_url}/v1/chat/completions", headers=OPENAI, json=openai_body())
    assert response.json()["choices"][0]["message"]["content"] == "eventually"


def test_recorded_headers_are_redacted(standin: StandinProvider) -> None:
    with client() as http:
        http.post(f"{standin.base_url}/v1/messages", headers=ANTHROPIC, json=anthropic_body())
        http.post(f"{standin.base_url}/v1/chat/completions", headers=OPENAI, json=openai_body())
    anthropic, openai = standin.requests()
    assert anthropic.headers["x-api-key"] == "REDACTED"
    assert openai.headers["authorization"] == "Bearer REDACTED"
    assert KEY not in repr(standin.requests())


def test_control_api(standin: StandinProvider) -> None:
    base = standin.base_url
    with client() as http:
        assert http.post(
            f"{base}/_standin/faults", json={"fault": "rate_limit", "retry_after": 4, "model": "m1"}
        ).json() == {"ok": True}
        http.post(
            f"{base}/_standin/replies",
            json={
                "text": "scripted",
                "tool_calls": [{"name": "remember", "arguments": {"text": "t", "private": False}}],
            },
        )
        assert http.post(f"{base}/_standin/faults", json={"fault": "nonsense"}).status_code == 400
        limited = http.post(f"{base}/v1/chat/completions", headers=OPENAI, json=openai_body("m1"))
        scripted = http.post(f"{base}/v1/chat/completions", headers=OPENAI, json=openai_body("m1"))
        records = http.get(f"{base}/_standin/requests", params={"model": "m1"}).json()["requests"]
        assert http.post(f"{base}/_standin/reset").json() == {"ok": True}
        after_reset = http.get(f"{base}/_standin/requests").json()["requests"]
    assert limited.status_code == 429 and limited.headers["retry-after"] == "4"
    call = scripted.json()["choices"][0]["message"]["tool_calls"][0]
    assert call["function"] == {"name": "remember", "arguments": '{"text": "t", "private": false}'}
    assert [r["answer"] for r in records] == ["fault:rate_limit", "reply"]
    assert records[0]["headers"]["authorization"] == "Bearer REDACTED"
    assert after_reset == []


def test_stop_is_idempotent_and_restartable() -> None:
    provider = StandinProvider()
    first = provider.start()
    provider.stop()
    provider.stop()
    second = provider.start()
    try:
        with client() as http:
            assert http.get(f"{second}/_standin/health").json() == {"ok": True}
    finally:
        provider.stop()
    assert first.startswith("http://127.0.0.1:")


def test_unknown_fault_is_refused(standin: StandinProvider) -> None:
    with pytest.raises(ValueError):
        standin.enqueue_fault("meteor")


def test_module_entry_point_serves_until_sigterm() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.runtime.standin", "--port", "0"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        assert line.startswith("STANDIN_URL=http://127.0.0.1:")
        base = line.removeprefix("STANDIN_URL=")
        with client() as http:
            http.post(f"{base}/_standin/faults", json={"fault": "key_rejected"})
            rejected = http.post(f"{base}/v1/messages", headers=ANTHROPIC, json=anthropic_body())
            count = len(http.get(f"{base}/_standin/requests").json()["requests"])
        assert rejected.status_code == 401 and count == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_default_reply_names_the_line_that_woke_the_agent(standin: StandinProvider) -> None:
    prompt = "Recent messages:\n- [ana] earlier\nYou were woken by: plan the launch with Bolt"
    with client() as http:
        got = http.post(f"{standin.base_url}/v1/messages", headers=ANTHROPIC, json=anthropic_body(text=prompt))
    assert got.json()["content"][0]["text"] == (
        'Noted, you asked "plan the launch with Bolt"; I will take it from here and report back in this room.'
    )
