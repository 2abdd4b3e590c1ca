"""Every benchmark figure in README.md and docs/ is what ``python -m bench report`` makes
of the committed result files (``docs/results/``), and every result file names its
commit."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest

from bench import cells, report, results, tables
from tests.conftest import REPO

# The sections of the docs that report benchmark figures: every table in them must be a
# generated one (between bench markers), so no hand-typed figure can hide there.
BENCHMARK_SECTIONS = {
    "README.md": ["## Benchmarks"],
    "docs/benchmarks/index.md": ["# Benchmarks"],
    "docs/how-to/formats.md": ["## Benchmarks"],
    "docs/architecture/scale.md": ["## Measured"],
    "docs/architecture/control-plane.md": ["## The benchmark"],
    "docs/how-to/ray.md": ["## Benchmark"],
}


def test_docs_match_the_committed_result_files() -> None:
    problems = report.check()
    assert not problems, (
        "\n".join(problems) + "\nrun `python -m bench report` (and commit docs/results/)"
    )


def test_every_result_file_names_its_commit() -> None:
    for path in sorted(results.RESULTS.glob("*.json")):
        res = json.loads(path.read_text())
        assert (res.get("commit") or {}).get("sha"), f"{path.name} names no commit"
        assert res.get("name") == path.stem, path.name


def _section(text: str, heading: str) -> str:
    start = text.index(heading + " ") if heading + " " in text else text.index(heading + "\n")
    level = heading.split()[0]
    m = re.compile(rf"^{level} ", re.M).search(text, start + len(heading))
    return text[start : m.start() if m else len(text)]


@pytest.mark.parametrize("doc", sorted(BENCHMARK_SECTIONS))
def test_no_table_outside_the_generated_ones(doc: str) -> None:
    text = (REPO / doc).read_text()
    for heading in BENCHMARK_SECTIONS[doc]:
        section = report.MARKER.sub("", _section(text, heading))
        rows = [line for line in section.splitlines() if line.startswith("|")]
        assert not rows, f"{doc} {heading}: a table not made by bench.report: {rows[:2]}"


def _cell(*runs: float) -> dict[str, Any]:
    return {
        "samples_per_s": results.spread(list(runs)),
        "ttfb_s": results.spread([0.1]),
        "peak_pss_bytes": results.spread([2**28]),
        "peak_rss_bytes": results.spread([2**28]),
        "cpu_ms_per_ksample": results.spread([5.0]),
        "under_load": False,
    }


def _result(name: str = "W1") -> dict[str, Any]:
    """A small, made-up result file of the suite's shape."""
    res = results.start(name, {"runs": 3})
    res.pop("_t0")
    res["commit"] = {"sha": "0" * 40, "short": "0000000", "dirty": False, "dirty_paths": []}
    res["load"]["after"] = res["load"]["before"]
    res["interference"] = {"runs": 9, "runs_under_load": 0}
    res["workload"] = {"key": name, "title": "made up"}
    res["cells"] = {
        "pinfeed": {"0": _cell(100, 104, 98), "1": _cell(200, 210, 190)},
        "dataloader": {"0": _cell(150, 151, 149), "1": _cell(100, 101, 99)},
        "dataloader-tuned": {"0": _cell(195, 196, 194), "1": _cell(120, 121, 119)},
    }
    res["roofline"] = {"cell": _cell(300)}
    return res


def test_a_hand_edited_figure_is_caught(tmp_path: Path) -> None:
    results.write(_result(), tmp_path)
    r = cells.Results(tmp_path)
    doc = "x\n<!-- bench:headline W1 -->\n<!-- /bench:headline -->\ny\n"
    made = report.render(doc, r)
    assert "200 (nw 1)" in made and "150 (nw 0)" in made
    assert report.render(made, r) == made  # stable
    edited = made.replace("200 (nw 1)", "210 (nw 1)")
    assert report.render(edited, r) != edited


def test_verdicts_come_from_the_numbers(tmp_path: Path) -> None:
    results.write(_result(), tmp_path)
    text = tables.headline(cells.Results(tmp_path), ["W1"])
    # best against best: pinfeed 200 (nw 1) vs DataLoader 150 (nw 0), tuned 195 (nw 0)
    assert "**wins 1.33x**" in text
    assert "ties 1.03x" in text
    spread = results.spread
    assert cells.verdict(spread([106.0]), spread([100.0])).startswith("**wins")
    assert cells.verdict(spread([104.0]), spread([100.0])).startswith("ties")
    assert cells.verdict(spread([94.0]), spread([100.0])).startswith("**loses")
    assert "(runs overlap)" in cells.verdict(spread([90.0, 110, 112]), spread([95.0, 100, 101]))


def test_a_missing_result_says_so(tmp_path: Path) -> None:
    doc = "<!-- bench:throughput W9 -->\n<!-- /bench:throughput -->\n"
    made = report.render(doc, cells.Results(tmp_path))
    assert "not yet measured" in made
    row = next(line for line in made.splitlines() if line.startswith("| W9"))
    values = row.split("|")[2:]  # after the workload's title
    assert not any(re.search(r"\d", v) for v in values), row  # no figure without a result


def test_a_measured_figure_in_prose_is_a_problem() -> None:
    text = (
        "pinfeed runs a little behind it (552 against 586\nsamples/s), 0.96x at one worker.\n"
        "| W1 | 1.08x | 12k samples/s |\n"
        "`python -m bench` says `1.5x`; a tie band of 5%, batch 256, a 20 ms step.\n"
        "<!-- bench:headline -->\nwins 2.20x\n<!-- /bench:headline -->\n"
        "```\n3.3x\n```\n"
    )
    assert report.prose_figures(text) == [(1, "586 samples/s"), (2, "0.96x")]


def test_a_result_without_its_commit_is_a_problem(tmp_path: Path) -> None:
    res = copy.deepcopy(_result())
    res["commit"] = {"sha": None}
    results.write(res, tmp_path)
    assert any("names no commit" in p for p in report.check(tmp_path))


def test_a_cell_under_load_is_marked(tmp_path: Path) -> None:
    res = _result()
    res["cells"]["pinfeed"]["1"]["under_load"] = True
    results.write(res, tmp_path)
    text = tables.headline(cells.Results(tmp_path), ["W1"])
    assert "200† (nw 1)" in text


def test_a_caching_dataloader_is_the_tuned_one_where_there_is_no_batched_read(
    tmp_path: Path,
) -> None:
    """W9: no batched read, a DataLoader keeping its decoded samples (``dataloader-cached``)
    shows in the tuned DataLoader's column, labelled so, and pinfeed's verdict against
    the tuned one is against it; without it the column says tuned = DataLoader."""
    res = _result("W9")
    del res["cells"]["dataloader-tuned"]
    results.write(res, tmp_path)
    r = cells.Results(tmp_path)
    assert "= DataLoader (no batched read): 150 (nw 0)" in tables.headline(r, ["W9"])
    res["cells"]["dataloader-cached"] = {"0": _cell(300, 301, 299), "1": _cell(250, 251, 249)}
    results.write(res, tmp_path)
    r = cells.Results(tmp_path)
    head = tables.headline(r, ["W9"])
    assert "DataLoader caching decoded samples: 300 (nw 0)" in head
    assert "**loses 0.67x**" in head  # pinfeed's best 200 against the caching 300
    rows = tables.throughput(r, ["W9"]).splitlines()
    assert not any("caching" in c for c in rows[0].split("|"))  # no column of its own
    nw0 = next(line for line in rows if line.startswith("| W9"))
    assert "DataLoader caching decoded samples: 300 [299-301]" in nw0
    assert "**loses 0.33x**" in nw0  # pinfeed 100 at nw 0 against it
