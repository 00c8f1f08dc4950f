"""``kvblocks generate`` streams tokens as they are produced and prints readable tables."""

from __future__ import annotations

import io
import re

import pytest
from cli_run import run_cli

from kvblocks.cli import main
from kvblocks.cli.generate import _printable, format_table

torch = pytest.importorskip("torch")
torch.set_num_threads(1)

BASE = ["--num-blocks", "32", "--device", "cpu"]


class _Recorder(io.StringIO):
    """stdout that notes, per write, how many records the stream had yielded by then."""

    def __init__(self, yielded: list[int]) -> None:
        super().__init__()
        self.yielded = yielded
        self.writes: list[tuple[int, str]] = []

    def write(self, s: str) -> int:
        self.writes.append((self.yielded[0], s))
        return super().write(s)


def _run_recorded(monkeypatch, argv: list[str]) -> _Recorder:
    from kvblocks.engine.llm import LLM

    yielded = [0]
    original = LLM.stream

    def counting_stream(self, *args, **kwargs):
        for record in original(self, *args, **kwargs):
            yielded[0] += 1
            yield record

    monkeypatch.setattr(LLM, "stream", counting_stream)
    out = _Recorder(yielded)
    monkeypatch.setattr("sys.stdout", out)
    assert main(["generate", *argv]) == 0
    return out


def test_single_completion_is_written_as_it_grows(monkeypatch) -> None:
    out = _run_recorded(monkeypatch, ["--max-tokens", "6", *BASE])
    text = out.getvalue()
    # Pieces were written while the stream was still yielding: after record 1, 2, ...
    moments = {k for k, s in out.writes if s and k > 0}
    assert len(moments) >= 5, out.writes
    streamed = text.split("streaming: ", 1)[1].split("\n", 1)[0]
    final = re.search(r"text=('.*')\n", text)
    assert final is not None
    assert streamed == _printable(eval(final.group(1)))  # the same text, escaped


def test_several_completions_print_one_line_per_step(monkeypatch) -> None:
    argv = ["--prompt-ids", "1,2,3", "--prompt-ids", "4,5", "--n", "2", "--temperature", "1"]
    out = _run_recorded(monkeypatch, [*argv, "--seed", "1", "--max-tokens", "4", *BASE])
    text = out.getvalue()
    lines = re.findall(r"^  p(\d)\[(\d)\] \+\[(\d+)\]", text, flags=re.M)
    by_completion: dict[tuple[str, str], list[int]] = {}
    for p, i, tok in lines:
        by_completion.setdefault((p, i), []).append(int(tok))
    assert len(by_completion) == 4 and all(len(v) == 4 for v in by_completion.values())
    # Each streamed token line precedes the summary, and matches the final token list.
    summary = text.index("prompt 0:")
    assert all(text.index(f"  p{p}[{i}]") < summary for p, i in by_completion)
    finals = re.findall(r"^  \[(\d)\] finish=\S+ logprob=\S+ tokens=(\[.*\])$", text, flags=re.M)
    assert sorted(eval(t) for _, t in finals) == sorted(by_completion.values())


def test_stats_are_a_table_with_integer_counters(capsys) -> None:
    assert main(["generate", "--max-tokens", "4", "--no-stream", *BASE]) == 0
    out = capsys.readouterr().out
    assert "streaming:" not in out
    assert "scheduler:\n" in out and "cache:\n" in out
    assert "=" not in out.split("scheduler:\n", 1)[1]  # no key=value runs
    assert re.search(r"\bnum_steps +4\b", out)
    assert not re.search(r"num_\w+ +\d+\.\d", out)  # counters are never floats
    assert re.search(r"ttft_mean_s +\d", out)
    assert max(len(line) for line in out.splitlines()) < 120


def test_format_table() -> None:
    table = format_table({"b_count": 3, "a_rate": 0.123456, "c_time_s": 2.0})
    lines = table.splitlines()
    assert len(lines) == 2
    assert re.match(r"^  a_rate +0\.1235 +c_time_s +2$", lines[0])
    assert re.match(r"^  b_count +3$", lines[1])
    assert format_table({}) == "  (none)"


def test_stop_min_tokens_logprobs_options(capsys) -> None:
    argv = ["--prompt-ids", "1,2,3", "--max-tokens", "5", "--logprobs", "2", "--json", *BASE]
    assert main(["generate", *argv, "--min-tokens", "5", "--stop-token-ids", "0"]) == 0
    import json

    c = json.loads(capsys.readouterr().out)["outputs"][0]["completions"][0]
    assert len(c["token_ids"]) == 5 and len(c["logprobs"]) == 5
    assert len(c["logprobs"][0]["top_token_ids"]) == 2


def test_streaming_in_a_subprocess() -> None:
    proc = run_cli("generate", "--max-tokens", "3", "--stop", "zz", *BASE)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("streaming: ")
    assert "scheduler:" in proc.stdout and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "argv", [["--logprobs", "-1"], ["--min-tokens", "x"], ["--min-tokens", "-2"]]
)
def test_bad_new_options_exit_2(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["generate", *argv])
    assert exc.value.code == 2


def test_min_tokens_over_max_tokens_is_one_line(capsys) -> None:
    assert main(["generate", "--max-tokens", "2", "--min-tokens", "5", *BASE]) == 1
    err = capsys.readouterr().err.strip()
    assert "--min-tokens" in err and "min_tokens" not in err and "\n" not in err
