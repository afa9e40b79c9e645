"""The script linker: each operation is sent with the library helpers it uses and no others
(Lua creates every local function of a script anew on each call, so unused ones cost time)."""

from __future__ import annotations

import re

from redis_layer_signals.scripts import OPERATIONS, definitions, link, load

LIBRARY = """-- header of the library, documentation only
local find, sub = string.find, string.sub

-- used only by outer
local function inner(x)
  return find(x, ',', 1, true)
end

local function outer(x)
  return inner(x) or 0
end

-- never used by the body below
local function unused(x)
  return sub(x, 2)
end
"""


def defined(text: str) -> list[str]:
    return re.findall(r"^local function (\w+)", text, re.MULTILINE)


def test_a_helper_used_through_another_is_kept_and_an_unused_one_dropped() -> None:
    text = link(LIBRARY, "return outer(ARGV[1])\n")
    assert defined(text) == ["inner", "outer"]
    assert "local find, sub = string.find, string.sub" in text
    assert "-- used only by outer" in text and "never used" not in text and "header" not in text
    assert text.endswith("return outer(ARGV[1])\n")


def test_a_name_in_a_comment_pulls_nothing_in() -> None:
    text = link(LIBRARY, "-- outer and unused are only mentioned here\nreturn 1\n")
    assert defined(text) == [] and "string.find" not in text


def test_library_definitions_carry_their_own_comment_and_names() -> None:
    defs = definitions(LIBRARY)
    assert [sorted(d.names) for d in defs] == [["find", "sub"], ["inner"], ["outer"], ["unused"]]
    assert defs[1].text.startswith("-- used only by outer\n") and "inner" in defs[2].uses


def test_every_operation_defines_what_it_calls_and_nothing_it_does_not() -> None:
    for name in OPERATIONS:
        text = load(name).text
        helpers = set(defined(text))
        code = re.sub(r"--[^\n]*", "", text)
        for helper in helpers:
            # each kept helper is called somewhere besides its own definition
            assert len(re.findall(rf"\b{helper}\b", code)) >= 2, (name, helper)
    assert "slot_pending" not in defined(load("record").text)
    assert "sweep" in defined(load("sweep").text) and "parse_holder" not in defined(load("sweep").text)


def test_helpers_only_the_rest_needs_are_placed_at_the_marker() -> None:
    body = (
        "local x = inner(ARGV[1])\nif x then\n  return x\nend\n"
        "-- @helpers: after the common path\nreturn outer(ARGV[1])\n"
    )
    text = link(LIBRARY, body)
    head, _, rest = text.partition("-- @helpers: after the common path\n")
    assert defined(head) == ["inner"] and defined(rest) == ["outer"]
    assert "local find, sub" in head and rest.rstrip().endswith("return outer(ARGV[1])")


def test_record_creates_no_sweep_helper_before_its_delivering_path_returns() -> None:
    head, _, rest = load("record").text.partition("-- @helpers")
    assert "sweep" not in defined(head) and "sweep" in defined(rest)
    assert {"replayed_reply", "remember_reply", "now_ms"} <= set(defined(head))


def test_a_helper_placed_at_the_marker_is_not_captured_by_a_local_of_the_code_above() -> None:
    """With the whole library in front, ``outer`` binds the library's ``inner``. Created at the
    marker, after a top-level ``local inner`` of the script, it would bind that local instead."""
    import fakeredis

    body = "local inner = 'shadow'\nif ARGV[1] == 'early' then\n  return inner\nend\n-- @helpers\nreturn outer('a,b')\n"
    client = fakeredis.FakeRedis()
    assert client.eval(LIBRARY + body, 0, "late") == 2  # the library's inner: find(',') -> 2
    assert client.eval(link(LIBRARY, body), 0, "late") == 2
    assert client.eval(link(LIBRARY, body), 0, "early") == b"shadow"


def test_a_double_dash_inside_a_string_starts_no_comment_and_a_string_pulls_nothing_in() -> None:
    import fakeredis

    body = "local sep = '--' return outer(sep .. ',')\n"
    assert defined(link(LIBRARY, body)) == ["inner", "outer"]
    assert fakeredis.FakeRedis().eval(link(LIBRARY, body), 0) == 3
    assert defined(link(LIBRARY, "return 'unused'\n")) == []
