"""Reading a bench/run work directory: meta.txt and the TSV files of its runs."""

import csv
import os
import statistics


def read_meta(work):
    """meta.txt's `key=value` lines as a dict."""
    meta = {}
    with open(os.path.join(work, "meta.txt")) as f:
        for line in f:
            if "=" in line:
                k, v = line.rstrip("\n").split("=", 1)
                meta[k] = v
    return meta


def read_tsv(work, name):
    """The rows of WORK/NAME as dicts; [] if there is no such file."""
    path = os.path.join(work, name)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return list(csv.DictReader(f, delimiter="\t"))


def med(values):
    """Median of the values that are not None or empty, as floats; None if there are none."""
    values = [float(v) for v in values if v not in (None, "")]
    return statistics.median(values) if values else None
