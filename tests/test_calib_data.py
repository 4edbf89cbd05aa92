"""Calibration data loading: JSONL field rule, plain text, bad inputs."""

from __future__ import annotations

import json

import pytest

from ascend_fa.calibration.data import TEXT_FIELDS, default_calib_path, load_calib_texts


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


def test_jsonl_field_priority(tmp_path):
    rows = [
        {"inputs_pretokenized": "A", "text": "x", "prompt": "y"},
        {"text": "B", "prompt": "y"},
        {"prompt": "C"},
        {"inputs_pretokenized": "", "text": "D"},  # empty field is skipped
        {"inputs_pretokenized": 3, "prompt": "E"},  # non-string is skipped
    ]
    p = write(tmp_path, "d.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert load_calib_texts(p) == ["A", "B", "C", "D", "E"]
    assert TEXT_FIELDS == ("inputs_pretokenized", "text", "prompt")


def test_jsonl_sniffed_without_suffix(tmp_path):
    p = write(tmp_path, "d.txt", '{"text": "one"}\n{"text": "two"}\n')
    assert load_calib_texts(p) == ["one", "two"]


def test_plain_text_paragraphs(tmp_path):
    p = write(tmp_path, "d.txt", "first para\nline two\n\n\n  second  \n \n third\n")
    assert load_calib_texts(p) == ["first para\nline two", "second", "third"]


def test_malformed_line_names_line_number(tmp_path):
    p = write(tmp_path, "d.jsonl", '{"text": "ok"}\n\n{"text": "broken"\n')
    with pytest.raises(ValueError, match=r"line 3: malformed JSON line"):
        load_calib_texts(p)


def test_non_object_and_missing_field_name_line(tmp_path):
    p = write(tmp_path, "d.jsonl", '{"text": "ok"}\n["a"]\n')
    with pytest.raises(ValueError, match=r"line 2: expected a JSON object, got list"):
        load_calib_texts(p)
    p = write(tmp_path, "e.jsonl", '{"text": "ok"}\n{"question": "q"}\n')
    with pytest.raises(
        ValueError,
        match=r"line 2: no non-empty text field; expected "
        r"one of inputs_pretokenized, text, prompt",
    ):
        load_calib_texts(p)


@pytest.mark.parametrize(
    "name,text", [("e.jsonl", ""), ("e.txt", "\n  \n\n"), ("f.jsonl", "\n\n")]
)
def test_empty_file(tmp_path, name, text):
    with pytest.raises(ValueError, match="calibration file is empty"):
        load_calib_texts(write(tmp_path, name, text))


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="calibration data not found"):
        load_calib_texts(tmp_path / "nope.jsonl")


def test_default_set_mixes_kinds():
    texts = load_calib_texts()
    assert load_calib_texts(default_calib_path()) == texts
    assert 30 <= len(texts) <= 60
    assert len(set(texts)) == len(texts)
    assert sum("def " in t or "#include" in t or "SELECT" in t for t in texts) >= 5
    assert sum("User:" in t or t.startswith('"') for t in texts) >= 5
    assert sum(sum(c.isdigit() for c in t) > 20 for t in texts) >= 5
    readme = default_calib_path().parent / "README.md"
    assert "Provenance" in readme.read_text(encoding="utf-8")
