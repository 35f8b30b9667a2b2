#!/usr/bin/env python
"""How many model calls `optimize`'s selection makes, on the CPU (no GPU needed): an HF Llama from a tiny
config, its generated kernels replaced by the original ops (sites count their launches as the real ones
do), the clocks forced meaningful so that selection runs as it would on a GPU.

    TRITON_INTERPRET=1 PYTHONPATH=$PWD python3 bench/selection_calls.py [LAYERS]

Prints the model calls selection made and its wall seconds (CPU seconds: what the count is for, not the
time), then the decision. Run it at two commits to compare selection's cost (README: 0b620db 436 calls,
efd472b 317 for 4 layers).
"""
import os
import sys
import tempfile
import time
import warnings

warnings.simplefilter("ignore")
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["FUSION_ADVISOR_CACHE"] = tempfile.mkdtemp(prefix="selection-calls-")

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import advisor  # noqa: E402
import advisor.bench.timing as timing  # noqa: E402
import advisor.workflows.live_model as live_model  # noqa: E402
from advisor.patching import rewrite  # noqa: E402


def _site(self, *xs):  # a launch counted as the real site counts it, the original ops computing
    keys = rewrite.enabled_keys()
    if (keys is None or self.key in keys) and self._guard(xs):
        self.stats["launched"] += 1
        caller = getattr(rewrite._RUNTIME, "caller", None)
        self.callers[caller] = self.callers.get(caller, 0) + 1
    return self.fallback(*xs)


def main(layers: int) -> None:
    rewrite.Site.__call__ = _site
    timing.timing_meaningful = lambda device: True
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(cfg).eval()
    calls = [0]
    forward = LlamaForCausalLM.forward

    def counted(self, *a, **k):
        calls[0] += 1
        return forward(self, *a, **k)

    LlamaForCausalLM.forward = counted
    selected = live_model.keep_faster

    def keep_faster(*a, **k):
        c0, t0 = calls[0], time.perf_counter()
        out = selected(*a, **k)
        print(f"selection: {calls[0] - c0} model calls, {time.perf_counter() - t0:.1f} s (CPU)", flush=True)
        return out

    live_model.keep_faster = keep_faster
    ids = torch.randint(0, 256, (2, 32))
    report = advisor.optimize(model, {"input_ids": ids}, interpret=True, reuse=False)
    print(report.selection["decision"])


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4)
