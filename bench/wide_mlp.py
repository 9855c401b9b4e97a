"""A wide MLP on MNIST-format images for bench/sharded.py: Flatten, Dense WIDTH ReLU, then DEPTH - 1
times Dense WIDTH ReLU, then Dense 10. At the defaults (width 4700, depth 2) it has 25.8 M
parameters, so Adam's two moments (206 MB in float32) are the largest part of a worker's training
state; `depth=25,width=1000` has as many in 25 layers of about 1 M parameters (4 MB of gradient
each), the shape of a deep network, whose gradients are made a layer at a time.

    trainerd run --plugin libpython_model.so --plugin-arg module=bench/wide_mlp.py --data MNIST_DIR ...
"""
import torch.nn as nn

# --plugin-arg width=W sets the hidden layers' width, depth=D their count.
arguments = {"width": 4700, "depth": 2}


def model(args):
    width, depth = int(args.get("width", 4700)), int(args.get("depth", 2))
    layers = [nn.Flatten(), nn.Linear(28 * 28, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))
