"""Constrained decoding libraries side by side on the CPU: xgrammar, llguidance and outlines-core.

For three JSON Schemas (a flat object; nested objects with arrays and enums; $ref and anyOf) each
library compiles the schema against the GPT-2 vocabulary (50,257 tokens), then walks the tokens of
one valid instance, computing the next-token mask before each token and advancing its matcher with
it, as a serving engine does per row and step. A table of JSON-Schema keywords says which each one
compiles (a keyword it refuses is an error; one it ignores would constrain nothing, so "ok" is
checked by a second schema that the keyword makes unsatisfiable where possible).

    python benchmarks/grammar_libs.py --tokenizer ../shared/data/tokenizers/gpt2 [--write]

Needs all three libraries installed (pip install xgrammar llguidance outlines-core); --write puts
the tables into their section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch
from report import publish  # benchmarks/report.py

SECTION = "## Constrained decoding: xgrammar, llguidance, outlines-core (CPU)"
SCHEMAS = {
    "flat": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "active": {"type": "boolean"},
        },
        "required": ["name", "age", "active"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "role": {"enum": ["admin", "editor", "viewer"]},
                    "address": {
                        "type": "object",
                        "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                        "required": ["city", "zip"],
                    },
                },
                "required": ["id", "role", "address"],
            },
            "tags": {"type": "array", "items": {"type": "string"}},
            "orders": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string"},
                        "qty": {"type": "integer"},
                        "price": {"type": "number"},
                    },
                    "required": ["sku", "qty", "price"],
                },
            },
        },
        "required": ["user", "tags", "orders"],
    },
    "ref_anyof": {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "value": {"anyOf": [{"type": "string"}, {"type": "number"}, {"type": "null"}]},
                    "children": {"type": "array", "items": {"$ref": "#/$defs/node"}},
                },
                "required": ["value", "children"],
            }
        },
        "type": "object",
        "properties": {"root": {"$ref": "#/$defs/node"}},
        "required": ["root"],
    },
}

INSTANCES = {
    "flat": {"name": "Ada Lovelace", "age": 36, "active": True},
    "nested": {
        "user": {"id": 7, "role": "editor", "address": {"city": "Paris", "zip": "75001"}},
        "tags": ["a", "bb", "ccc"],
        "orders": [
            {"sku": "X-1", "qty": 2, "price": 9.5},
            {"sku": "Y-22", "qty": 1, "price": 120.0},
        ],
    },
    "ref_anyof": {
        "root": {
            "value": "top",
            "children": [{"value": 1.5, "children": []}, {"value": None, "children": []}],
        }
    },
}

# keyword -> (a schema using it, a JSON text the keyword forbids: a library that ignores it would
# accept the text)
KEYWORDS = {
    "enum": ({"enum": ["a", "b"]}, '"c"'),
    "const": ({"const": 3}, "4"),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, '"x"'),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, '"x"'),
    "allOf": ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, "1"),
    "$ref": ({"$defs": {"i": {"type": "integer"}}, "$ref": "#/$defs/i"}, '"x"'),
    "minLength/maxLength": ({"type": "string", "minLength": 2, "maxLength": 3}, '"abcd"'),
    "pattern": ({"type": "string", "pattern": "^[0-9]+$"}, '"ab"'),
    "format (date)": ({"type": "string", "format": "date"}, '"hello"'),
    "minimum/maximum": ({"type": "integer", "minimum": 1, "maximum": 9}, "12"),
    "exclusiveMinimum": ({"type": "integer", "exclusiveMinimum": 5}, "5"),
    "multipleOf": ({"type": "integer", "multipleOf": 5}, "7"),
    "minItems/maxItems": ({"type": "array", "items": {"type": "integer"}, "maxItems": 1}, "[1,2]"),
    "prefixItems": ({"type": "array", "prefixItems": [{"type": "string"}], "items": False}, "[1]"),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1,1]"),
    "additionalProperties": (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False},
        '{"b":1}',
    ),
    "patternProperties": (
        {
            "type": "object",
            "patternProperties": {"^x": {"type": "integer"}},
            "additionalProperties": False,
        },
        '{"y":1}',
    ),
    "minProperties": ({"type": "object", "minProperties": 1}, "{}"),
    "not": ({"not": {"type": "integer"}}, "1"),
    "if/then/else": (
        {"if": {"type": "integer"}, "then": {"minimum": 5}, "else": {"type": "string"}},
        "1",
    ),
    "dependentRequired": ({"type": "object", "dependentRequired": {"a": ["b"]}}, '{"a":1}'),
}


def bytes_of_tokens(vocab: dict[str, int]) -> list[bytes]:
    """GPT-2's byte-level vocabulary maps each byte to a printable character; undo it to get each
    token's bytes."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, n = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    to_byte = {chr(c): b for b, c in zip(printable, chars)}
    out = [b""] * len(vocab)
    for token, i in vocab.items():
        out[i] = bytes(to_byte[c] for c in token)
    return out


class XGrammar:
    name = "xgrammar"

    def __init__(self, vocab: dict[str, int], eos: int, tokenizer_json: str):
        import xgrammar as xgr

        self.xgr = xgr
        encoded = sorted(vocab, key=vocab.get)
        self.info = xgr.TokenizerInfo(
            encoded,
            vocab_type=xgr.VocabType.BYTE_LEVEL,
            vocab_size=len(encoded),
            stop_token_ids=[eos],
        )
        self.vocab_size = len(encoded)

    def compile(self, schema: dict):
        return self.xgr.GrammarCompiler(self.info, cache_enabled=False).compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(",", ":")
        )

    def walk(self, compiled, tokens: list[int]) -> tuple[list[float], bool]:
        m = self.xgr.GrammarMatcher(compiled)
        bitmask = self.xgr.allocate_token_bitmask(1, self.vocab_size)
        times = []
        for t in tokens:
            start = time.perf_counter()
            m.fill_next_token_bitmask(bitmask)
            times.append(time.perf_counter() - start)
            if not m.accept_token(t):
                return times, False
        return times, m.is_terminated() or m.accept_token(self.info.stop_token_ids[0])

    def accepts(self, schema: dict, text: str, tokenize) -> bool:
        m = self.xgr.GrammarMatcher(self.compile(schema))
        return all(m.accept_token(t) for t in tokenize(text)) and m.accept_token(
            self.info.stop_token_ids[0]
        )


class LLGuidance:
    name = "llguidance"

    def __init__(self, vocab: dict[str, int], eos: int, tokenizer_json: str):
        import llguidance
        import llguidance.torch

        self.llg = llguidance
        self.tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=len(vocab), eos_token=eos)
        self.vocab_size, self.eos = len(vocab), eos

    def compile(self, schema: dict):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False}
        )
        # builds the parser; masks are computed lazily
        m = self.llg.LLMatcher(self.tok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return grammar

    def walk(self, grammar, tokens: list[int]) -> tuple[list[float], bool]:
        m = self.llg.LLMatcher(self.tok, grammar, log_level=0)
        bitmask = self.llg.torch.allocate_token_bitmask(1, self.vocab_size)
        times = []
        for t in tokens:
            start = time.perf_counter()
            self.llg.torch.fill_next_token_bitmask(m, bitmask, 0)
            times.append(time.perf_counter() - start)
            if not m.consume_token(t):
                return times, False
        return times, m.is_accepting()

    def accepts(self, schema: dict, text: str, tokenize) -> bool:
        m = self.llg.LLMatcher(self.tok, self.compile(schema), log_level=0)
        return m.consume_tokens(tokenize(text)) and m.is_accepting()


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, vocab: dict[str, int], eos: int, tokenizer_json: str):
        import outlines_core

        self.oc = outlines_core
        by_bytes: dict[bytes, list[int]] = {}
        for i, b in enumerate(bytes_of_tokens(vocab)):
            if i != eos:
                by_bytes.setdefault(b, []).append(i)
        self.vocab = outlines_core.Vocabulary(eos, by_bytes)
        self.vocab_size, self.eos = len(vocab), eos

    def compile(self, schema: dict):
        regex = self.oc.json_schema.build_regex_from_schema(
            json.dumps(schema), whitespace_pattern=""
        )
        return self.oc.Index(regex, self.vocab)

    def walk(self, index, tokens: list[int]) -> tuple[list[float], bool]:
        g = self.oc.Guide(index)
        mask = torch.zeros((self.vocab_size + 31) // 32, dtype=torch.int32)
        times = []
        for t in tokens:
            start = time.perf_counter()
            g.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
            times.append(time.perf_counter() - start)
            if not g.accepts_tokens([t]):
                return times, False
            g.advance(t)
        return times, g.is_finished() or g.accepts_tokens([self.eos])

    def accepts(self, schema: dict, text: str, tokenize) -> bool:
        g = self.oc.Guide(self.compile(schema))
        for t in tokenize(text):
            if not g.accepts_tokens([t]):
                return False
            g.advance(t)
        return g.accepts_tokens([self.eos]) or g.is_finished()


def keyword_support(lib, tokenize) -> dict[str, str]:
    """'ok' (compiles and forbids the text), 'ignored' (compiles but accepts it), or 'error'
    (refuses the schema)."""
    out = {}
    for keyword, (schema, forbidden) in KEYWORDS.items():
        try:
            lib.compile(schema)
        except Exception:
            out[keyword] = "error"
            continue
        try:
            out[keyword] = "ignored" if lib.accepts(schema, forbidden, tokenize) else "ok"
        except Exception:
            out[keyword] = "ok"
    return out


def measure(lib, tokenize, repeats: int) -> dict:
    row = {}
    for name, schema in SCHEMAS.items():
        compile_s = []
        for _ in range(repeats):
            start = time.perf_counter()
            compiled = lib.compile(schema)
            compile_s.append(time.perf_counter() - start)
        tokens = tokenize(json.dumps(INSTANCES[name], separators=(",", ":")))
        mask_s, ok = [], True
        for _ in range(repeats):
            times, accepted = lib.walk(compiled, tokens)
            mask_s.extend(times)
            ok = ok and accepted
        first = mask_s[:: len(tokens)] if ok else mask_s[:1]
        row[name] = {
            "compile_ms": 1e3 * statistics.median(compile_s),
            "first_ms": 1e3 * statistics.median(first),
            "mask_us": 1e6 * statistics.mean(mask_s),
            "tokens": len(tokens),
            "accepted": ok,
        }
    return row


def cpu_name() -> str:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(
            line.split(":", 1)[1].strip()
            for line in text.splitlines()
            if line.startswith("Model name")
        )
    except Exception:
        return "unknown CPU"


def table(results: dict, support: dict, setup_ms: dict) -> str:
    libs = list(results)
    lines = [
        "| library | version | vocabulary setup (ms) | schema | compile (ms) | first mask (ms) | mask (µs/token) |",
        "|---|---|---|---|---|---|---|",
    ]
    for lib in libs:
        version = importlib.metadata.version(lib.replace("-", "_"))
        for s in SCHEMAS:
            r = results[lib][s]
            mark = "" if r["accepted"] else " (instance refused)"
            lines.append(
                f"| {lib} | {version} | {setup_ms[lib]:.0f} | {s} ({r['tokens']} tokens) | "
                f"{r['compile_ms']:.1f} | {r['first_ms']:.2f} | {r['mask_us']:.0f}{mark} |"
            )
    lines += ["", "| keyword | " + " | ".join(libs) + " |", "|---" * (1 + len(libs)) + "|"]
    for k in KEYWORDS:
        lines.append(f"| `{k}` | " + " | ".join(support[lib][k] for lib in libs) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", default="../shared/data/tokenizers/gpt2")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--write", action="store_true", help="write the table into BENCHMARKS.md")
    args = parser.parse_args()
    from tokenizers import Tokenizer

    folder = Path(args.tokenizer)
    tokenizer_json = (folder / "tokenizer.json").read_text()
    vocab = json.loads((folder / "vocab.json").read_text())
    eos = vocab["<|endoftext|>"]
    hf = Tokenizer.from_str(tokenizer_json)

    def tokenize(text: str) -> list[int]:
        return hf.encode(text).ids

    results, support, setup_ms = {}, {}, {}
    for cls in (XGrammar, LLGuidance, OutlinesCore):
        start = time.perf_counter()
        lib = cls(vocab, eos, tokenizer_json)
        setup_ms[cls.name] = 1e3 * (time.perf_counter() - start)
        results[cls.name] = measure(lib, tokenize, args.repeats)
        support[cls.name] = keyword_support(lib, tokenize)
    text = table(results, support, setup_ms)
    command = f"python benchmarks/grammar_libs.py --tokenizer {args.tokenizer} --write"
    head = (
        f"`{command}` on {cpu_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}, GPT-2 "
        f"vocabulary ({len(vocab):,} tokens), compact JSON (no free whitespace). Compile: median of "
        f"{args.repeats} cold compiles (no cache); mask: mean time to fill one row's bitmask, over the tokens "
        "of a valid instance. Keywords: ok = compiles and forbids a text it rules out; ignored = compiles but "
        "accepts that text; error = refuses the schema."
    )
    publish(SECTION, head + "\n\n" + text, args.write)


if __name__ == "__main__":
    main()
