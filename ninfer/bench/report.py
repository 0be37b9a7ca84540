"""A benchmark's table (figure, value, unit, target, met) and its one line of JSON."""

from __future__ import annotations

import json
from pathlib import Path


def report(bench: str, results: dict, rows: list[tuple], targets: dict,
           json_path: str | None = None, note: str = "") -> dict:
    """Print `rows` ((key, label, unit, format)) of `results` beside `targets`
    ({key: (op, bound)}, op ">=" or "<="), then the JSON line; also write it to
    `json_path`. Returns the JSON document."""
    met = {key: {op: bound, "met": (results[key] >= bound if op == ">=" else
                                   results[key] <= bound)}
           for key, (op, bound) in targets.items()}
    print(f"{'figure':<44} {'value':>12}  {'unit':<10} {'target':>12}  ok")
    for key, label, unit, fmt in rows:
        op, bound = targets.get(key, ("", None))
        ok = "" if bound is None else "yes" if met[key]["met"] else "MISS"
        target = "" if bound is None else f"{op} {bound:,}"
        print(f"{label:<44} {results[key]:>12{fmt}}  {unit:<10} {target:>12}  {ok}")
    if note:
        print(note)
    doc = {"bench": bench, "results": results, "targets": met}
    write_line(doc, json_path)
    return doc


def write_line(doc: dict, json_path: str | None = None) -> None:
    """A benchmark's document as one line of JSON: printed, and written to `json_path`."""
    line = json.dumps(doc)
    print(line)
    if json_path:
        Path(json_path).write_text(line + "\n")
