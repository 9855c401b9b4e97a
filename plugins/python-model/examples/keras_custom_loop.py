"""The custom-training-loop tutorial's model (TensorFlow's "Custom training loop with Keras and
MultiWorkerMirroredStrategy"), as the tutorial writes it, with `tf.keras` become `keras` (Keras 3,
on its torch backend), and the one compile() line that says what its loop does: the mean of
SparseCategoricalCrossentropy(from_logits=True) over the global batch plus the L2 penalties
(`model.losses`), and RMSprop(learning_rate=0.001):

    trainerd local --workers 2 --plugin libpython_model.so \\
        --plugin-arg module=keras_custom_loop.py --data /usr/share/datasets/fashion-mnist

The images arrive channels-last, [B, 28, 28, 1]; `Input(shape=(28, 28))` takes them (Keras drops
the trailing 1), and the Reshape puts it back.
"""
import keras


def build_cnn_model():
  regularizer = keras.regularizers.L2(1e-5)
  return keras.Sequential([
      keras.Input(shape=(28, 28)),
      keras.layers.Reshape(target_shape=(28, 28, 1)),
      keras.layers.Conv2D(32, 3,
                          activation='relu',
                          kernel_regularizer=regularizer),
      keras.layers.Flatten(),
      keras.layers.Dense(128,
                         activation='relu',
                         kernel_regularizer=regularizer),
      keras.layers.Dense(10, kernel_regularizer=regularizer)
  ])


def model(args):
    model = build_cnn_model()
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.RMSprop(learning_rate=0.001), metrics=['accuracy'])
    return model
