"""Managed engine servers: a real vLLM CPU start and stop, early death, start-up timeout."""

import sys

import pytest
import requests

from eagleflow import engines
from eagleflow.errors import EagleflowError


@pytest.mark.slow
def test_real_vllm_server_answers_with_the_chat_template(vllm_server):
    r = requests.post(
        f"{vllm_server.url}/v1/chat/completions",
        timeout=120,
        json={
            "model": "target",
            "max_tokens": 16,
            "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
        },
    )
    assert r.status_code == 200
    assert "Paris" in r.json()["choices"][0]["message"]["content"]
    assert vllm_server.url.startswith("http://127.0.0.1:")


@pytest.mark.slow
def test_server_that_exits_early_gives_a_clear_error(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(tmp_path / "no-such-model"),
        "--port",
        str(engines.free_port()),
    ]
    server = engines.Server(
        cmd,
        "127.0.0.1",
        1,
        log_path=str(tmp_path / "log"),
        env=engines.engine_env("vllm", {}),
        startup_timeout_s=300,
    )
    with pytest.raises(EagleflowError, match=r"server exited with status \d+ before answering"):
        with server:
            pass
    assert not engines._group_alive(server.proc.pid)


def test_startup_timeout_stops_the_whole_process_group(tmp_path):
    # a "server" that never answers and has a child of its own
    cmd = ["bash", "-c", "sleep 300 & sleep 300"]
    server = engines.Server(
        cmd,
        "127.0.0.1",
        engines.free_port(),
        log_path=str(tmp_path / "log"),
        startup_timeout_s=2,
        grace_s=2,
    )
    with pytest.raises(EagleflowError, match="did not answer .* within 2 s"):
        with server:
            pass
    assert not engines._group_alive(server.proc.pid)
