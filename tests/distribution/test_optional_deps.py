"""What works without the optional dependencies, and how a missing one is reported.

Each check runs in a fresh interpreter whose ``sys.meta_path`` starts with a finder that
refuses the listed top-level packages, exactly as if they were not installed, so no
torch-less virtual environment is needed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from kvblocks._extras import raise_missing_extra

# Prepended to every child script: BLOCKED (a set of top-level names) is filled in per test.
_BLOCKER = textwrap.dedent(
    """
    import sys

    class _NotInstalled:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, _NotInstalled())
    """
)

# Optional or heavy packages that the core package, the scheduler and the simulator must not
# import.
_HEAVY = ("torch", "cupy", "safetensors", "tokenizers", "transformers", "matplotlib")


def _run(blocked: set[str], body: str) -> dict:
    """Run ``body`` in a fresh interpreter with ``blocked`` hidden; return its last JSON line."""
    script = f"BLOCKED = {sorted(blocked)!r}\n{_BLOCKER}\n{textwrap.dedent(body)}"
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


_IMPORT_ERROR_REPORT = """
    import json, traceback
    try:
        {statement}
    except ImportError as exc:
        report = {{
            "type": type(exc).__name__,
            "message": str(exc),
            "name": exc.name,
            "chained": exc.__cause__ is not None
            or (exc.__context__ is not None and not exc.__suppress_context__),
            "traceback": traceback.format_exc(),
        }}
    else:
        report = {{"type": None}}
    print(json.dumps(report))
"""


@pytest.mark.parametrize(
    ("statement", "blocked", "message"),
    [
        (
            "import kvblocks.ops",
            {"torch"},
            "kvblocks.ops needs torch: pip install 'kvblocks[torch]'",
        ),
        (
            "from kvblocks.ops import paged_attention",
            {"torch"},
            "kvblocks.ops needs torch: pip install 'kvblocks[torch]'",
        ),
        (
            "from kvblocks.engine import LLM",
            {"torch"},
            "kvblocks.engine needs torch: pip install 'kvblocks[engine]'",
        ),
        (
            "from kvblocks.engine import LLM",
            {"safetensors"},
            "kvblocks.engine needs safetensors: pip install 'kvblocks[engine]'",
        ),
        (
            "from kvblocks.engine import LLM",
            {"torch", "safetensors"},
            "pip install 'kvblocks[engine]'",
        ),
    ],
)
def test_missing_extra_is_one_import_error(statement: str, blocked: set[str], message: str) -> None:
    report = _run(blocked, _IMPORT_ERROR_REPORT.format(statement=statement))
    # Exactly ImportError (not its subclass ModuleNotFoundError), naming the extra, and not
    # chained to the raw "No module named 'torch'" from inside the package.
    assert report["type"] == "ImportError", report
    assert message in report["message"], report
    assert report["name"] in blocked
    assert not report["chained"], report["traceback"]
    assert report["traceback"].count("Error:") == 1, report["traceback"]


def test_missing_dependency_of_a_dependency_keeps_its_own_error() -> None:
    exc = ModuleNotFoundError("No module named 'sympy'", name="sympy")
    with pytest.raises(ModuleNotFoundError) as info:
        raise_missing_extra(exc, "kvblocks.ops", "torch", ["torch"])
    assert info.value is exc


def test_core_scheduler_and_simulator_import_without_optional_packages() -> None:
    report = _run(
        set(_HEAVY),
        f"""
        import json, sys
        import kvblocks
        import kvblocks.cli, kvblocks.scheduler, kvblocks.simulate
        from kvblocks import SamplingParams
        from kvblocks.scheduler import SamplingParams as SchedulerSamplingParams
        params = SamplingParams(max_tokens=4, temperature=0)
        print(json.dumps({{
            "same": SamplingParams is SchedulerSamplingParams,
            "max_tokens": params.max_tokens,
            "loaded": sorted(m for m in {_HEAVY!r} if m in sys.modules),
        }}))
        """,
    )
    assert report == {"same": True, "max_tokens": 4, "loaded": []}


def test_kvblocks_simulate_runs_without_torch() -> None:
    # matplotlib stays importable: the demo installs it for --plot, but a run without --plot
    # must not load it either.
    report = _run(
        {"torch", "cupy", "safetensors", "tokenizers", "transformers"},
        f"""
        import contextlib, io, json, sys
        from kvblocks.cli import main
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(err):
            code = main(["simulate", "--num-requests", "20", "--no-progress"])
        print(json.dumps({{
            "code": code,
            "stderr": err.getvalue(),
            "printed": len(out.getvalue()),
            "loaded": sorted(m for m in {_HEAVY!r} if m in sys.modules),
        }}))
        """,
    )
    assert report["code"] == 0, report["stderr"]
    assert report["printed"] > 0
    assert report["loaded"] == []


def test_engine_exports_sampling_params_with_llm() -> None:
    import kvblocks
    import kvblocks.sampling_params
    from kvblocks.engine import LLM, SamplingParams

    assert SamplingParams is kvblocks.SamplingParams is kvblocks.sampling_params.SamplingParams
    assert callable(LLM)
    assert "SamplingParams" in kvblocks.__all__
    assert "SamplingParams" in kvblocks.engine.__all__
