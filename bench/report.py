"""How every benchmark ends: its table printed, and kept as NAME.md and NAME.json under --out.

The markdown is what goes into RESULTS.md; the JSON keeps every figure the table rounds.
"""
from __future__ import annotations

import json
import os
from typing import Any


def bars_line(bars: dict[str, bool]) -> str:
    """One line saying which bars passed."""
    return "bars: " + ", ".join(f"{k}: {'PASS' if v else 'FAIL'}" for k, v in bars.items())


def report(out: str, name: str, lines: list[str], data: Any) -> str:
    """Print `lines` as one text, write it to OUT/NAME.md and `data` to OUT/NAME.json; returns the text."""
    text = "\n".join(lines)
    print(text)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(data, f, indent=1)
    return text
