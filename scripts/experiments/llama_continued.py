"""Helpers of experiment 4 (docs/experiments/llama-continued.md), used by llama_continued.sh.

make-model OUT --tokenizer DIR   a small random LlamaForCausalLM saved with transformers, plus the
                                 Llama 2 tokenizer (a stand-in for a downloaded Llama 2 checkpoint)
corpus TEXT OUT.jsonl            one JSON line per paragraph (a play's speeches), so the corpus has
                                 documents to split into train and validation
check HF_DIR LMFORGE_DIR --source SRC_HF_DIR [--prompt TEXT]
                                 loads the exported folder in transformers: logits equal lmforge's
                                 on the same folder's weights, weights differ from the source, and a
                                 greedy continuation is generated; prints one JSON object
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path


def make_model(out: Path, tokenizer: Path, seed: int = 0) -> None:
    import torch
    import transformers as tf

    config = tf.LlamaConfig(
        vocab_size=32000,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    tf.LlamaForCausalLM(config).save_pretrained(out)
    # The Llama 2 license asks that the agreement and notice travel with the tokenizer file.
    for name in ("tokenizer.model", "LICENSE.txt", "NOTICE.txt"):
        if (tokenizer / name).is_file():
            shutil.copy(tokenizer / name, out / name)


def corpus(text: Path, out: Path) -> int:
    paragraphs = [p.strip() for p in text.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs))
    tmp.replace(out)
    return len(paragraphs)


def check(hf_dir: Path, lmforge_dir: Path, source: Path, prompt: str, new_tokens: int = 24) -> dict:
    import torch
    import transformers as tf

    from lmforge.models import load_pretrained
    from lmforge.tokenizers import load_tokenizer

    tok = load_tokenizer(lmforge_dir)
    ids = torch.tensor([[tok.bos_id, *tok.encode(prompt)]])
    hf = tf.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ours = load_pretrained(lmforge_dir).eval()
    with torch.no_grad():
        hf_logits, our_logits = hf(ids).logits, ours(ids)[..., : hf.config.vocab_size]
    src = tf.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).state_dict()
    new = hf.state_dict()
    changed = [k for k in src if not torch.equal(src[k], new[k])]
    out = hf.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.eos_id)
    return {
        "max_abs_logit_diff": (hf_logits - our_logits).abs().max().item(),
        "tensors": len(src),
        "tensors_changed": len(changed),
        "prompt": prompt,
        "generated": tok.decode(out[0, ids.shape[1] :].tolist()),
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make-model")
    m.add_argument("out", type=Path)
    m.add_argument("--tokenizer", type=Path, required=True)
    c = sub.add_parser("corpus")
    c.add_argument("text", type=Path)
    c.add_argument("out", type=Path)
    k = sub.add_parser("check")
    k.add_argument("hf_dir", type=Path)
    k.add_argument("lmforge_dir", type=Path)
    k.add_argument("--source", type=Path, required=True)
    k.add_argument("--prompt", default="ROMEO:")
    args = p.parse_args(argv)
    if args.cmd == "make-model":
        make_model(args.out, args.tokenizer)
        print(f"wrote a random LlamaForCausalLM to {args.out}")
    elif args.cmd == "corpus":
        print(f"wrote {corpus(args.text, args.out)} paragraphs to {args.out}")
    else:
        print(json.dumps(check(args.hf_dir, args.lmforge_dir, args.source, args.prompt)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
