"""Small Hugging Face models built from configs (no download), for the real-model tests and for
`zinf plan`:

    zinf plan tests/hf_models.py:build --arg name=llama --params auto --budget 1MiB

Every model is fp32 with dropout off, hidden 128 (so that its projections, embeddings and heads
reach zinf's 64 KiB management threshold), 2 layers, 4 heads, vocabulary 512. `build` returns
(model, positional example inputs) as `zinf plan` wants, the model wrapped so that positional
arguments reach the Hugging Face forward as keywords; `hf_model` and `hf_batch` give the bare
model and its keyword batch, which is what the training tests compile.
"""
from __future__ import annotations

import torch
import torch.nn as nn

VOCAB, HIDDEN, INTER, LAYERS, HEADS = 512, 128, 256, 2, 4
BATCH, SEQ = 4, 64

NAMES = ("gpt2", "llama", "mistral", "qwen2", "bert", "t5", "bart")


def _config(name: str):
    import transformers as tf

    if name == "gpt2":
        return tf.GPT2Config(vocab_size=VOCAB, n_positions=128, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                             n_inner=INTER, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    if name in ("llama", "mistral", "qwen2"):
        cls = {"llama": tf.LlamaConfig, "mistral": tf.MistralConfig, "qwen2": tf.Qwen2Config}[name]
        return cls(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                   num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=128,
                   attention_dropout=0.0, tie_word_embeddings=False)
    if name == "bert":
        return tf.BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                             num_attention_heads=HEADS, intermediate_size=INTER, max_position_embeddings=128,
                             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    if name == "t5":
        return tf.T5Config(vocab_size=VOCAB, d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=INTER, num_layers=LAYERS,
                           num_decoder_layers=LAYERS, num_heads=HEADS, dropout_rate=0.0,
                           decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    if name == "bart":
        return tf.BartConfig(vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=LAYERS, decoder_layers=LAYERS,
                             encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=INTER,
                             decoder_ffn_dim=INTER, max_position_embeddings=128, dropout=0.0,
                             attention_dropout=0.0, activation_dropout=0.0, classifier_dropout=0.0,
                             pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
    raise ValueError(f"unknown model {name!r}; one of {NAMES}")


def hf_config(name: str, layers: int = LAYERS):
    cfg = _config(name)
    cfg.torch_dtype = torch.float32
    if layers != LAYERS:  # every config's own names for its depth
        for key in ("n_layer", "num_hidden_layers", "num_layers", "num_decoder_layers", "encoder_layers",
                    "decoder_layers"):
            if hasattr(cfg, key):
                setattr(cfg, key, int(layers))
    return cfg


def hf_model(name: str, seed: int = 0, layers: int = LAYERS):
    """The bare Hugging Face model, fp32, initialised from `seed`."""
    import transformers as tf

    cls = {"gpt2": tf.GPT2LMHeadModel, "llama": tf.LlamaForCausalLM, "mistral": tf.MistralForCausalLM,
           "qwen2": tf.Qwen2ForCausalLM, "bert": tf.BertForMaskedLM, "t5": tf.T5ForConditionalGeneration,
           "bart": tf.BartForConditionalGeneration}[name]
    torch.manual_seed(seed)
    model = cls(hf_config(name, layers))
    model.train()  # dropout is 0 everywhere: train mode is deterministic too
    return model


def hf_batch(name: str, batch: int = BATCH, seq: int = SEQ, seed: int = 1) -> dict[str, torch.Tensor]:
    """Keyword inputs that make the model return a loss. Ids avoid 0..2 (pad/bos/eos ids)."""
    g = torch.Generator().manual_seed(seed)

    def ids():  # torch.randint with a generator also works under FakeTensorMode
        return torch.randint(3, VOCAB, (batch, seq), generator=g)

    out = {"input_ids": ids(), "labels": ids()}  # T5/BART derive decoder inputs from the labels
    if name in ("bert", "t5", "bart"):  # without a mask these look for padding: data-dependent
        out["attention_mask"] = torch.ones(batch, seq, dtype=torch.long)
    return out


class Positional(nn.Module):
    """forward(*tensors) -> model(**dict(zip(keys, tensors))), for `zinf plan`'s positional inputs."""

    def __init__(self, model: nn.Module, keys: tuple[str, ...]) -> None:
        super().__init__()
        self.model = model
        self.keys = keys

    def forward(self, *tensors):
        return self.model(**dict(zip(self.keys, tensors)))


def build(name: str = "gpt2", batch: int = BATCH, seq: int = SEQ, seed: int = 0, layers: int = LAYERS):
    """(model, example inputs) for `zinf plan`; built in place, so it also works under FakeTensorMode."""
    model = hf_model(name, seed, int(layers))
    inputs = hf_batch(name, int(batch), int(seq))
    return Positional(model, tuple(inputs)), tuple(inputs.values())


# -- convolutions whose weights zinf manages ------------------------------------------------------

CONV_NAMES = ("cnn", "convfront")
CLASSES, CONVS = 10, 3
IMAGE = {"cnn": 128, "convfront": 64}  # convfront: 8x8 patches, 64 tokens an image


class CNN(nn.Module):
    """A patchifying convolution (96 KiB weight) and CONVS 3x3 convolutions (576 KiB each), all
    managed, then a small head."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, HIDDEN, 8, stride=8)  # 3*128*8*8 floats = 96 KiB
        self.convs = nn.ModuleList(nn.Conv2d(HIDDEN, HIDDEN, 3, padding=1) for _ in range(CONVS))  # 576 KiB
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x, y):
        h = torch.relu(self.patch(x))
        for conv in self.convs:
            h = torch.relu(conv(h))
        return nn.functional.cross_entropy(self.head(h.mean((2, 3))), y)


class ConvFront(nn.Module):
    """A convolutional patch embedding (managed weight) in front of two MLP blocks over the tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, HIDDEN, 8, stride=8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, 2 * INTER), nn.GELU(),
                                                  nn.Linear(2 * INTER, HIDDEN)) for _ in range(LAYERS))
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x, y):
        h = self.patch(x).flatten(2).transpose(1, 2)  # (batch, tokens, hidden)
        for blk in self.blocks:
            h = h + blk(h)
        return nn.functional.cross_entropy(self.head(h.mean(1)), y)


def conv_model(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return {"cnn": CNN, "convfront": ConvFront}[name]()


def conv_batch(name: str, batch: int = BATCH, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, IMAGE[name], IMAGE[name], generator=g), torch.randint(0, CLASSES, (batch,), generator=g)


def build_conv(name: str = "cnn", batch: int = BATCH, seed: int = 0):
    """(model, example inputs) of a convolutional model, for `zinf plan`."""
    return conv_model(name, seed), conv_batch(name, int(batch))
