"""The ops modules are layered downward: no module imports, at the top of the file or inside a
function, a module that imports it back (directly or through others).

A lazy import hides a cycle from Python but not from the reader: the module below then
depends on the one above, and the kernel choice leaks into it (issue 17 part 4). The scan
reads the source (every ``import`` node, wherever it sits), so it needs no CUDA.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvblocks.ops

OPS_DIR = Path(kvblocks.ops.__file__).parent
PACKAGE = "kvblocks.ops"


def _imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The ops modules (file stems; ``__init__`` for the package) ``path`` imports."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE:
                    found.add("__init__")
                elif alias.name.startswith(PACKAGE + "."):
                    found.add(alias.name.split(".")[2])
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: the package itself or one of its modules
                base = PACKAGE + ("." + node.module if node.module else "")
            else:
                base = node.module or ""
            if base == PACKAGE:
                # `from kvblocks.ops import x`: the module x, or a name of the package.
                found.update(a.name if a.name in modules else "__init__" for a in node.names)
            elif base.startswith(PACKAGE + "."):
                found.add(base.split(".")[2])
            elif base == "kvblocks" and any(a.name == "ops" for a in node.names):
                found.add("__init__")
    return found


def import_graph(directory: Path) -> dict[str, set[str]]:
    """Module -> the ops modules it imports (itself excluded), for every ``.py`` file."""
    files = {p.stem: p for p in directory.glob("*.py")}
    return {name: _imported_modules(path, set(files)) - {name} for name, path in files.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path a -> ... -> a) per module that reaches itself."""
    cycles = []
    for start in sorted(graph):
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in sorted(graph.get(node, ())):
                if nxt == start:
                    cycles.append([*path, start])
                    stack.clear()
                    break
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    return cycles


def test_no_ops_module_imports_one_that_imports_it_back():
    graph = import_graph(OPS_DIR)
    assert {"cuda_backend", "kernel_driver", "decode_attention", "prefill_launch"} <= set(graph)
    cycles = import_cycles(graph)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_the_scan_sees_lazy_relative_and_package_imports(tmp_path):
    # A scan that missed an import kind would pass on a cyclic package.
    (tmp_path / "low.py").write_text(
        "def f():\n    from kvblocks.ops import high\n    return high\n"
    )
    (tmp_path / "high.py").write_text("from .low import f\n")
    (tmp_path / "mid.py").write_text("import kvblocks.ops.top\n")
    (tmp_path / "top.py").write_text("if True:\n    from kvblocks.ops.mid import x  # noqa\n")
    (tmp_path / "__init__.py").write_text("from kvblocks.ops.leaf import y\n")
    (tmp_path / "leaf.py").write_text("def g():\n    from kvblocks.ops import NAME\n")
    cycles = {tuple(c) for c in import_cycles(import_graph(tmp_path))}
    assert ("low", "high", "low") in cycles
    assert ("mid", "top", "mid") in cycles
    assert ("leaf", "__init__", "leaf") in cycles


def test_precompile_covers_exactly_the_split_k_kernels_the_driver_launches():
    # fp16/bf16 prefill always takes the tensor-core kernel: the split-K kernel's prefill
    # instantiation is compiled (precompile, NVRTC tests) for fp32 only; every kernel the
    # driver launches is in the list.
    import numpy as np
    import torch

    from kvblocks.ops import kernel_driver
    from kvblocks.ops.cuda_sources import (
        DECODE_SOURCE,
        PREFILL_ROWS,
        PREFILL_SOURCE,
        SPLIT_K_SOURCE,
        kernel_names,
        split_k_kernel_name,
    )

    compiled = set(kernel_names(SPLIT_K_SOURCE))
    everything = compiled | set(kernel_names(PREFILL_SOURCE)) | set(kernel_names(DECODE_SOURCE))
    for dtype in (torch.float16, torch.bfloat16):
        assert split_k_kernel_name(dtype, 128, PREFILL_ROWS) not in compiled
    assert split_k_kernel_name(torch.float32, 128, PREFILL_ROWS) in compiled

    launched: list[str] = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        query = torch.zeros((5, 4, 128), dtype=dtype)
        cache = torch.zeros((4, 2, 16, 128), dtype=dtype)
        tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
        seq_lens = torch.tensor([20, 3], dtype=torch.int32)
        qsl = torch.tensor([0, 3, 5], dtype=torch.int32)
        kw = {"scale": None, "sliding_window": None, "soft_cap": None}
        kernel_driver.run_prefill(
            lambda item: launched.append(item.name), query, cache, cache, tables, qsl,
            seq_lens, max_query_len=3, target_ctas=4096, **kw,
        )  # fmt: skip
        for host in (np.array([20, 3], dtype=np.int32), None):
            kernel_driver.run_paged_attention(
                lambda item: launched.append(item.name), query[:2], cache, cache, tables,
                seq_lens, max_seq_len=20, seq_lens_host=host, split_k_ctas=4096,
                smem_limit=None, **kw,
            )  # fmt: skip
    kernel_driver._DECODERS.clear()  # the decoders hold this test's launchers
    assert set(launched) <= everything, set(launched) - everything
    assert any(n.startswith("split_k_attention_kernel<__half") for n in launched)
    assert any(n.startswith("decode_attention_kernel<__half") for n in launched)
    assert any(n.startswith("prefill_attention_kernel<__nv_bfloat16") for n in launched)
