"""A Keras callback the examples share: epoch wall times and the first loss."""

import time

import keras


class Recorder(keras.callbacks.Callback):
    """Wall time per epoch, and the loss of the very first batch.

    The first batch's loss is the untrained model's (about ln of the number
    of classes), so an example can tell whether the loss fell, even over one
    epoch.
    """

    def __init__(self):
        super().__init__()
        self.seconds = []
        self.first_loss = None

    def on_train_batch_end(self, batch, logs=None):
        if self.first_loss is None:
            self.first_loss = float(logs["loss"])

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.perf_counter() - self._start)
