from ninfer.lifecycle import salvage
from ninfer.lifecycle.salvage import Candidate, materializable

from .factories import MTP, NONE, checkpoint

TOKENS = tuple(range(10))


def test_complete_checkpoint_is_ok_in_every_mode():
    cp = checkpoint(TOKENS)
    assert materializable(cp, MTP).ok and materializable(cp, NONE).ok


def test_each_part_refuses():
    cases = {
        "nothing committed": checkpoint(()),
        "model identity": checkpoint(TOKENS, model="other"),
        "dtypes": checkpoint(TOKENS, dtypes="bf16"),
        "not completed": checkpoint(TOKENS, fenced=False),
        "attention KV": checkpoint(TOKENS, attn_kv=8),
        "recurrent state": checkpoint(TOKENS, recurrent_at=9),
    }
    for needle, cp in cases.items():
        decision = materializable(cp, NONE)
        assert not decision.ok and needle in decision.reason, (needle, decision)


def test_mtp_parts_are_needed_only_under_mtp():
    lagging = checkpoint(TOKENS, mtp_kv=4)
    no_hidden = checkpoint(TOKENS, hidden_at=None)
    assert materializable(lagging, NONE).ok and materializable(no_hidden, NONE).ok
    assert "MTP KV covers [0,4), needs [0,9)" in materializable(lagging, MTP).reason
    assert "last hidden state" in materializable(no_hidden, MTP).reason


def test_refused_frontier_falls_back_to_the_newest_complete_capture():
    frontier = checkpoint(TOKENS, cp_id="f", mtp_kv=6)
    newer = checkpoint(TOKENS[:8], cp_id="newer", mtp_kv=3)
    older = checkpoint(TOKENS[:6], cp_id="older")
    out = salvage.decide([Candidate("frontier", frontier), Candidate("fallback", newer),
                          Candidate("fallback", older)], MTP, "t", "s")
    assert not out.frontier_ok
    assert [r.checkpoint for r in out.refused] == ["f", "newer"]
    assert [(p.checkpoint.id, p.kind) for p in out.published] == [("older", "private")]


def test_published_frontier_skips_fallbacks_and_keeps_anchors():
    anchor = checkpoint(TOKENS[:4], cp_id="a")
    out = salvage.decide([Candidate("frontier", checkpoint(TOKENS, cp_id="f")),
                          Candidate("anchor", anchor),
                          Candidate("fallback", checkpoint(TOKENS[:6], cp_id="fb"))],
                         MTP, "t", "s")
    assert out.frontier_ok and not out.refused
    assert [(p.checkpoint.id, p.kind) for p in out.published] == [("f", "private"),
                                                                   ("a", "anchor")]


def test_no_session_publishes_only_shared():
    out = salvage.decide([Candidate("frontier", checkpoint(TOKENS, cp_id="f")),
                          Candidate("shared", checkpoint(TOKENS[:5], cp_id="sh"))],
                         NONE, "t", None)
    assert [p.kind for p in out.published] == ["shared"]
    assert out.published[0].session is None
    assert "no session key" in out.refused[0].reason


def test_nothing_committed_is_refused():
    out = salvage.decide([], NONE, "t", "s")
    assert not out.frontier_ok and not out.published
    assert out.refused[0].reason == "nothing committed"
