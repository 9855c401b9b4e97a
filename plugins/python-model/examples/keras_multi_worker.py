"""The multi-worker Keras tutorial's model (TensorFlow's "Multi-worker training with Keras"), as
the tutorial writes it, with `tf.keras` become `keras` (Keras 3, on its torch backend):

    trainerd local --workers 2 --plugin libpython_model.so \\
        --plugin-arg module=keras_multi_worker.py --data /usr/share/datasets/fashion-mnist

trainerd takes what compile() says: the loss, the metrics (shown under their Keras names) and the
optimizer, which it runs with Keras's update rules. The images arrive channels-last, [B, 28, 28, 1].
"""
import keras


def build_and_compile_cnn_model():
  model = keras.Sequential([
      keras.layers.Conv2D(32, 3, activation='relu', input_shape=(28, 28, 1)),
      keras.layers.MaxPooling2D(),
      keras.layers.Flatten(),
      keras.layers.Dense(64, activation='relu'),
      keras.layers.Dense(10, activation='softmax')
  ])
  model.compile(
      loss=keras.losses.sparse_categorical_crossentropy,
      optimizer=keras.optimizers.SGD(learning_rate=0.001),
      metrics=['accuracy'])
  return model


def model(args):
    return build_and_compile_cnn_model()
