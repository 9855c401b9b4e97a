"""Small PyTorch models for trainerd's torchscript plugin, written as any PyTorch user writes them.

Each scripts cleanly with torch.jit.script (script.py writes the file trainerd trains) and trains
eagerly as it is (eager.py, the comparison). Inputs are Fashion-MNIST images: [batch, 1, 28, 28]
for the CNNs, the 28 rows as a sequence of 28 tokens, [batch, 28, 28], for the transformer.
"""
import math

import torch
import torch.nn as nn


class TutorialCnn(nn.Module):
    """The TensorFlow multi-worker tutorials' CNN (trainerd's mnist-cnn plugin): Conv 32 3x3 ReLU,
    MaxPool 2, Dense 64 ReLU, Dense 10."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 32, 3)
        self.dense = nn.Linear(32 * 13 * 13, 64)
        self.logits = nn.Linear(64, 10)

    def forward(self, x):
        x = torch.max_pool2d(torch.relu(self.conv(x)), 2)
        return self.logits(torch.relu(self.dense(x.flatten(1))))


class BatchNormCnn(nn.Module):
    """The CNN with BatchNorm after the convolution: buffers (running mean and variance, the batch
    count) that are state, not parameters."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 32, 3, bias=False)
        self.bn = nn.BatchNorm2d(32)
        self.dense = nn.Linear(32 * 13 * 13, 64)
        self.logits = nn.Linear(64, 10)

    def forward(self, x):
        x = torch.max_pool2d(torch.relu(self.bn(self.conv(x))), 2)
        return self.logits(torch.relu(self.dense(x.flatten(1))))


class RowTransformer(nn.Module):
    """A one-block pre-norm transformer encoder over the image's rows as tokens: a row embedding
    and learned positions, multi-head self-attention, a feed-forward layer, mean pooling, a
    classifier. Attention is written out (not nn.MultiheadAttention) so that eager and scripted
    runs take the same kernels in training and in evaluation."""

    def __init__(self, tokens: int = 28, width: int = 28, d: int = 64, heads: int = 4, ff: int = 128):
        super().__init__()
        self.heads = heads
        self.scale = 1.0 / math.sqrt(d // heads)
        self.embed = nn.Linear(width, d)
        self.pos = nn.Parameter(torch.randn(tokens, d) * 0.02)
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)
        self.ff1 = nn.Linear(d, ff)
        self.ff2 = nn.Linear(ff, d)
        self.head = nn.Linear(d, 10)

    def forward(self, x):
        h = self.embed(x) + self.pos
        b, t, d = h.shape
        q, k, v = self.qkv(self.norm1(h)).chunk(3, dim=-1)
        q = q.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)
        k = k.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)
        v = v.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)
        attention = torch.softmax(torch.matmul(q, k.transpose(-2, -1)) * self.scale, dim=-1)
        h = h + self.proj(torch.matmul(attention, v).transpose(1, 2).reshape(b, t, d))
        h = h + self.ff2(torch.relu(self.ff1(self.norm2(h))))
        return self.head(h.mean(dim=1))


MODELS = {"cnn": TutorialCnn, "bn": BatchNormCnn, "transformer": RowTransformer}

# What trainerd's torchscript plugin needs to be told about each (--plugin-arg KEY=VALUE).
PLUGIN_ARGS = {"cnn": [], "bn": [], "transformer": ["input_shape=28x28"]}

# The shape of one example as each model takes it.
INPUT_SHAPE = {"cnn": (1, 28, 28), "bn": (1, 28, 28), "transformer": (28, 28)}


def build(name: str, seed: int) -> nn.Module:
    """Model `name` with its initial weights drawn from `seed`."""
    torch.manual_seed(seed)
    return MODELS[name]()
