"""What the examples share: fitting a model on a tfray dataset and judging it."""

import sys
import time
import warnings

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


def fit(model, ds, source, epochs):
    """``model.fit(ds)``; returns its history, a Recorder and each epoch's stats.

    ``source`` is the tfray dataset ``ds`` reads. Keras starts an iterator per
    epoch, in order, plus one at each epoch's end that it drops unread: the
    epochs are the iterators that delivered.
    """
    # An unknown epoch length (cardinality -2) Keras learns by running out of
    # data in the first epoch, and warns that it did.
    warnings.filterwarnings("ignore", message="Your input ran out of data")
    recorder = Recorder()
    seen = len(source.stats())
    # shuffle=False: Keras cannot shuffle a tf.data input, and warns if asked.
    history = model.fit(ds, epochs=epochs, callbacks=[recorder], shuffle=False, verbose=2)
    stats = [s for s in source.stats()[seen:] if s.batches]
    assert len(stats) == epochs, source.stats()[seen:]
    return history.history, recorder, stats


def exit_unless_loss_fell(name, first, last):
    """Exits non-zero unless the loss fell by a margin noise cannot fake."""
    if not last < 0.9 * first:
        sys.exit(f"{name}: FAILED: the loss did not fall ({first:.3f} -> {last:.3f})")
