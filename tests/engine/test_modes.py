"""The mode table (common/engine/modes.py) agrees with the proto enum, and its rules hold."""
from __future__ import annotations

import pytest

from common.engine import modes
from protos.hypic.v1 import router_pb2 as router_pb


def test_wire_values_equal_the_proto_enum() -> None:
    proto = {name.removeprefix("PREFILL_MODE_").lower(): value for name, value in router_pb.PrefillMode.items()}
    canonical = {name: value for name, value in proto.items() if name not in modes.ALIASES}
    assert canonical == {m: modes.to_wire(m) for m in modes.MODES}
    for alias, target in modes.ALIASES.items():
        assert proto[alias] == modes.to_wire(target)
    for value in router_pb.PrefillMode.values():
        assert modes.from_wire(value) == router_pb.PrefillMode.Name(value).removeprefix("PREFILL_MODE_").lower()
    assert modes.to_wire(modes.DEFAULT) == 0  # proto3's unset value is the default mode


def test_parse_accepts_aliases_and_case_and_rejects_the_rest() -> None:
    assert [modes.parse_mode(m.upper()) for m in modes.MODES] == list(modes.MODES)
    assert modes.parse_mode("naive") == "additive"
    for bad in ("", "hypic2", "reference", None, 3):
        with pytest.raises(ValueError):
            modes.parse_mode(bad)
    with pytest.raises(ValueError):
        modes.from_wire(len(modes.MODES))


def test_seam_rule() -> None:
    assert modes.seam_for("additive", 8) == 0
    assert modes.seam_for("naive", 8) == 0
    assert [modes.seam_for(m, 5) for m in ("full", "prefix", "hypic")] == [5, 5, 5]
    assert [m for m in modes.MODES if modes.uses_entries(m)] == ["additive", "hypic"]


def test_the_sdk_reads_the_same_table_off_the_proto() -> None:
    """The SDK may not import common/, so it takes the names from the enum; they must agree."""
    from hypic.client import MODE_NAMES, MODES, build_request

    assert sorted(MODE_NAMES) == sorted(modes.MODES)
    assert MODES == {name: modes.to_wire(name) for name in (*modes.MODES, *modes.ALIASES)}
    for name in (*modes.MODES, *modes.ALIASES, "Additive"):
        assert build_request(["a"], "q", mode=name).mode == modes.to_wire(name)


def test_old_benchmark_results_read_with_todays_names() -> None:
    """Results written before the rename say "naive"; readers see "additive", other names pass."""
    from bench import results_json

    old = ('{"modes": ["full", "naive", "hypic_w8"], "accuracy": {"update": {"naive": 39.0, "full": 96.0}},'
           ' "rows": [{"naive_s": 0.5, "full_s": 1.0}], "naive_part": 2.4, "what": "prefix, naive and hypic"}')
    got = results_json.loads(old)
    assert got["modes"] == ["full", "additive", "hypic_w8"]
    assert got["accuracy"] == {"update": {"additive": 39.0, "full": 96.0}}
    assert got["rows"] == [{"additive_s": 0.5, "full_s": 1.0}]
    assert got["naive_part"] == 2.4 and got["what"] == "prefix, naive and hypic"
