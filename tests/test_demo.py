from dsjax import demo


def test_demo_runs_and_prints(capsys):
    out = demo.run("tiny", "hello", max_tokens=4)
    assert len(out) == 4
    printed = capsys.readouterr().out
    assert "greedy tokens" in printed and "next-token top-5" in printed
