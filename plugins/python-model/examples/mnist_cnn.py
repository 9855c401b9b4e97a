"""The TensorFlow multi-worker tutorials' CNN (trainerd's mnist-cnn plugin) for trainerd's Python
model plugin: Conv 32 3x3 ReLU, MaxPool 2, Dense 64 ReLU, Dense 10.

    trainerd run --plugin libpython_model.so --plugin-arg module=mnist_cnn.py --data MNIST_DIR ...

On MNIST-format data (declaring no columns) the batch is {"image": float32 [B, 1, 28, 28] in
[0, 1], "label": int64 [B]}; the file defines only model(), so trainerd applies its defaults:
cross-entropy of module(image) against label, and accuracy.
"""
import torch
import torch.nn as nn


class TutorialCnn(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 32, 3)
        self.dense = nn.Linear(32 * 13 * 13, 64)
        self.logits = nn.Linear(64, 10)

    def forward(self, x):
        x = torch.max_pool2d(torch.relu(self.conv(x)), 2)
        return self.logits(torch.relu(self.dense(x.flatten(1))))


def model(args):
    return TutorialCnn()
