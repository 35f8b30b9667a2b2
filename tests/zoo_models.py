"""The model zoo of tests/test_zoo.py: tiny models of the installed transformers (random weights, nothing
downloaded) and three hand-written nets (a conv net, an MLP, a diffusion UNet's blocks), each with the inputs
its users call it with.

Every `Arch` builds a fresh model (fixed seed, `.eval()`) and its keyword inputs for a (batch, size)
pair: `size` is the sequence length of text models (the decoder's length for Whisper, whose encoder
input has a fixed length), the number of audio samples for Wav2Vec2 and the image side for vision
models. Text inputs carry an `attention_mask` that pads the last 3 positions of row 1 (right padding,
as a tokenizer batch does); encoder-decoders get `decoder_input_ids` too. Caches stay as each config
says (`use_cache` left at its default). Every dropout-like probability of a config is set to 0, so
train mode computes what eval mode does and is deterministic (nothing else is changed for the test).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

SEED = 0
VOCAB = 128
TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # inside the tiny vocabulary
# A causal LM / encoder: hidden 64, 4 heads of 16, 2 layers.
LM = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
          max_position_embeddings=64, **TOKENS)


@dataclass(frozen=True)
class Arch:
    name: str
    family: str  # causal-lm, encoder, encoder-decoder, speech, vision, hand-written
    build: Callable[[], nn.Module]
    inputs: Callable[[int, int], dict]  # (batch, size) -> keyword arguments
    example: tuple = (2, 16)  # (batch, size) that optimize profiles with
    other: tuple = (3, 11)  # a later call of another shape

    def model(self) -> nn.Module:
        torch.manual_seed(SEED)
        return self.build().eval()


def no_dropout(cfg):
    """Every dropout / layer-drop / drop-path / SpecAugment probability of a config (and its sub-configs) to 0."""
    for k, v in list(vars(cfg).items()):
        if isinstance(v, float) and ("drop" in k or k in ("mask_time_prob", "mask_feature_prob")):
            setattr(cfg, k, 0.0)
        elif hasattr(v, "to_dict") and hasattr(v, "model_type"):
            no_dropout(v)
    return cfg


def hf(cls_name: str, cfg_name: str, **cfg) -> Callable[[], nn.Module]:
    def build():
        import transformers

        config = no_dropout(getattr(transformers, cfg_name)(**cfg))
        return getattr(transformers, cls_name)(config)

    return build


# ------------------------------------------------------------------------------------------ inputs
def _gen(batch: int, size: int, salt: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(1000 * batch + size + 7 * salt)


def padded_mask(batch: int, seq: int) -> torch.Tensor:
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1, -3:] = 0  # row 1 is 3 tokens shorter (right padding)
    return mask


def token_ids(batch: int, seq: int, salt: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, seq), generator=_gen(batch, seq, salt))  # no special tokens


def text(batch: int, seq: int) -> dict:
    return {"input_ids": token_ids(batch, seq), "attention_mask": padded_mask(batch, seq)}


def seq2seq(batch: int, seq: int) -> dict:
    return {**text(batch, seq), "decoder_input_ids": token_ids(batch, seq // 2 + 1, salt=1)}


def pixels(batch: int, side: int) -> dict:
    return {"pixel_values": torch.randn(batch, 3, side, side, generator=_gen(batch, side))}


WHISPER = dict(vocab_size=VOCAB, num_mel_bins=16, d_model=64, encoder_layers=2, decoder_layers=2,
               encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
               max_source_positions=32, max_target_positions=64, decoder_start_token_id=1, **TOKENS)


def whisper_inputs(batch: int, dec_len: int) -> dict:
    mel = WHISPER["num_mel_bins"], 2 * WHISPER["max_source_positions"]  # Whisper's encoder takes exactly this
    return {"input_features": torch.randn(batch, *mel, generator=_gen(batch, dec_len)),
            "decoder_input_ids": token_ids(batch, dec_len, salt=1)}


def speech2text_inputs(batch: int, dec_len: int) -> dict:
    """Filter-bank frames (4 a decoder token) with padding at the end of row 1, and decoder tokens."""
    frames = 4 * dec_len
    mask = torch.ones(batch, frames, dtype=torch.long)
    mask[1, -8:] = 0
    return {"input_features": torch.randn(batch, frames, 16, generator=_gen(batch, dec_len)), "attention_mask": mask,
            "decoder_input_ids": token_ids(batch, dec_len // 2 + 1, salt=1)}


def audio(batch: int, samples: int) -> dict:
    return {"input_values": torch.randn(batch, samples, generator=_gen(batch, samples))}


# ----------------------------------------------------------------------------------- hand-written
class ConvNet(nn.Module):
    """Conv2d + BatchNorm2d + ReLU blocks with a residual, a depthwise conv, global pooling and a head."""

    def __init__(self, ch: int = 16, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, ch, 3, padding=1, bias=False), nn.BatchNorm2d(ch), nn.ReLU())
        self.blocks = nn.ModuleList(ConvBlock(ch) for _ in range(2))
        self.head = nn.Linear(ch, classes)

    def forward(self, pixel_values):
        x = self.stem(pixel_values)
        for b in self.blocks:
            x = b(x)
        return self.head(x.mean((2, 3)))


class ConvBlock(nn.Module):
    def __init__(self, ch: int):
        super().__init__()
        self.conv1 = nn.Conv2d(ch, ch, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(ch)
        self.dw = nn.Conv2d(ch, ch, 3, padding=1, groups=ch, bias=False)  # depthwise
        self.bn2 = nn.BatchNorm2d(ch)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.dw(y)) + x)


class MLP(nn.Module):
    """Pre-norm residual MLP blocks: LayerNorm -> Linear -> GELU -> Linear, plus the input."""

    def __init__(self, dim: int = 64, hidden: int = 128, depth: int = 2):
        super().__init__()
        self.layers = nn.ModuleList(MLPBlock(dim, hidden) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class MLPBlock(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


def unet():
    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:  # the GPU zoo's model (bench/workloads.py), at a CPU test's size
        sys.path.insert(0, root)
    from bench.workloads import UNetBlocks

    model = UNetBlocks(channels=32, groups=8, temb=32, heads=2)
    for m in model.modules():  # trained-looking GroupNorm affines
        if isinstance(m, nn.GroupNorm):
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.normal_(m.bias, std=0.5)
    return model


def unet_inputs(batch: int, side: int) -> dict:
    g = _gen(batch, side)
    return {"sample": torch.randn(batch, 32, side, side, generator=g),
            "timestep_embedding": torch.randn(batch, 32, generator=g)}


def mlp_inputs(batch: int, seq: int) -> dict:
    return {"x": torch.randn(batch, seq, 64, generator=_gen(batch, seq))}


def _batch_norm_stats(model: nn.Module) -> nn.Module:
    """BatchNorm running statistics that are not the identity (as a trained net's are)."""
    g = torch.Generator().manual_seed(SEED)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
    return model


# ------------------------------------------------------------------------------------------- zoo
IMG = (2, 32), (3, 32)  # vision: another batch size, the same image side

ARCHS: list[Arch] = [
    # causal LMs
    Arch("llama", "causal-lm", hf("LlamaForCausalLM", "LlamaConfig", num_key_value_heads=2, **LM), text),
    Arch("qwen2", "causal-lm", hf("Qwen2ForCausalLM", "Qwen2Config", num_key_value_heads=2, **LM), text),
    Arch("qwen3", "causal-lm", hf("Qwen3ForCausalLM", "Qwen3Config", num_key_value_heads=2, head_dim=16, **LM), text),
    Arch("gemma", "causal-lm", hf("GemmaForCausalLM", "GemmaConfig", num_key_value_heads=1, head_dim=16, **LM), text),
    Arch("phi3", "causal-lm", hf("Phi3ForCausalLM", "Phi3Config", **LM), text),
    Arch("phi", "causal-lm", hf("PhiForCausalLM", "PhiConfig", **LM), text),
    Arch("mistral", "causal-lm", hf("MistralForCausalLM", "MistralConfig", num_key_value_heads=2, **LM), text),
    Arch("gpt_neox", "causal-lm", hf("GPTNeoXForCausalLM", "GPTNeoXConfig", **LM), text),
    Arch("opt", "causal-lm", hf("OPTForCausalLM", "OPTConfig", vocab_size=VOCAB, hidden_size=64, ffn_dim=128,
                                num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                                word_embed_proj_dim=64, **TOKENS), text),
    Arch("gpt2", "causal-lm", hf("GPT2LMHeadModel", "GPT2Config", vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4,
                                 n_positions=64, **TOKENS), text),
    Arch("gptj", "causal-lm", hf("GPTJForCausalLM", "GPTJConfig", vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4,
                                 n_positions=64, rotary_dim=8, **TOKENS), text),
    Arch("bloom", "causal-lm", hf("BloomForCausalLM", "BloomConfig", vocab_size=VOCAB, hidden_size=64, n_layer=2,
                                  n_head=4, **TOKENS), text),
    Arch("falcon", "causal-lm", hf("FalconForCausalLM", "FalconConfig", vocab_size=VOCAB, hidden_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, **TOKENS), text),
    Arch("gpt_neo", "causal-lm", hf("GPTNeoForCausalLM", "GPTNeoConfig", vocab_size=VOCAB, hidden_size=64,
                                    num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
                                    window_size=8, max_position_embeddings=64, **TOKENS), text),
    Arch("mixtral", "causal-lm", hf("MixtralForCausalLM", "MixtralConfig", num_key_value_heads=2, num_local_experts=4,
                                    num_experts_per_tok=2, **LM), text),
    Arch("gemma2", "causal-lm", hf("Gemma2ForCausalLM", "Gemma2Config", num_key_value_heads=2, head_dim=16,
                                   sliding_window=8, **LM), text),
    Arch("starcoder2", "causal-lm", hf("Starcoder2ForCausalLM", "Starcoder2Config", num_key_value_heads=2, **LM), text),
    Arch("codegen", "causal-lm", hf("CodeGenForCausalLM", "CodeGenConfig", vocab_size=VOCAB, n_embd=64, n_layer=2,
                                    n_head=4, n_positions=64, rotary_dim=8, **TOKENS), text),
    Arch("gemma3", "causal-lm", hf("Gemma3ForCausalLM", "Gemma3TextConfig", num_key_value_heads=2, head_dim=16,
                                   sliding_window=8, **LM), text),
    Arch("olmo2", "causal-lm", hf("Olmo2ForCausalLM", "Olmo2Config", num_key_value_heads=2, **LM), text),
    Arch("cohere", "causal-lm", hf("CohereForCausalLM", "CohereConfig", num_key_value_heads=2, **LM), text),
    Arch("granite", "causal-lm", hf("GraniteForCausalLM", "GraniteConfig", num_key_value_heads=2, **LM), text),
    Arch("qwen2_moe", "causal-lm", hf("Qwen2MoeForCausalLM", "Qwen2MoeConfig", num_key_value_heads=2, num_experts=4,
                                      num_experts_per_tok=2, moe_intermediate_size=32,
                                      shared_expert_intermediate_size=64, **LM), text),
    Arch("stablelm", "causal-lm", hf("StableLmForCausalLM", "StableLmConfig", num_key_value_heads=2, **LM), text),
    Arch("nemotron", "causal-lm", hf("NemotronForCausalLM", "NemotronConfig", num_key_value_heads=2, **LM), text),
    Arch("persimmon", "causal-lm", hf("PersimmonForCausalLM", "PersimmonConfig", **LM), text),
    Arch("mpt", "causal-lm", hf("MptForCausalLM", "MptConfig", vocab_size=VOCAB, d_model=64, n_heads=4, n_layers=2,
                                expansion_ratio=2, max_seq_len=64, **TOKENS), text),
    Arch("biogpt", "causal-lm", hf("BioGptForCausalLM", "BioGptConfig", **LM), text),
    # no attention: a selective state-space scan, its cache the conv and SSM states
    Arch("mamba", "causal-lm", hf("MambaForCausalLM", "MambaConfig", vocab_size=VOCAB, hidden_size=64,
                                  num_hidden_layers=2, state_size=8, expand=2, conv_kernel=4, time_step_rank=8,
                                  **TOKENS), text, (2, 8), (3, 5)),  # the slow path's scan: ops per token
    # encoders
    Arch("bert", "encoder", hf("BertModel", "BertConfig", **LM), text),
    Arch("roberta", "encoder", hf("RobertaModel", "RobertaConfig", **{**LM, "max_position_embeddings": 66}), text),
    Arch("deberta_v2", "encoder", hf("DebertaV2Model", "DebertaV2Config", relative_attention=True,
                                     pos_att_type=["p2c", "c2p"], position_buckets=16, norm_rel_ebd="layer_norm",
                                     share_att_key=True, position_biased_input=False, **LM), text),
    Arch("distilbert", "encoder", hf("DistilBertModel", "DistilBertConfig", vocab_size=VOCAB, dim=64, n_layers=2,
                                     n_heads=4, hidden_dim=128, max_position_embeddings=64, pad_token_id=0), text),
    Arch("albert", "encoder", hf("AlbertModel", "AlbertConfig", embedding_size=32, **LM), text),
    Arch("electra", "encoder", hf("ElectraModel", "ElectraConfig", embedding_size=32, **LM), text),
    Arch("mpnet", "encoder", hf("MPNetModel", "MPNetConfig", **{**LM, "max_position_embeddings": 66}), text),
    Arch("modernbert", "encoder", hf("ModernBertModel", "ModernBertConfig", global_attn_every_n_layers=2,
                                     local_attention=8, cls_token_id=1, sep_token_id=2, **LM), text),
    Arch("esm", "encoder", hf("EsmModel", "EsmConfig", position_embedding_type="rotary", mask_token_id=3,
                              **{**LM, "max_position_embeddings": 66}), text),
    Arch("mobilebert", "encoder", hf("MobileBertModel", "MobileBertConfig", embedding_size=32, true_hidden_size=32,
                                     intra_bottleneck_size=32, num_feedforward_networks=2, **LM), text),
    Arch("funnel", "encoder", hf("FunnelModel", "FunnelConfig", vocab_size=VOCAB, block_sizes=[1, 1], d_model=64,
                                 n_head=4, d_head=16, d_inner=128, num_decoder_layers=1), text),
    # encoder-decoders
    Arch("bart", "encoder-decoder", hf("BartForConditionalGeneration", "BartConfig", vocab_size=VOCAB, d_model=64,
                                       encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                       decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                                       max_position_embeddings=64, decoder_start_token_id=1, **TOKENS), seq2seq),
    Arch("t5", "encoder-decoder", hf("T5ForConditionalGeneration", "T5Config", vocab_size=VOCAB, d_model=64, d_kv=16,
                                     d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
                                     relative_attention_num_buckets=8, decoder_start_token_id=0,
                                     pad_token_id=0, eos_token_id=2), seq2seq),
    Arch("marian", "encoder-decoder", hf("MarianMTModel", "MarianConfig", vocab_size=VOCAB, d_model=64,
                                         encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                         decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                                         max_position_embeddings=64, decoder_start_token_id=0, **TOKENS), seq2seq),
    Arch("pegasus", "encoder-decoder", hf("PegasusForConditionalGeneration", "PegasusConfig", vocab_size=VOCAB,
                                          d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                          decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                                          max_position_embeddings=64, decoder_start_token_id=0, **TOKENS), seq2seq),
    # speech
    Arch("whisper", "speech", hf("WhisperForConditionalGeneration", "WhisperConfig", **WHISPER), whisper_inputs,
         example=(2, 8), other=(3, 5)),
    Arch("wav2vec2", "speech", hf("Wav2Vec2Model", "Wav2Vec2Config", vocab_size=32, hidden_size=64,
                                  num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                  conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3),
                                  num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4), audio,
         example=(2, 400), other=(3, 320)),
    Arch("hubert", "speech", hf("HubertModel", "HubertConfig", vocab_size=32, hidden_size=64,
                                num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3),
                                num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4), audio,
         example=(2, 400), other=(3, 320)),
    # vision
    Arch("dinov2", "vision", hf("Dinov2Model", "Dinov2Config", image_size=32, patch_size=8, hidden_size=64,
                                num_hidden_layers=2, num_attention_heads=4, mlp_ratio=2), pixels, *IMG),
    Arch("siglip_vision", "vision", hf("SiglipVisionModel", "SiglipVisionConfig", image_size=32, patch_size=8,
                                       hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=128), pixels, *IMG),
    Arch("beit", "vision", hf("BeitModel", "BeitConfig", image_size=32, patch_size=8, hidden_size=64,
                              num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                              use_relative_position_bias=True), pixels, *IMG),
    Arch("convnextv2", "vision", hf("ConvNextV2Model", "ConvNextV2Config", hidden_sizes=[16, 32], depths=[1, 1],
                                    num_stages=2, image_size=32), pixels, *IMG),
    Arch("regnet", "vision", hf("RegNetModel", "RegNetConfig", embedding_size=16, hidden_sizes=[16, 32],
                                depths=[1, 1], groups_width=8), pixels, *IMG),
    Arch("vit", "vision", hf("ViTModel", "ViTConfig", image_size=32, patch_size=8, hidden_size=64,
                             num_hidden_layers=2, num_attention_heads=4, intermediate_size=128), pixels, *IMG),
    Arch("swin", "vision", hf("SwinModel", "SwinConfig", image_size=32, patch_size=4, embed_dim=16, depths=[1, 1],
                              num_heads=[2, 2], window_size=4), pixels, *IMG),
    Arch("convnext", "vision", hf("ConvNextModel", "ConvNextConfig", hidden_sizes=[16, 32], depths=[1, 1],
                                  num_stages=2, image_size=32), pixels, *IMG),
    Arch("clip_text", "vision", hf("CLIPTextModel", "CLIPTextConfig", **LM), text),
    Arch("clip_vision", "vision", hf("CLIPVisionModel", "CLIPVisionConfig", image_size=32, patch_size=8, hidden_size=64,
                                     num_hidden_layers=2, num_attention_heads=4, intermediate_size=128), pixels, *IMG),
    Arch("deit", "vision", hf("DeiTModel", "DeiTConfig", image_size=32, patch_size=8, hidden_size=64,
                              num_hidden_layers=2, num_attention_heads=4, intermediate_size=128), pixels, *IMG),
    Arch("resnet", "vision", hf("ResNetModel", "ResNetConfig", embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                layer_type="bottleneck"), pixels, *IMG),
    Arch("segformer", "vision", hf("SegformerModel", "SegformerConfig", num_encoder_blocks=2, depths=[1, 1],
                                   sr_ratios=[2, 1], hidden_sizes=[16, 32], patch_sizes=[7, 3], strides=[4, 2],
                                   num_attention_heads=[1, 2], mlp_ratios=[2, 2]), pixels, *IMG),
    Arch("poolformer", "vision", hf("PoolFormerModel", "PoolFormerConfig", hidden_sizes=[16, 32], depths=[1, 1],
                                    num_encoder_blocks=2, patch_sizes=[7, 3], strides=[4, 2], padding=[2, 1]),
         pixels, *IMG),
    # from a sweep of architectures outside the zoo (session 21): each ran, matched eager and patched something
    Arch("xlnet", "encoder", hf("XLNetModel", "XLNetConfig", vocab_size=VOCAB, d_model=64, n_layer=2, n_head=4,
                                d_inner=128, **TOKENS), text),
    Arch("convbert", "encoder", hf("ConvBertModel", "ConvBertConfig", embedding_size=64, head_ratio=2,
                                   conv_kernel_size=9, **LM), text),
    Arch("longformer", "encoder", hf("LongformerModel", "LongformerConfig", attention_window=8,
                                     **{**LM, "max_position_embeddings": 80}), text),
    Arch("jamba", "causal-lm", hf("JambaForCausalLM", "JambaConfig", num_key_value_heads=2, num_experts=4,
                                  num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1,
                                  attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8, mamba_d_conv=4,
                                  mamba_expand=2, mamba_dt_rank=8, **LM), text),
    Arch("deepseek_v3", "causal-lm", hf("DeepseekV3ForCausalLM", "DeepseekV3Config", num_key_value_heads=4,
                                        moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
                                        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                                        kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                        v_head_dim=16, **LM), text),
    Arch("gpt_oss", "causal-lm", hf("GptOssForCausalLM", "GptOssConfig", num_key_value_heads=2, head_dim=16,
                                    num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                                    layer_types=["sliding_attention", "full_attention"],
                                    **{**LM, "intermediate_size": 64}), text),
    Arch("speech2text", "speech", hf("Speech2TextForConditionalGeneration", "Speech2TextConfig", vocab_size=VOCAB,
                                     d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                     decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                                     input_feat_per_channel=16, input_channels=1, conv_kernel_sizes=(5, 5),
                                     conv_channels=32, max_source_positions=64, max_target_positions=64,
                                     decoder_start_token_id=1, **TOKENS), speech2text_inputs),
    # hand-written
    Arch("convnet", "hand-written", lambda: _batch_norm_stats(ConvNet()), pixels, (2, 16), (3, 12)),
    Arch("mlp", "hand-written", MLP, mlp_inputs),
    Arch("unet", "hand-written", unet, unet_inputs, (2, 8), (3, 6)),
]
BY_NAME = {a.name: a for a in ARCHS}
