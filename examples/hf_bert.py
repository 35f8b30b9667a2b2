"""Hugging Face BertModel forward pass (random weights, SDPA attention).

cuda: bf16, bert-base dims (hidden 768, 12 heads, intermediate 3072, vocab 30522), 2 layers, batch 32 x seq 512.
cpu:  fp32, hidden 64, 2 layers, 4 heads, intermediate 128, vocab 256, batch 2 x seq 16.
Usage: python examples/hf_bert.py [--device cuda|cpu] [--iters 3] [--layers N] [--attn sdpa|eager]
"""
import argparse
import os

import torch


def main():
    default_device = os.environ.get("FUSION_ADVISOR_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    ap = argparse.ArgumentParser(description="HF BERT forward")
    ap.add_argument("--device", default=default_device, choices=["cuda", "cpu"])
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"],
                    help="attention implementation: eager materialises softmax(q k^T) (what attention fusion targets)")
    a = ap.parse_args()

    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    if a.device == "cuda":
        dtype, batch, seq = torch.bfloat16, 32, 512
        dims = dict(hidden_size=768, num_attention_heads=12, intermediate_size=3072, vocab_size=30522)
    else:
        dtype, batch, seq = torch.float32, 2, 16
        dims = dict(hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=256)
    config = BertConfig(num_hidden_layers=a.layers, max_position_embeddings=max(seq, 512), **dims)
    config._attn_implementation = a.attn
    with torch.device(a.device):
        model = BertModel(config).to(dtype).eval()
        ids = torch.randint(0, config.vocab_size, (batch, seq))
        mask = torch.ones(batch, seq, dtype=torch.long)
    with torch.inference_mode():
        for _ in range(a.iters):
            out = model(input_ids=ids, attention_mask=mask)
    if a.device == "cuda":
        torch.cuda.synchronize()
    h = out.last_hidden_state
    print(f"hf_bert: {a.iters} iterations on {a.device}, hidden {tuple(h.shape)} {h.dtype}")


if __name__ == "__main__":
    main()
