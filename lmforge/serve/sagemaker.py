"""SageMaker's inference-container contract: `GET /ping` (200 while the engine runs) and `POST /invocations`.

/invocations takes three kinds of body:

* Hugging Face's text-generation container (TGI, which SageMaker's LLM images run):
  `{"inputs": "text" or ["text", ...], "parameters": {"max_new_tokens", "do_sample", "temperature", "top_k",
  "top_p", "repetition_penalty", "stop", "seed", "return_full_text", "details"}}`, answered as TGI does on
  SageMaker: `[{"generated_text": "..."}]`, one entry per input. As in TGI and transformers, decoding is
  greedy unless `do_sample` is true; `details` adds `{"finish_reason": "stop"|"length", "generated_tokens"}`.
* an OpenAI chat body (has "messages"): answered as /v1/chat/completions, `stream` included;
* an OpenAI completion body (has "prompt"): answered as /v1/completions.

For the OpenAI shapes "model" may be left out (an endpoint serves one model).
"""

from __future__ import annotations

import time

from fastapi import Request

from lmforge.inference.sampling import SamplingParams
from lmforge.serve.protocol import APIError, ChatRequest, CompletionRequest, TGIRequest, parse
from lmforge.serve.server import Server


async def invocations(server: Server, request: Request, data):
    start = time.perf_counter()
    if isinstance(data, dict) and "messages" in data:
        return await server.chat_completions(request, parse(ChatRequest, {"model": server.config.model_name, **data}))
    if isinstance(data, dict) and "prompt" in data:
        return await server.completions(request, parse(CompletionRequest, {"model": server.config.model_name, **data}))
    body = parse(TGIRequest, data)
    p = body.parameters
    texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
    if not texts:
        raise APIError(400, "'inputs' is an empty list: give at least one text", param="inputs")
    sampling = SamplingParams(p.temperature or 1.0, p.top_k, p.top_p, p.repetition_penalty, do_sample=p.do_sample)
    gen = server.start([server.encode_prompt(t) for t in texts], p.max_new_tokens, sampling, 1, p.stop, p.seed,
                       "max_new_tokens")
    out = await server.collect(request, gen, "/invocations", start)
    results = []
    for i, text in enumerate(texts):
        result = {"generated_text": (text if p.return_full_text else "") + out[i]["text"]}
        if p.details:
            result["details"] = {"finish_reason": out[i]["finish_reason"],
                                 "generated_tokens": gen.completion_tokens[i], "seed": p.seed}
        results.append(result)
    return results
