"""The service's wire format of the core results: each response model has exactly its type's
fields, a value's JSON validates against it, and the client's side makes the same value again."""

from __future__ import annotations

import datetime as dt
import json

import pytest
from pydantic import BaseModel

import dss
from dss.approx.explanation import Explanation
from dss.core.types import Layout, Session, Version, VersionId
from dss.service import models as m
from dss.service.codec import dump, fields_of, load
from dss.sessions.resume import Candidate
from dss.writes.compaction import Compaction

WHEN = dt.datetime(2026, 12, 4, 18, 0, 0, 123456, tzinfo=dt.UTC)
CANDIDATE = Candidate("s", VersionId(3), 40, 0.75, 0.8125, 17, 17, 16)
VALUES = [
    (Session, m.SessionOut, Session("s", "t", "u", Layout("l", 16, 1024, dtype="bf16"), None, 0, WHEN, WHEN)),
    (Version, m.VersionOut, Version(VersionId(7), "s", VersionId(6), 48, WHEN, "label ✓", True, False)),
    (Version, m.VersionOut, Version(VersionId(1), "s", None, 0, WHEN, None, False, True)),
    (Candidate, m.CandidateOut, CANDIDATE),
    (Compaction, m.CompactionOut, Compaction(False, 3, 1, 20, 4096, 1024, 2)),
    (
        Explanation,
        m.ExplainOut,
        Explanation(
            40, 16, "session", CANDIDATE, 17, [1, 2], [1, 3], 15, None, None, 19, 21, 4, 32, 16, [(17, 3), (5, 1)]
        ),
    ),
    (Explanation, m.ExplainOut, Explanation(5, 0, None, None, None)),
]


@pytest.mark.parametrize(("tp", "model", "value"), VALUES)
def test_a_result_goes_over_the_wire_and_comes_back_the_same(tp: type, model: type[BaseModel], value: object) -> None:
    assert set(model.model_fields) - {"freed_bytes"} == set(fields_of(tp))
    data = dump(value)
    if tp is Compaction:
        data["freed_bytes"] = value.freed_bytes  # type: ignore[attr-defined]
    wire = json.loads(model.model_validate(data).model_dump_json())  # what a client receives
    assert load(tp, wire) == value


def test_the_models_document_the_fields_their_types_document() -> None:
    schema = m.ExplainOut.model_json_schema()
    assert schema["properties"]["matched_tokens"]["description"] == "What resume reuses now (exact paths)."
    assert m.SessionOut.model_json_schema()["description"] == dss.Session.__doc__


def test_a_resume_result_says_over_the_wire_how_many_tokens_are_lossy() -> None:
    from dss.core.types import PageId, PageRef
    from dss.service.codec import resume_from, resume_out
    from dss.sessions.resume import ResumeResult

    pages = [PageRef(0, PageId(bytes(16)), "disk"), PageRef(1, PageId(bytes(range(16))), "host")]
    result = ResumeResult("s", VersionId(2), 64, 70, 64, 32, 1024, pages=pages, encodings={"int8": 32})
    wire = json.loads(m.ResumeOut.model_validate(resume_out(result)).model_dump_json())
    assert (wire["encodings"], wire["lossy_tokens"]) == ({"int8": 32}, 32)
    back = resume_from(wire, None)
    assert (back.encodings, back.lossy_tokens, back.matched_tokens) == ({"int8": 32}, 32, 64)
    exact = resume_from(
        json.loads(m.ResumeOut.model_validate(resume_out(back.with_encodings({}))).model_dump_json()), None
    )
    assert (exact.encodings, exact.lossy_tokens) == ({}, 0)
