"""Turns the samples into the table, the targets check, JSON, RESULTS.md and a chart.

Every figure is the median of its rounds. Every ratio is paired: the median,
over rounds, of the ratio of the two pipelines' samples in the same round (a
round measures each pipeline once, seconds apart), which cancels much of the
drift of a shared machine; it is therefore not exactly the ratio of the
medians shown. Ratios compare the same scenario *and load*: a busy-thread
row's ``x ceiling`` is against the ceiling with the same busy thread running
(the thread takes a core from TensorFlow as well as the GIL from Python).

Trainer CPU per batch (``cpu ms/batch``) is the trainer process's CPU time
over the timed run, all threads but the busy one, per batch; ``CPU x
ceiling`` pairs it with the ceiling's in the same round as above (lower is
better: 1.00x spends no more of the trainer's CPU per batch than reading
tensors already in memory). The busy thread's CPU per batch is shown apart.
"""

import datetime
import json
import os
import platform
import statistics

NOTES_MARKER = "<!-- Notes below this line are written by hand and kept across runs. -->"

LABELS = {
    "ceiling": "ceiling (N tensors in memory)",
    "ceiling_1": "ceiling_1 (1 tensor, cache-hot)",
    "from_generator": "from_generator(ray.get)",
    "to_tf": "Ray Data to_tf",
    "tfray": "tfray (epoch of N, repeated)",
    "tfray_1epoch": "tfray_1epoch (one long epoch)",
    "tfray_generators": "tfray_generators (2 producers, one long epoch, the second)",
    "ray_loop": "Ray's own loop over those producers (no TF)",
    "from_generator_tasks": "from_generator over that loop",
}
# What a pipeline's ``@K`` suffix sets.
SUFFIXES = {"tfray_generators": "max_inflight_per_producer"}


def median(samples, key):
    """The median of ``key`` over the samples (rounds)."""
    return statistics.median(s[key] for s in samples)


def paired(a, b, key="batches_per_s"):
    """Median over rounds of a[i][key] / b[i][key], or None."""
    if not a or not b:
        return None
    return statistics.median(x[key] / y[key] for x, y in zip(a, b))


def trainer_cpu(samples):
    """The samples with ``trainer_cpu_s_per_batch``: all threads but the busy one."""
    return [
        s | {"trainer_cpu_s_per_batch": s["cpu_s_per_batch"] - s.get("busy_cpu_s_per_batch", 0.0)}
        for s in samples
    ]


# How each load reads after a scenario's name ("idle" reads as nothing).
LOAD_SUFFIXES = {"idle": "", "busy": " + busy thread", "light": " + light consumer"}


def run_label(scenario, load):
    """A scenario and load as ``--scenarios`` names them: "12MB+busy" ("idle" reads as nothing)."""
    return scenario + ("" if load == "idle" else f"+{load}")


def scenario_label(r, sep=" "):
    """A row's scenario and load: "12MB + busy thread"."""
    return r["scenario"] + LOAD_SUFFIXES[r["load"]].replace(" + ", sep + "+ ", 1)


def _label(name):
    base, _, k = name.partition("@")
    return LABELS.get(base, base) + (f" ({SUFFIXES.get(base, 'max_inflight')}={k})" if k else "")


def proc_stat(path):
    """(name, process group, CPU seconds so far) from a ``/proc`` stat file; None once it is gone."""
    try:
        with open(path) as f:
            stat = f.read()
    except OSError:
        return None
    # The name is in brackets and may hold spaces; the process group, utime
    # and stime are the 3rd, 12th and 13th fields after it.
    fields = stat[stat.rindex(")") + 2 :].split()
    cpu_s = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return stat[stat.index("(") + 1 : stat.rindex(")")], int(fields[2]), cpu_s


def machine_info():
    import numpy
    import ray
    import tensorflow as tf

    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_gib = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal"):
                    mem_gib = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        import tfray

        tfray_path = os.path.dirname(os.path.abspath(tfray.__file__))
        tfray_built = tfray._native.built_tf_version()
    except Exception:  # noqa: BLE001 - informational only
        tfray_path, tfray_built = None, None
    tfray_from_repo = tfray_path == os.path.join(repo, "tfray")
    try:
        import subprocess

        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "tfray", "csrc"],
            capture_output=True,
            text=True,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        ).stdout.strip()
    except Exception:  # noqa: BLE001
        commit, dirty = None, ""
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "mem_gib": mem_gib,
        "load_avg_at_end": os.getloadavg(),
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "ray": ray.__version__,
        "numpy": numpy.__version__,
        "tfray_built_against": tfray_built,
        "tfray_imported_from": tfray_path,
        "tfray_from_this_checkout": tfray_from_repo,
        "git_commit": commit,
        "tfray_sources_modified": bool(dirty),
        "kernel": platform.release(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }


def assemble(results, rss, args, wall_s, machine=None):
    """The JSON document: settings, machine, samples, medians and ratios.

    ``machine``: ``machine_info()`` taken when the run started (the commit
    that ran), or None to take it now.
    """
    machine = dict(machine or machine_info())
    machine["load_avg_at_end"] = os.getloadavg()
    rows = []
    for r in results:
        samples = {name: trainer_cpu(s) for name, s in r["samples"].items()}
        med = {name: median(s, "batches_per_s") for name, s in samples.items() if s}
        for name, s in samples.items():
            if not s:
                continue
            row = {
                "scenario": r["scenario"],
                "load": r["load"],
                "pipeline": name,
                "batches_per_s": med[name],
                "gb_per_s": med[name] * r["bytes_per_batch"] / 1e9,
                "samples_batches_per_s": [x["batches_per_s"] for x in s],
                "min_batches_per_s": min(x["batches_per_s"] for x in s),
                "max_batches_per_s": max(x["batches_per_s"] for x in s),
                "cpu_ms_per_batch": 1e3 * median(s, "trainer_cpu_s_per_batch"),
                "cpu_x_ceiling": paired(
                    s, samples.get("ceiling"), "trainer_cpu_s_per_batch"
                ),
                "process_cpu_ms_per_batch": 1e3 * median(s, "cpu_s_per_batch"),
                "busy_cpu_ms_per_batch": (
                    1e3 * median(s, "busy_cpu_s_per_batch")
                    if "busy_cpu_s_per_batch" in s[0]
                    else None
                ),
                "busy_loops_per_s": (
                    median(s, "busy_loops_per_s") if s[0].get("busy_loops_per_s") else None
                ),
                "x_ceiling": paired(s, samples.get("ceiling")),
                "x_ceiling_of_medians": med[name] / med["ceiling"] if "ceiling" in med else None,
            }
            if name.startswith("tfray"):
                for other in ("from_generator", "to_tf"):
                    row[f"x_{other}"] = paired(s, samples.get(other))
                row["tfray_stats"] = s[-1].get("tfray")
            if name.startswith(("tfray_generators", "from_generator_tasks")):
                # Against Ray's own loop over the same producers: the floor of their path.
                row["x_ray_loop"] = paired(s, samples.get("ray_loop"))
                if s[0].get("machine_cpu_s_per_batch") is not None:
                    # The whole machine's CPU per batch against the loop's (lower is better).
                    row["machine_cpu_x_ray_loop"] = paired(
                        s, samples.get("ray_loop"), "machine_cpu_s_per_batch"
                    )
            if name == "ray_loop" and s[0].get("sum_cpu_s_per_batch") is not None:
                # (Runs before the loop timed its sums have neither figure.)
                row["sum_cpu_ms_per_batch"] = 1e3 * median(s, "sum_cpu_s_per_batch")
                row["path_cpu_ms_per_batch"] = path_cpu_ms(s)
            if name.startswith(("tfray_generators", "from_generator_tasks")):
                row["path_cpu_ms_per_batch"] = path_cpu_ms(s, samples.get("ceiling"))
            if s[0].get("machine_cpu_s_per_batch") is not None:
                row["machine_cpu_ms_per_batch"] = 1e3 * median(s, "machine_cpu_s_per_batch")
                row["machine_idle_ms_per_batch"] = 1e3 * median(s, "machine_idle_s_per_batch")
            rows.append(row)
    return {
        "settings": {
            "quick": args.quick,
            "rounds": args.rounds,
            "warmup_rounds": args.warmup_rounds,
            "seconds": args.seconds,
            "scenarios": args.runs,
            "pipelines": args.pipeline_names,
            "rss_batches": args.rss_batches,
            "switch_interval": args.switch_interval,
            "full": args.full,
            "load_avg_at_start": args.load_avg_at_start,
        },
        "machine": machine,
        "wall_s": wall_s,
        "scenarios": [
            {k: v for k, v in r.items() if k != "samples"} | {"samples": r["samples"]}
            for r in results
        ],
        "rows": rows,
        "rss": rss,
        "targets": targets(rows, rss),
    }


def path_cpu_ms(samples, ceiling=None):
    """The trainer's CPU per batch less its consumer's sum: what the delivery costs it.

    Median over rounds, paired: Ray's loop less its own numpy sums (timed
    in the loop); a TensorFlow pipeline less the ceiling's CPU in the same
    round (TensorFlow's sum over tensors already in memory). The two sums
    cost differently on the same bytes, so the throughput of Ray's loop
    and of a pipeline into TensorFlow differ by more than their paths.
    """
    if samples[0].get("sum_cpu_s_per_batch") is not None:
        return 1e3 * statistics.median(
            x["trainer_cpu_s_per_batch"] - x["sum_cpu_s_per_batch"] for x in samples
        )
    if not ceiling:
        return None
    return 1e3 * statistics.median(
        x["trainer_cpu_s_per_batch"] - c["trainer_cpu_s_per_batch"]
        for x, c in zip(samples, ceiling)
    )


def _row(rows, scenario, load, pipeline):
    for r in rows:
        if (r["scenario"], r["load"], r["pipeline"]) == (scenario, load, pipeline):
            return r
    return None


def targets(rows, rss):
    """The goals, each with the measured value and whether it is met."""
    out = []

    def check(what, scenario, load, key, goal, pipeline="tfray", at_most=False):
        r = _row(rows, scenario, load, pipeline)
        if r is None or r.get(key) is None:
            return
        value = r[key]

        def met(v):
            return v <= goal if at_most else v >= goal

        # A source's own variants only: from_refs' tfray_1epoch, from_generators' @K.
        variant = "tfray_1epoch" if pipeline == "tfray" else pipeline + "@"
        variants = {
            v["pipeline"]: v[key]
            for v in rows
            if (v["scenario"], v["load"]) == (scenario, load)
            and v["pipeline"].startswith(variant)
            and v.get(key) is not None
        }
        out.append(
            {
                "target": what,
                "scenario": run_label(scenario, load),
                "measured": value,
                "goal": goal,
                "at_most": at_most,
                "met": met(value),
                "variants": variants,
                "variants_met": {k: met(v) for k, v in variants.items()},
            }
        )

    for sc in ("12MB", "38MB"):
        check("tfray >= 0.95x ceiling, large batches", sc, "idle", "x_ceiling", 0.95)
    for sc in ("12MB", "38MB"):
        check("busy thread: tfray >= 0.8x ceiling under load", sc, "busy", "x_ceiling", 0.8)
    for sc in ("12MB", "38MB", "16KB"):
        check("busy thread: tfray >= 3x from_generator under load", sc, "busy", "x_from_generator", 3.0)
    check("16 KB: tfray >= 3x from_generator", "16KB", "idle", "x_from_generator", 3.0)
    for sc in ("16KB", "12MB", "38MB"):
        for load in ("idle", "busy"):
            check(
                "from_generators >= 1.0x Ray's own loop over the same producers",
                sc,
                load,
                "x_ray_loop",
                1.0,
                pipeline="tfray_generators",
            )
    # A consumer that reads one element of each batch, as a GPU trainer's CPU
    # does: the summing consumer's own cost no longer hides the path's.
    for sc in ("16KB", "1MB", "12MB", "38MB"):
        check(
            "light consumer: from_generators >= 1.0x Ray's own loop",
            sc,
            "light",
            "x_ray_loop",
            1.0,
            pipeline="tfray_generators",
        )
        check(
            "light consumer: machine CPU per batch <= 1.0x Ray's own loop's",
            sc,
            "light",
            "machine_cpu_x_ray_loop",
            1.0,
            pipeline="tfray_generators",
            at_most=True,
        )
    check("12 MB: tfray >= 10x to_tf", "12MB", "idle", "x_to_tf", 10.0)
    if rss is not None:
        out.append(
            {
                "target": f"RSS growth over {rss['batches']} tfray 12 MB batches < 2 batches",
                "scenario": "12MB",
                "measured": rss["growth_batches"],
                "goal": 2.0,
                "met": rss["growth_batches"] < 2.0,
            }
        )
    return out


def _fmt_ratio(x):
    return "" if x is None else f"{x:.2f}x"


def _fmt_ms(value):
    return "" if value is None else f"{value:.2f}"


def table_rows(data):
    header = [
        "scenario",
        "pipeline",
        "batches/s",
        "range",
        "GB/s",
        "x ceiling",
        "tfray / from_gen",
        "tfray / to_tf",
        "x Ray's loop",
        "CPU ms/batch",
        "CPU x ceiling",
        "busy thread ms/batch",
    ]
    lines = []
    for r in data["rows"]:
        lines.append(
            [
                scenario_label(r),
                _label(r["pipeline"]),
                f"{r['batches_per_s']:.1f}",
                f"{r['min_batches_per_s']:.0f}-{r['max_batches_per_s']:.0f}",
                f"{r['gb_per_s']:.2f}",
                _fmt_ratio(r["x_ceiling"]),
                _fmt_ratio(r.get("x_from_generator")),
                _fmt_ratio(r.get("x_to_tf")),
                _fmt_ratio(r.get("x_ray_loop")),
                f"{r['cpu_ms_per_batch']:.3f}",
                _fmt_ratio(r.get("cpu_x_ceiling")),
                "" if r["load"] != "busy" or r.get("busy_cpu_ms_per_batch") is None
                else f"{r['busy_cpu_ms_per_batch']:.3f}",
            ]
        )
    return header, lines


def table_text(data):
    return text_table(*table_rows(data))


def markdown_table(header, lines, text_columns=2):
    """A Markdown table; the first ``text_columns`` are text, the rest right-aligned figures."""
    out = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join(["---"] * text_columns + ["---:"] * (len(header) - text_columns)) + "|",
    ]
    for cells in lines:
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def text_table(header, lines):
    """Aligned columns, the first two text, the rest figures; a blank line between groups.

    A group is a run of lines with the same first cell.
    """
    widths = [max(len(str(x)) for x in col) for col in zip(header, *lines)]
    right = set(range(2, len(header)))

    def fmt(cells):
        return "  ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
        )

    out = [fmt(header), fmt(["-" * w for w in widths])]
    prev = None
    for cells in lines:
        if prev is not None and cells[0] != prev:
            out.append("")
        prev = cells[0]
        out.append(fmt(cells))
    return "\n".join(out)


def table_markdown(data):
    return markdown_table(*table_rows(data))


def targets_lines(data):
    """(met, target, scenario, tfray's value, the variants' values) per target."""
    lines = []
    for t in data["targets"]:
        fmt = "{:.2f}" if "RSS" in t["target"] else "{:.2f}x"
        variants = ", ".join(
            f"{_short(k)} {fmt.format(v)}{'' if t['variants_met'][k] else ' (not met)'}"
            for k, v in t.get("variants", {}).items()
        )
        lines.append(
            (
                "MET    " if t["met"] else "NOT MET",
                t["target"],
                t["scenario"],
                fmt.format(t["measured"]),
                variants,
            )
        )
    return lines


def _short(name):
    base, _, k = name.partition("@")
    return base + (f" {SUFFIXES.get(base, 'max_inflight')}={k}" if k else "")


def targets_text(data):
    out = ["targets (tfray = from_refs(refs).repeat() unless named; variants in brackets):"]
    for met, what, scenario, value, variants in targets_lines(data):
        out.append(f"  {met}  {what} [{scenario}]: {value}" + (f"  [{variants}]" if variants else ""))
    if data.get("rss"):
        r = data["rss"]
        out.append(
            f"  RSS {r['before_kb']['VmRSS'] / 1024:.0f} -> {r['after_kb']['VmRSS'] / 1024:.0f} MB "
            f"over {r['batches']} batches ({r['growth_bytes'] / 1e6:+.1f} MB)"
        )
    return "\n".join(out)


def chart(data, path):
    """Two panels over the same groups: batches/s, and the trainer's CPU ms per batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def group(r):
        return scenario_label(r, sep="\n")

    groups, names = [], []
    for r in data["rows"]:
        if group(r) not in groups:
            groups.append(group(r))
        if r["pipeline"] not in names:
            names.append(r["pipeline"])
    colors = {
        "ceiling": "#555555",
        "ceiling_1": "#bbbbbb",
        "from_generator": "#e69f00",
        "to_tf": "#56b4e9",
        "tfray": "#009e73",
        "tfray_1epoch": "#8fd9bf",
        "tfray_generators": "#cc79a7",
        "ray_loop": "#d55e00",
        "from_generator_tasks": "#f0e442",
    }
    width = 0.8 / len(names)
    fig, (top, bottom) = plt.subplots(
        2, 1, sharex=True, figsize=(max(8, 1.6 * len(groups) + 2), 9), height_ratios=(3, 2)
    )
    panels = (
        (top, "batches_per_s", "batches / s (log scale)"),
        (bottom, "cpu_ms_per_batch", "trainer CPU ms / batch\n(busy thread excluded, log scale)"),
    )
    for ax, key, ylabel in panels:
        for i, name in enumerate(names):
            xs, ys = [], []
            for j, g in enumerate(groups):
                for r in data["rows"]:
                    if group(r) == g and r["pipeline"] == name and r.get(key):
                        xs.append(j + (i - (len(names) - 1) / 2) * width)
                        ys.append(r[key])
            ax.bar(
                xs,
                ys,
                width,
                label=_label(name),
                color=colors.get(name.split("@")[0], None),
                hatch="///" if "@" in name else None,
                edgecolor="black",
                linewidth=0.4,
            )
        ax.set_yscale("log")
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", which="both", alpha=0.3)
        ax.set_axisbelow(True)
    bottom.set_xticks(range(len(groups)))
    bottom.set_xticklabels(groups)
    m = data["machine"]
    top.set_title(
        f"Input pipelines, same batches, same graph-mode consumer\n"
        f"{m['cores']} cores, {m['cpu']}; TF {m['tensorflow']}, Ray {m['ray']}",
        fontsize=10,
    )
    bottom.legend(fontsize=8, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.14), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # The legend sits below the axes.
    plt.close(fig)


def results_markdown(data, chart_name, notes):
    m = data["machine"]
    s = data["settings"]
    lines = [
        "# Benchmark results",
        "",
        "Written by `make bench` (`benchmarks/run.py`); the method is in the module",
        "docstrings of `run.py`, `pipelines.py` and `report.py`. Each figure is the",
        f"median of {s['rounds']} rounds of a ~{s['seconds']} s timed run (`range`: the",
        f"lowest and highest round), after {s.get('warmup_rounds', 0)} uncounted warm-up round(s) "
        "per scenario; each ratio is the median over rounds of the ratio",
        "within a round, against the ceiling under the same load. Raw samples:",
        "`benchmarks/results/latest.json` (not committed).",
        "",
        "## Machine",
        "",
        f"- CPU: {m['cpu']}, {m['cores']} cores, {m['mem_gib']} GiB RAM; kernel {m['kernel']}",
        f"- Python {m['python']}, TensorFlow {m['tensorflow']}, Ray {m['ray']}, numpy {m['numpy']}",
        (
            f"- tfray at commit {m['git_commit']}"
            + (" (with uncommitted changes in tfray/ or csrc/)" if m["tfray_sources_modified"] else "")
            if m.get("tfray_from_this_checkout", True)
            else f"- tfray imported from {m.get('tfray_imported_from')}, not this checkout"
        ),
        f"- date {m['date']}; wall time {data['wall_s']:.0f} s; load average (1, 5, 15 min) "
        + "at the start "
        + ", ".join(f"{x:.2f}" for x in s["load_avg_at_start"])
        + ", at the end "
        + ", ".join(f"{x:.2f}" for x in m["load_avg_at_end"])
        + " (a shared machine: other work ran alongside)",
        "",
        "## Throughput",
        "",
        f"![batches/s and trainer CPU per batch, per scenario and pipeline, log scale]({chart_name})",
        "",
        table_markdown(data),
        "",
        "Scenarios: " + "; ".join(
            f"{sc['scenario']}: {sc['describe']}, {sc['bytes_per_batch'] / 1e6:.3f} MB, "
            f"{sc['distinct_batches']} distinct batches"
            for sc in {sc["scenario"]: sc for sc in data["scenarios"]}.values()
        )
        + ". `+ light consumer`: the consumer reads one element of each batch, as a"
        " GPU trainer's CPU does, instead of summing every byte; the delivery path's"
        " own cost then shows"
        + ". `CPU ms/batch` is the trainer process's CPU time per batch, all threads but"
        " the busy one (whose own CPU per batch is `busy thread ms/batch`); `CPU x ceiling`"
        " is its ratio to the ceiling's in the same round. Producers in Ray's worker"
        " processes (`tfray_generators`) are not trainer CPU.",
        "",
        "## Targets",
        "",
        "Judged on `tfray` (`from_refs(refs).repeat()`, as specified); the variants'",
        "figures are shown alongside.",
        "",
        "| | target | scenario | tfray | variants |",
        "|---|---|---|---:|---|",
    ]
    for met, what, scenario, value, variants in targets_lines(data):
        lines.append(
            f"| {'met' if met.strip() == 'MET' else '**not met**'} | {what} | {scenario} | {value} | {variants} |"
        )
    if data.get("rss"):
        r = data["rss"]
        lines += [
            "",
            f"Trainer RSS around {r['batches']} tfray batches of {r['batch_bytes'] / 1e6:.1f} MB: "
            f"{r['before_kb']['VmRSS'] / 1024:.0f} MB -> {r['after_kb']['VmRSS'] / 1024:.0f} MB "
            f"({r['growth_bytes'] / 1e6:+.1f} MB, {r['growth_batches']:+.2f} batches; "
            f"anonymous {r['before_kb'].get('RssAnon', 0) / 1024:.0f} -> "
            f"{r['after_kb'].get('RssAnon', 0) / 1024:.0f} MB, shared memory "
            f"{r['before_kb'].get('RssShmem', 0) / 1024:.0f} -> "
            f"{r['after_kb'].get('RssShmem', 0) / 1024:.0f} MB).",
        ]
    lines += ["", *consumer_markdown(data)]
    lines += ["", NOTES_MARKER, ""]
    text = "\n".join(lines)
    return text + (notes or "")


def consumer_markdown(data):
    """The producers' rows split into the consumer's sum and the path (see path_cpu_ms)."""
    rows = data["rows"]
    lines = [
        "## From producers: the consumer's sum and the path",
        "",
        "Ray's own loop sums each batch with numpy; the pipelines into TensorFlow sum",
        "it with TensorFlow's `reduce_sum`, whose cost on the same bytes differs",
        "(the ceiling's CPU per batch). On a machine the producers saturate, a",
        "consumer's every extra millisecond is taken from them, so `x Ray's loop`",
        "measures the consumers' difference as well as the paths'. Trainer CPU, ms",
        "per batch, medians over the rounds; then the whole machine's CPU per batch",
        "(every process: producers, Ray's, the trainer) and its cores' idle time",
        "per batch, from `/proc/stat`: with the cores saturated, the rate is the",
        "cores over the whole machine's CPU a batch takes (on a quiet machine only:",
        "other work counts too):",
        "",
    ]
    header = [
        "scenario",
        "x Ray's loop",
        "TF's sum (ceiling)",
        "numpy's sum (Ray's loop)",
        "tfray_generators, less TF's sum",
        "Ray's loop, less numpy's sum",
        "machine CPU: tfray_generators",
        "machine CPU: Ray's loop",
        "idle: tfray_generators",
        "idle: Ray's loop",
    ]
    table = []
    for r in rows:
        if r["pipeline"] != "ray_loop":
            continue
        scenario, load = r["scenario"], r["load"]
        ceiling = _row(rows, scenario, load, "ceiling")
        ours = _row(rows, scenario, load, "tfray_generators")
        if ceiling is None or ours is None or r.get("sum_cpu_ms_per_batch") is None:
            continue
        if ours.get("path_cpu_ms_per_batch") is None:
            continue
        table.append(
            [
                scenario_label(r),
                _fmt_ratio(ours.get("x_ray_loop")),
                f"{ceiling['cpu_ms_per_batch']:.3f}",
                f"{r['sum_cpu_ms_per_batch']:.3f}",
                f"{ours['path_cpu_ms_per_batch']:.3f}",
                f"{r['path_cpu_ms_per_batch']:.3f}",
                _fmt_ms(ours.get("machine_cpu_ms_per_batch")),
                _fmt_ms(r.get("machine_cpu_ms_per_batch")),
                _fmt_ms(ours.get("machine_idle_ms_per_batch")),
                _fmt_ms(r.get("machine_idle_ms_per_batch")),
            ]
        )
    if not table:
        return []
    return lines + [markdown_table(header, table, text_columns=1)]


def write(data, here, *, full, out=None, write_json=True):
    """Writes JSON always; RESULTS.md and the chart in benchmarks/ only for full runs."""
    results_dir = os.path.join(here, "results")
    os.makedirs(results_dir, exist_ok=True)
    paths = []
    if write_json:
        # latest.json, and a copy named by the run's date that a later (say,
        # quick) run does not overwrite.
        stamp = data["machine"]["date"].replace(":", "").replace("-", "")[:15]
        kind = "full" if full else "partial"
        json_paths = [out or os.path.join(results_dir, "latest.json")]
        json_paths.append(os.path.join(results_dir, f"{kind}-{stamp}.json"))
        for json_path in json_paths:
            with open(json_path, "w") as f:
                json.dump(data, f, indent=1, default=str)
            paths.append(json_path)
    target_dir = here if full else results_dir
    chart_name = "throughput.png"
    chart_path = os.path.join(target_dir, chart_name)
    try:
        chart(data, chart_path)
        paths.append(chart_path)
    except ImportError as e:
        print(f"no chart: {e} (pip install matplotlib)")
    md_path = os.path.join(target_dir, "RESULTS.md")
    notes = None
    committed = os.path.join(here, "RESULTS.md")
    if os.path.exists(committed):
        with open(committed) as f:
            text = f.read()
        if NOTES_MARKER in text:
            notes = text.split(NOTES_MARKER, 1)[1].lstrip("\n")
    with open(md_path, "w") as f:
        f.write(results_markdown(data, chart_name, notes))
    paths.append(md_path)
    return paths


def main(argv=None):
    """Re-renders the table, chart and RESULTS.md from a run's JSON."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    here = os.path.dirname(os.path.abspath(__file__))
    parser.add_argument("json", nargs="?", default=os.path.join(here, "results", "latest.json"))
    args = parser.parse_args(argv)
    with open(args.json) as f:
        data = json.load(f)
    print(table_text(data))
    print()
    print(targets_text(data))
    for path in write(data, here, full=data["settings"].get("full", False), write_json=False):
        print(f"wrote {os.path.relpath(path)}")


if __name__ == "__main__":
    main()
