"""A wide Keras MLP (Keras 3 on its torch backend) for timing Keras's optimizer updates: Flatten,
Dense 4096 ReLU, Dense 4096 ReLU, Dense 1400 ReLU, Dense 10 (25.8 M parameters), compiled with
the optimizer `--plugin-arg optimizer=` names:

  sgd           SGD(0.01, momentum=0.9, nesterov=True, weight_decay=1e-3)
  rmsprop       RMSprop(1e-3)
  rmsprop_full  RMSprop(1e-3, momentum=0.9, centered=True, clipnorm=1.0)

    trainerd local --workers 2 --plugin target/release/libpython_model.so \\
        --plugin-arg module=bench/keras_wide_mlp.py --plugin-arg optimizer=rmsprop \\
        --data /usr/share/datasets/fashion-mnist --epochs 1 --steps-per-epoch 30 --batch-size 64 \\
        --threads 1 --no-evaluation --summary /tmp/s.json

Worker 0's summary (/tmp/s.worker0.json) gives the update's time per step as
step_phases.optimizer_ms.
"""
import keras

OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.01, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "rmsprop": lambda: keras.optimizers.RMSprop(1e-3),
    "rmsprop_full": lambda: keras.optimizers.RMSprop(1e-3, momentum=0.9, centered=True, clipnorm=1.0),
}

# --plugin-arg optimizer=NAME picks one of OPTIMIZERS.
arguments = {"optimizer": "rmsprop"}


def model(args):
    name = args.get("optimizer", "rmsprop")
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer={name!r}: expected one of {', '.join(OPTIMIZERS)}")
    m = keras.Sequential([
        keras.layers.Input((28, 28, 1)),
        keras.layers.Flatten(),
        keras.layers.Dense(4096, activation="relu"),
        keras.layers.Dense(4096, activation="relu"),
        keras.layers.Dense(1400, activation="relu"),
        keras.layers.Dense(10),
    ])
    m.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), optimizer=OPTIMIZERS[name]())
    return m
