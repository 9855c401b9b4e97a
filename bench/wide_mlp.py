"""A wide MLP on MNIST-format images for bench/sharded.py: Flatten, Dense WIDTH ReLU, Dense WIDTH
ReLU, Dense 10. At the default width (4700) it has 25.8 M parameters, so Adam's two moments
(206 MB in float32) are the largest part of a worker's training state.

    trainerd run --plugin libpython_model.so --plugin-arg module=bench/wide_mlp.py --data MNIST_DIR ...
"""
import torch.nn as nn

# --plugin-arg width=W sets the two hidden layers' width.
arguments = {"width": 4700}


def model(args):
    width = int(args.get("width", 4700))
    return nn.Sequential(
        nn.Flatten(), nn.Linear(28 * 28, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
    )
