"""Hardware tables of the performance models: every shipped entry cites a source or is an assumption."""

import json
import re

import pytest

from ascend_moe_ops.perfmodel import hardware as hw


def _good():
    return {"name": "t", "title": "Test chip", "version": "1",
            "params": {"clock_hz": {"value": 1e9, "unit": "Hz", "source": "datasheet p. 3, table 2"},
                       "gm_bw": {"value": 1.6e12, "unit": "B/s", "assumption": "vendor figure, unverified"}}}


def test_loads_and_labels():
    t = hw.HardwareTable.from_dict(_good())
    assert t["clock_hz"] == 1e9 and t.param("gm_bw").is_assumption
    assert "model" in t.label and "v1" in t.label
    assert [p.key for p in t.assumptions()] == ["gm_bw"]


@pytest.mark.parametrize("mutate, msg", [
    (lambda d: d["params"]["clock_hz"].pop("source"), "exactly one of 'source'"),
    (lambda d: d["params"]["clock_hz"].update(assumption="guess from a slide"), "exactly one of 'source'"),
    (lambda d: d["params"]["clock_hz"].update(source="x"), "must say where"),
    (lambda d: d["params"]["clock_hz"].pop("unit"), "has no 'unit'"),
    (lambda d: d["params"]["clock_hz"].update(value="fast"), "value must be"),
    (lambda d: d["params"]["clock_hz"].update(value=float("inf")), "finite"),
    (lambda d: d["params"]["clock_hz"].update(vaule=3), "unknown fields"),
    (lambda d: d.pop("version"), "has no 'version'"),
])
def test_rejects_malformed(mutate, msg):
    d = _good()
    mutate(d)
    with pytest.raises(hw.TableError, match=msg):
        hw.HardwareTable.from_dict(d)


def test_scaled_is_a_copy_with_a_new_version():
    t = hw.HardwareTable.from_dict(_good())
    s = t.scaled({"gm_bw": 0.7})
    assert s["gm_bw"] == pytest.approx(1.6e12 * 0.7) and t["gm_bw"] == 1.6e12
    assert s.version != t.version and "gm_bw" in s.version
    with pytest.raises(KeyError, match="no parameter 'nope'"):
        t.scaled({"nope": 2.0})
    with pytest.raises(ValueError, match="positive"):
        t.scaled({"gm_bw": 0.0})


def test_load_by_path_and_unknown_name(tmp_path):
    p = tmp_path / "chip.json"
    p.write_text(json.dumps(_good()))
    assert hw.load_table(p)["clock_hz"] == 1e9
    with pytest.raises(ValueError, match="no hardware table 'no-such-chip'"):
        hw.load_table("no-such-chip")


@pytest.mark.parametrize("name", hw.available_tables() or ["<none shipped yet>"])
def test_every_shipped_table_is_well_formed(name):
    if name.startswith("<"):
        pytest.skip("no hardware table shipped yet")
    t = hw.load_table(name)
    assert t.name == name and t.params


def test_the_docs_print_the_a2_table_as_it_is():
    """docs/perfmodel/a2_timeline.md shows the current A2 table, row for row (regenerate the section
    with HardwareTable.markdown() when a2.json changes)."""
    from pathlib import Path
    doc = (Path(__file__).resolve().parents[1] / "docs" / "perfmodel" / "a2_timeline.md").read_text()
    t = hw.load_table("a2")
    assert f"## The table (a2 v{t.version})" in doc
    assert t.markdown() in doc


@pytest.mark.parametrize("key, value, msg", [
    # these loaded, then divided by zero (sim, timeline), gave a negative time, or a misleading
    # "could not finish its schedule" error deep in the timeline
    ("clock_hz", 0, "params['clock_hz'].value must be > 0"),
    ("gm_bandwidth", -1e12, "params['gm_bandwidth'].value must be > 0"),
    ("mte2_gm_bytes_per_cycle", 0.0, "must be > 0"),
    ("peak_bf16_flops", 0, "must be > 0"),
    ("devices_per_node", 0, "must be > 0"),
    ("launch_latency_s", -1, "params['launch_latency_s'].value must be >= 0"),
    ("dma_latency_cycles", -5, "must be >= 0"),
])
def test_rejects_zero_rates_and_negative_values(key, value, msg):
    d = _good()
    d["params"][key] = {"value": value, "unit": "-", "assumption": "a value made up for this test"}
    with pytest.raises(hw.TableError, match=re.escape(msg)) as e:
        hw.HardwareTable.from_dict(d)
    assert "table 't'" in str(e.value)
    d["params"][key]["value"] = 0 if "latency" in key else 1  # a zero latency is fine
    assert hw.HardwareTable.from_dict(d)[key] == d["params"][key]["value"]


def test_require_names_the_missing_keys():
    t = hw.HardwareTable.from_dict(_good())
    assert t.require(["clock_hz"], "x") is t
    with pytest.raises(hw.TableError, match=r"table 't' .* lacks 'gm_bandwidth', 'l2_bytes', which the reader needs"):
        t.require(["clock_hz", "gm_bandwidth", "l2_bytes"], "the reader")


def test_host_bandwidth_zero_is_no_host_link_and_the_roofline_needs_its_keys_only():
    """host_bandwidth 0 means "no host link" (Cluster.host_bw: swapping refused), not a bad rate; the
    roofline helpers read four entries of a chip table, the scheduler all of TABLE_KEYS."""
    from ascend_moe_ops.perfmodel import a2_timeline as tl
    d = _good()
    d["params"]["host_bandwidth"] = {"value": 0, "unit": "B/s", "assumption": "no host link"}
    assert hw.HardwareTable.from_dict(d)["host_bandwidth"] == 0
    a2 = hw.load_table("a2")
    d = {"name": "chip", "title": "Roofline entries only", "version": "1",
         "params": {k: {"value": a2[k], "unit": "-", "assumption": "copied from a2"}
                                    for k in tl.ROOFLINE_KEYS}}
    chip = hw.HardwareTable.from_dict(d)
    assert tl.peak_flops(chip) == tl.peak_flops()
    assert tl.roofline_seconds(1e12, 1e9, chip) == tl.roofline_seconds(1e12, 1e9)
    with pytest.raises(hw.TableError, match="lacks"):
        tl.simulate({"kernel": "k", "kind": "aiv", "cores": []}, chip)
