"""task_data.py: the rows of replay_grpo.py's data-set tasks (--task jsonl, gsm8k, math), read and checked.

A jsonl file of {"prompt", "answer"} lines, or a hub data set (users with a network) or its local copy
(--data-path): whatever is wrong with the input is said in one line naming the file, the line or the row
(UserError), never as a traceback from deep inside a loader. make_task in replay_grpo.py turns rows into a task.
"""

import json
from pathlib import Path

from run_folder import UserError


def read_jsonl(path: str) -> list[dict]:
    """{"prompt": str, "answer": str or number, "solution": optional str} per line, as rows of three strings (a
    missing solution is the answer); one line names a bad line."""
    if not Path(path).is_file():
        raise UserError(f"--data-path {path}: no such file")
    out = []
    for lineno, raw in enumerate(Path(path).read_bytes().splitlines(), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"{path}:{lineno}: not valid UTF-8 (byte {e.start})") from None
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict) or "prompt" not in row or "answer" not in row:
            raise UserError(f'{path}:{lineno}: each line needs "prompt" and "answer" keys, '
                            f"got {sorted(row) if isinstance(row, dict) else type(row).__name__}")
        for key, kinds in (("prompt", (str,)), ("answer", (str, int, float)), ("solution", (str,))):
            value = row.get(key, "")
            if not isinstance(value, kinds) or isinstance(value, bool):
                raise UserError(f'{path}:{lineno}: "{key}" must be {" or ".join(k.__name__ for k in kinds)}, got '
                                f"{json.dumps(value)[:40]}")
        answer = str(row["answer"])
        out.append({"prompt": row["prompt"], "answer": answer, "solution": row.get("solution", answer)})
    if not out:
        raise UserError(f"{path}: the data set is empty")
    return out

def load_hf_rows(hub_id: str, config: str | None, split: str, local: str | None, columns: tuple[str, ...]) -> list:
    """Rows from the hub (users with a network) or a local copy (--data-path): a folder saved by
    `datasets`, a folder of <split>.jsonl / .parquet files, or one such file. Every row must hold each of
    `columns` as text."""
    import datasets
    datasets.disable_progress_bars()  # the console shows the run, not the loader
    where = f"--data-path {local}" if local else f"hub data set {hub_id}"
    try:
        if local and (Path(local) / "dataset_dict.json").exists():
            rows = list(datasets.load_from_disk(local)[split])
        elif local and Path(local).is_file():
            rows = list(datasets.load_dataset(Path(local).suffix.lstrip(".").replace("jsonl", "json"),
                                              data_files={split: local}, split=split))
        else:
            rows = list(datasets.load_dataset(local or hub_id, None if local else config, split=split))
    except Exception as e:  # the hub, a missing file: one clear line either way
        where += "" if local else " (needs a network)"
        raise UserError(f"could not load split '{split}' from {where}: {type(e).__name__}: {e}") from None
    for i, row in enumerate(rows):
        bad = [c for c in columns if not isinstance(row.get(c), str)]
        if bad:
            raise UserError(f"{where}, split '{split}', row {i}: the task needs the text columns {', '.join(columns)}; "
                            f"{', '.join(bad)} is missing or not text (columns: {', '.join(sorted(row))})")
    return rows
