"""A SPLADE head on BERT: MLM head to the vocabulary, then max over the sequence of log(1 + relu(logits)) * mask.

Eager PyTorch materialises the B x L x V logits (V = 30522); a matmul + reduction kernel never has to.
cuda: bf16, bert-base dims (hidden 768, vocab 30522), batch 32 x seq 256.
cpu:  fp32, hidden 64, vocab 1000, batch 2 x seq 16.
Usage: python examples/splade.py [--device cuda|cpu] [--iters 3]
"""
import argparse
import os

import torch


class SpladeHead(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        from transformers.models.bert.modeling_bert import BertOnlyMLMHead

        self.mlm = BertOnlyMLMHead(config)

    def forward(self, hidden, attention_mask):
        logits = self.mlm(hidden)
        weights = torch.log1p(torch.relu(logits)) * attention_mask.unsqueeze(-1)
        return torch.amax(weights, dim=1)


def main():
    default_device = os.environ.get("FUSION_ADVISOR_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    ap = argparse.ArgumentParser(description="SPLADE head on BERT")
    ap.add_argument("--device", default=default_device, choices=["cuda", "cpu"])
    ap.add_argument("--iters", type=int, default=3)
    a = ap.parse_args()

    from transformers import BertConfig

    torch.manual_seed(0)
    if a.device == "cuda":
        dtype, batch, seq, config = torch.bfloat16, 32, 256, BertConfig()
    else:
        dtype, batch, seq = torch.float32, 2, 16
        config = BertConfig(hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=1000)
    with torch.device(a.device):
        head = SpladeHead(config).to(dtype).eval()
        hidden = torch.randn(batch, seq, config.hidden_size, dtype=dtype)
        mask = (torch.rand(batch, seq) > 0.2).to(dtype)
    with torch.inference_mode():
        for _ in range(a.iters):
            out = head(hidden, mask)
    if a.device == "cuda":
        torch.cuda.synchronize()
    print(f"splade: {a.iters} iterations on {a.device}, output {tuple(out.shape)} {out.dtype}")


if __name__ == "__main__":
    main()
