"""Write a tiny random-weight Llama model with its own tokenizer to a folder, for real vLLM.

There is no model hub on the build machine, so the real-engine tests (tests/realengine) load
this instead: a byte-level BPE tokenizer trained here on a small built-in text, a chat
template, and a 2-layer Llama whose weights come from a fixed seed (so every run writes the
same model). Run it with an interpreter that has torch, transformers and tokenizers (the
vLLM virtualenv does):

    python testbed/tiny_model.py OUT_DIR [--kv-heavy | --wide]

(or ``scripts/dev/make_tiny_model.py``). It imports nothing of the project, so the vLLM
virtualenv runs it by its path (testbed/vllm_env.py).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

VOCAB_SIZE = 1024
# Chat turns as plain text, so the template needs no special tokens beyond bos/eos.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


def corpus() -> list[str]:
    words = [
        "the",
        "a",
        "prefill",
        "decode",
        "token",
        "cache",
        "engine",
        "router",
        "policy",
        "node",
        "card",
        "memory",
        "shared",
        "segment",
        "lease",
        "transfer",
        "prompt",
        "answer",
        "stream",
        "chunk",
        "batch",
        "latency",
        "throughput",
        "cpu",
        "gpu",
        "numa",
        "core",
        "thread",
        "queue",
        "request",
        "model",
        "layer",
        "head",
        "block",
        "page",
        "offload",
        "split",
        "merge",
        "fast",
        "slow",
        "hot",
        "cold",
        "one",
        "two",
        "three",
        "four",
        "five",
        "six",
        "seven",
        "eight",
        "nine",
        "ten",
        "and",
        "or",
        "not",
        "is",
        "are",
        "was",
        "were",
        "be",
        "been",
        "have",
        "has",
        "had",
        "do",
        "does",
        "did",
        "will",
        "would",
        "can",
        "could",
        "should",
        "may",
        "might",
    ]
    lines = []
    for i in range(400):
        n = 6 + i % 11
        lines.append(" ".join(words[(i * 7 + j * 13) % len(words)] for j in range(n)) + ".")
    lines += ["user: hello\nassistant: hello there", "system: be brief\n"]
    return lines


# --kv-heavy: the same tokenizer and size class, but 64 KiB of KV per token (4 layers x 32 KV
# heads x 128 x 2 x bf16), so 1 GiB of VLLM_CPU_KVCACHE_SPACE holds 16k tokens and a modest
# load runs the engine out of KV (scripts/bench/pressure_compare.py).
KV_HEAVY = {"num_hidden_layers": 4, "num_attention_heads": 32, "num_key_value_heads": 32}
# --wide: the second geometry of the real-engine tier (tests/realengine/test_pd_geometry.py):
# 8 KV heads of 128 (no grouping), 3 layers and 1,024 positions, so no layout assumption of
# the connector or the router hides behind the first model's 2 heads of 64 and 4,096 positions.
WIDE = {
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 1024,
}


def cpu_has_bf16() -> bool:
    """Whether this CPU computes in bfloat16 (x86 AVX512-BF16 or AMX, Arm's BF16)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = set(text.split())
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def build(out: Path, *, seed: int = 0, kv_heavy: bool = False, wide: bool = False) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 0)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)

    torch.manual_seed(seed)
    shape: dict[str, int] = {
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,  # head_dim 64, grouped-query attention as in real models
        "max_position_embeddings": 4096,
    }
    dtype = torch.bfloat16
    if kv_heavy:
        shape = {**shape, **KV_HEAVY, "head_dim": 128}
    if wide:
        shape = WIDE
        dtype = torch.bfloat16 if cpu_has_bf16() else torch.float32
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=256,
        intermediate_size=512,
        **shape,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        tie_word_embeddings=False,
        torch_dtype=str(dtype).removeprefix("torch."),
    )
    model = LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(out, safe_serialization=True)
    (out / "syshax-tiny-model.json").write_text(json.dumps({"seed": seed, "vocab": len(fast)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    shape = parser.add_mutually_exclusive_group()
    shape.add_argument("--kv-heavy", action="store_true", help="64 KiB of KV per token")
    shape.add_argument(
        "--wide",
        action="store_true",
        help="8 KV heads of 128, 1,024 positions (bf16 if the CPU has it)",
    )
    args = parser.parse_args()
    build(args.out, seed=args.seed, kv_heavy=args.kv_heavy, wide=args.wide)
    print(args.out)


if __name__ == "__main__":
    main()
