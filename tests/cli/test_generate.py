"""``kvblocks generate``: end to end on the tiny model and on a saved checkpoint."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cli_run import run_cli

from kvblocks.cli import main

torch = pytest.importorskip("torch")
# Tiny-model ops are microseconds long: intra-op threads only add contention here.
torch.set_num_threads(1)


def _main(argv: list[str]) -> int:
    """``kvblocks generate ARGV`` through the real command-line entry point."""
    return main(["generate", *argv])


def test_default_run_prints_tokens_and_cache_stats(capsys) -> None:
    assert _main(["--max-tokens", "4", "--num-blocks", "32", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "prompt 0: 'Paged attention" in out
    assert "finish=length" in out and "text=" in out
    assert "engine:" in out and "tokens/s" in out
    assert "cache:" in out and "scheduler:" in out


def test_prompt_ids_json_matches_the_dense_reference(capsys) -> None:
    from kvblocks.engine.dense import dense_greedy_generate
    from kvblocks.engine.tiny import build_tiny_model

    argv = ["--prompt-ids", "1,2,3", "--prompt-ids", "7,8", "--max-tokens", "6"]
    assert _main([*argv, "--json", "--num-blocks", "32", "--device", "cpu"]) == 0
    doc = json.loads(capsys.readouterr().out)
    tokens = [o["completions"][0]["token_ids"] for o in doc["outputs"]]
    assert tokens == dense_greedy_generate(build_tiny_model(), [[1, 2, 3], [7, 8]], 6)
    assert doc["outputs"][0]["completions"][0]["finish_reason"] == "length"
    assert {"engine", "scheduler", "cache"} <= doc["stats"].keys()


def test_sampling_options_and_n(capsys) -> None:
    argv = ["--prompt", "abc", "--n", "2", "--temperature", "0.9", "--top-k", "10"]
    assert _main([*argv, "--seed", "3", "--max-tokens", "3", "--json", "--device", "cpu"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["outputs"][0]["completions"]) == 2


def test_model_directory_with_tokenizer(tmp_path: Path, capsys) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    from kvblocks.engine.loader import save_checkpoint
    from kvblocks.engine.tiny import build_tiny_model, tiny_config

    save_checkpoint(build_tiny_model(tiny_config("qwen2")), tmp_path)
    vocab = {"<unk>": 0, **{f"w{i}": i + 1 for i in range(255)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    argv = ["--model", str(tmp_path), "--prompt", "w1 w2", "--max-tokens", "3", "--json"]
    assert _main([*argv, "--device", "cpu"]) == 0
    out = json.loads(capsys.readouterr().out)["outputs"][0]
    assert out["prompt_token_ids"] == [2, 3]
    assert isinstance(out["completions"][0]["text"], str)


def test_no_kv_cache_groups_keeps_one_group_with_the_same_tokens(tmp_path: Path, capsys) -> None:
    """Gemma 2 mixes window and full layers: one KV cache group per kind by default, one
    group of every layer under ``--no-kv-cache-groups``; the tokens are the dense model's."""
    from kvblocks.engine.dense import dense_greedy_generate
    from kvblocks.engine.loader import save_checkpoint
    from kvblocks.engine.tiny import build_tiny_model, tiny_config

    model = build_tiny_model(tiny_config("gemma2"))
    save_checkpoint(model, tmp_path)
    prompt = [(7 * i) % 250 + 1 for i in range(40)]  # longer than the 8-token windows
    argv = ["--model", str(tmp_path), "--prompt-ids", ",".join(map(str, prompt))]
    argv += ["--max-tokens", "6", "--block-size", "8", "--device", "cpu"]
    want = dense_greedy_generate(model, [prompt], 6)[0]
    for flags, groups in (([], 2), (["--no-kv-cache-groups"], 1)):
        assert _main([*argv, *flags, "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["kv_cache_groups"] == groups
        assert doc["outputs"][0]["completions"][0]["token_ids"] == want
    assert _main([*argv, "--no-stream"]) == 0
    assert "2 KV cache group(s)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["--model", "/nonexistent/model"], "is not a directory"),
        (["--prompt-ids", "1,999"], r"token ids must be in [0, 256)"),
        (["--n", "3", "--beam-width", "2"], "must be <= --beam-width"),
    ],
)
def test_engine_errors_are_one_line(argv: list[str], message: str, capsys) -> None:
    assert _main([*argv, "--device", "cpu", "--num-blocks", "16"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvblocks generate: error:") and message in err
    assert "\n" not in err


def test_text_prompt_without_tokenizer_is_an_error(tmp_path: Path, capsys) -> None:
    from kvblocks.engine.loader import save_checkpoint
    from kvblocks.engine.tiny import build_tiny_model

    save_checkpoint(build_tiny_model(), tmp_path)
    assert _main(["--model", str(tmp_path), "--prompt", "hi", "--device", "cpu"]) == 1
    assert "text prompts need a tokenizer" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["--prompt-ids", "1,x"],
        ["--prompt-ids", "1,,2"],  # an empty field is a missing id (issue 7, item 19)
        ["--max-tokens", "0"],
        ["--block-size", "12"],
        ["--bogus"],
    ],
)
def test_bad_options_exit_nonzero_without_traceback(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        _main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    # Unknown options are reported by the top-level parser, the rest by the subcommand.
    assert re.match(r"kvblocks( generate)?: error: ", err) and "\n" not in err


def test_a_thread_count_the_machine_cannot_start_is_refused(capsys) -> None:
    # --threads 100000 went to torch.set_num_threads: the process died of SIGSEGV
    # (20000: libgomp "Thread creation failed" and exit 1).
    with pytest.raises(SystemExit) as exc:
        _main(["--threads", "100000", "--device", "cpu"])
    assert exc.value.code == 2
    assert "--threads: expected an integer in [1, 1024]" in capsys.readouterr().err


def test_help_lists_the_options(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        _main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for option in ("--model", "--prompt-ids", "--beam-width", "--num-blocks", "--json"):
        assert option in out


def test_console_script_help_in_a_subprocess() -> None:

    proc = subprocess.run(
        [sys.executable, "-m", "kvblocks.cli", "generate", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "--prompt-ids" in proc.stdout


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("tpu", "unknown device"),
        ("meta", "not supported"),
        ("cuda:99", "cuda"),
        pytest.param(
            "cuda",
            "no CUDA GPU",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU"),
        ),
    ],
)
def test_unusable_device_is_one_line(device: str, message: str) -> None:
    """Issue 7, item 16: no torch traceback for a device torch cannot use."""
    proc = run_cli("generate", "--device", device, "--max-tokens", "2", "--num-blocks", "16")
    assert proc.returncode == 1, proc.stderr
    err = proc.stderr.strip()
    assert err.startswith("kvblocks generate: error:") and len(err.splitlines()) == 1, err
    assert message in err


def test_n2_json_counts_agree_and_are_ints(capsys) -> None:
    """Issue 7, item 17: one count of generated tokens, printed as integers."""
    argv = ["--prompt-ids", "1,2,3", "--n", "2", "--temperature", "1", "--seed", "1"]
    assert _main([*argv, "--max-tokens", "8", "--ignore-eos", "--json", "--device", "cpu"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["engine"]["generated_tokens"] == 16
    assert stats["scheduler"]["num_generated_tokens"] == 16
    assert isinstance(stats["engine"]["steps"], int)
    assert all(isinstance(v, int) for k, v in stats["scheduler"].items() if k.startswith("num_"))


def test_max_model_len_option(capsys) -> None:
    argv = ["--prompt-ids", "1,2,3", "--max-tokens", "10", "--max-model-len", "5", "--json"]
    assert _main([*argv, "--device", "cpu", "--num-blocks", "16"]) == 0
    completion = json.loads(capsys.readouterr().out)["outputs"][0]["completions"][0]
    assert len(completion["token_ids"]) == 2 and completion["finish_reason"] == "length"
    assert _main(["--prompt-ids", "1,2,3", "--max-model-len", "3", "--device", "cpu"]) == 1
    assert "--max-model-len" in capsys.readouterr().err
