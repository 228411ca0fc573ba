"""What the controller shows carries no credentials: its events, its log and the error it sends
back to the driver, whatever part of the run the text came from. No Ray here: the controller's
methods on a real ``Controller`` whose Ray runtime context is a stand-in."""

from __future__ import annotations

import logging

from elastic.actors.controller_actor import ControllerActor
from elastic.checkpoint import CheckpointStore

SECRET = "shh-controller-secret-0123"


def test_events_the_log_and_the_error_sent_back_carry_no_credentials(rayless_controller, tmp_path, monkeypatch,
                                                                       caplog):
    c = rayless_controller(name="redact")
    c.store = CheckpointStore(f"file://{tmp_path}", "redact", {"token": SECRET})
    with caplog.at_level(logging.INFO, logger="elastic.controller"):
        c.log("recovery", f"rank 1 failed: ConnectionError(https://u:{SECRET}@host/x?sig=1): {SECRET}",
              error=f"auth {SECRET}", rank=1)
    event = c.events[-1]
    assert SECRET not in event.message and SECRET not in str(event.details) and event.details["rank"] == 1
    assert "rank 1 failed" in event.message and SECRET not in caplog.text

    def run_for(steps, epochs):
        raise RuntimeError(f"a worker died: storage_options={{'token': '{SECRET}'}}")

    monkeypatch.setattr(c, "run_for", run_for)
    monkeypatch.setattr(c, "shutdown", lambda: None)
    actor = ControllerActor.__new__(ControllerActor)  # its __init__ builds the controller from kwargs
    actor.controller, actor._error = c, None
    out = actor.run(3, None)
    assert out["error"]["type"] == "RuntimeError" and "a worker died" in out["error"]["message"]
    assert SECRET not in str(out["error"]) and "run_for" in out["error"]["traceback"]


def test_without_storage_urls_lose_their_userinfo_and_query(rayless_controller):
    c = rayless_controller(name="redact-nostore")
    c.store = None
    c.log("note", "joined ray://admin:hunter22@head:10001 and https://h/x?X-Amz-Signature=abc")
    assert "hunter22" not in c.events[-1].message and "abc" not in c.events[-1].message


def test_an_errors_first_line_is_taken_after_a_secret_of_several_lines_is_hidden(rayless_controller, tmp_path):
    # The first line was taken before the redaction: the start of a PEM-like secret alone on it
    # is no whole secret, so it showed in the errored transition and in a rank lost at the end.
    key = "-----BEGIN KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEF\n-----END KEY-----"
    c = rayless_controller(name="redact-lines")
    c.store = CheckpointStore(f"file://{tmp_path}", "redact-lines", {"token": {"private_key": key}})
    error = RuntimeError(f"storage refused the key {key} for the bucket")
    c._errored(error)
    c._lost_after_end(2, "rank-2", " (the final flush)", error)
    said = " ".join(e.message for e in c.events)
    assert "storage refused the key ***" in said and "BEGIN KEY" not in said, said
    assert "rank 2 (rank-2) was lost after the last step" in c.events[-1].message
