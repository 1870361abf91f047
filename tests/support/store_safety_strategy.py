"""Keras fit and evaluate under MirroredStrategy on tfray batches (test_store_safety.py).

Run as ``python store_safety_strategy.py RAY_ADDRESS`` (or ``local``). Two
logical CPU devices make two replicas, so each global batch is split along
its first dimension, into slices of the batch's memory in Ray's store; the
model's first layer and its loss are elementwise ops on those slices. Checks that
evaluate's loss is the true loss, that a long fit converges, and that every
Ray object is unchanged afterwards; prints "store unchanged" on success.
"""

import os
import sys

import numpy as np
import ray

ROWS, FEATURES, BATCHES = 512, 128, 4  # 256 KB batches: in the shared store.


def main(address):
    if address == "local":
        ray.init(address="local", num_cpus=2, object_store_memory=150 * 2**20, log_to_driver=False)
    else:
        ray.init(address=address, log_to_driver=False)
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()]
    )
    if os.environ.get("TF_USE_LEGACY_KERAS") == "1":
        import tf_keras as keras
    else:
        import keras

    import tfray

    rng = np.random.default_rng(0)
    true_w = rng.normal(size=(FEATURES, 1)).astype(np.float32) / np.sqrt(FEATURES)
    batches = []
    for _ in range(BATCHES):
        x = rng.normal(size=(ROWS, FEATURES)).astype(np.float32)
        batches.append({"x": x, "y": x @ true_w})
    refs = [ray.put(b) for b in batches]
    ds = tfray.Dataset(refs).map(lambda b: (b["x"], b["y"]))

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    assert strategy.num_replicas_in_sync == 2
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((FEATURES,)),
                keras.layers.Rescaling(0.5),  # Elementwise on the replica's slice.
                keras.layers.Dense(1, use_bias=False),
            ]
        )
        model.compile(optimizer=keras.optimizers.SGD(0.2), loss="mse")
    w0 = rng.normal(size=(FEATURES, 1)).astype(np.float32) / np.sqrt(FEATURES)
    model.set_weights([w0])
    expected = float(np.mean([np.mean((0.5 * b["x"] @ w0 - b["y"]) ** 2) for b in batches]))
    for _ in range(2):
        loss = model.evaluate(ds, verbose=0)
        print(f"evaluate loss {loss:.6f}, expected {expected:.6f}")
        assert abs(loss - expected) <= 1e-3 * expected, (loss, expected)
    history = model.fit(ds.repeat(), steps_per_epoch=25, epochs=4, verbose=0)
    losses = history.history["loss"]
    print("fit losses", [round(v, 6) for v in losses])
    assert losses[-1] < 0.2 * losses[0] and np.isfinite(losses).all(), losses
    (w,) = model.get_weights()
    expected = float(np.mean([np.mean((0.5 * b["x"] @ w - b["y"]) ** 2) for b in batches]))
    loss = model.evaluate(ds, verbose=0)
    print(f"evaluate after fit loss {loss:.6g}, expected {expected:.6g}")
    assert abs(loss - expected) <= 1e-3 * expected + 1e-6, (loss, expected)
    for i, ref in enumerate(refs):
        got = ray.get(ref)
        for key in ("x", "y"):
            if not np.array_equal(got[key], batches[i][key]):
                sys.exit(f"object {i} field {key} changed: sum {got[key].sum()} != {batches[i][key].sum()}")
    print("store unchanged")


if __name__ == "__main__":
    main(sys.argv[1])
