"""A full object store: TensorFlow holds more of the batches than the store, and the epoch goes on from disk.

A 150 MB object store; 150 batches of 2 MB made by Ray tasks (``from_refs``),
or yielded by two generator producers (``from_generators``), read through
``ds.shuffle(100)``. The shuffle buffer holds about 200 MB of tensors, each
pinning its Ray object, so the store cannot hold them all: Ray spills what
the epoch has yet to read and restores it as the epoch reaches it. Each row
is a fresh local Ray and reads one epoch; it says how long the epoch took,
whether every batch came once, Ray's restored objects against the batches,
what Ray reports of its own restores (the disk's speed: restored bytes over
the restore workers' time), and whether tfray warned that TensorFlow holds
more than the store.

Targets: every batch once, restored objects at most 1.2x the batches, the
warning logged once. ``make bench-full-store`` (about a minute).
"""

import argparse
import json
import logging
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["CUDA_VISIBLE_DEVICES"] = ""

MB = 1 << 20
STORE_BYTES = 150 * MB
BATCHES = 150
BATCH_BYTES = 2 * MB
BUFFER = 100
LIMIT_S = 400  # An epoch still reading after this is cut off (and fails its targets).
RESTORED_OVER_BATCHES = 1.2
KINDS = ("from_refs", "from_generators")


def _store_stats():
    import ray
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    state = get_state_from_address(ray.get_runtime_context().gcs_address)
    return get_memory_info_reply(state).store_stats


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _batch(i):
    import numpy as np

    return np.full(BATCH_BYTES // 4, i, np.int32)


def _produce(shard):
    for i in range(shard, BATCHES, 2):
        yield _batch(i)


def measure(kind):
    """One epoch of ``kind`` in a fresh Ray: its row."""
    import ray

    import tfray

    ray.init(num_cpus=2, object_store_memory=STORE_BYTES, log_to_driver=False, include_dashboard=False)
    try:
        if kind == "from_refs":
            make = ray.remote(_batch)
            refs = [make.remote(i) for i in range(BATCHES)]
            ray.wait(refs, num_returns=BATCHES, fetch_local=False)
            source = tfray.Dataset.from_refs(refs)
        else:
            source = tfray.Dataset.from_generators(_produce, 2)
        before = _store_stats()
        warnings = _Warnings()
        logging.getLogger("tfray").addHandler(warnings)
        seen = []
        start = time.monotonic()
        for batch in source.shuffle(BUFFER, seed=1):
            seen.append(int(batch[0]))
            if time.monotonic() - start > LIMIT_S:
                break
        elapsed = time.monotonic() - start
        del batch
        logging.getLogger("tfray").removeHandler(warnings)
        after = _store_stats()
        restore_s = after.restore_time_total_s - before.restore_time_total_s
        restored_bytes = after.restored_bytes_total - before.restored_bytes_total
        warned = [m for m in warnings.messages if "more than this node's object store" in m]
        return dict(
            kind=kind,
            seconds=elapsed,
            batches=len(seen),
            once=sorted(seen) == list(range(BATCHES)),
            restored=after.restored_objects_total - before.restored_objects_total,
            spilled=after.spilled_objects_total,
            epoch_mb_s=len(seen) * BATCH_BYTES / MB / elapsed,
            restore_mb_s=restored_bytes / MB / restore_s if restore_s > 0 else None,
            warned=len(warned),
            warning=warned[0] if warned else None,
        )
    finally:
        ray.shutdown()


def targets(rows):
    out = []
    for r in rows:
        out.append((f"{r['kind']}: every one of the {BATCHES} batches once", r["once"]))
        out.append(
            (
                f"{r['kind']}: restored objects / batches <= {RESTORED_OVER_BATCHES} "
                f"({r['restored']} / {BATCHES} = {r['restored'] / BATCHES:.2f})",
                r["restored"] <= RESTORED_OVER_BATCHES * BATCHES,
            )
        )
        out.append((f"{r['kind']}: the warning logged once ({r['warned']})", r["warned"] == 1))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    parser.add_argument("--json", help="write the rows and the machine here")
    args = parser.parse_args(argv)

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import report

    load_at_start = os.getloadavg()
    rows = []
    for kind in args.kinds.split(","):
        row = measure(kind)
        print(json.dumps({k: v for k, v in row.items() if k != "warning"}), flush=True)
        rows.append(row)
    machine = report.machine_info()
    header = ["source", "epoch s", "batches", "each once", "restored", "spilled", "epoch MB/s", "Ray's restores MB/s"]
    lines = [
        [
            r["kind"],
            f"{r['seconds']:.1f}",
            str(r["batches"]),
            "yes" if r["once"] else "NO",
            f"{r['restored']} ({r['restored'] / BATCHES:.2f}x)",
            str(r["spilled"]),
            f"{r['epoch_mb_s']:.0f}",
            "-" if r["restore_mb_s"] is None else f"{r['restore_mb_s']:.0f}",
        ]
        for r in rows
    ]
    print(
        f"\n{BATCHES} batches of {BATCH_BYTES // MB} MB through shuffle({BUFFER}), "
        f"a {STORE_BYTES // MB} MB object store; one epoch a row, each in a fresh Ray\n"
    )
    print(report.text_table(header, lines))
    warning = next((r["warning"] for r in rows if r["warning"]), None)
    if warning:
        print(f"\nthe warning: {warning}")
    print()
    checks = targets(rows)
    for text, met in checks:
        print(("met     " if met else "NOT MET ") + text)
    print(
        f"\nload average at the start: {' '.join(f'{x:.2f}' for x in load_at_start)}, at the end: "
        f"{' '.join(f'{x:.2f}' for x in machine['load_avg_at_end'])}; "
        f"tfray {machine['git_commit']}{' (modified)' if machine['tfray_sources_modified'] else ''}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "targets": checks, "machine": machine, "load_at_start": load_at_start}, f, indent=1)
    return 0 if all(met for _, met in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
