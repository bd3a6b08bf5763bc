"""`lmforge serve MODEL_DIR`: load the model and its tokenizer, start the engine, listen with
uvicorn.

The socket is bound first (lmforge.serve.listen), so a port in use fails before the model loads.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
from pathlib import Path

from lmforge.errors import UserError
from lmforge.serve.tool_parsers import PARSERS as TOOL_PARSERS

log = logging.getLogger(__name__)

# `--tokenizer` of generate and serve, as `lmforge eval` has it: the same forms, read by the same
# load_tokenizer.
TOKENIZER_HELP = (
    "tokenizer file or folder to use instead of MODEL_DIR's (a tokenizer.json, vocab.json + merges.txt, "
    "a SentencePiece .model, or a folder holding one; default: MODEL_DIR's own, for a checkpoint its "
    "run's). The chat template stays the model's, the one it was fine-tuned with: --lora's adapter's, "
    "else MODEL_DIR's (chat_template.jinja, else tokenizer_config.json); only where neither has one is "
    "the tokenizer's folder's used"
)
TOKENIZER_FIX = (
    "pass --tokenizer PATH (a tokenizer.json, vocab.json + merges.txt, a SentencePiece .model, or a "
    "folder holding one)"
)


def add_template_limits(p: argparse.ArgumentParser, chars_default: str) -> None:
    """--template-timeout and --max-template-chars, of serve and generate: what one render of the
    chat template may take (lmforge.chat_sandbox)."""
    p.add_argument(
        "--template-timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="time the chat template's render of one prompt may take before it is stopped and the prompt "
        "refused (default 5; a chat renders in milliseconds)",
    )
    p.add_argument(
        "--max-template-chars",
        type=int,
        default=None,
        metavar="N",
        help=f"most characters one chat template render may write (default {chars_default})",
    )


def template_limits(args: argparse.Namespace, chars_default: int):
    from lmforge.chat_sandbox import RenderLimits

    if not 0 < args.template_timeout < float("inf"):
        raise UserError(
            f"--template-timeout must be a positive number of seconds, got {args.template_timeout}"
        )
    chars = chars_default if args.max_template_chars is None else args.max_template_chars
    if chars < 1:
        raise UserError(f"--max-template-chars must be >= 1, got {chars}")
    return RenderLimits(args.template_timeout, chars)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model_dir",
        help="lmforge model folder or Hugging Face folder, with its tokenizer files (or "
        "--tokenizer), or a training checkpoint (RUN_DIR/checkpoints/step-N: its run's "
        "tokenizer)",
    )
    p.add_argument(
        "--host",
        default=None,
        help="address to listen on (default 127.0.0.1; 0.0.0.0 in SageMaker)",
    )
    p.add_argument(
        "--port", type=int, default=None, help="port (default $SAGEMAKER_BIND_TO_PORT, else 8000)"
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health, /ping and the page "
        "(default $LMFORGE_API_KEY; the variable keeps the key out of `ps`)",
    )
    p.add_argument(
        "--model-name",
        default=None,
        help="the id clients pass as `model` (default: the folder name, with its run's for a run's hf/, "
        "model/ or a checkpoint: sft-run/hf, sft-run/step-00000400; with --lora the adapter's: "
        "sft-run/hf-adapter)",
    )
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together (default 8)")
    p.add_argument(
        "--prefill-batch",
        type=int,
        default=None,
        help="most waiting requests prefilled in one forward (default: --max-batch; 1 = one at a time)",
    )
    p.add_argument(
        "--max-context",
        type=int,
        default=None,
        help="tokens per request, prompt + completion (default: the model's positions); "
        "the KV cache holds max-batch x max-context tokens",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep the keys/values of prompt blocks (16 tokens) for later prompts that start with the "
        "same tokens: a shared system prompt or chat history is computed once (default on, as in "
        "vLLM; --no-enable-prefix-caching turns it off)",
    )
    p.add_argument(
        "--prefix-cache-blocks",
        type=int,
        default=None,
        metavar="N",
        help="blocks of 16 tokens the prefix cache keeps, least recently used evicted first (default: "
        "one row's worth, max-context / 16: the KV memory of one more batch row)",
    )
    p.add_argument(
        "--max-tokens-limit",
        type=int,
        default=4096,
        help="most tokens one request may ask for (default 4096)",
    )
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=256,
        help="when a request names no max_tokens (default 256)",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=1024,
        help="waiting choices (all requests' prompts x n) before answering 503 (default 1024)",
    )
    p.add_argument(
        "--max-choices",
        type=int,
        default=128,
        help="most choices (prompts x n) one request may ask for (default 128); the engine serves "
        "requests in turn",
    )
    p.add_argument(
        "--max-body-bytes", type=int, default=1 << 20, help="largest request body (default 1 MiB)"
    )
    p.add_argument(
        "--read-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="time a request's headers, and then its body, may take to arrive before a 408 (default 10)",
    )
    p.add_argument(
        "--keep-alive-timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="time an idle connection stays open after a response (default 5)",
    )
    add_template_limits(p, "4 x --max-body-bytes")
    p.add_argument(
        "--allowed-hosts",
        default=None,
        metavar="HOSTS",
        help="comma-separated Host names to answer to besides IP addresses, localhost and --host (and this "
        "machine's name when --host is not loopback); '.example.com' admits it and every name under "
        "it, '*' any Host. Others get 421: a web page could otherwise reach a local server through "
        "DNS rebinding (default: none more; inside SageMaker, '*')",
    )
    p.add_argument(
        "--generation-config",
        choices=["auto", "none"],
        default="auto",
        help="auto (the default, as vLLM's): a request that leaves temperature, top_k, top_p or "
        "repetition_penalty out gets the model folder's generation_config.json value (temperature, "
        "top_k, top_p where it sets do_sample, greedy where it sets do_sample false; "
        "repetition_penalty), as `lmforge generate` reads it; none: OpenAI's defaults",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="cast weights (default: keep)",
    )
    p.add_argument(
        "--lora",
        default=None,
        metavar="DIR",
        help="a PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors, e.g. a run's "
        "hf-adapter/) to merge into the model; its chat template, if it has one, is used",
    )
    p.add_argument("--tokenizer", default=None, metavar="PATH", help=TOKENIZER_HELP)
    p.add_argument(
        "--tool-parser",
        choices=list(TOOL_PARSERS),
        default=None,
        help="how tool calls are read from the model's text (vLLM's names): hermes "
        "(<tool_call>{...}</tool_call>: Hermes, Qwen2.5/3), llama3_json (Llama 3.x JSON), mistral "
        "([TOOL_CALLS][...]) (default: the format the chat template's own markers name)",
    )
    p.add_argument(
        "--device",
        default="auto",
        help="auto (the accelerator torch reports, else cpu; the default), cpu, cuda, cuda:1 ...",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    import uvicorn

    from lmforge.devices import resolve_device
    from lmforge.inference.engine import Engine, EngineConfig
    from lmforge.models.io import missing_model_folder, parse_dtype
    from lmforge.serve.app import create_app
    from lmforge.serve.chat import ChatFormat
    from lmforge.serve.http import uvicorn_config
    from lmforge.serve.listen import allowed_hosts, bind, is_loopback, listen_address
    from lmforge.serve.server import ServeConfig

    folder = Path(args.model_dir)
    if not folder.is_dir():
        raise missing_model_folder(folder)
    for name in (
        "max_batch",
        "prefill_batch",
        "max_context",
        "max_tokens_limit",
        "default_max_tokens",
        "max_queue",
        "max_body_bytes",
        "max_choices",
        "prefix_cache_blocks",
    ):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("read_timeout", "keep_alive_timeout"):
        value = getattr(args, name)
        if not 0 < value < float("inf"):
            raise UserError(
                f"--{name.replace('_', '-')} must be a positive number of seconds, got {value}"
            )
    limits = template_limits(args, 4 * args.max_body_bytes)
    device = resolve_device(args.device)
    api_key = args.api_key or os.environ.get("LMFORGE_API_KEY") or None
    host, port = listen_address(args.host, args.port)
    hosts = allowed_hosts(host, args.allowed_hosts)
    sock = bind(host, port)
    try:
        tokenizer = served_tokenizer(folder, args.tokenizer)
        model, chat_folder = load_served(
            folder, args.lora, device, parse_dtype(args.dtype), args.tokenizer
        )
        check_vocabulary(tokenizer, model, args.tokenizer)
        engine = Engine(
            model,
            tokenizer,
            EngineConfig(
                args.max_batch,
                args.max_context,
                args.max_queue,
                prefill_batch=args.prefill_batch,
                prefix_cache=args.enable_prefix_caching,
                prefix_cache_blocks=args.prefix_cache_blocks,
            ),
        )
        if args.max_context is not None and args.max_context > engine.context:
            log.warning(
                "--max-context %d is past what the model reads: requests get its %d tokens",
                args.max_context,
                engine.context,
            )
        chat = ChatFormat(tokenizer, chat_folder, limits=limits)
        if chat.chat is None:
            log.warning(
                "'%s' has no chat template: /v1/chat/completions renders plain 'User: ... Assistant:' turns",
                chat_folder,
            )
        name = args.model_name or served_name(Path(args.lora) if args.lora else folder)
        defaults = generation_defaults(folder) if args.generation_config == "auto" else {}
        config = ServeConfig(
            name,
            args.max_tokens_limit,
            args.default_max_tokens,
            api_key,
            args.max_body_bytes,
            args.max_choices,
            args.read_timeout,
            args.keep_alive_timeout,
            defaults,
            allowed_hosts=tuple(hosts),
            sagemaker=bool(os.environ.get("SAGEMAKER_BIND_TO_PORT")),
            tool_parser=args.tool_parser,
        )
        app = create_app(engine, tokenizer, chat, config)
    except BaseException:
        sock.close()
        raise
    # SageMaker: behind IAM
    if not api_key and not is_loopback(host) and not os.environ.get("SAGEMAKER_BIND_TO_PORT"):
        log.warning(
            "listening on %s without --api-key: anyone who can reach this address can use the model",
            host,
        )
    kv = sum(t.numel() * t.element_size() for t in engine.cache.k + engine.cache.v)
    if engine.prefix is not None:
        kv += engine.prefix.nbytes
    shown = f"[{host}]" if ":" in host else host
    print(
        f"serving '{name}' at http://{shown}:{port} (chat page at /, OpenAI API under /v1); batch "
        f"{args.max_batch} x {engine.context} tokens, KV cache {kv / 2**20:.0f} MiB"
        f"{_prefix_note(engine)}"
        f"{'; API key required' if api_key else ''}",
        flush=True,
    )
    server = uvicorn.Server(
        uvicorn_config(
            app,
            config.read_timeout,
            config.keep_alive_timeout,
            log_level="info",
            access_log=False,
            timeout_graceful_shutdown=5,
        )
    )
    try:
        server.run(sockets=[sock])
    # uvicorn re-raises Ctrl+C after its graceful shutdown: that is a normal stop
    except KeyboardInterrupt:
        pass
    print("server stopped", flush=True)


def _prefix_note(engine) -> str:
    pool = engine.prefix
    if pool is None:
        return ""
    return f" (prefix cache {pool.blocks} x 16 tokens in it)"


def served_tokenizer(folder: Path, path: str | None):
    """`path` (--tokenizer), else the model folder's own tokenizer, else (a checkpoint) its
    run's, as `lmforge eval` reads it; a folder without one is a line naming --tokenizer."""
    from lmforge.models.source import model_tokenizer

    return model_tokenizer(folder, path, TOKENIZER_FIX)


def check_vocabulary(tokenizer, model, path: str | None) -> None:
    """A --tokenizer with ids past the model's embedding rows is another model's: one line now,
    not an index error from the first prompt that holds such an id (as `lmforge eval` refuses
    it)."""
    if path is not None and tokenizer.vocab_size > model.config.vocab_size:
        raise UserError(
            f"--tokenizer {path} has {tokenizer.vocab_size} ids but the model only "
            f"{model.config.vocab_size}: give the tokenizer the model was trained with"
        )


def load_served(folder: Path, lora: str | None, device, dtype, tokenizer: str | None = None):
    """The model to serve, with a PEFT adapter merged in (served at the base model's speed), and
    the folder whose chat template prompts it (chat_folder)."""
    from lmforge.models import load_pretrained
    from lmforge.models.lora import merge_lora
    from lmforge.models.peft_read import load_peft_adapter

    model = load_pretrained(folder, device=device, dtype=dtype)
    add_generation_eos(model, folder)
    if lora:
        load_peft_adapter(model, lora)
        model = merge_lora(model)
    return model, chat_folder(folder, lora, tokenizer)


def chat_folder(folder: Path, lora: str | None, tokenizer: str | None = None) -> Path:
    """The folder whose chat template prompts the model: the adapter's when it carries one, else
    the model folder's (each the template the model was fine-tuned with, which a run's export and
    checkpoints carry), else that of the --tokenizer (the folder given, or the one holding the
    file: where a weights-only import's template is, beside the tokenizer it left behind); the
    model folder where none has one."""
    from lmforge.serve.chat import read_chat_template

    candidates = [Path(lora)] if lora else []
    candidates.append(folder)
    if tokenizer is not None:
        candidates.append(Path(tokenizer) if Path(tokenizer).is_dir() else Path(tokenizer).parent)
    return next((c for c in candidates if read_chat_template(c)), folder)


def add_generation_eos(model, folder: Path) -> None:
    """Adds to the model config's eos ids those of the folder's generation_config.json:
    transformers' generate and vLLM stop at them too (Phi-3's <|end|>, Gemma's <end_of_turn> are
    there only)."""
    from lmforge.inference.text import token_ids
    from lmforge.models.source import generation_config

    have = token_ids(model.config.eos_token_id)
    try:
        more = token_ids(generation_config(folder)[0].get("eos_token_id")) - have
    # not an id or a list of ids: transformers would refuse the file; nothing to add
    except TypeError:
        return
    if more and all(isinstance(i, int) and 0 <= i < model.config.vocab_size for i in more):
        model.config.eos_token_id = sorted(have | more)


def generation_defaults(folder: Path) -> dict[str, float | int]:
    """The sampling defaults of the folder's generation_config.json (its model's origin's, for a
    checkpoint), read as `lmforge generate` and transformers' generate read them: temperature,
    top_k, top_p and min_p where do_sample is true, greedy (temperature 0) where it is false,
    repetition_penalty either way; a value they would refuse is left out. Said in one line, as
    vLLM's --generation-config auto says it."""
    from lmforge.models.source import generation_config

    config, path = generation_config(folder)

    def number(name: str, ok) -> bool:
        value = config.get(name)
        return (
            isinstance(value, int | float)
            and not isinstance(value, bool)
            and math.isfinite(value)
            and ok(value)
        )

    defaults: dict[str, float | int] = {}
    if config.get("do_sample") is True:
        if number("temperature", lambda v: v >= 0):
            defaults["temperature"] = float(config["temperature"])
        if number("top_k", lambda v: v == int(v) and v > 0):
            defaults["top_k"] = int(config["top_k"])
        if number("top_p", lambda v: 0 < v < 1):
            defaults["top_p"] = float(config["top_p"])
        if number("min_p", lambda v: 0 < v <= 1):
            defaults["min_p"] = float(config["min_p"])
    elif config.get("do_sample") is False:
        defaults["temperature"] = 0.0
    if number("repetition_penalty", lambda v: v > 0 and v != 1):
        defaults["repetition_penalty"] = float(config["repetition_penalty"])
    if defaults:
        log.info(
            "default sampling parameters from %s (a request's own values win; --generation-config none for "
            "OpenAI's defaults): %s",
            path,
            ", ".join(f"{k} {v}" for k, v in defaults.items()),
        )
    return defaults


def served_name(folder: Path) -> str:
    """The model id a folder is served under by default: its name, and for the folders every run
    names alike (a run's hf/ and model/, its checkpoints' step-N) the run's name before it, so
    two runs served side by side differ."""
    folder = folder.resolve()

    # a run folder named just "run" (the quickstart's): the folder around it
    def run_name(run: Path) -> str:
        return run.parent.name if run.name == "run" and run.parent.name else run.name

    if folder.name in ("hf", "model", "hf-adapter") and folder.parent.name:
        return f"{run_name(folder.parent)}/{folder.name}"
    if (
        folder.name.startswith("step-")
        and folder.parent.name == "checkpoints"
        and folder.parent.parent.name
    ):
        return f"{run_name(folder.parent.parent)}/{folder.name}"
    return folder.name
