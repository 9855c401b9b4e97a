"""The tutorial CNN with BatchNorm after the convolution (trainerd's mnist-bn plugin) for
trainerd's Python model plugin: buffers (running mean and variance, the batch count) that are
state, not parameters.

    trainerd run --plugin libpython_model.so --plugin-arg module=mnist_bn.py --data MNIST_DIR ...

The batch is {"image": float32 [B, 1, 28, 28] in [0, 1], "label": int64 [B]}; trainerd's default
loss (cross-entropy of module(image) against label) and metric (accuracy).
"""
import torch
import torch.nn as nn


class BatchNormCnn(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 32, 3, bias=False)
        self.bn = nn.BatchNorm2d(32)
        self.dense = nn.Linear(32 * 13 * 13, 64)
        self.logits = nn.Linear(64, 10)

    def forward(self, x):
        x = torch.max_pool2d(torch.relu(self.bn(self.conv(x))), 2)
        return self.logits(torch.relu(self.dense(x.flatten(1))))


def model(args):
    return BatchNormCnn()
