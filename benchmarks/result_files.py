"""What the benchmarks share around their result files: the shapes a run may name, and merging this
run's rows into an earlier file's."""

import json


def refuse_unknown_shapes(ap, names, known) -> None:
    """--shapes naming a shape the benchmark does not have: an argparse error listing the known ones,
    before any work."""
    unknown = sorted(set(names) - set(known))
    if unknown:
        ap.error(f"--shapes: unknown {unknown}; known: {', '.join(known)}")


def refuse_other_gpu(ap, merge_path: str, gpu: str) -> None:
    """--merge of a file measured on another GPU: an argparse error, before any timing (its rows
    would be merged as this GPU's)."""
    with open(merge_path) as f:
        earlier_gpu = json.load(f)["meta"]["gpu"]
    if earlier_gpu != gpu:
        ap.error(f"--merge {merge_path}: its rows were measured on {earlier_gpu}, this GPU is {gpu}")


def runs_with_rows(earlier_meta: dict, meta: dict, rows: list, run_of) -> list:
    """The runs that measured a row still in `rows` (each row's `measured` is its run's date), each
    named once: the earlier file's, then this one's. run_of(meta) -> a run's entry."""
    runs = earlier_meta.get("runs") or [run_of(earlier_meta)]
    measured = {r["measured"] for r in rows}
    return [run for run in runs if run["date"] in measured and run["date"] != meta["date"]] + [run_of(meta)]
