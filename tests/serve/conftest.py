"""A tiny random GPT-NeoX model with a one-word-per-token tokenizer, served for real by uvicorn on
127.0.0.1 (a free port, a thread of this process, so tests can look at the engine too)."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from tests.conftest import make_hf_model

pytest.importorskip("transformers")
pytest.importorskip("fastapi")

WORDS = ["<|endoftext|>", "<unk>"] + [f"t{i}" for i in range(2, 300)]
API_KEY = "test-key-123"


def word_tokenizer() -> Tokenizer:
    """One token per word 't<id>' (0 = <|endoftext|>, the NeoX config's eos): text is easy to
    predict."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|endoftext|>"])
    return tok


@pytest.fixture(scope="package")
def model_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("serve") / "tiny-neox"
    make_hf_model("gpt_neox").save_pretrained(folder)
    word_tokenizer().save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="package")
def reference(model_dir):
    """The same model and tokenizer loaded apart from any server: what `generate` gives alone."""
    from lmforge.models import load_pretrained
    from lmforge.tokenizers import load_tokenizer

    return load_pretrained(model_dir), load_tokenizer(model_dir)


class LiveServer:
    def __init__(self, app, engine, config):
        import uvicorn

        from lmforge.serve.http import uvicorn_config
        from lmforge.serve.listen import bind

        sock = bind("127.0.0.1", 0)
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.engine = engine
        self.server = uvicorn.Server(
            uvicorn_config(
                app,
                config.read_timeout,
                config.keep_alive_timeout,
                log_level="warning",
                access_log=False,
            )
        )
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@contextmanager
def serve(
    model_dir: Path, api_key: str | None = None, max_batch: int = 4, template_limits=None, **config
):
    """A live server of `model_dir`; `template_limits`: its chat template's
    (lmforge.chat_sandbox.RenderLimits)."""
    from lmforge.inference.engine import Engine, EngineConfig
    from lmforge.models import load_pretrained
    from lmforge.serve.app import create_app
    from lmforge.serve.chat import ChatFormat
    from lmforge.serve.server import ServeConfig
    from lmforge.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    engine = Engine(load_pretrained(model_dir), tokenizer, EngineConfig(max_batch=max_batch))
    config = ServeConfig(model_dir.name, api_key=api_key, **config)
    chat = ChatFormat(tokenizer, model_dir, limits=template_limits)
    server = LiveServer(create_app(engine, tokenizer, chat, config), engine, config)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="package")
def server(model_dir):
    with serve(model_dir, max_tokens_limit=100, max_body_bytes=64 * 1024) as s:
        yield s


@pytest.fixture(scope="package")
def secured(model_dir):
    with serve(model_dir, api_key=API_KEY) as s:
        yield s


@contextmanager
def slowed(engine, seconds: float):
    """Each engine step sleeps `seconds` first: tokens come at a pace a test can watch (or
    leave)."""
    step = engine.step
    engine.step = lambda: (time.sleep(seconds), step())[1]
    try:
        yield
    finally:
        del engine.step  # back to the class's method
