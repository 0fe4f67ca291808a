#!/usr/bin/env python3
"""Write a tiny random-weight Llama model with its own tokenizer to a folder, for real vLLM.

The writer is testbed/tiny_model.py (the real-engine tests run it through testbed/vllm_env.py);
this runs it by hand. Use an interpreter that has torch, transformers and tokenizers (the
vLLM virtualenv does):

    python scripts/dev/make_tiny_model.py OUT_DIR [--kv-heavy | --wide]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from testbed.tiny_model import main

if __name__ == "__main__":
    main()
