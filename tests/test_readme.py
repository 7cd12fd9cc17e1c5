"""The README's scheduler example, run as written on the demo-shaped model: its cancel takes effect."""

from __future__ import annotations

from doc_examples import README, fenced_blocks


def test_the_readme_scheduler_example_runs_and_its_cancel_ends_b(vocab_ckpt, tmp_path, capsys):
    """The example called `b.cancel()` after `run_until_idle()` had finished `b`: a cancel that did nothing.
    Run as written (the prefix cache in a temporary folder), `b` ends "cancelled" and `a` runs to its 32 tokens."""
    from fastar import load

    (block,) = [b.text for b in fenced_blocks(README, "python") if "engine.scheduler(" in b.text]
    assert '"~/.cache/fastar/prefixes"' in block
    engine = load(vocab_ckpt)
    try:
        scope = {"engine": engine}
        exec(block.replace('"~/.cache/fastar/prefixes"', repr(str(tmp_path))), scope)
    finally:
        engine.close()
    m = scope["sched"].metrics()
    assert m["requests_cancelled"] == 1 and m["requests_finished"] == 2, m  # b; a and the one with callbacks
    assert " cancelled {" in capsys.readouterr().out  # the printed finish_reason of b's last chunk
    assert len(scope["outs"]) == 2
