"""`refit.plan_schema`: a plan file read back (`refit.load_plan`) is checked whole against one typed
declaration, every wrong value refused naming its place; a plan's summary is what its declaration
says (the docs' table and ``refit settings --json-schema summary`` come from it)."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

import refit
from refit.cli import main as refit_main
from refit.errors import InvalidInput
from refit.plan import PLAN_FORMAT, Plan
from refit.plan_schema import PlanSummary, check_plan_file, load_plan

ROOT = Path(__file__).resolve().parents[2]
WRONG = st.one_of(st.text(max_size=5), st.floats(allow_nan=False), st.lists(st.integers(-3, 3), max_size=3),
                  st.dictionaries(st.text(max_size=3), st.integers(), max_size=2), st.booleans(), st.none(),
                  st.integers(-10, -1))


def _plans() -> dict[str, Plan]:
    spec = refit.load_spec("qwen3-30b-moe")
    return {"plain": refit.make_plan(spec, "megatron:tp2ep2", "vllm:tp2").plan,
            "phased": refit.make_plan(spec, "megatron:tp2ep2", "vllm:tp2", phase_layers=8).plan}


PLANS = _plans()
PLAIN = PLANS["plain"].to_dict()


def test_the_format_is_the_planners() -> None:
    assert _refusal({**PLAIN, "format": PLAN_FORMAT}) is None
    assert _refusal({**PLAIN, "format": PLAN_FORMAT + 1}).startswith("plan.format")


@pytest.mark.parametrize("name", sorted(PLANS))
def test_a_written_plan_loads_equal(tmp_path: Path, name: str) -> None:
    path = tmp_path / "plan.json"
    assert refit_main(["plan", "--model", "qwen3-30b-moe", "--src", "megatron:tp2ep2", "--dst", "vllm:tp2",
                       "--phase-layers", "8" if name == "phased" else "0", "--out", str(path)]) == 0
    assert refit.load_plan(str(path)) == PLANS[name]


def _refusal(data: dict) -> str | None:
    try:
        check_plan_file(json.dumps(data))
    except InvalidInput as e:
        return str(e)
    return None


@hsettings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from(sorted(PLAIN)), value=WRONG)
def test_a_wrong_value_is_refused_naming_its_key(key: str, value) -> None:
    message = _refusal({**PLAIN, key: value})
    if message is None:  # the declaration takes it: only a value a plan may hold (an empty list, a name)
        assert isinstance(value, (str, list)), (key, value)
        return
    assert message.startswith(f"plan.{key}"), message


@hsettings(max_examples=200, deadline=None)
@given(table=st.sampled_from(["tensors", "transfers", "buckets"]), data=st.data())
def test_a_wrong_cell_is_refused_naming_its_row_and_column(table: str, data) -> None:
    rows = PLAIN[table]
    row = data.draw(st.integers(0, len(rows) - 1))
    column = data.draw(st.integers(0, len(rows[row]) - 1))
    value = data.draw(st.one_of(st.text(min_size=1, max_size=3), st.floats(allow_nan=False), st.none(),
                                st.integers(-9, -1), st.dictionaries(st.text(max_size=2), st.integers(), max_size=1)))
    edited = copy.deepcopy(PLAIN)
    edited[table][row] = list(edited[table][row])
    edited[table][row][column] = value
    message = _refusal(edited)
    if message is None:  # a name where a name belongs
        assert table == "tensors" and column == 0 and isinstance(value, str), (table, column, value)
        return
    assert message.startswith(f"plan.{table}[{row}][{column}]"), message


def test_refusals_say_where_what_and_why(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({**PLAIN, "placement": {**PLAIN["placement"], "kind": "coloc"}}))
    with pytest.raises(InvalidInput, match=rf"plan file {re.escape(str(path))}: plan.placement.kind: 'coloc' is "
                                           "refused: Input should be 'colocated' or 'disaggregated'"):
        load_plan(str(path))
    path.write_text(json.dumps({k: v for k, v in PLAIN.items() if k != "buckets"}))
    with pytest.raises(InvalidInput, match="plan.buckets: Field required"):
        load_plan(str(path))
    path.write_text(json.dumps({**PLAIN, "bucket_size": 1}))
    with pytest.raises(InvalidInput, match="plan.bucket_size: 1 is refused: Extra inputs are not permitted"):
        load_plan(str(path))
    path.write_text(json.dumps(PLAIN)[:-40])
    with pytest.raises(InvalidInput, match="plan is not JSON"):
        load_plan(str(path))
    with pytest.raises(InvalidInput, match="plan file .*missing.json: No such file"):
        load_plan(str(tmp_path / "missing.json"))
    # well-typed, inconsistent: the plan's own check names it
    edited = copy.deepcopy(PLAIN)
    edited["buckets"][1][3] += 1
    path.write_text(json.dumps(edited))
    with pytest.raises(InvalidInput, match="malformed plan: bucket 1"):
        load_plan(str(path))


def _summary(args: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    assert refit_main(["plan", "--model", "qwen3-8b", "--src", "tp2", "--dst", "tp4", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)["summary"]


@pytest.mark.parametrize("args", [[], ["--src-dtype", "float32", "--predict", "--engine", "vllm"],
                                  ["--dst-dtype", "fp8", "--phase-layers", "4"]])
def test_the_summary_is_its_declaration(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from pydantic import TypeAdapter

    summary = _summary(args, capsys)
    TypeAdapter(PlanSummary).validate_python(summary, strict=True)


def test_docs_summary_table_is_the_declaration() -> None:
    from refit.validation import markdown_table

    text = (ROOT / "docs" / "layouts.md").read_text()
    found = re.search(r"<!-- summary: generated[^\n]*-->\n(.*?)\n<!-- /summary -->", text, re.S)
    assert found and found[1] == markdown_table(PlanSummary, "what it holds"), \
        "regenerate docs/layouts.md's summary table: refit.validation.markdown_table(PlanSummary, 'what it holds')"


@pytest.mark.parametrize("what,key", [("plan", "transfers"), ("summary", "plan_hash")])
def test_json_schemas(what: str, key: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert refit_main(["settings", "--json-schema", what]) == 0
    assert key in json.loads(capsys.readouterr().out)["properties"]
