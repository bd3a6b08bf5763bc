"""SageMaker's inference-container contract: `GET /ping` (200 while the engine runs) and `POST
/invocations`.

/invocations takes three kinds of body:

* Hugging Face's text-generation container (TGI, which SageMaker's LLM images run): `{"inputs":
  "text" or ["text", ...], "parameters": {"max_new_tokens", "do_sample", "temperature", "top_k",
  "top_p", "repetition_penalty", "frequency_penalty", "stop", "seed", "return_full_text",
  "details"}}`, answered as TGI
  does on SageMaker: `[{"generated_text": "..."}]`, one entry per input. As in TGI, it samples when
  `do_sample` is true or temperature, top_k or top_p change the distribution, else decodes greedily;
  the text ends with the stop sequence that ended it (TGI keeps it); `details` adds
  `{"finish_reason": "length"|"eos_token"|"stop_sequence", "generated_tokens", "seed"}` (the seed
  drawn when sampling without one), without TGI's per-token `prefill` and `tokens`. TGI's errors:
  422 `{"error", "error_type": "validation"}` for a request it cannot take, its other parameters
  that change the answer (typical_p, truncate, best_of, watermark, top_n_tokens,
  decoder_input_details, grammar, adapter_id, `stream`) refused by name; a parameter TGI does not
  define is ignored, with a warning in the log naming it. Sampling defaults are TGI's (greedy
  unless asked), not the model folder's. The penalties are /v1's, row by row in the same batch
  (lmforge.inference.penalties): repetition_penalty as TGI and transformers apply it (prompt and
  output); frequency_penalty (and presence_penalty, which TGI lacks) as OpenAI defines it, over
  the counts of the generated tokens, where TGI subtracts it times each token's share of the prompt
  and output together.
* an OpenAI chat body (has "messages"): answered as /v1/chat/completions, `stream` included;
* an OpenAI completion body (has "prompt"): answered as /v1/completions.

For the OpenAI shapes "model" may be left out, as on /v1 (an endpoint serves one model).
"""

from __future__ import annotations

import random
import time

from fastapi import Request
from fastapi.responses import JSONResponse

from lmforge.inference.sampling import SamplingParams
from lmforge.serve.protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    TGIRequest,
    parse,
    warn_ignored,
)
from lmforge.serve.server import Server


async def invocations(server: Server, request: Request, data):
    start = time.perf_counter()
    if isinstance(data, dict) and "messages" in data:
        return await server.chat_completions(request, parse(ChatRequest, data))
    if isinstance(data, dict) and "prompt" in data:
        return await server.completions(request, parse(CompletionRequest, data))
    try:
        return await _tgi(server, request, data, start)
    except APIError as e:  # in TGI's shape: a request it cannot take is a 422
        return JSONResponse(
            {
                "error": e.message,
                "error_type": "validation" if e.status == 400 else e.code or e.type,
            },
            status_code=422 if e.status == 400 else e.status,
        )


async def _tgi(server: Server, request: Request, data, start: float) -> list[dict]:
    body = parse(TGIRequest, data)
    p = body.parameters
    bad = [f"parameters.{name}" for name in p.unsupported()] + (["stream"] if body.stream else [])
    if bad:
        raise APIError(
            400, f"'{bad[0]}' is not supported by this server: leave it out", param=bad[0]
        )
    warn_ignored(p, where="TGI parameters")
    texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
    if not texts:
        raise APIError(400, "'inputs' is an empty list: give at least one text", param="inputs")
    sampled = p.sampling()
    # TGI reports the one it drew
    seed = p.seed if p.seed is not None or not sampled else random.randrange(2**63)
    sampling = SamplingParams(
        p.temperature or 1.0, p.top_k, p.top_p, p.repetition_penalty or 1.0, do_sample=sampled
    )
    gen = server.start(
        await server.prompts.texts(request, texts, "inputs"),
        p.max_new_tokens,
        sampling,
        1,
        p.stop,
        seed,
        "max_new_tokens",
        extra={"frequency_penalty": p.frequency_penalty, "presence_penalty": p.presence_penalty},
    )
    out = await server.collect(request, gen, "/invocations", start)
    results = []
    for i, text in enumerate(texts):
        stop = out[i].get("stop_string")
        result = {
            "generated_text": (text if p.return_full_text else "") + out[i]["text"] + (stop or "")
        }
        if p.details:
            reason = (
                "length"
                if out[i]["finish_reason"] == "length"
                else "stop_sequence"
                if stop
                else "eos_token"
            )
            result["details"] = {
                "finish_reason": reason,
                "generated_tokens": gen.completion_tokens[i],
                "seed": seed if sampled else None,
            }
        results.append(result)
    return results
