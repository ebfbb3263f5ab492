"""`refit.validation`: what users hand refit as data is checked against one typed declaration.
The vLLM backend's ``init_info`` / ``update_info`` and LoRA adapter (their declarations need vLLM), the
verl backend's options and the ``REFIT_*`` settings (plan files: test_plan_schema.py): every wrong type or out-of-range value, and every unknown key, is refused
naming it; the docs' tables and the JSON schemas come from the declarations."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

from refit import settings
from refit.errors import InvalidInput

ROOT = Path(__file__).resolve().parents[2]
WRONG = st.one_of(st.text(max_size=5), st.floats(allow_nan=False), st.lists(st.integers(), max_size=2),
                  st.dictionaries(st.text(max_size=3), st.integers(), max_size=2), st.booleans(), st.none(),
                  st.integers(-10, -1))


def infos():
    pytest.importorskip("vllm")
    from refit.integrations.vllm import infos as module

    return module


def _accepts(cls, name: str, value) -> bool:
    """Whether pydantic's strict check of that one field would take ``value`` (the oracle is the
    annotation itself: a wrong value must be refused, a right one accepted)."""
    from refit.validation import _adapters

    try:
        _adapters(cls)[name].validate_python(value, strict=True)
    except Exception:  # noqa: BLE001 - any refusal
        return False
    return True


def _declaration(which: str) -> tuple[type, dict]:
    """The declaration read as ``which`` and the least valid input of it."""
    if which == "engine_kwargs.refit":
        pytest.importorskip("verl")
        from refit.integrations.verl import VerlOptions

        return VerlOptions, {}
    module = infos()
    if which == "init_info.adapter":
        from refit.integrations.vllm.lora_slot import AdapterInfo

        return AdapterInfo, {"name": "a", "id": 1, "r": 8, "lora_alpha": 16.0, "target_modules": ["q_proj"]}
    if which == "init_info":
        return module.RefitInitInfo, {}
    return module.RefitUpdateInfo, {"plan_id": "p", "version": 3}


@hsettings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=st.sampled_from(["init_info", "update_info", "engine_kwargs.refit", "init_info.adapter"]), data=st.data())
def test_a_wrong_value_is_refused_naming_its_field(which, data) -> None:
    from refit.validation import parse

    cls, base = _declaration(which)
    name = data.draw(st.sampled_from([f.name for f in dataclasses.fields(cls)]))
    value = data.draw(WRONG)
    if _accepts(cls, name, value):
        assert getattr(parse(cls, {**base, name: value}, which), name) == value
        return
    with pytest.raises(InvalidInput) as e:
        parse(cls, {**base, name: value}, which)
    assert str(e.value).startswith(f"{which}.{name}"), str(e.value)
    assert repr(value)[:20] in str(e.value)


@pytest.mark.parametrize("which,key,near", [("init_info", "stagin", "staging"), ("init_info", "windows_layers",
                                                                                  "window_layers"),
                                            ("update_info", "timout", "timeout"), ("update_info", "deltas", "delta")])
def test_an_unknown_key_is_refused_naming_the_nearest(which, key, near) -> None:
    from refit.integrations.vllm.engine import RefitWeightTransferEngine

    module = infos()
    parse = RefitWeightTransferEngine.parse_init_info if which == "init_info" else \
        RefitWeightTransferEngine.parse_update_info  # what vLLM calls with the loop's dict
    base = {} if which == "init_info" else {"plan_id": "p", "version": 3}
    with pytest.raises(InvalidInput, match=rf"{which}: unknown key '{key}'; did you mean '{near}'\?"):
        parse(None, {**base, key: 1})
    assert isinstance(parse(None, base), (module.RefitInitInfo, module.RefitUpdateInfo))


def test_docs_tables_are_the_declarations() -> None:
    from refit.validation import markdown_table

    module = infos()
    text = (ROOT / "docs" / "rl-loop-and-vllm.md").read_text()
    for cls, tag in ((module.RefitInitInfo, "init_info"), (module.RefitUpdateInfo, "update_info")):
        found = re.search(rf"<!-- {tag}: generated[^\n]*-->\n(.*?)\n<!-- /{tag} -->", text, re.S)
        assert found and found[1] == markdown_table(cls), f"regenerate the {tag} table of docs/rl-loop-and-vllm.md"


def test_json_schemas(capsys) -> None:
    from refit.cli import main

    assert main(["settings", "--json-schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert set(schema["properties"]) == {k.name for k in settings.KNOBS} and schema["additionalProperties"] is False
    assert schema["properties"]["REFIT_IPC"]["enum"] == ["auto", "push", "pull"]
    infos()
    assert main(["settings", "--json-schema", "update_info"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema["required"] == ["plan_id", "version"] and schema["additionalProperties"] is False
    assert schema["properties"]["version"]["minimum"] == 1


KNOB_VALUES = st.one_of(st.text(max_size=8), st.integers(-5, 10**20).map(str), st.sampled_from(["yes", "", "1,2,3,4"]))


@hsettings(max_examples=300, deadline=None)
@given(knob=st.sampled_from([k for k in settings.KNOBS if not k.secret]), value=KNOB_VALUES)
def test_a_wrong_setting_is_refused_naming_the_variable(knob, value) -> None:
    try:
        knob.parse(value)
    except InvalidInput as e:
        assert str(e).startswith(f"{knob.name}={value!r}: must be "), str(e)


def test_verl_options_table_and_refusals() -> None:
    pytest.importorskip("verl")
    from refit.integrations.verl import VerlOptions
    from refit.validation import markdown_table, parse

    text = (ROOT / "docs" / "verl.md").read_text()
    found = re.search(r"<!-- verl: generated[^\n]*-->\n(.*?)\n<!-- /verl -->", text, re.S)
    assert found and found[1] == markdown_table(VerlOptions), "regenerate docs/verl.md's options table"
    with pytest.raises(InvalidInput, match=r"engine_kwargs.refit: unknown key 'engine_grup'; did you mean 'engine_group'"):
        parse(VerlOptions, {"engine_grup": "x"}, "engine_kwargs.refit")
    with pytest.raises(InvalidInput, match=r"engine_kwargs.refit.timeout: '30' is refused"):
        parse(VerlOptions, {"timeout": "30"}, "engine_kwargs.refit")
    assert parse(VerlOptions, {"timeout": 30, "init_info": {"staging": "atomic"}}, "x").timeout == 30
