"""`lmforge generate MODEL_DIR --prompt TEXT`: completions of text prompts, printed one after
another."""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from lmforge.cli.serve import TOKENIZER_HELP, add_template_limits
from lmforge.errors import UserError

log = logging.getLogger(__name__)
CHAT_MAX_CHARS = 4 << 20  # --max-template-chars: serve's default for its default body limit


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model_dir",
        help="lmforge model folder or Hugging Face folder, with its tokenizer files (or "
        "--tokenizer), or a training checkpoint (RUN_DIR/checkpoints/step-N: its run's "
        "tokenizer)",
    )
    p.add_argument(
        "--prompt", action="append", required=True, help="prompt text; repeat for a batch"
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="each prompt is a user message, rendered with the model's chat template (its "
        "chat_template.jinja or tokenizer_config.json; a fine-tuning run's export and checkpoints "
        "carry the one it trained with; else --tokenizer's folder's), as /v1/chat/completions renders "
        "it; the completion is the assistant's reply",
    )
    p.add_argument(
        "--system",
        default=None,
        metavar="TEXT",
        help="with --chat: a system message before each prompt",
    )
    add_template_limits(p, str(CHAT_MAX_CHARS))
    p.add_argument(
        "--lora",
        default=None,
        metavar="DIR",
        help="a PEFT LoRA adapter folder (e.g. a run's hf-adapter/), merged into MODEL_DIR on load",
    )
    p.add_argument("--tokenizer", default=None, metavar="PATH", help=TOKENIZER_HELP)
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=64,
        help="tokens to generate per prompt at most (default 64)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="0 = greedy. Default, as transformers' generate: the folder's generation_config.json "
        "(its do_sample, temperature, top_k, top_p), else greedy; --top-k/--top-p alone sample at 1.0",
    )
    p.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens")
    p.add_argument(
        "--top-p", type=float, default=None, help="nucleus sampling: smallest set with mass >= p"
    )
    p.add_argument(
        "--min-p",
        type=float,
        default=None,
        help="sample only tokens at least MIN_P x as likely as the most likely one (0 = off; serve's "
        "min_p). Default: the folder's generation_config.json where it samples, else off",
    )
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=None,
        help="> 1 discourages tokens of the prompt and the output (1.0 = off; transformers' and vLLM's). "
        "Default: the folder's generation_config.json, else off",
    )
    p.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        help="OpenAI's, -2 to 2: subtracted from a token's score once per time it was generated "
        "(default 0)",
    )
    p.add_argument(
        "--presence-penalty",
        type=float,
        default=0.0,
        help="OpenAI's, -2 to 2: subtracted from the score of every token generated so far (default 0)",
    )
    p.add_argument(
        "--stop", action="append", default=[], help="stop at this text (not printed); repeatable"
    )
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="cast weights (default: keep)",
    )
    p.add_argument(
        "--device",
        default="auto",
        help="auto (the accelerator torch reports, else cpu; the default), cpu, cuda, cuda:1 ...",
    )
    p.add_argument(
        "--compile",
        nargs="?",
        const="default",
        default=None,
        metavar="MODE",
        choices=["default", "reduce-overhead", "max-autotune"],
        help="torch.compile the decode step: faster per token after a one-off compile (needs a C++ "
        "compiler on CPU); worth it for long generations. MODE reduce-overhead: a static-shape step "
        "replayed as CUDA graphs on CUDA (default: plain compile)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    from lmforge.cli.serve import check_vocabulary, load_served, served_tokenizer, template_limits
    from lmforge.devices import resolve_device
    from lmforge.inference import generate_text
    from lmforge.inference.generate import check_fits
    from lmforge.models.io import missing_model_folder, parse_dtype

    if not Path(args.model_dir).is_dir():
        raise missing_model_folder(args.model_dir)
    if args.system is not None and not args.chat:
        raise UserError("--system is a chat message: add --chat")
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    limits = template_limits(args, CHAT_MAX_CHARS)
    device = resolve_device(args.device)
    tokenizer = served_tokenizer(Path(args.model_dir), args.tokenizer)
    model, chat_folder = load_served(
        Path(args.model_dir), args.lora, device, parse_dtype(args.dtype), args.tokenizer
    )
    check_vocabulary(tokenizer, model, args.tokenizer)
    prompts, stop = args.prompt, list(args.stop)
    if args.chat:
        prompts, chat_stop = chat_prompts(tokenizer, chat_folder, args.prompt, args.system, limits)
        stop += chat_stop
    # generate() checks the same, but this line can name the flag.
    longest = max(
        len(ids)
        for ids in (
            prompts
            if args.chat
            else tokenizer.encode_batch(prompts, add_bos=tokenizer.add_bos_token)
        )
    )
    if longest:
        check_fits(
            longest, args.max_new_tokens, model.config.max_position_embeddings, "--max-new-tokens"
        )
    temperature, top_k, top_p, min_p = sampling_defaults(args, Path(args.model_dir))
    start = time.perf_counter()
    texts = generate_text(
        model,
        tokenizer,
        prompts,
        args.max_new_tokens,
        stop=stop,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=repetition_penalty(args, Path(args.model_dir)),
        frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty,
        seed=args.seed,
        compile=args.compile or False,
    )
    log.info("generated %d completion(s) in %.2f s", len(texts), time.perf_counter() - start)
    for i, text in enumerate(texts):
        if len(texts) > 1:
            print(f"--- completion {i + 1} of {len(texts)} ---")
        print(text)


def chat_prompts(
    tokenizer, folder: Path, prompts: list[str], system: str | None, limits=None
) -> tuple[list[list[int]], list[str]]:
    """(each prompt as a user message after `system`, rendered to ids with `folder`'s chat
    template as the server renders a chat, under the same limits
    (lmforge.chat_sandbox.RenderLimits); the stop strings that format needs)."""
    from lmforge.serve.chat import ChatFormat
    from lmforge.serve.protocol import APIError

    chat = ChatFormat(tokenizer, folder, limits=limits)
    if chat.chat is None:
        log.warning(
            "'%s' has no chat template: the prompts are rendered as plain 'User: ... Assistant:' turns",
            folder,
        )
    head = [("system", system)] if system is not None else []
    try:
        return [chat.encode([*head, ("user", p)]) for p in prompts], list(chat.stop)
    except APIError as e:
        if e.code in ("template_limit", "tokenizer_error"):  # the line names its fix
            raise UserError(e.message) from None
        fix = (
            "drop --system if it takes no system message"
            if system is not None
            else "prompt without --chat"
        )
        raise UserError(f"{e.message}: {fix}") from None
    finally:
        chat.close()


def repetition_penalty(args: argparse.Namespace, folder: Path) -> float:
    """--repetition-penalty, else the model's generation_config.json's (transformers' generate
    applies it, greedy or sampled), else 1.0 (off)."""
    from lmforge.models.source import generation_config

    if args.repetition_penalty is not None:
        return args.repetition_penalty
    value = generation_config(folder)[0].get("repetition_penalty")
    return (
        float(value)
        if isinstance(value, int | float) and not isinstance(value, bool) and value > 0
        else 1.0
    )


def sampling_defaults(
    args: argparse.Namespace, folder: Path
) -> tuple[float, int | None, float | None, float]:
    """(temperature, top_k, top_p, min_p): the flags given; with none of them, what the model's
    generation_config.json asks for (transformers' generate reads it the same way: sampling only
    where it says do_sample), else greedy."""
    from lmforge.models.source import generation_config

    flags = (args.temperature, args.top_k, args.top_p, args.min_p)
    if any(flag is not None for flag in flags):
        temperature = 1.0 if args.temperature is None else args.temperature
        return temperature, args.top_k, args.top_p, args.min_p or 0.0
    config, path = generation_config(folder)
    if not config.get("do_sample"):
        return 0.0, None, None, 0.0
    temperature, top_k, top_p, min_p = (
        config.get("temperature", 1.0),
        config.get("top_k"),
        config.get("top_p"),
        config.get("min_p"),
    )
    log.info(
        "sampling as %s asks (temperature %s, top_k %s, top_p %s, min_p %s): --temperature 0 for "
        "greedy",
        path,
        temperature,
        top_k,
        top_p,
        min_p,
    )
    return (
        float(temperature),
        (int(top_k) if top_k else None),
        (float(top_p) if top_p not in (None, 1.0) else None),
        (float(min_p) if min_p else 0.0),
    )
