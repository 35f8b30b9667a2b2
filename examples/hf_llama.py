"""Hugging Face LlamaForCausalLM forward pass (random weights, SDPA attention, no KV cache).

cuda: bf16, hidden 2048, 2 layers, 16 heads, intermediate 5632, vocab 32000, batch 4 x seq 512.
cpu:  fp32, hidden 64, 2 layers, 4 heads, intermediate 128, vocab 256, batch 2 x seq 16.
Usage: python examples/hf_llama.py [--device cuda|cpu] [--iters 3] [--layers N]
"""
import argparse
import os

import torch


def main():
    default_device = os.environ.get("FUSION_ADVISOR_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    ap = argparse.ArgumentParser(description="HF Llama forward")
    ap.add_argument("--device", default=default_device, choices=["cuda", "cpu"])
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--layers", type=int, default=2)
    a = ap.parse_args()

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if a.device == "cuda":
        dtype, batch, seq = torch.bfloat16, 4, 512
        dims = dict(hidden_size=2048, num_attention_heads=16, intermediate_size=5632, vocab_size=32000)
    else:
        dtype, batch, seq = torch.float32, 2, 16
        dims = dict(hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=256)
    config = LlamaConfig(num_hidden_layers=a.layers, max_position_embeddings=max(seq, 128), **dims)
    config._attn_implementation = "sdpa"
    with torch.device(a.device):
        model = LlamaForCausalLM(config).to(dtype).eval()
        ids = torch.randint(0, config.vocab_size, (batch, seq))
    with torch.inference_mode():
        for _ in range(a.iters):
            out = model(input_ids=ids, use_cache=False)
    if a.device == "cuda":
        torch.cuda.synchronize()
    print(f"hf_llama: {a.iters} iterations on {a.device}, logits {tuple(out.logits.shape)} {out.logits.dtype}")


if __name__ == "__main__":
    main()
