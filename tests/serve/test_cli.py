"""`lmforge serve`: the real console script in a subprocess, and its one-line start-up errors."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from lmforge.cli import main
from lmforge.serve.listen import listen_address


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_listen_address(monkeypatch):
    monkeypatch.delenv("SAGEMAKER_BIND_TO_PORT", raising=False)
    assert listen_address(None, None) == ("127.0.0.1", 8000)  # loopback unless told otherwise
    monkeypatch.setenv("SAGEMAKER_BIND_TO_PORT", "8080")
    # SageMaker's health checks come from outside
    assert listen_address(None, None) == ("0.0.0.0", 8080)
    assert listen_address("127.0.0.1", 9000) == ("127.0.0.1", 9000)  # explicit flags win


def test_the_default_model_id_names_the_run_of_a_runs_folders(tmp_path):
    """Every run exports hf/ and model/ and checkpoints step-N: served under those names alone,
    two runs collided and a client could not tell which model answered."""
    from lmforge.cli.serve import served_name

    run = tmp_path / "sft-qwen"
    assert (
        served_name(run / "hf") == "sft-qwen/hf" and served_name(run / "model") == "sft-qwen/model"
    )
    assert served_name(run / "checkpoints" / "step-00000400") == "sft-qwen/step-00000400"
    assert served_name(tmp_path / "Qwen2.5-0.5B-Instruct") == "Qwen2.5-0.5B-Instruct"
    # `serve BASE --lora RUN/hf-adapter`: the adapter's
    assert served_name(run / "hf-adapter") == "sft-qwen/hf-adapter"
    # `lmforge quickstart`'s run folder: named by the folder around it
    quickstart = tmp_path / "quickstart" / "run"
    assert served_name(quickstart / "checkpoints" / "step-00000095") == "quickstart/step-00000095"


def test_startup_errors_are_one_line(model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SAGEMAKER_BIND_TO_PORT", raising=False)
    assert main(["serve", str(tmp_path / "missing")]) == 1
    assert (
        capsys.readouterr().err == f"error: model folder '{tmp_path / 'missing'}' does not exist\n"
    )
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", str(model_dir), "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot listen on 127.0.0.1:{port}" in err and "--port" in err
    assert main(["serve", str(model_dir), "--lora", str(tmp_path)]) == 1
    assert (
        capsys.readouterr().err
        == f"error: no adapter_config.json in '{tmp_path}': point --lora at a PEFT LoRA "
        "adapter folder\n"
    )
    # was a traceback from the KV cache
    assert main(["serve", str(model_dir), "--max-context", "-5"]) == 1
    assert "--max-context must be >= 1, got -5" in capsys.readouterr().err
    assert main(["serve", str(model_dir), "--max-batch", "0"]) == 1
    assert "--max-batch must be >= 1" in capsys.readouterr().err
    assert main(["serve", str(model_dir), "--prefill-batch", "0"]) == 1
    assert "--prefill-batch must be >= 1" in capsys.readouterr().err
    assert main(["serve", str(model_dir), "--read-timeout", "nan"]) == 1
    assert "--read-timeout must be a positive number of seconds" in capsys.readouterr().err
    assert main(["serve", str(model_dir), "--max-choices", "0"]) == 1
    assert "--max-choices must be >= 1" in capsys.readouterr().err
    assert main(["serve", str(model_dir), "--prefix-cache-blocks", "0"]) == 1
    assert "--prefix-cache-blocks must be >= 1" in capsys.readouterr().err
    monkeypatch.setenv("SAGEMAKER_BIND_TO_PORT", "eighty")
    assert main(["serve", str(model_dir)]) == 1
    assert "SAGEMAKER_BIND_TO_PORT" in capsys.readouterr().err


def test_prefix_caching_flags_reach_the_engine(model_dir, capsys, monkeypatch):
    """On by default as in vLLM; --no-enable-prefix-caching turns it off; --prefix-cache-blocks
    sizes it (the default: one row's worth of blocks)."""
    import lmforge.serve.app
    from lmforge.errors import UserError

    engines = []

    def stop_before_listening(engine, *args, **kwargs):
        engines.append(engine)
        raise UserError("stopped by the test")

    monkeypatch.setattr(lmforge.serve.app, "create_app", stop_before_listening)
    monkeypatch.delenv("SAGEMAKER_BIND_TO_PORT", raising=False)
    for flags in ([], ["--no-enable-prefix-caching"], ["--prefix-cache-blocks", "7"]):
        assert main(["serve", str(model_dir), "--port", "0", "--max-context", "40", *flags]) == 1
        assert "stopped by the test" in capsys.readouterr().err
    default, off, seven = (e.prefix for e in engines)
    assert default.blocks == 3 and off is None and seven.blocks == 7


@pytest.mark.slow
def test_console_script_serves_with_key_from_the_environment(model_dir):
    port = _free_port()
    env = {**os.environ, "SAGEMAKER_BIND_TO_PORT": str(port), "LMFORGE_API_KEY": "from-env"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lmforge.cli",
            "serve",
            str(model_dir),
            "--host",
            "127.0.0.1",
            "--max-batch",
            "2",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/ping").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(
                    f"lmforge serve did not come up: {proc.communicate()[0] if proc.poll() else ''}"
                )
            time.sleep(0.2)
        assert httpx.get(url + "/v1/models").status_code == 401
        models = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer from-env"}).json()
        assert models["data"][0]["id"] == model_dir.name
    finally:
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out
    assert (
        f"serving '{model_dir.name}' at http://127.0.0.1:{port}" in out
        and "API key required" in out
    )
